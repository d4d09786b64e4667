"""``bench policies``' figures (pure but for the headroom's replay): per case and policy, the time to target over
seeds, the runs that diverged or never arrived, and the share of the headroom over ``sync``.

The headroom is ``bench headroom``'s: samples per board second of an idealized fleet that waits for no one
(``free``) over an idealized ``sync``, replayed on the very boards of the simulated runs (their training rates,
including a straggler fleet's spread, their seeded timelines, the first plan's batches, the links at the size of one
update). The simulator leaves out the bus, so the overhead per round is 0 and each transfer carries one latency.
``ratio - 1`` is what not waiting could gain; a policy's share of it is ``(sync median / policy median - 1) /
(ratio - 1)``: 1 is all of it, 0 is sync's time, below 0 slower than sync. It is None when there is no headroom to
share (``ratio - 1 < MIN_HEADROOM``) or when either median is None (half the runs never reached the target).
A policy can exceed 1: the headroom bounds samples per second, not what a policy gains per sample.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from edgemesh.bench.headroom import Load, Workload, headroom
from edgemesh.common import costs
from edgemesh.common.codecs import bytes_per_value
from edgemesh.simulate import SimRun, SimSettings
from edgemesh.simulate.engine import hardware
from edgemesh.simulate.fleet import Planner

MIN_HEADROOM = 0.02
"""A ratio closer to 1 than this leaves no headroom a share could be taken of (a share of noise)."""


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile), linear interpolation, infinities kept (an unreached run)."""
    xs = sorted(values)
    def at(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        if xs[lo] == xs[hi]:
            return xs[lo]
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return at(0.25), at(0.5), at(0.75)


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None


def _time(run: Mapping[str, Any]) -> float:
    return math.inf if run["time_to_target_s"] is None else float(run["time_to_target_s"])


def policy_figures(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One policy's runs of one case (one per seed, as ``SimRun.summary`` gives them) in figures."""
    times = [_time(r) for r in runs]
    q1, median, q3 = quartiles(times)
    reached = [t for t in times if math.isfinite(t)]
    finals = [r["final_accuracy"] for r in runs if r["final_accuracy"] is not None]
    return {"runs": len(runs),
            "median_time_to_target_s": _finite(median),
            "iqr_time_to_target_s": [_finite(q1), _finite(q3)],
            "min_max_time_to_target_s": [round(min(reached), 3), round(max(reached), 3)] if reached else None,
            "reached_share": round(len(reached) / len(runs), 3),
            "never_reached_share": round(1 - len(reached) / len(runs), 3),
            "diverged_share": round(sum(bool(r["diverged"]) for r in runs) / len(runs), 3),
            "median_final_accuracy": round(statistics.median(finals), 4) if finals else None,
            "median_versions": statistics.median(r["versions"] for r in runs),
            "median_gradients": statistics.median(r["gradients"] for r in runs),
            "discarded": sum(sum(r["discarded"].values()) for r in runs)}


def headroom_share(sync_median: float | None, policy_median: float | None, ratio: float) -> float | None:
    """``(sync median / policy median - 1) / (ratio - 1)`` (module docstring); None when it is undefined."""
    if sync_median is None or policy_median is None or ratio - 1 < MIN_HEADROOM:
        return None
    return round((sync_median / policy_median - 1) / (ratio - 1), 3)


def case_figures(by_policy: Mapping[str, Sequence[Mapping[str, Any]]], ratio: float) -> dict[str, dict[str, Any]]:
    """Every policy's figures in one case, with its speed-up over ``sync``'s median, its share of the headroom
    ``ratio``, and on how many seeds it reached the target sooner than ``sync`` did on the same seed (the same
    timelines, weights and partition: a paired count, which a median hides; a run that never arrived is slower than
    one that did) (``sync`` must be among them for these)."""
    out = {p: policy_figures(runs) for p, runs in by_policy.items()}
    sync = out.get("sync", {}).get("median_time_to_target_s")
    sync_times = {r["seed"]: _time(r) for r in by_policy.get("sync", ())}
    for p, figures in out.items():
        paired = [(_time(r), sync_times[r["seed"]]) for r in by_policy[p] if r["seed"] in sync_times]
        figures["seeds_paired_with_sync"] = len(paired)
        figures["sooner_than_sync"] = sum(t < ts for t, ts in paired)
        median = figures["median_time_to_target_s"]
        figures["speedup_over_sync"] = round(sync / median, 3) if sync is not None and median is not None else None
        figures["headroom_share"] = headroom_share(sync, median, ratio)
    return out


def ratios_over_sync(case: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The straggler fleet's medians of ``adaptive`` and ``fedbuff`` over ``sync``'s (time ratios: below 1 is
    sooner), and how many times sooner than ``sync`` each is."""
    if not case:
        return None
    figures = case["policies"]
    sync = figures.get("sync", {}).get("median_time_to_target_s")
    out: dict[str, Any] = {}
    for p in ("adaptive", "fedbuff"):
        median = figures.get(p, {}).get("median_time_to_target_s")
        ok = sync is not None and median is not None
        out[f"{p}_over_sync"] = round(median / sync, 3) if ok else None
        out[f"{p}_times_sooner"] = round(sync / median, 3) if ok else None
    return out


def workload_of(settings: SimSettings) -> tuple[Workload, list[tuple[str, str]], float, float]:
    """The case's workload as ``bench headroom`` counts it, on the case's boards: (workload, fleet, lag_s, detect_s).
    Batches are the first plan's in ``steady`` (so that a scenario's throttling at the start does not leak into
    them, as ``bench headroom`` takes them from the steady report)."""
    steady = hardware(dataclasses.replace(settings, scenario="steady"))
    cfg = steady.cfg
    codec = settings.codec or cfg.compressor.default_codec
    plan = Planner(cfg, steady.boards, codec).plan(steady.boards, 0.0, "start")
    nbytes = costs.cost(cfg.training.model_spec).params * bytes_per_value(codec, cfg.compressor.static_density)
    loads = tuple(Load(d.device, steady.boards[d.device].samples_per_s, d.batch_size,
                       nbytes / steady.boards[d.device].profile.uplink_bps + steady.boards[d.device].profile.latency_s,
                       nbytes / steady.boards[d.device].profile.downlink_bps
                       + steady.boards[d.device].profile.latency_s)
                  for d in plan.devices)
    lag_s = cfg.worker.stats_interval_s + cfg.planner.rebalance_interval_s
    detect_s = cfg.planner.replan_debounce_s if settings.detect_s is None else settings.detect_s
    return Workload(loads, 0.0), steady.names, lag_s, detect_s


def headroom_of(settings: SimSettings, seeds: Sequence[int]) -> dict[str, Any]:
    """``bench headroom``'s ratio for the case of ``settings`` over its budget, per evaluation seed, and their
    median (what the shares are taken of)."""
    load, fleet, lag_s, detect_s = workload_of(settings)
    scenarios = hardware(settings).scenarios
    per_seed = {}
    for seed in seeds:
        figures = headroom(scenarios[settings.scenario], scenarios["steady"], fleet, load, seed, settings.budget_s,
                           lag_s=lag_s, detect_s=detect_s)
        per_seed[seed] = figures["ratio"]
    ratios = list(per_seed.values())
    return {"ratio": round(statistics.median(ratios), 3), "min_max": [min(ratios), max(ratios)],
            "per_seed": {str(k): v for k, v in per_seed.items()}, "horizon_s": settings.budget_s,
            "lag_s": lag_s, "detect_s": detect_s, "overhead_s": 0.0,
            "batches": {x.device: x.batch for x in load.loads}}


def brief(run: SimRun) -> dict[str, Any]:
    """One evaluation run without its curve (the report stays readable)."""
    out = run.summary()
    for key in ("curve", "updates_by_device", "batch_sizes"):
        out.pop(key, None)
    return out
