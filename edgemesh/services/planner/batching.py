"""Batch sizes per device: uniform, or balanced so that every device finishes an iteration together.

Pure functions and a small observation store, no I/O: the planner service feeds them hellos,
stats and the parameter server's ``SyncState``.

Cost model
----------
One iteration of device *i* at batch *b* takes ``t_i(b) = fixed_i + b x sample_i`` seconds:

* ``sample_i``, compute seconds per sample, and the step's fixed part come from the device's
  stats: the fixed part is the intercept of a least-squares line through its recent
  ``(batch, step time)`` pairs when it has trained at two or more batch sizes (else 0), and
  ``sample_i`` is the latest pair's ``(step time - fixed) / batch``, so a device that slows down
  (thermal throttling) or recovers is planned at its new speed from its next stats on. Before any
  stats, ``costs.step_seconds_estimate`` from the FLOPS in its hello.
* ``fixed_i`` adds the upload time of one update (``DeviceStats.upload_time_s``).
* A device the parameter server lists as slow (``SyncState.slow``) is ``1 + delay index``
  times slower than measured: its updates arrive that many rounds late, whatever the cause
  (compute, link stalls), so it gets a batch that much smaller ("shrink the computation" of
  the adaptive bounded-delay paper).

**Balanced** batches: the smallest round time *T* for which the batches
``b_i = clamp(floor((T - fixed_i) / sample_i), min_batch, cap_i)`` add up to at least ``total``
samples (bisection on *T*; the sum grows with *T*). ``cap_i`` is the smaller of ``max_batch``
and the largest batch the device's memory holds (``costs.max_batch_for_memory``). The round
then carries about as many samples as a uniform one (``total`` = devices x
``training.batch_size`` by default), and fast devices no longer wait for slow ones.

**Uniform** batches: ``training.batch_size`` for everyone, capped by memory.

A new plan is worth publishing only when some batch moves by more than a relative threshold
(``needs_rebalance``), so noisy step times do not churn plans.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from edgemesh.common import costs

OBSERVATIONS_KEPT = 8
"""(batch, step time) pairs kept per device for the fit."""
BISECTION_STEPS = 60
"""Steps of the search for the round time (its error is far below a microsecond)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpeed:
    """How long one iteration of a device takes: ``fixed_s + batch x sample_s``."""

    device: str
    sample_s: float
    """Compute seconds per training sample."""
    fixed_s: float = 0.0
    """Seconds per iteration that do not grow with the batch (step overhead, upload)."""
    max_batch: int
    """Largest batch the device's memory holds."""

    def __post_init__(self) -> None:
        if not (self.sample_s > 0 and math.isfinite(self.sample_s)):
            raise ValueError(f"{self.device}: sample_s must be a positive number")
        if not (self.fixed_s >= 0 and math.isfinite(self.fixed_s)):
            raise ValueError(f"{self.device}: fixed_s must be >= 0")
        if self.max_batch < 1:
            raise ValueError(f"{self.device}: max_batch must be >= 1")

    def iteration_s(self, batch: int) -> float:
        return self.fixed_s + batch * self.sample_s


@dataclass(frozen=True, slots=True)
class Batches:
    """A batch size per device and the iteration time they aim at."""

    sizes: dict[str, int]
    round_time_s: float
    """Predicted iteration time: the slowest device's ``t_i(b_i)``."""


def uniform(devices: Iterable[DeviceSpeed], batch: int) -> Batches:
    """``batch`` for every device (capped by its memory)."""
    devices = list(devices)
    sizes = {d.device: min(batch, d.max_batch) for d in devices}
    return Batches(sizes, max((d.iteration_s(sizes[d.device]) for d in devices), default=0.0))


def balanced(devices: Iterable[DeviceSpeed], *, total: int, min_batch: int, max_batch: int) -> Batches:
    """Batches sized so that every device finishes at about the same time and they add up to ``total``.

    Each batch lies in ``[min_batch, min(max_batch, device cap)]``; when even the caps do not
    reach ``total``, every device gets its cap.
    """
    devices = list(devices)
    if min_batch < 1 or max_batch < min_batch:
        raise ValueError("need 1 <= min_batch <= max_batch")
    if not devices:
        return Batches({}, 0.0)
    caps = {d.device: max(1, min(max_batch, d.max_batch)) for d in devices}
    floors = {d.device: min(min_batch, caps[d.device]) for d in devices}

    def sizes_at(t: float) -> dict[str, int]:
        return {d.device: max(floors[d.device], min(caps[d.device], math.floor((t - d.fixed_s) / d.sample_s)))
                for d in devices}

    lo = 0.0
    hi = max(d.iteration_s(caps[d.device]) for d in devices)
    if sum(sizes_at(hi).values()) < total:
        sizes = sizes_at(hi)
    else:
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            if sum(sizes_at(mid).values()) >= total:
                hi = mid
            else:
                lo = mid
        sizes = sizes_at(hi)
    by_name = {d.device: d for d in devices}
    return Batches(sizes, max(by_name[name].iteration_s(b) for name, b in sizes.items()))


def needs_rebalance(current: Mapping[str, int], proposed: Mapping[str, int], threshold: float) -> bool:
    """Whether ``proposed`` differs enough from ``current`` to publish: other devices, or a batch
    that moves by more than ``threshold`` (relative) and by at least 2 samples."""
    if set(current) != set(proposed):
        return True
    for device, old in current.items():
        new = proposed[device]
        if abs(new - old) >= 2 and abs(new - old) > threshold * old:
            return True
    return False


@dataclass(slots=True)
class SpeedTracker:
    """What the planner has measured of each device's speed."""

    steps: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)
    uploads: dict[str, float] = field(default_factory=dict)

    def observe(self, device: str, batch: int, step_time_s: float, upload_time_s: float = 0.0) -> None:
        """Record a device's mean step time at ``batch`` (ignored when either is unknown)."""
        if batch >= 1 and step_time_s > 0:
            kept = self.steps.setdefault(device, deque(maxlen=OBSERVATIONS_KEPT))
            if kept and kept[-1] == (batch, step_time_s):
                return  # the same stats again (a retained or repeated message)
            kept.append((batch, step_time_s))
        if upload_time_s > 0:
            self.uploads[device] = upload_time_s

    def fit(self, device: str) -> tuple[float, float] | None:
        """(step overhead s, seconds per sample) from the device's observations, or None."""
        kept = self.steps.get(device)
        if not kept:
            return None
        if len({b for b, _ in kept}) < 2:
            batch, seconds = kept[-1]
            return 0.0, seconds / batch
        n = len(kept)
        mean_b = sum(b for b, _ in kept) / n
        mean_t = sum(t for _, t in kept) / n
        var = sum((b - mean_b) ** 2 for b, _ in kept)
        slope = sum((b - mean_b) * (t - mean_t) for b, t in kept) / var
        intercept = mean_t - slope * mean_b
        batch, seconds = kept[-1]
        if slope <= 0 or intercept < 0 or seconds <= intercept:  # noise: the latest ratio, no overhead
            return 0.0, seconds / batch
        # the line gives the overhead; the latest observation gives the speed now: a board that throttled (or
        # recovered) since the older observations is planned at its new speed at once, not after they age out
        return intercept, (seconds - intercept) / batch

    def speed(self, device: str, *, spec: str, matmul_flops: float, memory_bytes: int, lag: float = 0.0,
              reference_batch: int = 32) -> DeviceSpeed | None:
        """The device's speed for planning; None when its memory holds no batch at all.

        ``lag`` is its delay index when the parameter server lists it as slow (0 otherwise).
        """
        cap = costs.max_batch_for_memory(spec, memory_bytes)
        if cap < 1:
            return None
        fitted = self.fit(device)
        if fitted is None:
            overhead = 0.0
            per_sample = costs.step_seconds_estimate(spec, reference_batch, matmul_flops) / reference_batch
        else:
            overhead, per_sample = fitted
        slowdown = 1.0 + max(0.0, lag)
        return DeviceSpeed(device=device, sample_s=per_sample * slowdown,
                           fixed_s=(overhead + self.uploads.get(device, 0.0)) * slowdown, max_batch=cap)
