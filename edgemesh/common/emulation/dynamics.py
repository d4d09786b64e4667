"""One emulated device's timeline under a scenario: when it throttles, stalls, drops out, and its link rate.

Pure and seeded: the same scenario, seed and device name give the same timeline in every run, so
one scenario replays the same under every synchronization policy. Times are board seconds since
the run's clock started (the worker starts it when the first plan names it, which is when the
planner has seen the whole fleet); a dilated emulation multiplies them by its dilation.

* **throttling**: an alternating renewal process, full speed then throttled, spells exponential with
  the scenario's means; the first state is drawn from the long-run share of throttled time, so a
  run starts as a warmed-up device would.
* **stalls** and **drop-outs**: Poisson processes, lengths exponential (capped); a drop-out that
  comes during another is merged into it.
* **link rate**: every ``bandwidth_interval_s`` a new factor ``exp(N(-sigma^2 / 2, sigma))`` (mean 1).

Each kind draws from its own random stream, so changing one rate does not move the others' events.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any, Literal

from edgemesh.common.emulation.scenarios import Scenario

Kind = Literal["throttle", "stall", "drop", "bandwidth"]
HORIZON_S = 6 * 3600.0
"""Board seconds a timeline covers; after it the device stays as the profile says."""


@dataclass(frozen=True, slots=True)
class Episode:
    """One event: ``kind`` from ``start_s`` for ``length_s`` board seconds, with ``value`` (the speed factor
    of a throttled spell, the rate factor of a bandwidth interval; 0 for stalls and drop-outs)."""

    kind: Kind
    start_s: float
    length_s: float
    value: float = 0.0

    @property
    def end_s(self) -> float:
        return self.start_s + self.length_s

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "start_s": round(self.start_s, 3), "length_s": round(self.length_s, 3),
                **({"value": round(self.value, 4)} if self.kind in ("throttle", "bandwidth") else {})}


def _rng(seed: int, scenario: str, device: str, kind: str) -> random.Random:
    digest = hashlib.sha256(f"{seed}/{scenario}/{device}/{kind}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _poisson(rng: random.Random, per_s: float, mean_s: float, cap_s: float, horizon_s: float,
             kind: Kind) -> list[Episode]:
    out: list[Episode] = []
    t = 0.0
    while per_s > 0:
        t += rng.expovariate(per_s)
        if t >= horizon_s:
            break
        length = rng.expovariate(1.0 / mean_s)
        if cap_s > 0:
            length = min(length, cap_s)
        if out and t < out[-1].end_s:  # comes while the last one lasts: one longer episode
            last = out.pop()
            out.append(Episode(kind, last.start_s, max(last.end_s, t + length) - last.start_s))
            t = out[-1].end_s
            continue
        out.append(Episode(kind, t, length))
        t += length
    return out


def _throttling(rng: random.Random, s: Scenario, horizon_s: float) -> list[Episode]:
    out: list[Episode] = []
    throttled = rng.random() < s.throttled_s / (s.throttled_s + s.unthrottled_s)
    t = 0.0
    while t < horizon_s:
        length = rng.expovariate(1.0 / (s.throttled_s if throttled else s.unthrottled_s))
        if throttled:
            out.append(Episode("throttle", t, length, s.throttle_speed))
        t += length
        throttled = not throttled
    return out


def _bandwidth(rng: random.Random, s: Scenario, horizon_s: float) -> list[Episode]:
    out = []
    sigma = s.bandwidth_sigma
    t = 0.0
    while t < horizon_s:
        out.append(Episode("bandwidth", t, s.bandwidth_interval_s, math.exp(rng.gauss(-sigma * sigma / 2, sigma))))
        t += s.bandwidth_interval_s
    return out


class Timeline:
    """The episodes of one device (sorted by start within each kind), and what they mean at a time."""

    def __init__(self, device: str, episodes: dict[Kind, list[Episode]]) -> None:
        self.device = device
        self.episodes = episodes
        self._throttle_starts = [e.start_s for e in episodes.get("throttle", [])]
        self._bandwidth_starts = [e.start_s for e in episodes.get("bandwidth", [])]
        self._blocks = sorted((e for k in ("stall", "drop") for e in episodes.get(k, [])), key=lambda e: e.start_s)
        self._block_starts = [e.start_s for e in self._blocks]
        self._block_reach = list(itertools.accumulate((e.end_s for e in self._blocks), max))
        """The latest end of the stalls and drop-outs begun so far, by start order."""
        self._drop_starts = [e.start_s for e in episodes.get("drop", [])]

    @classmethod
    def of(cls, scenario: Scenario, profile: str, device: str, seed: int, horizon_s: float = HORIZON_S) -> Timeline:
        s = scenario
        episodes: dict[Kind, list[Episode]] = {}
        if s.throttles(profile):
            episodes["throttle"] = _throttling(_rng(seed, s.name, device, "throttle"), s, horizon_s)
        if s.stalls_per_minute > 0:
            episodes["stall"] = _poisson(_rng(seed, s.name, device, "stall"), s.stalls_per_minute / 60.0, s.stall_s,
                                         s.max_stall_s, horizon_s, "stall")
        if s.disconnects_per_hour > 0:
            episodes["drop"] = _poisson(_rng(seed, s.name, device, "drop"), s.disconnects_per_hour / 3600.0,
                                        s.outage_s, s.max_outage_s, horizon_s, "drop")
        if s.varies_bandwidth:
            episodes["bandwidth"] = _bandwidth(_rng(seed, s.name, device, "bandwidth"), s, horizon_s)
        return cls(device, episodes)

    def _at(self, kind: Kind, starts: list[float], t: float) -> Episode | None:
        i = bisect.bisect_right(starts, t) - 1
        if i < 0:
            return None
        e = self.episodes[kind][i]
        return e if t < e.end_s else None

    def speed_at(self, t: float) -> float:
        """Share of full compute speed at board time ``t``."""
        e = self._at("throttle", self._throttle_starts, t)
        return e.value if e is not None else 1.0

    def rate_at(self, t: float) -> float:
        """Link rate factor at board time ``t``."""
        e = self._at("bandwidth", self._bandwidth_starts, t)
        return e.value if e is not None else 1.0

    def work_end(self, start: float, work_s: float) -> float:
        """When ``work_s`` seconds of full-speed compute begun at ``start`` end, throttled spells slowing it."""
        spells = self.episodes.get("throttle")
        if not spells or work_s <= 0:
            return start + max(work_s, 0.0)
        t, left = start, work_s
        i = max(0, bisect.bisect_right(self._throttle_starts, t) - 1)
        while left > 1e-12:
            e = spells[i] if i < len(spells) else None
            if e is None or t < e.start_s:  # full speed until the next spell
                until = e.start_s if e is not None else math.inf
                if t + left <= until:
                    return t + left
                left -= until - t
                t = until
            elif t < e.end_s:  # inside a spell
                done = (e.end_s - t) * e.value
                if done >= left:
                    return t + left / e.value
                left -= done
                t = e.end_s
                i += 1
            else:
                i += 1
        return t

    def blocked_until(self, t: float) -> float:
        """When the link moves bytes again after board time ``t``: the end of the stalls and drop-outs ``t`` falls
        in (``t`` itself if none)."""
        while (i := bisect.bisect_right(self._block_starts, t)) and self._block_reach[i - 1] > t:
            t = self._block_reach[i - 1]
        return t

    def transfer_end(self, start: float, busy_s: float) -> float:
        """When ``busy_s`` seconds of sending at the profile's rate, handed to the link at ``start``, have arrived:
        stalls and drop-outs hold the bytes, each interval's rate factor speeds or slows them."""
        t, left = self.blocked_until(start), busy_s
        bands = self.episodes.get("bandwidth", [])
        while left > 1e-12:
            b = bisect.bisect_right(self._bandwidth_starts, t)
            next_rate = bands[b].start_s if b < len(bands) else math.inf
            k = bisect.bisect_right(self._block_starts, t)
            next_block = self._blocks[k].start_s if k < len(self._blocks) else math.inf
            rate = self.rate_at(t)
            until = min(next_rate, next_block)
            if t + left / rate <= until:
                return t + left / rate
            left -= (until - t) * rate
            t = self.blocked_until(until)
        return t

    def drop_between(self, start: float, end: float) -> Episode | None:
        """The first drop-out under way at ``start`` or beginning before ``end``, None if none."""
        drops = self.episodes.get("drop", [])
        i = bisect.bisect_right(self._drop_starts, start) - 1
        if i >= 0 and drops[i].end_s > start:
            return drops[i]
        return drops[i + 1] if i + 1 < len(drops) and drops[i + 1].start_s < end else None

    def link_events(self) -> list[Episode]:
        """Stalls, drop-outs and rate changes in the order they start: what drives the emulated link."""
        events = [e for k in ("stall", "drop", "bandwidth") for e in self.episodes.get(k, [])]
        return sorted(events, key=lambda e: e.start_s)

    def until(self, horizon_s: float, kinds: tuple[Kind, ...] = ("throttle", "stall", "drop")) -> list[Episode]:
        """The episodes of ``kinds`` that start before ``horizon_s``, in order (what a report lists)."""
        events = [e for k in kinds for e in self.episodes.get(k, []) if e.start_s < horizon_s]
        return sorted(events, key=lambda e: e.start_s)

    def share(self, kind: Kind, horizon_s: float) -> float:
        """Share of ``[0, horizon_s)`` spent in episodes of ``kind``."""
        if horizon_s <= 0:
            return 0.0
        inside = sum(max(0.0, min(e.end_s, horizon_s) - e.start_s) for e in self.episodes.get(kind, [])
                     if e.start_s < horizon_s)
        return inside / horizon_s
