"""The ``adaptive`` synchronization rule (docs/synchronization.md: adaptive bounded delay), pure.

No I/O and no clocks of its own: the parameter server feeds it observations and asks it questions.

* **Delay index.** Each device carries ``I = (1 - alpha) * I + alpha * d``, an exponential
  moving average of the delays ``d = v - b`` of its updates (the first observation sets it;
  applied and discarded updates both count, so a device whose updates are thrown away shows as slow).
  Default ``alpha = 0.3``.
* **Round deadline τ.** A round opens when the model of the previous round is published (the
  first round: with its first update). Each cluster's *cycle* (seconds from the publication of the
  model an update was computed on to the update's arrival, whichever round it lands in) is
  remembered per cluster (the last ``window = 32``). ``τ = quantile_dq(per-cluster median cycle) *
  slack`` (``dq = deadline_quantile = 0.5``: the typical cluster, times the slack), clamped to
  ``[min_deadline_s, max_deadline_s]``; with no observations yet
  ``τ = max_deadline_s``. Counting late updates too matters: were only the punctual ones timed, a
  round cut short would leave the late clusters unmeasured, the deadline would follow the fastest
  ones, cut the next round shorter still, and collapse to ``min_deadline_s`` (it did, before).
  Defaults: ``q = 0.9``, ``slack = 1.5``, ``[0.02 s, 30 s]``.
* **Delay bound D.** ``D = ceil(quantile_q(delay indices of live devices) * slack)``, clamped
  to ``[min_bound, max_bound]`` (``max_bound`` is ``training.staleness_bound``, set at run time
  with ``set-bound``); with no indices yet ``D = max_bound``. Default ``min_bound = 1``.
* **Judging** (``scheduler.AdaptiveScheduler``). An update with ``d < 0`` is refused (``future``);
  ``d > D`` is discarded (``stale``: its sender resyncs); otherwise it is applied, scaled by
  :func:`staleness_weight` ``1 / (1 + d)``.
* **Weights of a round** (:func:`round_weights`). Contribution *i* with ``s_i`` samples and delay
  ``d_i`` weighs ``s_i / max(S, sum s) x 1 / (1 + d_i)``, where ``S`` is the samples the plan
  expects per round (the batch sizes of its devices). A round the deadline closes with half
  the fleet's samples takes half a step, not a whole one on half the data: cutting rounds short
  then trades waiting for more, smaller steps, instead of for noisier ones.
* **Slow devices.** Live devices whose delay index exceeds ``slow_factor`` times the fleet median
  and the median plus ``slow_margin`` versions (defaults 2 and 0.5: a device one round late twice
  running is slow; with a margin of 1, a device always one round late, index 1, never was): candidates
  for a smaller batch
  (planner) or harder compression (compressor).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from edgemesh.common.config import AdaptiveConfig
from edgemesh.common.vocabulary import StalenessRule


def staleness_weight(delay: int, rule: StalenessRule = "inverse") -> float:
    """Scale of an update applied ``delay`` versions late: ``1 / (1 + delay)`` (``inverse``) or
    ``1 / (1 + sqrt(delay))`` (``sqrt``).

    A stale gradient points where the model was, not where it is; damping it by its delay
    keeps asynchronous SGD with momentum stable (Zhang et al., "Staleness-aware Async-SGD", 2016).
    FedBuff (Nguyen et al., 2022) damps by the square root: gentler on larger delays.
    """
    delay = max(0, delay)
    return 1.0 / (1.0 + (math.sqrt(delay) if rule == "sqrt" else delay))


def compensated_momentum(momentum: float, clusters: int) -> float:
    """The momentum an asynchronous step takes so that, with what ``clusters`` clusters updating in turn add,
    the model moves with ``momentum`` in all: ``max(0, 1 - (1 - momentum) x clusters)``.

    Asynchrony begets momentum (Mitliagkas et al., 2016): with ``M`` workers whose updates arrive in turn, each
    computed on a model ``M - 1`` steps old on average, asynchronous SGD behaves as SGD with an implicit momentum
    of about ``1 - 1/M``; added to an explicit 0.9, four clusters move the model as with 0.975. Taking
    ``1 - momentum`` times ``M`` out of the explicit part keeps the product ``(1 - explicit) / M`` at
    ``1 - momentum``.
    """
    return max(0.0, 1.0 - (1.0 - momentum) * max(1, clusters))


def round_weights(samples: Sequence[int], delays: Sequence[int], planned: int,
                  rule: StalenessRule = "inverse") -> list[float]:
    """Weights of one adaptive round's contributions (module docstring): their share of the
    ``planned`` samples (at most the whole round), damped by their delays."""
    total = max(planned, sum(samples))
    return [n / total * staleness_weight(d, rule) for n, d in zip(samples, delays, strict=True)]


def quantile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile of ``values`` (0 for none)."""
    xs = sorted(values)
    if not xs:
        return 0.0
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class AdaptiveDelay:
    """Delay indices, the round deadline and the delay bound of the adaptive policy."""

    settings: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    indices: dict[str, float] = field(default_factory=dict)
    arrivals: dict[str, deque[float]] = field(default_factory=dict)
    max_bound: int = 4
    """Upper clamp of D (the PS keeps it at ``training.staleness_bound`` / ``set-bound``)."""
    live_devices: frozenset[str] | None = None
    """Devices the bound and slow-device rule consider (None = every device with an index)."""

    def follow(self, max_bound: int, live_devices: frozenset[str] | None) -> None:
        """The configured bound (``training.staleness_bound``, ``set-bound``) and the plan's devices."""
        self.max_bound, self.live_devices = max_bound, live_devices

    # ------------------------------------------------------------------ observations
    def observe_delay(self, device: str, delay: int) -> float:
        """Fold one update's delay into ``device``'s index; return the new index."""
        d = float(max(0, delay))
        old = self.indices.get(device)
        new = d if old is None else (1 - self.settings.alpha) * old + self.settings.alpha * d
        self.indices[device] = new
        return new

    def observe_arrival(self, cluster: str, seconds: float) -> None:
        """Remember that an update of ``cluster`` arrived ``seconds`` after the model it was computed on went out."""
        window = self.arrivals.setdefault(cluster, deque(maxlen=self.settings.window))
        window.append(max(0.0, seconds))

    def restore_arrivals(self, kept: Mapping[str, Sequence[float]]) -> None:
        """Arrival times a checkpoint kept (the last ``window`` of each cluster), for the clusters with none yet:
        a restarted parameter server's rounds wait as long as they did, not ``max_deadline_s`` until it relearns."""
        for cluster, seconds in kept.items():
            self.arrivals.setdefault(cluster, deque((max(0.0, s) for s in seconds), maxlen=self.settings.window))

    def retain(self, devices: Iterable[str], clusters: Iterable[str]) -> None:
        """Keep only the delay indices of ``devices`` and the arrival times of ``clusters`` (a new plan's):
        what departed devices and clusters left behind would otherwise be kept forever."""
        keep, kept_clusters = set(devices), set(clusters)
        self.indices = {d: i for d, i in self.indices.items() if d in keep}
        self.arrivals = {c: a for c, a in self.arrivals.items() if c in kept_clusters}

    # ------------------------------------------------------------------ adapted values
    def deadline(self, live_clusters: Iterable[str] | None = None) -> float:
        """τ in seconds: how long a round waits, after its first update, for the other clusters."""
        s = self.settings
        keys = self.arrivals.keys() if live_clusters is None else [c for c in live_clusters if c in self.arrivals]
        typical = [quantile(self.arrivals[c], 0.5) for c in keys if self.arrivals[c]]
        if not typical:
            return s.max_deadline_s
        return min(s.max_deadline_s, max(s.min_deadline_s, quantile(typical, s.deadline_quantile) * s.slack))

    def _live_indices(self, live_devices: Iterable[str] | None) -> list[float]:
        if live_devices is None:
            return list(self.indices.values())
        return [self.indices[d] for d in live_devices if d in self.indices]

    def bound(self, max_bound: int | None = None, live_devices: Iterable[str] | None = None) -> int:
        """D in versions: the largest delay an update may have and still be applied."""
        max_bound = self.max_bound if max_bound is None else max_bound
        live_devices = self.live_devices if live_devices is None else live_devices
        lo = min(self.settings.min_bound, max_bound)
        values = self._live_indices(live_devices)
        if not values:
            return max_bound
        wanted = math.ceil(quantile(values, self.settings.quantile) * self.settings.slack - 1e-9)
        return min(max_bound, max(lo, wanted))

    def slow_devices(self, live_devices: Iterable[str] | None = None) -> list[str]:
        """Devices whose delay index exceeds ``slow_factor`` x the fleet median (and the median + ``slow_margin``)."""
        live_devices = self.live_devices if live_devices is None else live_devices
        pool = {d: self.indices[d] for d in (self.indices if live_devices is None else live_devices)
                if d in self.indices}
        if len(pool) < 2:
            return []
        median = quantile(pool.values(), 0.5)
        limit = max(median * self.settings.slow_factor, median + self.settings.slow_margin)
        return sorted(d for d, i in pool.items() if i > limit)
