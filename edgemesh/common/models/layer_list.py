"""A model written as a list of layers, as a job file gives it, checked whole when the spec is made.

Items are a layer name (``"relu"``) or a table with one layer entry and its options
(``{conv2d = 16, kernel = 3, padding = 1}``); input sizes (channels, features) are inferred from
the layer before. Children are named by kind and a 1-based count per kind: ``conv1, relu1, pool1,
conv2, ..., flatten1, fc1, drop1, bn1, gn1`` (``pool`` counts max- and average-pooling together), after
an ``input`` standardization when the job gives mean and std. The names depend on the list alone,
so parameters (``conv1.weight``, ``fc2.bias``) are named alike on every host.

A residual block ``{residual = [...], activation = "relu"}`` is a child like any other (``res1``)
holding ``body``, its sub-list named afresh (``res1.body.conv1``, ``res1.body.bn1``), and ``skip``,
the projection when the body changes its input's shape (``res1.skip.conv1``, ``res1.skip.bn1``);
its output is ``activation(body(x) + skip(x))``.

A job file is input from the network: a list is bounded before anything is built (``MAX_LAYERS`` items,
residual blocks ``MAX_RESIDUAL_DEPTH`` deep, widths ``MAX_WIDTH``, kernels, windows, strides and padding
``MAX_KERNEL``, ``MAX_PARAMS`` parameters counted from the options, ``MAX_ACTIVATION_VALUES`` values out of any
layer per sample), and whatever goes wrong while it is checked is a ModelError naming the layer.
"""

from __future__ import annotations

import functools
import itertools
import math
import reprlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from edgemesh.common.errors import ModelError
from edgemesh.common.models.lean import GlobalAvgPool, LeanMaxPool2d, LeanReLU, Residual
from edgemesh.common.models.probe import REAL_PROBE_MAX_PARAMS
from edgemesh.common.models.specs import ModelSpec, check_io, standardize

Make = Callable[[], nn.Module]
Children = list[tuple[str, Make]]
"""Named builders of a list's modules, in order."""
IMAGE: Final = 3
"""Rank of a (channels, height, width) sample."""
FLAT: Final = 1
"""Rank of a (features,) sample."""
OptionRule = range | type[bool] | tuple[str, ...]
"""What an option takes: a range the integers allowed, ``bool`` is true or false, a tuple the names allowed."""
ACTIVATIONS: Final = ("relu", "relu6", "hardswish", "silu", "tanh", "sigmoid")
"""The element-wise layers, which a residual block's ``activation`` may name."""
MAX_RESIDUAL_DEPTH: Final = 3
"""Most residual blocks a layer may sit inside (a residual in a residual in a residual)."""
MAX_NESTING: Final = 2 * MAX_RESIDUAL_DEPTH + 4
"""Most lists and tables a layer list may nest (each residual block is a table and a list), walked before anything
else: a deeper structure is refused whole, without recursing into it."""
MAX_LAYERS: Final = 1000
"""Most items a layer list may hold, those inside residual blocks included (MobileNetV2 is about 150)."""
MAX_WIDTH: Final = 65536
"""Most output channels of a conv2d, features of a linear layer, and groups of a convolution."""
MAX_KERNEL: Final = 1024
"""Largest kernel, pooling window, stride and padding."""
MAX_PARAMS: Final = 50_000_000
"""Most parameters a layer-list model may hold (200 MB as float32; ResNet-50 has 25 million), counted from the
layers' options before any of them is built."""
MAX_ACTIVATION_VALUES: Final = 2**24
"""Most values one sample may be, as input or as any layer's output (64 MiB as float32), checked before the layer is
probed."""


class _Short(reprlib.Repr):
    """How errors write an item out: a few levels and entries of it, never the whole of a huge or deeply nested one;
    a table's keys in the order written (``reprlib`` sorts them)."""

    def __init__(self) -> None:
        super().__init__()  # Python 3.11's Repr takes its limits as attributes
        self.maxlevel, self.maxlist, self.maxdict, self.maxstring, self.maxother = 3, 6, 6, 60, 60

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces + (["..."] if len(x) > self.maxdict else [])) + "}"


_SHORT: Final = _Short()


@dataclass(frozen=True, slots=True)
class _Kind:
    """One kind of layer a list may name."""

    prefix: str
    """Child names are the prefix and a count: ``conv1``."""
    value: str | None
    """What the table entry of the kind gives (``channels``, ``window``...); None: a bare name, no options."""
    options: Mapping[str, OptionRule]
    """Option -> what it takes."""
    ranks: tuple[int, ...]
    """Sample ranks the layer takes (empty: any)."""


KINDS: Final[dict[str, _Kind]] = {
    "conv2d": _Kind("conv", "output channels",
                    {"kernel": range(1, MAX_KERNEL + 1), "padding": range(MAX_KERNEL + 1),
                     "stride": range(1, MAX_KERNEL + 1), "groups": range(1, MAX_WIDTH + 1), "bias": bool}, (IMAGE,)),
    "linear": _Kind("fc", "output features", {"bias": bool}, (FLAT,)),
    "relu": _Kind("relu", None, {}, ()),
    "maxpool2d": _Kind("pool", "window", {"stride": range(1, MAX_KERNEL + 1)}, (IMAGE,)),
    "avgpool2d": _Kind("pool", "window", {"stride": range(1, MAX_KERNEL + 1)}, (IMAGE,)),
    "flatten": _Kind("flatten", None, {}, ()),
    "dropout": _Kind("drop", "probability", {}, ()),
    "batchnorm": _Kind("bn", None, {}, (FLAT, IMAGE)),
    "groupnorm": _Kind("gn", "groups", {}, (FLAT, IMAGE)),
    "tanh": _Kind("tanh", None, {}, ()),
    "sigmoid": _Kind("sigmoid", None, {}, ()),
    "relu6": _Kind("relu6_", None, {}, ()),
    "hardswish": _Kind("hswish", None, {}, ()),
    "silu": _Kind("silu", None, {}, ()),
    "globalavgpool": _Kind("gap", None, {}, (IMAGE,)),
    "residual": _Kind("res", "layer list", {"activation": ACTIVATIONS}, ()),
}
"""Every layer name a list may use, in the order error messages list them."""
VALUE_LIMITS: Final = {"conv2d": MAX_WIDTH, "linear": MAX_WIDTH, "maxpool2d": MAX_KERNEL, "avgpool2d": MAX_KERNEL,
                       "groupnorm": MAX_WIDTH}
"""The largest value of each kind whose value is a positive integer."""
RANK_NAMES: Final = {FLAT: "a flat (features,) input", IMAGE: "a (channels, height, width) input"}
PLAIN: Final[dict[str, Make]] = {"relu": LeanReLU, "relu6": nn.ReLU6, "hardswish": nn.Hardswish, "silu": nn.SiLU,
                                 "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "flatten": nn.Flatten,
                                 "globalavgpool": GlobalAvgPool}
"""The module of each bare-name layer."""


def _make(kind: str, value: Any, options: Mapping[str, Any], shape: tuple[int, ...]) -> Make:
    """A builder of the (non-residual) layer for an input of per-sample ``shape`` (already checked)."""
    if kind == "conv2d":
        return functools.partial(nn.Conv2d, shape[0], value, options["kernel"], stride=options.get("stride", 1),
                                 padding=options.get("padding", 0), groups=options.get("groups", 1),
                                 bias=options.get("bias", True))
    if kind == "linear":
        return functools.partial(nn.Linear, shape[0], value, bias=options.get("bias", True))
    if kind == "maxpool2d":
        return functools.partial(LeanMaxPool2d, value, stride=options.get("stride", value))
    if kind == "avgpool2d":
        return functools.partial(nn.AvgPool2d, value, stride=options.get("stride", value))
    if kind == "dropout":
        return functools.partial(nn.Dropout, float(value))
    if kind == "batchnorm":
        return functools.partial(nn.BatchNorm1d if len(shape) == FLAT else nn.BatchNorm2d, shape[0])
    if kind == "groupnorm":
        return functools.partial(nn.GroupNorm, value, shape[0])
    return PLAIN[kind]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | Mapping)


def _label(item: Any) -> str:
    """How an error names an item: a residual block by its kind (its sub-list is named item by item), others as
    written (shortened)."""
    return "residual" if isinstance(item, Mapping) and "residual" in item else _SHORT.repr(item)


def _option(kind: str, key: str, rule: OptionRule, option: Any) -> Any:
    """``option`` as given for ``key`` if ``rule`` allows it; ModelError with the reason alone otherwise."""
    if isinstance(rule, tuple):
        if not isinstance(option, str) or option not in rule:
            raise ModelError(f"{kind} option {key} must be one of {', '.join(rule)}, got {_SHORT.repr(option)}")
    elif isinstance(rule, range):
        if not _is_int(option) or option < rule.start:
            raise ModelError(f"{kind} option {key} must be an integer >= {rule.start}, got {_SHORT.repr(option)}")
        if option not in rule:
            raise ModelError(f"{kind} option {key} may be at most {rule[-1]}, got {option}")
    elif not isinstance(option, bool):
        raise ModelError(f"{kind} option {key} must be true or false, got {_SHORT.repr(option)}")
    return option


def _parse(item: Any) -> tuple[str, Any, dict[str, Any]]:
    """(kind, value, options) of one item as written; raises ModelError with the reason alone."""
    if isinstance(item, str):
        return _bare(item), None, {}
    if not isinstance(item, Mapping):
        raise ModelError(f"a layer is a name or a table, not {type(item).__name__}")
    kind = _named_kind(item)
    spec, value = KINDS[kind], item[kind]
    if spec.value is None:
        raise ModelError(f"{kind} takes no value or options: write {kind!r}")
    VALUE_RULES[kind](kind, spec.value, value)
    return kind, value, _options(kind, item)


def _bare(name: str) -> str:
    """The kind of a layer written as its name alone."""
    if name not in KINDS:
        raise ModelError(f"unknown layer; known: {', '.join(KINDS)}")
    if KINDS[name].value is not None:
        raise ModelError(f"{name} needs its {KINDS[name].value}: write {{{name} = ...}}")
    return name


def _named_kind(table: Mapping[Any, Any]) -> str:
    """The one layer kind a table names among its keys."""
    kinds = [k for k in table if k in KINDS]
    if len(kinds) != 1:
        found = f"names {len(kinds)} layers ({', '.join(kinds)})" if kinds else "unknown layer"
        raise ModelError(f"{found}; a table names exactly one of: {', '.join(KINDS)}")
    return str(kinds[0])


def _probability(kind: str, what: str, value: Any) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1:
        raise ModelError(f"{kind} {what} must be a number in [0, 1), got {_SHORT.repr(value)}")


def _layers(kind: str, what: str, value: Any) -> None:
    if not _is_list(value) or not value:
        raise ModelError(f"{kind} takes a non-empty list of layers, got {_SHORT.repr(value)}")


def _positive_integer(kind: str, what: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ModelError(f"{kind} {what} must be a positive integer, got {_SHORT.repr(value)}")
    if value > VALUE_LIMITS[kind]:
        raise ModelError(f"{kind} {what} may be at most {VALUE_LIMITS[kind]}, got {value}")


VALUE_RULES: Final[dict[str, Callable[[str, str, Any], None]]] = {
    "conv2d": _positive_integer, "linear": _positive_integer, "maxpool2d": _positive_integer,
    "avgpool2d": _positive_integer, "dropout": _probability, "residual": _layers, "groupnorm": _positive_integer,
}
"""How the value of each kind that takes one is checked: ``rule(kind, what the value is, value)`` raises ModelError
with the reason alone."""


def _options(kind: str, table: Mapping[Any, Any]) -> dict[str, Any]:
    """The options of a table naming ``kind``, each checked against what it takes."""
    spec = KINDS[kind]
    options: dict[str, Any] = {}
    for key, option in table.items():
        if key == kind:
            continue
        if key not in spec.options:
            allowed = ", ".join(spec.options) or "none"
            raise ModelError(f"unknown option {_SHORT.repr(key)} for {kind}; options: {allowed}")
        options[key] = _option(kind, key, spec.options[key], option)
    if kind == "conv2d" and "kernel" not in options:
        raise ModelError("conv2d needs option kernel")
    return options


def _fit(kind: str, value: Any, options: Mapping[str, Any], shape: tuple[int, ...]) -> None:
    """ModelError with the reason alone when an option does not suit the layer's input of ``shape``."""
    groups = options.get("groups", 1)
    if kind == "conv2d" and (shape[0] % groups or value % groups):
        raise ModelError(f"groups = {groups} must divide the input channels ({shape[0]}) and the output "
                         f"channels ({value}); groups equal to the input channels is a depthwise convolution")
    if kind == "groupnorm" and shape[0] % value:
        raise ModelError(f"{value} groups must divide its input's {shape[0]} channels")


def _params(kind: str, value: Any, options: Mapping[str, Any], shape: tuple[int, ...]) -> int:
    """Parameters of the (non-residual) layer for an input of per-sample ``shape``, from its options alone."""
    bias = value if options.get("bias", True) else 0
    if kind == "conv2d":
        return value * (shape[0] // options.get("groups", 1)) * options["kernel"] ** 2 + bias
    if kind == "linear":
        return value * shape[0] + bias
    if kind in ("batchnorm", "groupnorm"):
        return 2 * shape[0]
    return 0


def _output_values(kind: str, value: Any, options: Mapping[str, Any], shape: tuple[int, ...]) -> int:
    """Values per sample out of the (non-residual) layer for an input of ``shape``, from its options alone: exact
    for a convolution and a linear layer, the input's for the others (none of which grows it)."""
    if kind == "conv2d":
        kernel, padding, stride = options["kernel"], options.get("padding", 0), options.get("stride", 1)
        return value * math.prod(max(0, (size + 2 * padding - kernel) // stride + 1) for size in shape[1:])
    if kind == "linear":
        return int(value)
    return math.prod(shape)


@dataclass(slots=True)
class _Budget:
    """The parameters of the layers checked so far, against ``MAX_PARAMS``."""

    params: int = 0

    def add(self, params: int) -> None:
        """Count ``params`` more; ModelError with the reason alone past the limit."""
        self.params += params
        if self.params > MAX_PARAMS:
            raise ModelError(f"brings the model to {self.params:,} parameters, more than the {MAX_PARAMS:,} a layer "
                             "list may hold")


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


@dataclass(frozen=True, slots=True)
class _Chain:
    """The checked layers of one list."""

    children: Children
    shape: tuple[int, ...]
    """Per-sample output shape of the last layer."""
    last: str
    """Where the last layer is (``model 'm': layer 7 ({'linear': 5})``), for an error about the output."""
    batchnorm: bool
    """Whether a batch norm is among the layers (nested blocks included)."""


def _sequential(children: Children) -> nn.Sequential:
    return nn.Sequential(OrderedDict((child, make()) for child, make in children))


def _chain(where: str, layers: Sequence[Any], input_shape: tuple[int, ...], depth: int, budget: _Budget) -> _Chain:
    """The named layer builders of a non-empty list inside ``depth`` residual blocks, every layer checked against
    its input (its parameters counted on ``budget``); ModelError naming the layer after ``where`` (``model 'm': ``
    or the enclosing blocks)."""
    counts: dict[str, int] = {}
    out: Children = []
    shape = input_shape
    batchnorm = False
    at = where
    for position, item in enumerate(layers, start=1):
        at = f"{where}layer {position} ({_label(item)})"
        try:
            kind, value, options = _parse(item)
            ranks = KINDS[kind].ranks
            if ranks and len(shape) not in ranks:
                expects = " or ".join(RANK_NAMES[r] for r in ranks)
                hint = "; put 'flatten' before it" if ranks == (FLAT,) else ""
                raise ModelError(f"expects {expects} but gets shape {shape}{hint}")
            _fit(kind, value, options, shape)
            if kind != "residual":
                values = _output_values(kind, value, options, shape)
                if values > MAX_ACTIVATION_VALUES:
                    raise ModelError(f"gives {values:,} values per sample from its input of shape {shape}, more than "
                                     f"the {MAX_ACTIVATION_VALUES:,} a layer may")
                budget.add(_params(kind, value, options, shape))
        except ModelError as exc:
            raise ModelError(f"{at}: {exc}") from None
        if kind == "residual":
            make, new_shape, inner_bn = _residual(at, value, options, shape, depth + 1, budget)
            batchnorm = batchnorm or inner_bn
        else:
            make = _make(kind, value, options, shape)
            try:
                new_shape = _probe(make, shape)
            except (RuntimeError, ValueError) as exc:
                raise ModelError(f"{at}: does not fit its input of shape {shape}: {exc}") from None
            batchnorm = batchnorm or kind == "batchnorm"
        if 0 in new_shape:
            raise ModelError(f"{at}: gives an empty output {new_shape} from its input of shape {shape}")
        shape = new_shape
        prefix = KINDS[kind].prefix
        counts[prefix] = counts.get(prefix, 0) + 1
        out.append((f"{prefix}{counts[prefix]}", make))
    return _Chain(out, shape, at, batchnorm)


def _residual(at: str, layers: Sequence[Any], options: Mapping[str, Any], shape: tuple[int, ...],
              depth: int, budget: _Budget) -> tuple[Make, tuple[int, ...], bool]:
    """(builder, output shape, whether its body has batch norm) of the residual block at ``at`` whose body sits
    inside ``depth`` blocks; ModelError naming the block, or the layer of its body, that is wrong."""
    if depth > MAX_RESIDUAL_DEPTH:
        raise ModelError(f"{at}: residual blocks nest at most {MAX_RESIDUAL_DEPTH} deep")
    body = _chain(f"{at}, ", layers, shape, depth, budget)
    try:
        skip = _projection(shape, body.shape, body.batchnorm)
        if skip is not None:  # a 1x1 convolution or a linear layer without bias, then batch norm's weight and bias
            budget.add(shape[0] * body.shape[0] + (2 * body.shape[0] if body.batchnorm else 0))
    except ModelError as exc:
        raise ModelError(f"{at}: {exc}") from None
    activation: str | None = options.get("activation")

    def build() -> nn.Module:
        act = None if activation is None else _make(activation, None, {}, body.shape)()
        return Residual(_sequential(body.children), None if skip is None else _sequential(skip), act)

    return build, body.shape, body.batchnorm


def _projection(shape: tuple[int, ...], out: tuple[int, ...], batchnorm: bool) -> Children | None:
    """The skip connection's modules from ``shape`` to a body's output ``out``: none (the identity) when they
    agree, else a projection without bias (the body's last layer has its own), then batch norm when the body has
    one; ModelError with the reason alone when no projection fits."""
    if out == shape:
        return None
    if len(out) != len(shape) or len(shape) not in (FLAT, IMAGE):
        raise ModelError(f"its layers turn shape {shape} into {out}; a skip connection projects only from a "
                         "(channels, height, width) shape to another, or from a (features,) shape to another")
    if len(shape) == FLAT:
        return [("fc1", functools.partial(nn.Linear, shape[0], out[0], bias=False)),
                *([("bn1", functools.partial(nn.BatchNorm1d, out[0]))] if batchnorm else [])]
    stride_h, stride_w = _stride(shape[1], out[1]), _stride(shape[2], out[2])
    if stride_h is None or stride_w is None:
        raise ModelError(f"its layers turn shape {shape} into {out}; a 1x1 convolution of the skip connection "
                         "cannot give that height and width (it can only keep or shrink them by a stride)")
    return [("conv1", functools.partial(nn.Conv2d, shape[0], out[0], 1, stride=(stride_h, stride_w), bias=False)),
            *([("bn1", functools.partial(nn.BatchNorm2d, out[0]))] if batchnorm else [])]


def _stride(size: int, size_out: int) -> int | None:
    """The least stride at which a 1x1 convolution turns ``size`` positions into ``size_out``; None if none does."""
    stride = -(-size // size_out)
    return stride if -(-size // stride) == size_out else None


def _check_size(name: str, layers: Sequence[Any]) -> None:
    """ModelError when ``layers`` nests lists and tables more than ``MAX_NESTING`` deep, or holds more than
    ``MAX_LAYERS`` layers (residual blocks' included). Walked without recursion, so that no structure a job file
    gives is too deep to be refused."""
    count = 0
    for position, item in enumerate(layers, start=1):
        stack: list[tuple[Any, int, bool]] = [(item, 2, False)]  # (node, its depth, whether it is a layer list)
        while stack:
            node, depth, is_layers = stack.pop()
            if not (isinstance(node, Mapping) or _is_list(node)):
                continue
            if depth > MAX_NESTING:
                raise ModelError(f"model {name!r}: layer {position} nests lists and tables more than {MAX_NESTING} "
                                 f"deep (residual blocks nest at most {MAX_RESIDUAL_DEPTH} deep)")
            if isinstance(node, Mapping):
                stack.extend((v, depth + 1, k == "residual" and _is_list(v)) for k, v in node.items())
                continue
            count += len(node) if is_layers else 0
            if count + len(layers) > MAX_LAYERS:
                raise ModelError(f"model {name!r}: the layer list holds more than {MAX_LAYERS} layers (those in "
                                 "residual blocks included)")
            stack.extend((v, depth + 1, False) for v in node)
    if len(layers) > MAX_LAYERS:
        raise ModelError(f"model {name!r}: the layer list holds {len(layers)} layers, more than {MAX_LAYERS}")


def layer_list_spec(name: str, layers: Sequence[Any], input_shape: Sequence[int], num_classes: int,
                    mean: Sequence[float] = (), std: Sequence[float] = (), description: str = "") -> ModelSpec:
    """The spec of a model written as a layer list, checked now: ModelError naming the layer
    (``layer 4 ({'linear': 10}): ...``, ``layer 3 (residual), layer 2 ({'conv2d': 8}): ...``) that is unknown,
    has a bad option or does not fit its input, or the last one when the output is not one score per class."""
    shape = check_io(name, input_shape, num_classes)
    if math.prod(shape) > MAX_ACTIVATION_VALUES:
        raise ModelError(f"model {name!r}: input_shape {shape} holds {math.prod(shape):,} values per sample, more "
                         f"than the {MAX_ACTIVATION_VALUES:,} a layer list takes")
    first = standardize(name, shape, mean, std)
    if not _is_list(layers):
        raise ModelError(f"model {name!r}: layers must be a list, got {type(layers).__name__}")
    if not layers:
        raise ModelError(f"model {name!r}: the layer list is empty")
    _check_size(name, layers)
    try:
        chain = _chain(f"model {name!r}: ", layers, shape, 0, _Budget())
    except ModelError:
        raise
    except Exception as exc:  # torch's own errors, whatever a bound above missed: the job is refused, not a crash
        raise ModelError(f"model {name!r}: the layer list does not build: {type(exc).__name__}: "
                         f"{_SHORT.repr(str(exc))}") from exc
    if chain.shape != (num_classes,):
        raise ModelError(f"{chain.last}: the model's output per sample is {chain.shape}, but it must be "
                         f"({num_classes},) for {num_classes} classes")
    children = chain.children

    def build() -> nn.Module:
        modules: list[tuple[str, nn.Module]] = [("input", first())] if first is not None else []
        modules += [(child, make()) for child, make in children]
        return nn.Sequential(OrderedDict(modules))

    summary = ", ".join(child for child, _ in children)
    return ModelSpec(name=name, input_shape=shape, num_classes=num_classes, builder=build,
                     description=description or f"layer list: {summary}")
