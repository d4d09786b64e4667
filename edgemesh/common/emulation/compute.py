"""Stretching a training step's real compute time to an emulated device's speed.

The host is faster than the boards it emulates, so a step computed here for real is then
held until it would have ended on the device:

    emulated(batch) = reference(batch) x host_gflops / device_train_gflops

``reference(batch)`` is the host's uncontended time for a step of that batch, not the time of
this very step: the host runs many emulated devices at once, and a step slowed by the others
must not make the emulated device slower (or noisier) than the board it stands for. It is the
line ``overhead + batch x per_sample`` through the best of ``CALIBRATION_REPEATS`` real steps at
two batch sizes, measured once (:meth:`ComputeStretch.calibrate`), lowered by any faster step
seen later. Until calibrated it is the fastest real step seen at that batch size.
A step whose real time already exceeds its emulated time is an *overrun*: the host cannot
keep up and the device runs at the host's pace (counted, so reports can say so).

``host_gflops`` is the float32 matrix-multiply rate of one host thread as a training process
uses it (:func:`measure_host_gflops`, best of a few short runs so that a busy host does not
lower it); ``device_train_gflops`` is the profile's all-core rate times its parallel efficiency.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

HOST_MATMUL_N = 512
"""Side of the square float32 matrices of the host benchmark."""
HOST_RUNS = 5
"""Short benchmark runs; the best counts."""
HOST_RUN_S = 0.1
"""Length of one benchmark run, seconds."""
CALIBRATION_BATCHES = (4, 64)
"""Batch sizes of the calibration steps (the line through them gives every other)."""
CALIBRATION_REPEATS = 5
"""Real steps per calibration batch size; the fastest counts."""


def measure_host_gflops(threads: int = 1, runs: int = HOST_RUNS, run_s: float = HOST_RUN_S) -> float:
    """This host's float32 matrix-multiply GFLOP/s on ``threads`` torch threads (best of ``runs``)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = HOST_MATMUL_N
        a = torch.rand(n, n)
        b = torch.rand(n, n)
        a @ b  # warm up
        best = 0.0
        for _ in range(runs):
            count = 0
            start = time.perf_counter()
            while (elapsed := time.perf_counter() - start) < run_s:
                a @ b
                count += 1
            best = max(best, 2.0 * n**3 * count / elapsed / 1e9)
        return best
    finally:
        torch.set_num_threads(previous)


@dataclass(slots=True)
class ComputeStretch:
    """Emulated step times of one device, from its real ones."""

    ratio: float
    """host GFLOP/s over the device's training GFLOP/s: how many times slower the device is."""
    reference: dict[int, float] = field(default_factory=dict)
    """Fastest real step time seen per batch size."""
    line: tuple[float, float] | None = None
    """Calibrated host step time ``(overhead s, seconds per sample)``, or None."""
    steps: int = 0
    overruns: int = 0

    def __post_init__(self) -> None:
        if not self.ratio > 0:
            raise ValueError("ratio must be > 0")

    @classmethod
    def for_device(cls, host_gflops: float, device_train_gflops: float) -> ComputeStretch:
        if host_gflops <= 0 or device_train_gflops <= 0:
            raise ValueError("GFLOP/s figures must be > 0")
        return cls(ratio=host_gflops / device_train_gflops)

    def calibrate(self, step: Callable[[int], float]) -> tuple[float, float]:
        """Fit the host's uncontended step time from ``step(batch)``, which runs one real step and
        returns its seconds; returns ``(overhead s, seconds per sample)``."""
        (b0, b1) = CALIBRATION_BATCHES
        t0 = min(step(b0) for _ in range(CALIBRATION_REPEATS))
        t1 = min(step(b1) for _ in range(CALIBRATION_REPEATS))
        per_sample = max((t1 - t0) / (b1 - b0), 0.0)
        overhead = max(t0 - per_sample * b0, 0.0)
        if per_sample == 0.0:  # noise swamped the slope: all of it per sample
            per_sample = t1 / b1
        self.line = (overhead, per_sample)
        return self.line

    def emulated(self, batch: int, real_s: float) -> float:
        """The step's emulated duration: what it would have taken on the device (never below ``real_s``)."""
        best = self.reference.get(batch)
        if best is None and self.line is not None:
            best = self.line[0] + self.line[1] * batch
        if best is None or real_s < best:
            best = real_s
        self.reference[batch] = best
        self.steps += 1
        target = best * self.ratio
        if real_s > target:
            self.overruns += 1
            return real_s
        return target

    def hold_s(self, batch: int, real_s: float) -> float:
        """How long to wait after a step that really took ``real_s`` so it ends at its emulated time."""
        return self.emulated(batch, real_s) - real_s
