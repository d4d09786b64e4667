"""A stable plan: the figures the planner plans with (measurements smoothed), and when measurements alone call for a
new training grid (docs/mesh.md#re-planning).

Pure: no I/O, no clock (callers pass the time), no torch. The planner's registry feeds ``Smoother`` every device's
stats; the mesh parallelism asks ``review`` whether the current grid gives way. Tests drive both with synthetic
measurement streams.

Smoothing
---------
Each figure a device measures (``DeviceStats``: training rate ``compute_flops``, uplink, downlink, latency) is planned
as the median of the device's last ``planner.smoothing_window`` measurements of it, from its current incarnation (a 0,
not measured, is skipped). A median, not a mean: a loopback link measured anywhere from 0.35 to 31 MB/s from one
interval to the next has outliers either way; one moves a mean a lot, a median by one rank.

Re-planning for measurements
----------------------------
Without a join, a leave, a drain or an operator's ``replan`` (which the planner never holds back), the current grid
gives way to a new one only when all three hold, checked in this order:

1. **band**: a device's smoothed figure moved beyond ``planner.replan_band`` from the one the current grid was laid
   out with: above ``(1 + band)`` times it, or below ``1 / (1 + band)`` of it. What is compared is what the cost
   model uses: an unknown uplink is the cost model's default (``DEFAULT_LINK_BPS``), an unknown downlink the uplink,
   and a latency under ``LATENCY_FLOOR_S`` that floor, so the first measurement of a slow link is a move and a
   loopback's 0.1 or 0.3 ms latency is not.
2. **interval**: the last re-plan for measurements was at least ``planner.replan_min_interval_s`` ago;
3. **gain**: the current grid's iteration, predicted on the smoothed figures, is more than ``planner.replan_threshold``
   (the margin) above the best new grid's, predicted on the same figures.

Figures that moved and were weighed become the reference of the next moves, whether the grid gave way or not: a move
not worth a new grid is weighed once, not again at every review until noise elsewhere tips it over the margin.

What moved, and the two predictions, are the re-plan's cause (``Cause``): the plan's reason, the ``replan`` event and
``edgemesh devices`` say it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from edgemesh.common import costs
from edgemesh.common.config import PlannerConfig
from edgemesh.common.messages import DeviceHello, DeviceStats
from edgemesh.services.planner.mesh import DeviceInfo, Grid, Wire, grid_iteration_s, training_grid
from edgemesh.services.planner.mesh.member_cost import link_rates

ReplanReason = Literal["start", "join", "leave", "control", "rebalance", "slowdown", "links"]
"""Why a plan went out (``Plan.reason``, the ``replans`` counter's label): the planner started, a device joined or
left, an operator drained or undrained a device or asked for a plan, balanced batches moved, a device's smoothed
speed moved, its smoothed links moved."""
REPLAN_REASONS: tuple[ReplanReason, ...] = ("start", "join", "leave", "control", "rebalance", "slowdown", "links")

Figure = Literal["speed", "uplink", "downlink", "latency"]
FIGURES: tuple[Figure, ...] = ("speed", "uplink", "downlink", "latency")
UNITS: dict[Figure, tuple[float, str]] = {"speed": (1e-9, "GFLOP/s"), "uplink": (1e-6, "MB/s"),
                                          "downlink": (1e-6, "MB/s"), "latency": (1e3, "ms")}
"""How a figure is written: scale and unit."""
LOW_QUANTILE, HIGH_QUANTILE = 0.25, 0.75
"""A figure moved beyond the band only when the window's quartiles both lie beyond it, on the same side."""
LATENCY_FLOOR_S = 0.001
"""Latencies below this are compared as this: a loopback's 0.1 or 0.3 ms is no move."""
MOVES_LISTED = 4
"""Moves a cause names; the rest are counted."""
STATS_FIELDS: dict[Figure, str] = {"speed": "compute_flops", "uplink": "link_rate_bps",
                                   "downlink": "downlink_rate_bps", "latency": "latency_s"}
"""The ``DeviceStats`` field of each figure."""


# --------------------------------------------------------------------------- causes


@dataclass(frozen=True, slots=True)
class Cause:
    """Why a plan goes out: a label (the plan's ``reason``) and, where it applies, the devices and figures (the
    ``replan`` event's ``cause``, the planner's ``status``)."""

    label: ReplanReason
    detail: str = ""

    def describe(self) -> str:
        """``label: detail`` (the label alone without a detail)."""
        return f"{self.label}: {self.detail}" if self.detail else self.label


# --------------------------------------------------------------------------- smoothing


@dataclass(slots=True)
class _Window:
    incarnation: int
    latest: DeviceStats
    kept: dict[Figure, deque[float]]


@dataclass(slots=True)
class Smoother:
    """Every device's last ``window`` measurements of each figure, and their medians (module docstring)."""

    window: int = 9
    _devices: dict[str, _Window] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError("the smoothing window must hold at least 1 measurement")

    def observe(self, stats: DeviceStats) -> None:
        """Take a device's stats; a new incarnation starts from nothing."""
        kept = self._devices.get(stats.device)
        if kept is None or kept.incarnation != stats.incarnation:
            kept = _Window(stats.incarnation, stats, {f: deque(maxlen=self.window) for f in FIGURES})
            self._devices[stats.device] = kept
        kept.latest = stats
        for figure, name in STATS_FIELDS.items():
            value = getattr(stats, name)
            if value > 0 and math.isfinite(value):
                kept.kept[figure].append(value)

    def smoothed(self, device: str, quantile: float = 0.5) -> DeviceStats | None:
        """The device's latest stats with each figure replaced by its median over the window (0 where never
        measured); another ``quantile`` of the window for the band (``LOW_QUANTILE``, ``HIGH_QUANTILE``)."""
        kept = self._devices.get(device)
        if kept is None:
            return None

        def at(figure: Figure) -> float:
            values = kept.kept[figure]
            return float(np.quantile(np.fromiter(values, float), quantile)) if values else 0.0

        return dataclasses.replace(kept.latest, compute_flops=at("speed"), link_rate_bps=at("uplink"),
                                   downlink_rate_bps=at("downlink"), latency_s=at("latency"))


def measured_info(hello: DeviceHello, stats: DeviceStats | None) -> DeviceInfo:
    """What the grid plans a device with: its hello, its speed replaced by the (smoothed) training rate it measured
    and the link figures its hello left unknown by those it measured (``DeviceInfo.with_measured_links``); stats of
    another incarnation count for nothing."""
    info = DeviceInfo.from_hello(hello)
    if stats is None or stats.incarnation != hello.incarnation:
        return info
    info = info.with_measured_links(stats)
    if stats.compute_flops > 0:
        info = dataclasses.replace(info, flops=stats.compute_flops / costs.TRAIN_EFFICIENCY)
    return info


# --------------------------------------------------------------------------- the band


@dataclass(frozen=True, slots=True)
class Move:
    """A device's figure that moved beyond the band: from what the current grid was laid out with to its median."""

    device: str
    figure: Figure
    before: float
    after: float

    def describe(self) -> str:
        scale, unit = UNITS[self.figure]
        return f"{self.device} {self.figure} {self.before * scale:.3g} -> {self.after * scale:.3g} {unit}"


def figures(info: DeviceInfo) -> dict[Figure, float]:
    """A device's figures as the cost model uses them (unknown links at their defaults, latency at its floor)."""
    up, down, latency = link_rates(info)
    return {"speed": info.flops, "uplink": up, "downlink": down, "latency": max(latency, LATENCY_FLOOR_S)}


@dataclass(frozen=True, slots=True)
class Measured:
    """The devices' smoothed figures (medians), and the quartiles of their windows (the band is judged on those)."""

    median: Sequence[DeviceInfo]
    low: Sequence[DeviceInfo]
    high: Sequence[DeviceInfo]

    @classmethod
    def exactly(cls, devices: Sequence[DeviceInfo]) -> Measured:
        """Figures known without spread (one measurement each, or figures a test sets)."""
        return cls(devices, devices, devices)


def moves(planned: Sequence[DeviceInfo], measured: Measured, band: float) -> list[Move]:
    """The figures of ``measured`` beyond ``band`` (relative) from the same device's in ``planned``: the window's
    lower quartile above ``(1 + band)`` times the planned figure, or its upper quartile below ``1 / (1 + band)`` of it
    (three quarters of the recent measurements beyond the band, on one side). Devices in only one of them are a join
    or a leave, not a move."""
    before = {d.device: figures(d) for d in planned}
    lows, highs = {d.device: figures(d) for d in measured.low}, {d.device: figures(d) for d in measured.high}
    out = []
    for info in measured.median:
        old, low, high = before.get(info.device), lows.get(info.device), highs.get(info.device)
        if old is None or low is None or high is None:
            continue
        for figure, after in figures(info).items():
            if low[figure] > old[figure] * (1 + band) or high[figure] * (1 + band) < old[figure]:
                out.append(Move(info.device, figure, old[figure], after))
    return out


def describe(found: Sequence[Move]) -> str:
    """``speed moved: a ...; link moved: b ...`` for the first ``MOVES_LISTED`` moves, and how many more."""
    speeds = [m.describe() for m in found[:MOVES_LISTED] if m.figure == "speed"]
    links = [m.describe() for m in found[:MOVES_LISTED] if m.figure != "speed"]
    parts = ([f"speed moved: {', '.join(speeds)}"] if speeds else []) + (
        [f"link moved: {', '.join(links)}"] if links else [])
    rest = len(found) - MOVES_LISTED
    return "; ".join(parts) + (f" (and {rest} more)" if rest > 0 else "")


# --------------------------------------------------------------------------- the decision


@dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
    """When measurements alone make a new grid (module docstring), with the grid's own settings."""

    band: float
    """``planner.replan_band``."""
    margin: float
    """``planner.replan_threshold``."""
    min_interval_s: float
    """``planner.replan_min_interval_s``."""
    spec: str
    batch: int
    """The iteration's samples over all clusters."""
    wire: Wire
    max_cluster_size: int
    slack: float
    min_batch: int
    max_batch: int

    @classmethod
    def of(cls, planner: PlannerConfig, *, spec: str, batch: int, wire: Wire) -> Rule:
        return cls(band=planner.replan_band, margin=planner.replan_threshold,
                   min_interval_s=planner.replan_min_interval_s, spec=spec, batch=batch, wire=wire,
                   max_cluster_size=planner.max_cluster_size, slack=planner.grid_slack, min_batch=planner.min_batch,
                   max_batch=planner.max_batch)

    def lay_out(self, devices: Sequence[DeviceInfo]) -> Grid:
        """The best training grid of ``devices``."""
        return training_grid(self.spec, devices, batch=self.batch, max_cluster_size=self.max_cluster_size,
                             wire=self.wire, slack=self.slack, min_batch=self.min_batch, max_batch=self.max_batch)


@dataclass(frozen=True, slots=True)
class Review:
    """What ``review`` found: a new grid and its cause, or why the current grid stays."""

    grid: Grid | None
    """The grid to publish; None keeps the current one."""
    cause: Cause | None
    """Why the new grid (None when the current one stays)."""
    note: str
    """What was found, for the log."""
    wait_s: float = 0.0
    """Above 0: figures moved but the interval holds them; ask again after this many seconds."""
    reviewed: bool = False
    """Figures moved and were weighed (a new grid, or one not worth the margin): the next moves are measured from
    these figures, so a move not worth a new grid is weighed once, not again at every review until noise in
    another figure tips it over the margin."""


def review(grid: Grid, planned: Sequence[DeviceInfo], spread: Measured, *, now: float, last_s: float,
           rule: Rule) -> Review:
    """Whether ``grid``, laid out with ``planned``, gives way for the smoothed figures ``spread`` (same devices) at
    time ``now``, the last re-plan for measurements having been at ``last_s`` (module docstring). Pure but for the
    CPU a new grid costs (laid out only once the band and the interval pass)."""
    found = moves(planned, spread, rule.band)
    measured = spread.median
    if not found:
        return Review(None, None, f"no figure moved beyond the {rule.band:.0%} band")
    moved = describe(found)
    wait = last_s + rule.min_interval_s - now
    if wait > 0:
        return Review(None, None, f"{moved}; held {wait:.1f}s by the {rule.min_interval_s:g}s interval", wait_s=wait)
    new = rule.lay_out(measured)
    current_s = grid_iteration_s(rule.spec, grid, measured, rule.wire)
    best_s = new.predicted_iteration_s
    if not grid.clusters:
        worth = bool(new.clusters)
    else:
        worth = bool(new.clusters) and current_s > (1 + rule.margin) * best_s
    predicted = (f"predicted {current_s * 1e3:.3g} -> {best_s * 1e3:.3g} ms per iteration "
                 f"(margin {rule.margin:.0%})")
    if not worth:
        return Review(None, None, f"{moved}; kept: {predicted}", reviewed=True)
    label: ReplanReason = "slowdown" if any(m.figure == "speed" for m in found) else "links"
    return Review(new, Cause(label, f"{moved}; {predicted}"), f"{moved}; {predicted}", reviewed=True)
