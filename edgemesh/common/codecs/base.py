"""The codec interface, the registry and error feedback."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from edgemesh.common.errors import CodecError
from edgemesh.common.messages import CodecPolicy, ShardUpdate
from edgemesh.common.vocabulary import CodecName


class Codec(Protocol):
    """Turns a flat float32 gradient into bytes and back."""

    name: CodecName
    lossless: bool

    def encode(self, grad: np.ndarray, policy: CodecPolicy | None) -> bytes: ...

    def decode(self, data: bytes, numel: int) -> np.ndarray: ...


class ResidualCodec(Codec, Protocol):
    """A lossy codec that also returns what it did not send, so error feedback need not decode.

    ``encode_with_residual(grad, policy)`` returns ``(data, grad - decode(data, grad.size))``,
    the residual equal element for element to decoding the payload.
    """

    def encode_with_residual(self, grad: np.ndarray, policy: CodecPolicy | None) -> tuple[bytes, np.ndarray]: ...


_REGISTRY: dict[CodecName, Codec] = {}


def register(codec: Codec) -> Codec:
    _REGISTRY[codec.name] = codec
    return codec


def get_codec(name: str) -> Codec:
    """The codec called ``name`` (a policy's, or one a log or payload names); CodecError if there is none."""
    try:
        return _REGISTRY[name]  # type: ignore[index]  # any str: an unknown name is the KeyError below
    except KeyError:
        raise CodecError(f"codec {name!r} is not available (have: {', '.join(sorted(_REGISTRY))})",
                         "codec_unknown") from None


QUICK_DECODE_BYTES = 4 << 20
"""The most payload ``quick_to_decode`` decodes where it arrives."""


def quick_to_decode(shards: Iterable[ShardUpdate]) -> bool:
    """Whether decoding ``shards`` costs less than handing it to a thread: all ``none`` (the decoded values are a
    view of the payload, checked finite) and no more than ``QUICK_DECODE_BYTES`` of them (2.48 MB: 0.15 ms, where
    a thread hop took 0.2-1.5 ms on a busy host)."""
    total = 0
    for shard in shards:
        if shard.codec != "none":
            return False
        total += len(shard.data)
    return total <= QUICK_DECODE_BYTES


SMALL_TENSOR = 1024
"""Tensors of fewer values travel as ``fp16`` under any lossy policy: on a few hundred values a
sparsifying or quantizing codec's fixed cost (about 0.4 ms an encode, 0.15 ms a decode on the
development host) buys a few hundred bytes at most. Biases and small layers are most of a
model's tensors and almost none of its values."""
DENSE_FOR_SMALL: CodecName = "fp16"


def codec_for(name: CodecName, numel: int) -> Codec:
    """The codec that encodes a tensor of ``numel`` values under a policy naming ``name``."""
    if numel < SMALL_TENSOR and name not in ("none", DENSE_FOR_SMALL):
        return get_codec(DENSE_FOR_SMALL)
    return get_codec(name)


PROBE_VALUES = 65_536
"""Values of the random tensor ``bytes_per_value`` encodes."""


def bytes_per_value(name: CodecName, density: float = 1.0) -> float:
    """Bytes codec ``name`` spends per float32 value at ``density`` (sparsifying codecs), measured by
    encoding a random tensor of ``PROBE_VALUES``: what the planner's cost model charges a transfer."""
    probe = np.random.default_rng(0).standard_normal(PROBE_VALUES).astype(np.float32)
    policy = CodecPolicy(device="probe", codec=name, density=density)
    return len(get_codec(name).encode(probe, policy)) / PROBE_VALUES


def available_codecs() -> tuple[CodecName, ...]:
    return tuple(sorted(_REGISTRY))


def check_finite(values: np.ndarray, codec: str) -> np.ndarray:
    if not np.isfinite(values).all():
        raise CodecError(f"{codec} payload holds NaN or Inf", "nan")
    return values


class ErrorFeedback:
    """Keeps, per shard key, the residual a lossy codec did not send and adds it to the next gradient."""

    def __init__(self) -> None:
        self._residual: dict[str, np.ndarray] = {}

    def encode(self, key: str, grad: np.ndarray, codec: Codec, policy: CodecPolicy | None) -> bytes:
        flat = np.ascontiguousarray(grad, dtype=np.float32).reshape(-1)
        residual = self._residual.get(key)
        if residual is not None and residual.shape == flat.shape:
            flat = flat + residual
        encode_with_residual = None if codec.lossless else getattr(codec, "encode_with_residual", None)
        if encode_with_residual is not None:
            data, self._residual[key] = encode_with_residual(flat, policy)
            return data
        data = codec.encode(flat, policy)
        if codec.lossless:
            self._residual.pop(key, None)
        else:
            self._residual[key] = flat - codec.decode(data, flat.size)
        return data

    def residual(self, key: str) -> np.ndarray | None:
        return self._residual.get(key)

    def reset(self) -> None:
        self._residual.clear()
