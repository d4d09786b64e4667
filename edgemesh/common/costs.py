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
  gradients, the error-feedback residual and the worker's model view.
* **Training efficiency.** A device's training throughput in FLOP/s is about
  ``TRAIN_EFFICIENCY`` x its matrix-multiply rate (what ``DeviceHello.flops`` reports), the
  planner's first estimate before a device has reported its measured step time.
"""

from __future__ import annotations

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
