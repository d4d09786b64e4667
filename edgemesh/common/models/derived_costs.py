"""What a model costs, derived from its modules (the figures ``costs`` holds), and how model parallelism divides it.

Figures come from one forward pass of one zero sample (``probe.on_sample``: on the meta device when
the model allows, so nothing is computed):

* **MACs** are torch's own count (``torch.utils.flop_counter.FlopCounterMode``) halved: the FLOPs of
  matrix multiplies (``mm``, ``addmm``, ``bmm``, ``baddbmm``: linear layers), convolutions and
  attention, at 2 FLOPs per multiply-accumulate. Bias additions, element-wise layers, pooling and
  normalization are not counted (memory-bound and small; see ``costs``).
* **Activations** are the values every leaf module outputs for the sample, plus the input and the sum
  of a residual block no activation follows: what a training step keeps for its backward pass (an
  upper bound with ``LeanReLU``/``LeanMaxPool2d``).
* **Parameters** are every parameter of the module (all of them travel).
* **Layer figures** (``costs.LayerCost``) for a model ``mesh_stages`` can divide, else none.

A host checks a job's model against its memory budget before it builds it (``meta_costs``: the spec built on
the meta device, so a model of a billion parameters costs no memory to measure) with the estimates of
``worker_memory`` and ``server_memory``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from edgemesh.common import costs
from edgemesh.common.costs import ACTIVATION_COPIES, FLOAT32_BYTES, PARAM_COPIES, RUNTIME_BYTES, LayerCost, ModelCost
from edgemesh.common.errors import ModelError
from edgemesh.common.models.lean import GlobalAvgPool, Residual, Standardize
from edgemesh.common.models.probe import Forward, on_sample
from edgemesh.common.models.specs import ModelSpec, build_model, get_spec

CHANNELWISE: Final = (nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.Hardtanh, nn.Hardswish, nn.SiLU,
                      nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, GlobalAvgPool)
"""Modules that act on each channel alone: model parallelism runs them on a member's slice."""
NORMS: Final = (nn.BatchNorm1d, nn.BatchNorm2d)
"""Batch norms model parallelism divides, in a stage's tail: a member normalizes its own channels over the cluster's
whole batch (every member holds it), with its rows of the weight, bias and running statistics."""
DROPOUTS: Final = (nn.Dropout,)
"""Dropout, with a mask the cluster draws from a seed it shares (``masks``): in a tail a member applies its slice
of the whole tensor's mask, before a layer every member applies the whole mask to the whole input."""
REPLICATED: Final = (Standardize, nn.Flatten, nn.Identity)
"""Parameterless modules that mix channels or positions: every member runs them on the whole input."""
FLOPS_PER_MAC_COUNTED: Final = 2
"""FlopCounterMode counts a multiply-accumulate as 2 FLOPs."""
SERVER_PARAM_COPIES: Final = 6
"""float32 copies of the parameters a parameter server holds: the weights, their momentum, a step's combined
gradient, the broadcast's reference (what the workers hold), the copy handed to the evaluation and the divergence
guard's best model. The decoded updates waiting in its queue come on top (at most ``ps.max_batch`` of them)."""
SERVER_EVAL_BATCH: Final = 512
"""Samples a parameter server evaluates at once (``models.evaluate``'s batch), without gradients."""


@dataclass(frozen=True, slots=True)
class Stage:
    """One divisible layer of a spec, as model parallelism runs it (docs/mesh.md).

    A member applies ``pre`` to the whole (gathered) input, its slice of ``layer``'s output
    units, then ``tail`` to that slice; the slices are then all-gathered along dim 1. In a residual
    block the first stage keeps the block's input and the last adds the member's channels of the skip
    connection before ``post``.
    """

    layer: str
    """Path of the conv or linear module (``conv1``, ``res1.body.conv2``); its output units are what the filter
    division divides."""
    pre: tuple[str, ...]
    tail: tuple[str, ...]
    opens: str = ""
    """The residual block whose first layer this is: its input, the stage's input after the first ``entry`` modules
    of ``pre``, is what the block's skip connection carries, so every member keeps it whole."""
    entry: int = 0
    closes: str = ""
    """The residual block whose last layer this is: after ``tail`` a member adds its channels of the skip connection
    (of the kept block input, or its rows of the projection ``skip`` of it), then runs ``post``."""
    skip: tuple[str, ...] = ()
    """The closed block's projection: a conv or linear layer with the same output units as ``layer`` (so the same
    counts divide it), then batch norms of those channels; empty for the identity."""
    post: tuple[str, ...] = ()
    """Channel-wise modules after the block's sum: its activation and the modules that follow the block."""


def mesh_stages(model: nn.Module) -> tuple[Stage, ...]:
    """Split a sequential model into its divisible stages, residual blocks' bodies included.

    A residual block (``lean.Residual``) divides exactly when its body is sequential, holds no residual block, and
    ends with a conv or linear layer and channel-wise modules, and its skip is the identity or a projection (a conv
    or linear layer of the same output units as the body's last layer, without groups, then batch norms): its body's
    layers are stages named by their paths (``res1.body.conv1``), the first keeps the block's input, the last adds
    the member's channels of the skip before the block's activation (``Stage.opens``, ``Stage.closes``).

    Raises ModelError for a model model parallelism cannot divide: not sequential, a module it does not know to
    divide exactly (a nested residual block, a batch norm that does not follow a conv or linear layer's channels,
    any other module with parameters or randomness), since each member must compute exactly what one process would,
    or a conv layer a member cannot slice by output units (padding other than zeros). Layers without bias divide
    by their weight rows; grouped and depthwise convolutions by whole groups.
    """
    if not isinstance(model, nn.Sequential):
        raise ModelError(f"model parallelism needs a sequential model (a layer list builds one), got a "
                         f"{type(model).__name__}: return an nn.Sequential of the layers from the entry point, write "
                         "the model as a layer list, or train it with planner.parallelism = \"data\"")
    walk = _Walk()
    for name, module in model.named_children():
        if isinstance(module, Residual):
            walk.block(name, module)
        else:
            walk.module(name, module)
    return walk.finish()


@dataclass(slots=True)
class _Building:
    """The stage ``mesh_stages`` is building."""

    layer: str
    units: int
    pre: list[str]
    opens: str
    entry: int
    tail: list[str] = field(default_factory=list)
    closes: str = ""
    skip: tuple[str, ...] = ()
    post: list[str] = field(default_factory=list)

    def after(self, name: str) -> None:
        """Channel-wise module ``name`` follows: in the tail, or after the sum once a residual block closed."""
        (self.post if self.closes else self.tail).append(name)

    def stage(self) -> Stage:
        return Stage(self.layer, tuple(self.pre), tuple(self.tail), self.opens, self.entry, self.closes, self.skip,
                     tuple(self.post))


class _Walk:
    """``mesh_stages``' walk over the model's modules, in forward order."""

    def __init__(self) -> None:
        self.stages: list[Stage] = []
        self.open: _Building | None = None
        self.pending: list[str] = []
        """Modules before the next layer, which every member runs on the whole input."""
        self.entering: tuple[str, int] | None = None
        """A residual block whose first layer is still to come, and how many pending modules precede its input."""

    def module(self, name: str, module: nn.Module) -> None:
        if isinstance(module, Residual):
            raise ModelError(f"model parallelism cannot divide module {name!r} (Residual inside a residual block: "
                             "nested blocks do not divide)")
        if isinstance(module, nn.Conv2d | nn.Linear):
            _check_divisible(name, module)
            self._close()
            opens, entry = self.entering or ("", 0)
            self.open = _Building(name, _units(module), self.pending, opens, entry)
            self.pending, self.entering = [], None
        elif isinstance(module, NORMS):
            current = self.open
            _check_norm(name, module, current.layer if current else None, current.units if current else 0)
            assert current is not None  # _check_norm refuses a batch norm no layer precedes
            current.after(name)
        elif isinstance(module, (*CHANNELWISE, *DROPOUTS)):
            if self.open is not None:
                self.open.after(name)
            else:
                self.pending.append(name)
        elif isinstance(module, REPLICATED):
            self._close()
            self.pending.append(name)
        else:
            raise ModelError(f"model parallelism cannot divide module {name!r} ({type(module).__name__})")

    def block(self, name: str, block: Residual) -> None:
        """Residual block ``name``: its body's stages, the last one closing the block with its skip, then its
        activation like any module after the block."""
        if not isinstance(block.body, nn.Sequential):
            raise ModelError(f"model parallelism cannot divide module {name!r} (Residual whose body is not sequential)")
        self._close()
        self.entering = (name, len(self.pending))
        for child, module in block.body.named_children():
            self.module(f"{name}.body.{child}", module)
        if self.entering is not None or self.open is None:
            raise ModelError(f"model parallelism cannot divide module {name!r} (Residual whose body does not end with "
                             "a conv or linear layer and channel-wise modules)")
        self.open.closes, self.open.skip = name, _skip(name, block.skip, self.open.layer, self.open.units)
        if block.act is not None:
            self.module(f"{name}.act", block.act)

    def finish(self) -> tuple[Stage, ...]:
        if self.open is None:
            raise ModelError("the model must end with a conv or linear layer (and channel-wise modules)")
        self._close()
        return tuple(self.stages)

    def _close(self) -> None:
        if self.open is not None:
            self.stages.append(self.open.stage())
            self.open = None


def _skip(name: str, skip: nn.Module | None, layer: str, units: int) -> tuple[str, ...]:
    """The paths of residual block ``name``'s projection (empty for the identity skip); ModelError unless it is a
    conv or linear layer of the ``units`` of the body's last ``layer``, without groups, then batch norms."""
    if skip is None:
        return ()
    path = f"{name}.skip"
    children = list(skip.named_children()) if isinstance(skip, nn.Sequential) else [("", skip)]
    paths = [f"{path}.{child}" if child else path for child, _ in children]
    modules = [module for _, module in children]
    first = modules[0] if modules else None
    if not isinstance(first, nn.Conv2d | nn.Linear) or not all(isinstance(m, NORMS) for m in modules[1:]):
        raise ModelError(f"model parallelism cannot divide module {path!r} (a skip connection divides as the identity "
                         "or as a conv or linear layer followed by batch norms)")
    _check_divisible(paths[0], first)
    if isinstance(first, nn.Conv2d) and first.groups > 1 or _units(first) != units:
        raise ModelError(f"model parallelism cannot divide module {paths[0]!r} (a projection divides with the body's "
                         f"last layer {layer!r} of {units} units: it needs as many output units and no groups)")
    for p, module in zip(paths[1:], modules[1:], strict=True):
        _check_norm(p, module, paths[0], units)
    return tuple(paths)


def _units(module: nn.Conv2d | nn.Linear) -> int:
    """Output units of a conv or linear layer: what the filter division divides."""
    return module.out_channels if isinstance(module, nn.Conv2d) else module.out_features


def _check_norm(name: str, module: nn.Module, layer: str | None, units: int) -> None:
    """ModelError unless batch norm ``module`` normalizes the output channels of conv or linear ``layer`` (of
    ``units``), which a member can then normalize on its own channels."""
    kind = type(module).__name__
    if layer is None:
        raise ModelError(f"model parallelism cannot divide module {name!r} ({kind} that follows no conv or linear "
                         "layer: only a batch norm of a layer's output channels divides with them)")
    assert isinstance(module, NORMS)
    if module.num_features != units:
        raise ModelError(f"model parallelism cannot divide module {name!r} ({kind} of {module.num_features} "
                         f"features after {layer!r} of {units} units)")


def _check_divisible(name: str, module: nn.Conv2d | nn.Linear) -> None:
    """ModelError unless a member can compute a slice of the layer's output units from the whole input with its
    rows of the weight and bias (if any): a member pads its input with zeros, as ``F.conv2d`` does. A grouped
    convolution's slice is whole groups, computed from their input channels (the member's counts say so)."""
    if isinstance(module, nn.Conv2d) and module.padding_mode != "zeros":
        raise ModelError(f"model parallelism cannot divide module {name!r} ({type(module).__name__} with "
                         f"padding_mode = {module.padding_mode!r})")


def _counted(module: nn.Module) -> bool:
    """Whether the values ``module`` outputs count as activations: a leaf's, and a residual block's when no
    activation follows its sum (the sum is made outside any leaf; an activation's output is counted as a leaf's)."""
    return next(module.children(), None) is None or (isinstance(module, Residual) and module.act is None)


def _values(output: Any) -> int:
    """Values in a module's output (a tensor, or tensors in a tuple, list or dict)."""
    if isinstance(output, torch.Tensor):
        return output.numel()
    if isinstance(output, tuple | list):
        return sum(_values(o) for o in output)
    if isinstance(output, dict):
        return sum(_values(o) for o in output.values())
    return 0


@dataclass(slots=True)
class _Pass:
    """What one forward pass of one sample showed."""

    macs: int
    activations: int
    inputs: dict[str, tuple[int, ...]]
    """Per-sample input shape of each module, by path (``res1.body.conv1``)."""
    outputs: dict[str, tuple[int, ...]]


def _watch(model: nn.Module, input_shape: tuple[int, ...]) -> Callable[[Forward], _Pass]:
    """A ``measure`` for ``probe.on_sample``: counts FLOPs, leaf outputs and module shapes of one pass."""

    def measure(forward: Forward) -> _Pass:
        seen = _Pass(0, math.prod(input_shape), {}, {})

        def leaf(module: nn.Module, args: Any, output: Any) -> None:
            seen.activations += _values(output)

        def child(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                    seen.inputs[name], seen.outputs[name] = tuple(args[0].shape[1:]), tuple(output.shape[1:])
            return hook

        handles = [m.register_forward_hook(leaf) for m in model.modules() if _counted(m)]
        handles += [m.register_forward_hook(child(n)) for n, m in model.named_modules() if n]
        try:
            with FlopCounterMode(display=False) as counter:
                forward()
        finally:
            for handle in handles:
                handle.remove()
        seen.macs = counter.get_total_flops() // FLOPS_PER_MAC_COUNTED
        return seen

    return measure


def _layer_costs(model: nn.Module, stages: tuple[Stage, ...], seen: _Pass) -> tuple[LayerCost, ...]:
    modules = dict(model.named_modules())
    out = []
    for stage in stages:
        module = modules[stage.layer]
        assert isinstance(module, nn.Conv2d | nn.Linear)
        units = _units(module)
        per_unit_out, macs = _unit_figures(stage.layer, module, seen)
        gathered = math.prod(seen.outputs[(stage.layer, *stage.tail, *stage.post)[-1]][1:])
        in_values = math.prod(seen.inputs[stage.pre[0] if stage.pre else stage.layer])
        norms = [(name, modules[name]) for name in (*stage.tail, *stage.skip[1:], *stage.post)
                 if isinstance(modules[name], NORMS)]
        own = [module, *(n for _, n in norms)]
        divided = _divided(norms)
        if stage.skip:  # the projection: its rows are the layer's (the same output units), its cost counted with it
            projection = modules[stage.skip[0]]
            assert isinstance(projection, nn.Conv2d | nn.Linear)
            skip_out, skip_macs = _unit_figures(stage.skip[0], projection, seen)
            per_unit_out, macs = per_unit_out + skip_out, macs + skip_macs
            own.append(projection)
            divided = (*(f"{stage.skip[0]}.{part}" for part in ("weight", "bias")
                         if getattr(projection, part) is not None), *divided)
        params = sum(p.numel() for m in own for p in m.parameters()) // units
        group = units // module.groups if isinstance(module, nn.Conv2d) and module.groups > 1 else 1
        out.append(LayerCost(stage.layer, units, macs, params, per_unit_out, gathered, in_values, divided=divided,
                             counters=_counters(norms), bias=module.bias is not None, group=group))
    return tuple(out)


def _unit_figures(name: str, module: nn.Conv2d | nn.Linear, seen: _Pass) -> tuple[int, int]:
    """(values out, forward MACs) of one output unit of conv or linear layer ``name``, for one sample."""
    per_unit_out = math.prod(seen.outputs[name][1:])
    if isinstance(module, nn.Conv2d):
        per_output = module.in_channels // module.groups * math.prod(module.kernel_size)
    else:
        per_output = module.in_features
    return per_unit_out, per_unit_out * per_output


def _divided(norms: list[tuple[str, nn.Module]]) -> tuple[str, ...]:
    """The tensors of a stage's batch norms (its tail's, its projection's, after its block's sum) divided with its
    layer's rows: weight, bias and running statistics."""
    own = ("weight", "bias", "running_mean", "running_var")
    return tuple(f"{name}.{part}" for name, norm in norms for part in own if getattr(norm, part, None) is not None)


def _counters(norms: list[tuple[str, nn.Module]]) -> tuple[str, ...]:
    """The batch-count buffers of a stage's batch norms (kept whole by every member)."""
    return tuple(f"{name}.num_batches_tracked" for name, norm in norms
                 if getattr(norm, "num_batches_tracked", None) is not None)


def _derive(model: nn.Module, input_shape: tuple[int, ...]) -> tuple[ModelCost, tuple[LayerCost, ...] | None, str]:
    """(cost, layer figures or None, why there are none)."""
    shape = tuple(input_shape)
    try:
        seen = on_sample(model, shape, _watch(model, shape))
    except Exception as exc:  # whatever the model's forward raises
        raise ModelError(f"the model rejects a zero sample of shape {(1, *shape)}: {exc}") from exc
    cost = ModelCost(params=sum(p.numel() for p in model.parameters()), macs_per_sample=seen.macs,
                     activations_per_sample=seen.activations)
    try:
        stages = mesh_stages(model)
    except ModelError as exc:
        return cost, None, str(exc)
    return cost, _layer_costs(model, stages, seen), ""


def derive_costs(model: nn.Module, input_shape: tuple[int, ...]) -> tuple[ModelCost, tuple[LayerCost, ...] | None]:
    """The per-sample cost of ``model`` on samples of ``input_shape``, and its per-layer division
    figures (None when ``mesh_stages`` cannot divide it). ModelError if the model rejects the sample."""
    cost, layers, _ = _derive(model, input_shape)
    return cost, layers


def register_costs(name: str) -> tuple[ModelCost, tuple[LayerCost, ...] | None]:
    """Build spec ``name``, derive its figures and register them in ``costs`` (which calls this for a
    spec it does not know yet)."""
    spec = get_spec(name)
    cost, layers, why = _derive(build_model(name), spec.input_shape)
    costs.register(name, cost, layers, why=why)
    return cost, layers


def measure_cost(name: str) -> ModelCost:
    """The per-sample training cost of spec ``name``, derived afresh from its modules."""
    spec = get_spec(name)
    return derive_costs(build_model(name), spec.input_shape)[0]


def measure_layers(name: str) -> tuple[LayerCost, ...]:
    """Per-layer division figures of spec ``name``, derived afresh; ModelError if it cannot be divided."""
    spec = get_spec(name)
    model = build_model(name)
    stages = mesh_stages(model)
    return _layer_costs(model, stages, on_sample(model, spec.input_shape, _watch(model, spec.input_shape)))


# --------------------------------------------------------------------------- memory a host needs for a model


@dataclass(frozen=True, slots=True)
class MemoryNeed:
    """A training process's estimated peak memory for one model: its parameters (in copies), the activations of a
    batch, and the process itself (``costs.RUNTIME_BYTES``)."""

    params: int
    param_copies: int
    batch: int
    activations_per_sample: int
    activation_copies: int

    @property
    def param_bytes(self) -> int:
        return self.param_copies * FLOAT32_BYTES * self.params

    @property
    def activation_bytes(self) -> int:
        return self.activation_copies * FLOAT32_BYTES * self.batch * self.activations_per_sample

    @property
    def total_bytes(self) -> int:
        return RUNTIME_BYTES + self.param_bytes + self.activation_bytes

    def describe(self) -> str:
        """``1234 MiB (1,000,000 parameters x 4 copies: 15 MiB; activations of 32 samples: 3 MiB; the process: 260
        MiB)``."""
        return (f"{_mib(self.total_bytes)} MiB ({self.params:,} parameters x {self.param_copies} copies: "
                f"{_mib(self.param_bytes)} MiB; activations of {self.batch} samples: {_mib(self.activation_bytes)} "
                f"MiB; the process: {_mib(RUNTIME_BYTES)} MiB)")


def _mib(n: int) -> int:
    return math.ceil(n / 2**20)


def worker_memory(cost: ModelCost, batch: int) -> MemoryNeed:
    """What a worker training ``cost``'s model at ``batch`` samples a step holds (``costs.training_memory_bytes``'s
    accounting: the weights, their gradients, the error-feedback residual and the model view; every layer's output
    and its gradient)."""
    return MemoryNeed(params=cost.params, param_copies=PARAM_COPIES, batch=batch,
                      activations_per_sample=cost.activations_per_sample, activation_copies=ACTIVATION_COPIES)


def server_memory(cost: ModelCost, shards: int = 1) -> MemoryNeed:
    """What one of ``shards`` parameter server processes holds for ``cost``'s model: its rows of the parameters in
    ``SERVER_PARAM_COPIES`` copies, and the outputs of an evaluation batch (``SERVER_EVAL_BATCH``, no gradients)."""
    return MemoryNeed(params=math.ceil(cost.params / max(shards, 1)), param_copies=SERVER_PARAM_COPIES,
                      batch=SERVER_EVAL_BATCH, activations_per_sample=cost.activations_per_sample,
                      activation_copies=1)


def meta_costs(spec: ModelSpec) -> tuple[ModelCost, tuple[LayerCost, ...] | None, str]:
    """The figures of ``spec``'s model built on the meta device: its parameters counted, one sample's forward pass
    watched, and nothing allocated: (cost, layer figures or None, why there are none). ModelError if the model does
    not build there or rejects the sample (a module without meta support: build it for real, ``derive_costs``)."""
    try:
        with torch.device("meta"):
            model = spec.builder()
    except ModelError:
        raise
    except Exception as exc:  # whatever the model's builder raises on the meta device
        raise ModelError(f"model {spec.name!r} does not build on the meta device: {type(exc).__name__}: {exc}") \
            from exc
    return _derive(model, spec.input_shape)


def built_costs(spec: ModelSpec, seed: int = 0) -> tuple[ModelCost, tuple[LayerCost, ...] | None, str]:
    """``meta_costs``'s figures of ``spec``'s model built for real (memory and all), for a model the meta device
    cannot build."""
    return _derive(build_model(spec.name, seed=seed), spec.input_shape)
