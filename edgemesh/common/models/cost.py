"""What a model costs, derived from its modules, and how model parallelism divides it.

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
from dataclasses import dataclass
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
                      nn.MaxPool2d, nn.AvgPool2d, GlobalAvgPool)
"""Modules that act on each channel alone: model parallelism runs them on a member's slice."""
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
    units, then ``tail`` to that slice; the slices are then all-gathered along dim 1.
    """

    layer: str
    """Name of the conv or linear module; its output units are what the filter division divides."""
    pre: tuple[str, ...]
    tail: tuple[str, ...]


def mesh_stages(model: nn.Module) -> tuple[Stage, ...]:
    """Split a sequential model into its divisible stages.

    Raises ModelError for a model model parallelism cannot divide: not sequential, a module with
    parameters that is neither conv nor linear (batch norm), one that is random (dropout) or
    unknown (a residual block), since each member must compute exactly what one process would,
    or a conv or linear layer a member cannot slice by output units (grouped, or without bias).
    """
    if not isinstance(model, nn.Sequential):
        raise ModelError("model parallelism needs a sequential model")
    stages: list[Stage] = []
    layer: str | None = None  # the stage being built
    pre: list[str] = []
    tail: list[str] = []
    pending: list[str] = []  # replicated modules before the next layer
    for name, module in model.named_children():
        if isinstance(module, nn.Conv2d | nn.Linear):
            _check_divisible(name, module)
            if layer is not None:
                stages.append(Stage(layer, tuple(pre), tuple(tail)))
            layer, pre, tail, pending = name, pending, [], []
        elif isinstance(module, CHANNELWISE):
            (tail if layer is not None else pending).append(name)
        elif isinstance(module, REPLICATED):
            if layer is not None:
                stages.append(Stage(layer, tuple(pre), tuple(tail)))
                layer = None
            pending.append(name)
        else:
            raise ModelError(f"model parallelism cannot divide module {name!r} ({type(module).__name__})")
    if layer is None:
        raise ModelError("the model must end with a conv or linear layer (and channel-wise modules)")
    stages.append(Stage(layer, tuple(pre), tuple(tail)))
    return tuple(stages)


def _check_divisible(name: str, module: nn.Conv2d | nn.Linear) -> None:
    """ModelError unless a member can compute a slice of the layer's output units from the whole input
    with a slice of its weight and bias (a grouped convolution's slice needs a slice of the input)."""
    kind = type(module).__name__
    if module.bias is None:
        raise ModelError(f"model parallelism cannot divide module {name!r} ({kind} without bias)")
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        raise ModelError(f"model parallelism cannot divide module {name!r} ({kind} with groups = {module.groups})")


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
    """Per-sample input shape of each top-level child."""
    outputs: dict[str, tuple[int, ...]]


def _watch(model: nn.Module, input_shape: tuple[int, ...]) -> Callable[[Forward], _Pass]:
    """A ``measure`` for ``probe.on_sample``: counts FLOPs, leaf outputs and child shapes of one pass."""

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
        handles += [m.register_forward_hook(child(n)) for n, m in model.named_children()]
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
    modules = dict(model.named_children())
    out = []
    for stage in stages:
        module = modules[stage.layer]
        assert isinstance(module, nn.Conv2d | nn.Linear)
        shape = seen.outputs[stage.layer]
        units, per_unit_out = shape[0], math.prod(shape[1:])
        gathered = math.prod(seen.outputs[stage.tail[-1] if stage.tail else stage.layer][1:])
        in_values = math.prod(seen.inputs[stage.pre[0] if stage.pre else stage.layer])
        if isinstance(module, nn.Conv2d):
            per_output = module.in_channels // module.groups * math.prod(module.kernel_size)
        else:
            per_output = module.in_features
        params = sum(p.numel() for p in module.parameters()) // units
        out.append(LayerCost(stage.layer, units, per_unit_out * per_output, params, per_unit_out, gathered,
                             in_values))
    return tuple(out)


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
