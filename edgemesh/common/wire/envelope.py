"""The wire format: one versioned MessagePack envelope for every message (docs/wire.md).

``{"v": 1, "kind": str, "body": {...}}``. Each message kind is a frozen dataclass declared
once in ``messages`` and registered here with ``@message("kind")``; ``encode`` and ``decode``
are the only functions that turn them into bytes and back. The decoder checks every field
against the dataclass's type hints (types, finite floats, tensor dtype/shape/length), then
the class's own ``validate()``; every failure is one ``WireError`` with a short reason.

Tensors travel as ``(dtype, shape, raw little-endian bytes)`` (``tensors.Tensor``): never pickle.

Payloads larger than a chunk travel as ``chunk`` envelopes (``chunks``): the bus calls ``chunks.frames`` on
the way out and ``chunks.Receiver.take`` on the way in, which decodes through here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import msgpack
import numpy as np

from edgemesh.common.errors import WireError
from edgemesh.common.wire.tensors import Tensor

WIRE_VERSION = 1
CHUNK_KIND = "chunk"

MAX_STR = 4096
MAX_ITEMS = 1_000_000
INT_RANGE = (-(2**63), 2**64 - 1)
"""Integers MessagePack carries; a JSON body may hold larger ones, which are refused."""

T = TypeVar("T")

_KINDS: dict[str, type] = {}
_FIELDS: dict[type, tuple[tuple[str, Any, bool], ...]] = {}


def message(kind: str) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as the message ``kind`` (each kind declared once)."""

    def register(cls: type[T]) -> type[T]:
        if kind in _KINDS and _KINDS[kind] is not cls:
            raise TypeError(f"message kind {kind!r} declared twice")
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        _KINDS[kind] = cls
        cls.KIND = kind  # type: ignore[attr-defined]
        return cls

    return register


def kind_of(cls_or_msg: Any) -> str:
    kind = getattr(cls_or_msg, "KIND", None)
    if kind is None:
        raise TypeError(f"{cls_or_msg!r} is not a registered message")
    return str(kind)


def registered_kinds() -> dict[str, type]:
    return dict(_KINDS)


# --------------------------------------------------------------------------- plain conversion


def _to_plain(value: Any) -> Any:
    if isinstance(value, Tensor):
        return {"dtype": value.dtype, "shape": list(value.shape), "data": value.data}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: _to_plain(getattr(value, name)) for name, _, _ in _fields(type(value))}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """``(name, type, required)`` of every field of the dataclass ``cls``, worked out once per class (a message of
    many small parts, as shard 0's steps, decodes a class's fields thousands of times)."""
    spec = _FIELDS.get(cls)
    if spec is None:
        hints = typing.get_type_hints(cls)
        spec = _FIELDS[cls] = tuple(
            (f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls))
    return spec


def _fail(path: str, message: str, reason: str = "field") -> typing.NoReturn:
    raise WireError(f"{path}: {message}", reason)


def _from_plain(tp: Any, value: Any, path: str) -> Any:
    """``value`` checked against the field type ``tp``: a plain type's check (``_SCALARS``), a type shape's
    (``_SHAPES``, by origin: ``Literal``, unions, ``tuple``, ``list``, ``dict``; ``Tensor``; ``Any``), or a
    nested dataclass's fields."""
    scalar = _SCALARS.get(tp)
    if scalar is not None:  # the plain types first, by identity: most values are one
        return scalar(value, path)
    shape = _SHAPES.get(get_origin(tp) or tp)
    if shape is not None:
        return shape(tp, value, path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_from_plain(tp, value, path, top=False)
    raise TypeError(f"{path}: wire cannot decode type {tp!r}")


def _any(_: Any, value: Any, path: str) -> Any:
    return value


def _literal(tp: Any, value: Any, path: str) -> Any:
    if value not in get_args(tp):
        _fail(path, f"{value!r} is not one of {get_args(tp)}")
    return value


def _union(tp: Any, value: Any, path: str) -> Any:
    """The first option ``value`` fits (None for ``None``)."""
    errors: list[WireError] = []
    for option in get_args(tp):
        if option is type(None):
            if value is None:
                return None
            continue
        try:
            return _from_plain(option, value, path)
        except WireError as err:
            errors.append(err)
    # surface a NaN rejection as such rather than as a type mismatch
    nan = next((e for e in errors if e.reason == "nan"), None)
    if nan is not None:
        raise nan
    _fail(path, f"{type(value).__name__} does not fit {tp}")


def _tensor(_: Any, value: Any, path: str) -> Tensor:
    if not isinstance(value, dict):
        _fail(path, "expected a tensor map")
    missing = {"dtype", "shape", "data"} - value.keys()
    if missing:
        _fail(path, f"tensor lacks {', '.join(sorted(missing))}")
    tensor = Tensor(
        dtype=_from_plain(str, value["dtype"], path + ".dtype"),
        shape=tuple(_from_plain(int, d, f"{path}.shape") for d in _as_list(value["shape"], path)),
        data=_from_plain(bytes, value["data"], path + ".data"),
    )
    try:
        tensor.validate()
    except WireError as exc:
        raise WireError(f"{path}: {exc}", exc.reason) from None
    return tensor


def _tuple(tp: Any, value: Any, path: str) -> tuple[Any, ...]:
    """``tuple[X, ...]`` item by item, or a fixed ``tuple[X, Y]`` of as many items."""
    args = get_args(tp)
    items = _as_list(value, path)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_from_plain(args[0], v, f"{path}[{i}]") for i, v in enumerate(items))
    if len(items) != len(args):
        _fail(path, f"expected {len(args)} items, got {len(items)}")
    return tuple(_from_plain(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, items, strict=True)))


def _list(tp: Any, value: Any, path: str) -> list[Any]:
    (arg,) = get_args(tp)
    return [_from_plain(arg, v, f"{path}[{i}]") for i, v in enumerate(_as_list(value, path))]


def _map(tp: Any, value: Any, path: str) -> dict[Any, Any]:
    key_tp, val_tp = get_args(tp)
    if not isinstance(value, dict):
        _fail(path, f"expected map, got {type(value).__name__}")
    if len(value) > MAX_ITEMS:
        _fail(path, "too many entries")
    return {
        _from_plain(key_tp, k, f"{path}.key"): _from_plain(val_tp, v, f"{path}[{k!r}]")
        for k, v in value.items()
    }


_SHAPES: dict[Any, Callable[[Any, Any, str], Any]] = {
    Any: _any, Literal: _literal, Union: _union, types.UnionType: _union, Tensor: _tensor, tuple: _tuple, list: _list,
    dict: _map,
}
"""The type shapes a field may have, by their origin (or the type itself for ``Tensor`` and ``Any``), and their
checks: ``check(tp, value, path)``."""


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, f"expected bool, got {type(value).__name__}")
    return value


def _int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"expected int, got {type(value).__name__}")
    if not INT_RANGE[0] <= value <= INT_RANGE[1]:
        _fail(path, "integer out of the 64-bit range")
    return value


def _float(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(path, f"expected number, got {type(value).__name__}")
    if isinstance(value, int) and not INT_RANGE[0] <= value <= INT_RANGE[1]:
        _fail(path, "number out of the 64-bit range")  # float() of a larger int may overflow
    if not math.isfinite(value):
        _fail(path, "NaN or Inf", "nan")
    return float(value)


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        _fail(path, f"expected str, got {type(value).__name__}")
    if len(value) > MAX_STR:
        _fail(path, f"string longer than {MAX_STR}")
    return value


def _bytes(value: Any, path: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)):
        _fail(path, f"expected bytes, got {type(value).__name__}")
    return bytes(value)


_SCALARS: dict[Any, Callable[[Any, str], Any]] = {bool: _bool, int: _int, float: _float, str: _str, bytes: _bytes}
"""The plain field types and their checks."""


def _as_list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        _fail(path, f"expected list, got {type(value).__name__}")
    if len(value) > MAX_ITEMS:
        _fail(path, "too many items")
    return list(value)


def _dataclass_from_plain(cls: type[T], value: Any, path: str, *, top: bool = True) -> T:
    """``value`` as a ``cls``, every field checked; the message's ``validate()`` (``top``: a message
    validates the parts it is made of) turns its ValueError into a ``field`` WireError."""
    if not isinstance(value, dict):
        _fail(path, f"expected map, got {type(value).__name__}")
    kwargs: dict[str, Any] = {}
    for name, tp, required in _fields(cls):
        if name in value:
            kwargs[name] = _from_plain(tp, value[name], f"{path}.{name}")
        elif required:
            _fail(path, f"missing field {name!r}")
    # unknown keys are ignored: a newer sender may add fields with defaults
    try:
        obj = cls(**kwargs)
        validate = getattr(obj, "validate", None) if top else None
        if validate is not None:
            validate()
    except WireError:
        raise
    except (ValueError, TypeError) as exc:
        raise WireError(f"{path}: {exc}", "field") from None
    return obj


# --------------------------------------------------------------------------- envelopes


def pack(kind: str, body: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "kind": kind, "body": body}, use_bin_type=True)


def encode(msg: Any) -> bytes:
    """Serialize a registered message to its envelope bytes."""
    return pack(kind_of(msg), _to_plain(msg))


@dataclasses.dataclass(frozen=True, slots=True)
class Envelope:
    """An unpacked envelope whose body is not yet checked against its dataclass."""

    kind: str
    body: dict[str, Any]
    size: int


def unpack(payload: bytes, *, max_bytes: int) -> Envelope:
    """Parse the envelope (msgpack, version, kind). Raises WireError."""
    if len(payload) > max_bytes:
        raise WireError(f"payload of {len(payload)} bytes exceeds the {max_bytes}-byte limit", "oversized")
    if not payload:
        raise WireError("empty payload", "malformed")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"not MessagePack: {exc}", "malformed") from None
    if not isinstance(obj, dict) or not {"v", "kind", "body"} <= obj.keys():
        raise WireError("not an EdgeMesh envelope", "malformed")
    if obj["v"] != WIRE_VERSION:
        raise WireError(f"wire version {obj['v']!r} unsupported (this build speaks {WIRE_VERSION})", "version")
    kind, body = obj["kind"], obj["body"]
    if not isinstance(kind, str) or not isinstance(body, dict):
        raise WireError("envelope kind/body have wrong types", "malformed")
    return Envelope(kind=kind, body=body, size=len(payload))


def unpack_json(payload: bytes, kind: str, *, max_bytes: int) -> Envelope:
    """A UTF-8 JSON object as the body of ``kind`` (operators steer with plain ``mosquitto_pub``)."""
    if len(payload) > max_bytes:
        raise WireError(f"payload of {len(payload)} bytes exceeds the {max_bytes}-byte limit", "oversized")
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, or > 4,300 digits
        raise WireError(f"neither an EdgeMesh envelope nor a JSON object: {exc}", "malformed") from None
    if not isinstance(body, dict):
        raise WireError("JSON body must be an object", "malformed")
    return Envelope(kind=kind, body=body, size=len(payload))


def decode_envelope(envelope: Envelope, expected: type[T] | tuple[type, ...]) -> T:
    """Check an envelope's body against the expected message class(es)."""
    classes = expected if isinstance(expected, tuple) else (expected,)
    cls = _KINDS.get(envelope.kind)
    if cls is None:
        raise WireError(f"unknown message kind {envelope.kind!r}", "kind")
    if cls not in classes:
        names = ", ".join(kind_of(c) for c in classes)
        raise WireError(f"unexpected kind {envelope.kind!r} here (expected {names})", "kind")
    return typing.cast(T, _dataclass_from_plain(cls, envelope.body, envelope.kind))


def decode(payload: bytes, expected: type[T] | tuple[type, ...], *, max_bytes: int = 64 << 20) -> T:
    """Bytes to a validated message; raises WireError with a reason."""
    return decode_envelope(unpack(payload, max_bytes=max_bytes), expected)


def to_json_dict(msg: Any) -> dict[str, Any]:
    """A message as a JSON-able dict (bytes shown by length), for logs and CLI output."""

    def convert(value: Any) -> Any:
        if isinstance(value, bytes):
            return f"<{len(value)} bytes>"
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    return typing.cast(dict[str, Any], convert(_to_plain(msg)))


def from_json_body(kind_cls: type[T], body: Any) -> T:
    """Build a message from a plain (e.g. JSON) dict with the same validation as the wire."""
    return _dataclass_from_plain(kind_cls, body, kind_of(kind_cls))


def truncate(payload: bytes, limit: int = 64) -> str:
    """A payload for a log line."""
    head = bytes(payload[:limit])  # a bytearray's shows as bytes too
    return repr(head) + (f"... ({len(payload)} bytes)" if len(payload) > limit else "")
