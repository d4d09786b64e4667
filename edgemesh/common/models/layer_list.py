"""A model written as a list of layers, as a job file gives it, checked whole when the spec is made.

Items are a layer name (``"relu"``) or a table with one layer entry and its options
(``{conv2d = 16, kernel = 3, padding = 1}``); input sizes (channels, features) are inferred from
the layer before. Children are named by kind and a 1-based count per kind: ``conv1, relu1, pool1,
conv2, ..., flatten1, fc1, drop1, bn1`` (``pool`` counts max- and average-pooling together), after
an ``input`` standardization when the job gives mean and std. The names depend on the list alone,
so parameters (``conv1.weight``, ``fc2.bias``) are named alike on every host.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from edgemesh.common.errors import ModelError
from edgemesh.common.models.lean import LeanMaxPool2d, LeanReLU
from edgemesh.common.models.probe import REAL_PROBE_MAX_PARAMS
from edgemesh.common.models.specs import ModelSpec, check_io, standardize

Make = Callable[[], nn.Module]
IMAGE: Final = 3
"""Rank of a (channels, height, width) sample."""
FLAT: Final = 1
"""Rank of a (features,) sample."""


@dataclass(frozen=True, slots=True)
class _Kind:
    """One kind of layer a list may name."""

    prefix: str
    """Child names are the prefix and a count: ``conv1``."""
    value: str | None
    """What the table entry of the kind gives (``channels``, ``window``...); None: a bare name, no options."""
    options: Mapping[str, int]
    """Option -> its least allowed value."""
    ranks: tuple[int, ...]
    """Sample ranks the layer takes (empty: any)."""


KINDS: Final[dict[str, _Kind]] = {
    "conv2d": _Kind("conv", "output channels", {"kernel": 1, "padding": 0, "stride": 1}, (IMAGE,)),
    "linear": _Kind("fc", "output features", {}, (FLAT,)),
    "relu": _Kind("relu", None, {}, ()),
    "maxpool2d": _Kind("pool", "window", {"stride": 1}, (IMAGE,)),
    "avgpool2d": _Kind("pool", "window", {"stride": 1}, (IMAGE,)),
    "flatten": _Kind("flatten", None, {}, ()),
    "dropout": _Kind("drop", "probability", {}, ()),
    "batchnorm": _Kind("bn", None, {}, (FLAT, IMAGE)),
    "tanh": _Kind("tanh", None, {}, ()),
    "sigmoid": _Kind("sigmoid", None, {}, ()),
}
"""Every layer name a list may use, in the order error messages list them."""
RANK_NAMES: Final = {FLAT: "a flat (features,) input", IMAGE: "a (channels, height, width) input"}


def _make(kind: str, value: Any, options: Mapping[str, int], shape: tuple[int, ...]) -> Make:
    """A builder of the layer for an input of per-sample ``shape`` (already checked)."""
    if kind == "conv2d":
        return functools.partial(nn.Conv2d, shape[0], value, options["kernel"], stride=options.get("stride", 1),
                                 padding=options.get("padding", 0))
    if kind == "linear":
        return functools.partial(nn.Linear, shape[0], value)
    if kind == "maxpool2d":
        return functools.partial(LeanMaxPool2d, value, stride=options.get("stride", value))
    if kind == "avgpool2d":
        return functools.partial(nn.AvgPool2d, value, stride=options.get("stride", value))
    if kind == "dropout":
        return functools.partial(nn.Dropout, float(value))
    if kind == "batchnorm":
        return functools.partial(nn.BatchNorm1d if len(shape) == FLAT else nn.BatchNorm2d, shape[0])
    plain: dict[str, Make] = {"relu": LeanReLU, "flatten": nn.Flatten, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
    return plain[kind]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse(item: Any) -> tuple[str, Any, dict[str, int]]:
    """(kind, value, options) of one item as written; raises ModelError with the reason alone."""
    known = ", ".join(KINDS)
    if isinstance(item, str):
        if item not in KINDS:
            raise ModelError(f"unknown layer; known: {known}")
        if KINDS[item].value is not None:
            raise ModelError(f"{item} needs its {KINDS[item].value}: write {{{item} = ...}}")
        return item, None, {}
    if not isinstance(item, Mapping):
        raise ModelError(f"a layer is a name or a table, not {type(item).__name__}")
    kinds = [k for k in item if k in KINDS]
    if len(kinds) != 1:
        found = f"names {len(kinds)} layers ({', '.join(kinds)})" if kinds else "unknown layer"
        raise ModelError(f"{found}; a table names exactly one of: {known}")
    kind = kinds[0]
    spec, value = KINDS[kind], item[kind]
    if spec.value is None:
        raise ModelError(f"{kind} takes no value or options: write {kind!r}")
    if kind == "dropout":
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1:
            raise ModelError(f"dropout probability must be a number in [0, 1), got {value!r}")
    elif not _is_int(value) or value < 1:
        raise ModelError(f"{kind} {spec.value} must be a positive integer, got {value!r}")
    options: dict[str, int] = {}
    for key, option in item.items():
        if key == kind:
            continue
        if key not in spec.options:
            allowed = ", ".join(spec.options) or "none"
            raise ModelError(f"unknown option {key!r} for {kind}; options: {allowed}")
        least = spec.options[key]
        if not _is_int(option) or option < least:
            raise ModelError(f"{kind} option {key} must be an integer >= {least}, got {option!r}")
        options[key] = option
    if kind == "conv2d" and "kernel" not in options:
        raise ModelError("conv2d needs option kernel")
    return kind, value, options


def _probe(make: Make, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per-sample output shape of the layer on a zero sample of ``shape``: a real sample through a small layer
    (milliseconds), the meta device for a large one (no memory, but a process's first meta forward costs about a
    second: ``probe``)."""
    with torch.device("meta"):
        layer = make()
    device = "meta"
    if sum(p.numel() for p in layer.parameters()) <= REAL_PROBE_MAX_PARAMS:
        layer, device = make(), "cpu"
    layer.eval()  # batch norm takes a batch of one
    with torch.no_grad():
        out = layer(torch.zeros((1, *shape), device=device))
    return tuple(out.shape[1:])


def _layers(name: str, layers: Sequence[Any], input_shape: tuple[int, ...],
            num_classes: int) -> list[tuple[str, Make]]:
    """The named layer builders of the list, every layer checked against its input; ModelError naming the layer."""
    if isinstance(layers, str | bytes | Mapping) or not isinstance(layers, Sequence):
        raise ModelError(f"model {name!r}: layers must be a list, got {type(layers).__name__}")
    if not layers:
        raise ModelError(f"model {name!r}: the layer list is empty")
    counts: dict[str, int] = {}
    out: list[tuple[str, Make]] = []
    shape = input_shape
    where = ""
    for position, item in enumerate(layers, start=1):
        where = f"model {name!r}: layer {position} ({item!r})"
        try:
            kind, value, options = _parse(item)
        except ModelError as exc:
            raise ModelError(f"{where}: {exc}") from None
        ranks = KINDS[kind].ranks
        if ranks and len(shape) not in ranks:
            expects = " or ".join(RANK_NAMES[r] for r in ranks)
            hint = "; put 'flatten' before it" if ranks == (FLAT,) else ""
            raise ModelError(f"{where}: expects {expects} but gets shape {shape}{hint}")
        make = _make(kind, value, options, shape)
        try:
            new_shape = _probe(make, shape)
        except (RuntimeError, ValueError) as exc:
            raise ModelError(f"{where}: does not fit its input of shape {shape}: {exc}") from None
        if 0 in new_shape:
            raise ModelError(f"{where}: gives an empty output {new_shape} from its input of shape {shape}")
        shape = new_shape
        prefix = KINDS[kind].prefix
        counts[prefix] = counts.get(prefix, 0) + 1
        out.append((f"{prefix}{counts[prefix]}", make))
    if shape != (num_classes,):
        raise ModelError(f"{where}: the model's output per sample is {shape}, but it must be ({num_classes},) "
                         f"for {num_classes} classes")
    return out


def layer_list_spec(name: str, layers: Sequence[Any], input_shape: Sequence[int], num_classes: int,
                    mean: Sequence[float] = (), std: Sequence[float] = (), description: str = "") -> ModelSpec:
    """The spec of a model written as a layer list, checked now: ModelError naming the layer
    (``layer 4 ({'linear': 10}): ...``) that is unknown, has a bad option or does not fit its input,
    or the last one when the output is not one score per class."""
    shape = check_io(name, input_shape, num_classes)
    first = standardize(name, shape, mean, std)
    children = _layers(name, layers, shape, num_classes)

    def build() -> nn.Module:
        modules: list[tuple[str, nn.Module]] = [("input", first())] if first is not None else []
        modules += [(child, make()) for child, make in children]
        return nn.Sequential(OrderedDict(modules))

    summary = ", ".join(child for child, _ in children)
    return ModelSpec(name=name, input_shape=shape, num_classes=num_classes, builder=build,
                     description=description or f"layer list: {summary}")
