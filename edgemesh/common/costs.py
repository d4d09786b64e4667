"""What training one model spec costs a device: FLOPs and memory, without importing torch.

The planner sizes batches and checks memory with these figures, and it runs on small hosts
that must not pay for torch, so the figures are a table here; ``models.measure_cost`` derives
the same numbers from the torch modules and a test keeps the two equal.

Cost model
----------
* **Compute.** ``train_flops_per_sample = 6 x MACs``: a forward pass costs 2 FLOPs per
  multiply-accumulate of every conv and linear layer; the backward pass about twice the forward
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

from collections.abc import Sequence
from dataclasses import dataclass

from edgemesh.common.errors import ModelError

FLOAT32_BYTES = 4
RUNTIME_BYTES = 260 * 2**20
"""Resident size of a worker process before its batch (Python, torch, numpy, the data set):
peak RSS of a digits worker measured on the development host (``bench/reports/demo-*.json``)."""
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
    """Number of trainable parameters."""
    macs_per_sample: int
    """Multiply-accumulates of the conv and linear layers in one forward pass of one sample."""
    activations_per_sample: int
    """float32 values every layer outputs for one sample (input included)."""

    @property
    def train_flops_per_sample(self) -> float:
        return float(FLOPS_PER_MAC * self.macs_per_sample)


COSTS: dict[str, ModelCost] = {
    "digits-cnn": ModelCost(params=38_282, macs_per_sample=337_536, activations_per_sample=7_434),
    "cifar-cnn": ModelCost(params=620_362, macs_per_sample=10_848_768, activations_per_sample=137_738),
}
"""Cost of every spec in ``models.MODEL_SPECS`` (checked against the modules by the tests)."""


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One conv or linear layer as model parallelism divides it: by output units (filters or features).

    Per-sample figures; a member holding ``n`` of the ``units`` does ``n x macs_per_unit`` MACs
    per sample forward, holds ``n x params_per_unit`` parameters, keeps ``n x out_per_unit``
    values before the layer's channel-wise tail (ReLU, pooling) and sends ``n x gathered_per_unit``
    values after it to the other members (the forward all-gather). In the backward pass it computes
    a partial gradient of the whole input (``in_values``) and sends the other members their
    channels of it (the reduce-scatter); the first layer, whose input is the data, sends none.
    """

    name: str
    """Module name in the spec (``conv1``, ``fc2``): parameters are ``<name>.weight`` and ``<name>.bias``."""
    units: int
    """Output filters (conv) or features (linear): what the filter division divides."""
    macs_per_unit: int
    params_per_unit: int
    out_per_unit: int
    gathered_per_unit: int
    in_values: int
    """float32 values of the layer's whole input, for one sample."""


LAYERS: dict[str, tuple[LayerCost, ...]] = {
    "digits-cnn": (
        LayerCost("conv1", 16, 576, 10, 64, 64, 64),
        LayerCost("conv2", 32, 9_216, 145, 64, 16, 1_024),
        LayerCost("fc1", 64, 512, 513, 1, 1, 512),
        LayerCost("fc2", 10, 64, 65, 1, 1, 64),
    ),
    "cifar-cnn": (
        LayerCost("conv1", 32, 27_648, 28, 1_024, 256, 3_072),
        LayerCost("conv2", 64, 73_728, 289, 256, 64, 8_192),
        LayerCost("conv3", 128, 36_864, 577, 64, 16, 4_096),
        LayerCost("fc1", 256, 2_048, 2_049, 1, 1, 2_048),
        LayerCost("fc2", 10, 256, 257, 1, 1, 256),
    ),
}
"""The divisible layers of every spec, in forward order (checked against the modules by the tests)."""


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


def layers(spec: str) -> tuple[LayerCost, ...]:
    try:
        return LAYERS[spec]
    except KeyError:
        raise ModelError(f"no layer figures for model {spec!r}; known: {', '.join(sorted(LAYERS))}") from None


def cost(spec: str) -> ModelCost:
    try:
        return COSTS[spec]
    except KeyError:
        raise ModelError(f"no cost figures for model {spec!r}; known: {', '.join(sorted(COSTS))}") from None


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
