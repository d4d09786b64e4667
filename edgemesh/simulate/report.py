"""Runs of several policies and seeds, and what they say together: a JSON report and a short table.

Per policy: the median time to the target over its seeds (a run that never reached it counts as slower than any
that did; the median is None when half of them never did), the spread of the times that reached it, the share of
runs that reached it and of runs that diverged (a loss that is not finite, or an accuracy that collapsed).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from edgemesh.simulate.engine import Parallelism, Policy, SimRun, SimSettings, hardware, simulate


def summarize(runs: Sequence[SimRun]) -> dict[str, Any]:
    """One policy's runs (one per seed) in figures."""
    times = [r.time_to_target_s for r in runs]
    reached = sorted(t for t in times if t is not None)
    ranked = sorted(math.inf if t is None else t for t in times)
    median = statistics.median(ranked) if ranked else math.inf
    finals = [r.final_accuracy for r in runs if r.final_accuracy is not None]
    return {
        "runs": len(runs),
        "median_time_to_target_s": round(median, 3) if math.isfinite(median) else None,
        "time_to_target_spread_s": [reached[0], reached[-1]] if reached else None,
        "reached_share": round(len(reached) / len(runs), 3) if runs else None,
        "diverged_share": round(sum(r.diverged for r in runs) / len(runs), 3) if runs else None,
        "median_final_accuracy": round(statistics.median(finals), 4) if finals else None,
        "median_versions": statistics.median(r.versions for r in runs) if runs else None,
        "discarded": sum(sum(r.discarded.values()) for r in runs),
    }


def compare(base: SimSettings, policies: Sequence[Policy], seeds: Sequence[int],
            progress: Callable[[str], None] = lambda _: None,
            parallelisms: Sequence[Parallelism | None] = (None,)) -> dict[str, Any]:
    """Every policy of ``policies`` under every seed of ``seeds`` (``base`` gives the rest), and under every
    parallelism of ``parallelisms`` if more than ``base``'s: the report, by policy (``policy/parallelism`` when
    parallelisms are compared)."""
    cases = [(policy, parallelism) for parallelism in parallelisms for policy in policies]
    for policy, parallelism in cases:  # every setting checked before the first run (a model mesh cannot divide too)
        hardware(dataclasses.replace(base, policy=policy, parallelism=parallelism))
    runs: dict[str, list[SimRun]] = {}
    for policy, parallelism in cases:
        label = policy if tuple(parallelisms) == (None,) else f"{policy}/{parallelism or 'data'}"
        for seed in seeds:
            run = simulate(dataclasses.replace(base, policy=policy, parallelism=parallelism, seed=seed))
            runs.setdefault(label, []).append(run)
            reached = "not reached" if run.time_to_target_s is None else f"{run.time_to_target_s:g} s"
            progress(f"{label} seed {seed}: time to {base.target:g} {reached} (best {run.best_accuracy}), final "
                     f"accuracy {run.final_accuracy}, {run.versions} versions, {run.gradients} gradients in "
                     f"{run.wall_s:.1f} s")
    return {
        "settings": {"fleet": list(base.fleet), "scenario": base.scenario, "seeds": list(seeds),
                     "target": base.target, "budget_s": base.budget_s, "eval_interval_s": base.eval_interval_s,
                     "lr": base.lr, "codec": base.codec, "detect_s": base.detect_s, "overrides": dict(base.overrides),
                     "job_file": base.job_file or None, "ps_update_s": base.ps_update_s,
                     "ps_broadcast_s": base.ps_broadcast_s,
                     "times": "virtual board seconds"},
        "policies": {p: summarize(rs) for p, rs in runs.items()},
        "runs": {p: [r.summary() for r in rs] for p, rs in runs.items()},
    }


def table(report: dict[str, Any]) -> str:
    """The report's per-policy figures as a few lines of text."""
    width = max(9, *(len(p) for p in report["policies"]))
    head = f"{'policy':<{width}} {'runs':>4} {'reached':>7} {'median s':>8} {'spread s':>13} {'final acc':>9} " \
           f"{'versions':>8} {'discarded':>9} {'diverged':>8}"
    lines = [head]
    for policy, s in report["policies"].items():
        spread = "-" if s["time_to_target_spread_s"] is None else \
            "{:.1f}-{:.1f}".format(*s["time_to_target_spread_s"])
        median = "-" if s["median_time_to_target_s"] is None else f"{s['median_time_to_target_s']:.1f}"
        final = "-" if s["median_final_accuracy"] is None else f"{s['median_final_accuracy']:.4f}"
        lines.append(f"{policy:<{width}} {s['runs']:>4} {s['reached_share']:>7.0%} {median:>8} {spread:>13} {final:>9} "
                     f"{s['median_versions']:>8g} {s['discarded']:>9} {s['diverged_share']:>8.0%}")
    return "\n".join(lines)
