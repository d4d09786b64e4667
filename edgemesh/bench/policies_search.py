"""``bench policies --search-adaptive``: the adaptive rule's parameters chosen on the simulator, then checked on the
evaluation seeds (docs/benchmarks.md).

1. **Search**, on seeds of its own (``SEARCH_SEEDS``, apart from the tuning and evaluation seeds): every candidate
   of ``GRID`` (``ps.adaptive.deadline_quantile`` x ``ps.adaptive.slack``, the two figures that set how long a
   round waits) runs ``adaptive`` at its tuned rate in every case, beside ``sync`` at its own.
2. **Score**: per case, ``sync``'s median time to target over the candidate's (a run that never arrives is
   infinitely slow); a candidate whose runs diverge more often than ``sync``'s in a case scores 0 there. The
   candidate with the best geometric mean over the cases wins; the services' defaults win a tie.
3. **Check**: the winner on the evaluation seeds of every case, beside the default rule's and ``sync``'s runs of the
   main evaluation: the same figures (``case_figures``) with the winner as ``adaptive-searched``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from edgemesh.bench.policies_figures import brief, case_figures, headroom_of
from edgemesh.common.config import AdaptiveConfig
from edgemesh.simulate import SimRun, SimSettings

if TYPE_CHECKING:
    from edgemesh.bench.policies import Bench

GRID: dict[str, tuple[float, ...]] = {"deadline_quantile": (0.25, 0.5, 0.75, 1.0), "slack": (1.0, 1.5, 2.5)}
"""The figures searched: which cluster's typical cycle a round waits for (0.25: a fast one, 1: the slowest), and
the factor on it."""
SEARCH_SEEDS = (2000, 2001, 2002)
SEARCHED = "adaptive-searched"
"""The winner's name in the check's figures."""

Runner = Callable[[Sequence[SimSettings]], list[SimRun]]
CaseOf = Callable[[str], SimSettings]


def candidates() -> list[dict[str, float]]:
    """Every combination of ``GRID``'s figures."""
    keys = list(GRID)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(GRID[k] for k in keys))]


def default() -> dict[str, float]:
    """The services' own figures of ``GRID``'s keys."""
    rule = AdaptiveConfig()
    return {k: float(getattr(rule, k)) for k in GRID}


def with_rule(settings: SimSettings, rule: Mapping[str, float]) -> SimSettings:
    """``settings`` under the adaptive rule's figures ``rule``."""
    return dataclasses.replace(settings, overrides={**settings.overrides,
                                                    **{f"ps.adaptive.{k}": repr(v) for k, v in rule.items()}})


def _time(run: SimRun) -> float:
    return math.inf if run.time_to_target_s is None else run.time_to_target_s


def score(sync: Sequence[SimRun], adaptive: Sequence[SimRun]) -> float:
    """``sync``'s median time over ``adaptive``'s (0 if ``adaptive`` never arrives, or diverges more often)."""
    if sum(r.diverged for r in adaptive) > sum(r.diverged for r in sync):
        return 0.0
    s, a = statistics.median(map(_time, sync)), statistics.median(map(_time, adaptive))
    if not math.isfinite(a):
        return 0.0
    return s / a if math.isfinite(s) else math.inf


def geometric_mean(values: Sequence[float]) -> float:
    if any(v <= 0 for v in values):
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 0.0


def search(bench: Bench, lr: Mapping[str, Mapping[str, float]], case_of: CaseOf, tuning_case: Callable[[str], str],
           run: Runner, evaluation: Mapping[str, Mapping[str, Sequence[dict[str, Any]]]],
           progress: Callable[[str], None]) -> dict[str, Any]:
    """The search, the score of every candidate and the check (module docstring). ``lr``: each fleet's tuned rate
    per policy; ``evaluation``: the main evaluation's runs per case and policy (``sync`` and ``adaptive`` among
    them)."""
    rules = candidates()
    plan: list[tuple[str, str, int, SimSettings]] = []  # (case, who, seed, settings)
    for case in bench.cases:
        base = case_of(case)
        rates = lr[tuning_case(case)]
        for seed in SEARCH_SEEDS:
            plan.append((case, "sync", seed, dataclasses.replace(base, policy="sync", lr=rates["sync"], seed=seed)))
            for i, rule in enumerate(rules):
                plan.append((case, str(i), seed, with_rule(dataclasses.replace(
                    base, policy="adaptive", lr=rates["adaptive"], seed=seed), rule)))
    progress(f"adaptive search: {len(rules)} candidates, {len(plan)} runs")
    done = run([s for *_, s in plan])
    by: dict[tuple[str, str], list[SimRun]] = {}
    for (case, who, _, _), r in zip(plan, done, strict=True):
        by.setdefault((case, who), []).append(r)
    table = []
    for i, rule in enumerate(rules):
        per_case = {c: round(score(by[(c, "sync")], by[(c, str(i))]), 3) for c in bench.cases}
        table.append({"rule": rule, "speedup_over_sync": per_case,
                      "geometric_mean": round(geometric_mean(list(per_case.values())), 4),
                      "median_time_to_target_s": {c: _finite(statistics.median(map(_time, by[(c, str(i))])))
                                                  for c in bench.cases}})
    home = default()
    best = max(range(len(rules)), key=lambda i: (table[i]["geometric_mean"], rules[i] == home))
    chosen = rules[best]
    check: dict[str, Any] = {}
    if chosen != home:
        checks = [(case, seed, with_rule(dataclasses.replace(case_of(case), policy="adaptive", seed=seed,
                                                             lr=lr[tuning_case(case)]["adaptive"]), chosen))
                  for case in bench.cases for seed in bench.seeds]
        progress(f"adaptive search: checking {chosen} on {len(checks)} runs")
        checked = run([s for *_, s in checks])
        for case in bench.cases:
            mine = [brief(r) for (c, _, _), r in zip(checks, checked, strict=True) if c == case]
            runs = {"sync": evaluation[case]["sync"], "adaptive": evaluation[case]["adaptive"], SEARCHED: mine}
            ratio = headroom_of(case_of(case), bench.seeds)["ratio"]
            check[case] = case_figures(runs, ratio)
    return {"grid": {k: list(v) for k, v in GRID.items()}, "search_seeds": list(SEARCH_SEEDS),
            "default": home, "chosen": chosen, "chosen_is_default": chosen == home,
            "score": "per case, sync's median time to target over the candidate's (unreached: infinitely slow; 0 if "
                     "the candidate diverged more often than sync); the best geometric mean over the cases wins, "
                     "the services' defaults a tie",
            "candidates": table, "check": check}


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None
