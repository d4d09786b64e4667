"""What training one model spec costs a device: FLOPs and memory, without importing torch.

The planner sizes batches and checks memory with these figures, and it runs on small hosts that
must not pay for torch, so this module only holds them: a registry of every spec's figures, filled
with figures derived from the torch modules (``models.derive_costs``). A process that has torch
derives a spec's figures on first use (``models`` is imported then, not before); one that has not
registers the figures it is given (``cost_from_plain``: the plain form travels in a message).

Cost model
----------
* **Compute.** ``train_flops_per_sample = 6 x MACs``: a forward pass costs 2 FLOPs per
  multiply-accumulate of every conv, linear and attention layer; the backward pass about twice the forward
  (input and weight gradients). Element-wise layers are left out (they are memory-bound and small).
* **Memory** of a training process at batch ``b``:
  ``RUNTIME_BYTES + PARAM_COPIES x 4 x params + ACTIVATION_COPIES x 4 x b x activations``
  where ``activations`` counts the float32 outputs of every layer for one sample (kept for the
  backward pass, each with its gradient), and the parameter copies are the weights, their
  gradients, the error-feedback residual and the worker's model view. ReLU and max-pooling
  keep only a 1-byte mask or window offset (``models.LeanReLU``, ``models.LeanMaxPool2d``), so
  this is an upper bound.
* **Training efficiency.** A device's training throughput in FLOP/s is about
  ``TRAIN_EFFICIENCY`` x its matrix-multiply rate (what ``DeviceHello.flops`` reports), the
  planner's first estimate before a device has reported its measured step time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgemesh.common.errors import ModelError

FLOAT32_BYTES = 4
RUNTIME_BYTES = 260 * 2**20
"""Resident size of a worker process before its batch (Python, torch, numpy, the data set):
peak RSS of a digits worker measured on the development host (``bench/reports/demo.json``)."""
PARAM_COPIES = 4
"""float32 copies of the parameters a worker holds: weights, gradients, error-feedback residual, model view."""
ACTIVATION_COPIES = 2
"""Each layer output is kept for the backward pass and gets a gradient of the same size."""
FLOPS_PER_MAC = 6
"""Training FLOPs per forward multiply-accumulate: 2 forward, 4 backward."""
TRAIN_EFFICIENCY = 0.4
"""Training FLOP/s over matrix-multiply FLOP/s: the digits CNN at batch 32 on one thread of the
development host (37.7 GFLOP/s of training against 84-99 GFLOP/s of sgemm)."""


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Per-sample training cost of a model spec."""

    params: int
    """Number of parameters (every one of ``named_parameters()``: all of them travel)."""
    macs_per_sample: int
    """Multiply-accumulates of the matrix multiplies (linear layers), convolutions and attention in one
    forward pass of one sample, as torch's flop counter counts them (``models.derived_costs``)."""
    activations_per_sample: int
    """float32 values every layer outputs for one sample (input included)."""

    @property
    def train_flops_per_sample(self) -> float:
        return float(FLOPS_PER_MAC * self.macs_per_sample)


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One conv or linear layer as model parallelism divides it: by output units (filters or features).

    Per-sample figures; a member holding ``n`` of the ``units`` does ``n x macs_per_unit`` MACs
    per sample forward, holds ``n x params_per_unit`` parameters, keeps ``n x out_per_unit``
    values before the layer's channel-wise tail (ReLU, pooling; a residual block's projection's
    output too) and sends ``n x gathered_per_unit`` values after it to the other members (the
    forward all-gather). In the backward pass it computes
    a partial gradient of the whole input (``in_values``) and sends the other members their
    channels of it (the reduce-scatter); the first layer, whose input is the data, sends none.
    """

    name: str
    """Module name in the spec (``conv1``, ``fc2``): parameters are ``<name>.weight`` and, with ``bias``,
    ``<name>.bias``."""
    units: int
    """Output filters (conv) or features (linear): what the filter division divides."""
    macs_per_unit: int
    params_per_unit: int
    out_per_unit: int
    gathered_per_unit: int
    in_values: int
    """float32 values of the layer's whole input, for one sample."""
    divided: tuple[str, ...] = ()
    """Tensors divided by the same rows as the layer's output units: its channel-wise tail's batch norms' weight
    and bias (counted in ``params_per_unit``) and running mean and variance, and, for the last layer of a residual
    block with a projection, the projection's weight (and bias) and its batch norms' (its MACs and parameters
    counted in this layer's figures). A member holds and trains its rows of them, and sends their gradients and
    changes as shards of those rows."""
    counters: tuple[str, ...] = ()
    """Integer counters of the tail (batch norm's ``num_batches_tracked``, one row): every member holds them whole,
    and the cluster's first member alone sends their change, so that a joined update counts a step once."""
    bias: bool = True
    """Whether the layer has a bias (``<name>.bias``): a layer without one (``bias=False``) is divided by its weight
    rows alone."""
    group: int = 1
    """Output units of one group of a grouped convolution (``out_channels / groups``; 1 for any other layer): a
    member's count of the layer is a whole number of groups, which it computes from their input channels alone."""

    def parts(self) -> tuple[str, ...]:
        """The layer's own parameters: ``<name>.weight``, and ``<name>.bias`` when it has one."""
        return (f"{self.name}.weight", f"{self.name}.bias") if self.bias else (f"{self.name}.weight",)


def member_rows(layer_costs: Sequence[LayerCost], counts: Mapping[str, Sequence[int]],
                index: int) -> dict[str, tuple[int, int]]:
    """``tensor -> (start, stop)``: the rows of the model state member ``index`` of a filter division (``counts``:
    layer -> units per member) holds, an empty range for a layer it has no unit of: its slice of every layer's weight
    and bias (none for a layer without bias) and of the tensors divided with the layer (``LayerCost.divided``), and
    every counter whole. A layer ``layer_costs`` does not list is taken to have a bias."""
    figures = {la.name: la for la in layer_costs}
    rows: dict[str, tuple[int, int]] = {}
    for layer, units in counts.items():
        span = slices(units)[index]
        figure = figures.get(layer)
        own = figure.parts() if figure is not None else (f"{layer}.weight", f"{layer}.bias")
        rows.update(dict.fromkeys(own, span))
        if figure is not None:
            rows.update(dict.fromkeys(figure.divided, span))
            rows.update({name: (0, 1) for name in figure.counters})
    return rows


def slices(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges of the units of one layer, member by member in member order:
    how a filter division's counts become each member's rows."""
    out = []
    start = 0
    for n in counts:
        if n < 0:
            raise ValueError(f"negative count in {tuple(counts)}")
        out.append((start, start + n))
        start += n
    return out


_COSTS: dict[str, ModelCost] = {}
_LAYERS: dict[str, tuple[LayerCost, ...] | None] = {}
_WHY: dict[str, str] = {}
"""Why a registered spec has no layer figures (the module model parallelism refuses)."""


def register(spec: str, cost: ModelCost, layers: tuple[LayerCost, ...] | None, *, why: str = "") -> None:
    """Figures of ``spec`` (replacing any it had): ``layers`` None when model parallelism cannot divide
    it, ``why`` saying what stops it."""
    _COSTS[spec], _LAYERS[spec] = cost, (tuple(layers) if layers is not None else None)
    _WHY[spec] = why


def forget(spec: str) -> None:
    """Drop the figures of ``spec`` (its model changed); the next lookup derives them again."""
    _COSTS.pop(spec, None)
    _LAYERS.pop(spec, None)
    _WHY.pop(spec, None)


def known(spec: str) -> bool:
    """Whether figures of ``spec`` are registered (nothing is derived)."""
    return spec in _COSTS


def _figures(spec: str) -> tuple[ModelCost, tuple[LayerCost, ...] | None]:
    """The registered figures of ``spec``, derived from its modules (torch) the first time."""
    if spec not in _COSTS:
        try:
            from edgemesh.common import models
        except ImportError as exc:
            raise ModelError(f"no cost figures for model {spec!r}, and none can be derived here: {exc}") from exc
        models.register_costs(spec)  # ModelError for an unknown spec, listing the known ones
    return _COSTS[spec], _LAYERS[spec]


def cost(spec: str) -> ModelCost:
    """Per-sample cost of ``spec``; ModelError for an unknown spec."""
    return _figures(spec)[0]


def layers(spec: str) -> tuple[LayerCost, ...]:
    """The divisible layers of ``spec`` in forward order; ModelError for an unknown spec or one model
    parallelism cannot divide (saying why)."""
    figures = _figures(spec)[1]
    if figures is None:
        raise ModelError(f"no layer figures for model {spec!r}: {_WHY.get(spec) or 'it cannot be divided'}")
    return figures


PLAIN_VERSION = 1
"""Version of the plain form (``cost_to_plain``); another version is refused."""
_COST_FIELDS = ("params", "macs_per_sample", "activations_per_sample")
_LAYER_FIELDS = ("name", "units", "macs_per_unit", "params_per_unit", "out_per_unit", "gathered_per_unit",
                 "in_values")
_LAYER_NAMES = ("divided", "counters")
"""Fields of a layer that list tensor names; a plain form without them (a layer with no batch norm) is whole."""
_LAYER_DEFAULTS: dict[str, Any] = {"bias": True, "group": 1}
"""Fields of a layer written only when they differ from these defaults, so that older figures decode unchanged."""


def cost_to_plain(cost: ModelCost, layers: Sequence[LayerCost] | None) -> dict[str, Any]:
    """The figures as JSON-ready plain data (ints, strings, lists), for a message."""
    return {
        "version": PLAIN_VERSION,
        **{f: getattr(cost, f) for f in _COST_FIELDS},
        "layers": None if layers is None else [{f: getattr(la, f) for f in _LAYER_FIELDS}
                                               | {f: list(getattr(la, f)) for f in _LAYER_NAMES if getattr(la, f)}
                                               | {f: getattr(la, f) for f, default in _LAYER_DEFAULTS.items()
                                                  if getattr(la, f) != default}
                                               for la in layers],
    }


def _fields(d: Any, names: tuple[str, ...], ints: tuple[str, ...], where: str) -> dict[str, Any]:
    """``d`` as a dict: a table of exactly ``names``, those of ``ints`` integers >= 0."""
    if not isinstance(d, Mapping):
        raise ModelError(f"{where}: expected a table, got {type(d).__name__}")
    if set(d) != set(names):
        missing, extra = sorted(set(names) - set(d)), sorted(set(d) - set(names))
        raise ModelError(f"{where}: missing {missing}, unexpected {extra}")
    for name in ints:
        if not (isinstance(d[name], int) and not isinstance(d[name], bool) and d[name] >= 0):
            raise ModelError(f"{where}: {name} must be an integer >= 0, got {d[name]!r}")
    return dict(d)


def cost_from_plain(d: Any) -> tuple[ModelCost, tuple[LayerCost, ...] | None]:
    """The figures ``cost_to_plain`` gave; ModelError naming the first thing wrong."""
    top = _fields(d, ("version", *_COST_FIELDS, "layers"), ("version", *_COST_FIELDS), "cost figures")
    if top["version"] != PLAIN_VERSION:
        raise ModelError(f"cost figures: version {top['version']} is not {PLAIN_VERSION}")
    cost = ModelCost(**{f: top[f] for f in _COST_FIELDS})
    if top["layers"] is None:
        return cost, None
    if not isinstance(top["layers"], list | tuple) or not top["layers"]:
        raise ModelError(f"cost figures: layers must be a non-empty list or null, got {top['layers']!r}")
    out = []
    for i, item in enumerate(top["layers"]):
        out.append(_layer_from_plain(item, f"cost figures: layer {i}"))
    names = [la.name for la in out]
    if len(set(names)) != len(names):
        raise ModelError(f"cost figures: layer names repeat: {names}")
    return cost, tuple(out)


def _layer_from_plain(item: Any, where: str) -> LayerCost:
    """One layer of ``cost_from_plain``; ModelError naming the first thing wrong."""
    given = tuple(f for f in (*_LAYER_NAMES, *_LAYER_DEFAULTS) if isinstance(item, Mapping) and f in item)
    la = _fields(item, (*_LAYER_FIELDS, *given), _LAYER_FIELDS[1:], where)
    if not isinstance(la["name"], str) or not la["name"]:
        raise ModelError(f"{where}: name must be a non-empty string, got {la['name']!r}")
    where = f"{where} ({la['name']})"
    if la["units"] < 1:
        raise ModelError(f"{where}: units must be >= 1")
    for f in given:
        if f not in _LAYER_NAMES:
            continue
        if not isinstance(la[f], list | tuple) or not all(isinstance(n, str) and n for n in la[f]):
            raise ModelError(f"{where}: {f} must be a list of names")
        la[f] = tuple(la[f])
    if not isinstance(la.get("bias", True), bool):
        raise ModelError(f"{where}: bias must be true or false, got {la['bias']!r}")
    group = la.get("group", 1)
    if not (isinstance(group, int) and not isinstance(group, bool) and group >= 1 and la["units"] % group == 0):
        raise ModelError(f"{where}: group must be an integer >= 1 that divides the units, got {group!r}")
    return LayerCost(**la)


def training_memory_bytes(spec: str, batch: int) -> int:
    """Estimated peak memory of a worker training ``spec`` at ``batch`` samples per step."""
    c = cost(spec)
    return (RUNTIME_BYTES + PARAM_COPIES * FLOAT32_BYTES * c.params
            + ACTIVATION_COPIES * FLOAT32_BYTES * batch * c.activations_per_sample)


def member_memory_bytes(layer_costs: Sequence[LayerCost], held: Sequence[int], batch: int) -> int:
    """Estimated peak memory of a model-parallel member holding ``held[l]`` units of every layer
    (forward order) at ``batch``: its parameter rows (``PARAM_COPIES`` copies), the layer outputs
    it computes before their channel-wise tail and their gradients, its gathered slices, and the
    whole gathered input of every layer (kept for the weight gradient). With every unit held it
    is a data-parallel worker's memory under the same accounting."""
    params = sum(n * la.params_per_unit for la, n in zip(layer_costs, held, strict=True))
    activations = sum(n * (2 * la.out_per_unit + la.gathered_per_unit) + la.in_values
                      for la, n in zip(layer_costs, held, strict=True))
    return RUNTIME_BYTES + (PARAM_COPIES * params + batch * activations) * FLOAT32_BYTES


def max_batch_for_memory(spec: str, memory_bytes: int) -> int:
    """The largest batch whose estimated memory fits ``memory_bytes`` (0 if not even one sample fits)."""
    c = cost(spec)
    free = memory_bytes - RUNTIME_BYTES - PARAM_COPIES * FLOAT32_BYTES * c.params
    per_sample = ACTIVATION_COPIES * FLOAT32_BYTES * c.activations_per_sample
    return max(0, free // per_sample)


def step_seconds_estimate(spec: str, batch: int, matmul_flops: float) -> float:
    """A device's compute time for one step, from its matrix-multiply rate alone (no measurement yet)."""
    if matmul_flops <= 0:
        raise ValueError("matmul_flops must be > 0")
    return batch * cost(spec).train_flops_per_sample / (matmul_flops * TRAIN_EFFICIENCY)
