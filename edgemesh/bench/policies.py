"""``edgemesh bench policies``: does ``adaptive`` beat ``sync``, and by how much of the headroom? (docs/benchmarks.md)

Every policy (the service's ``sync``, ``async``, ``ssp``, ``adaptive``, and FedBuff as a peer's reference,
``edgemesh.simulate.reference``) trains the digits job on the simulator's virtual clock, over many seeds, in each
case: the default fleet in ``steady``, ``dynamic`` and ``harsh``, and a straggler-heavy fleet (eight laptop-class
boards whose training rates span 10x, uniform batches, ``steady``).

The order of a run:

1. **Tune** (``policies_tuning``): per policy and fleet, every rate of a small grid on the tuning seeds (never the
   evaluation seeds), on ``steady``; the rate with the best median time to target wins (a run that never reaches
   it is slower than any that does; ties go to the smaller rate; if no rate reaches it, the best median final
   accuracy). One rule for every policy, stable across seeds because it ranks medians.
2. **Evaluate**: each policy at its rate on every evaluation seed of every case, runs ending at the target.
3. **Headroom** (``policies_figures``): ``bench headroom``'s idealized ``free`` over ``sync`` in samples per second,
   replayed on the same boards, timelines (per seed), batches and links; each policy's share of it is
   ``(sync median / policy median - 1) / (ratio - 1)``.
4. **Scale** (optional): one policy on a fleet of the default profiles replicated to N devices, timed in wall
   seconds.
5. **Adaptive search** (optional, ``policies_search``): the adaptive rule's parameters chosen on seeds of their own,
   the winner checked on the evaluation seeds.

Runs are independent and deterministic, so ``--jobs`` spreads them over processes without changing a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from edgemesh import cli
from edgemesh.bench.fleet import DEFAULT_FLEET
from edgemesh.bench.policies_figures import brief, case_figures, headroom_of, ratios_over_sync
from edgemesh.bench.policies_plot import plot, tables
from edgemesh.bench.policies_tuning import choose_lr
from edgemesh.bench.reporting import write_report
from edgemesh.common.errors import ConfigError
from edgemesh.simulate import POLICIES, Policy, SimRun, SimSettings, simulate, straggler_fleet

logger = logging.getLogger(__name__)

SCENARIOS = ("steady", "dynamic", "harsh")
"""The default fleet's cases: the emulator's scenarios."""
STRAGGLER = "straggler"
"""The straggler fleet's case (its scenario is ``steady``: the speed spread is the only event)."""
STRAGGLER_DEVICES, STRAGGLER_SPREAD = 8, 10.0
LR_GRID = (0.01, 0.03, 0.1)
"""Learning rates tried per policy: a factor of ~3 apart, around the rate ``sync`` takes here (docs/simulation.md:
0.02 trains, 0.2 diverges)."""
TUNING_SEEDS = (1000, 1001)
"""Seeds of the tuning runs, apart from the evaluation seeds (0, 1, ...)."""
SEEDS = 10
MODEL = "digits-cnn"
"""The job: the digits CNN (``bench fleet``'s ``digits-wide-cnn`` costs twice the wall time per gradient, which
would not fit 200 runs in an hour on two shared cores)."""
TARGET = 0.95
BUDGET_S = 12.0
"""Virtual seconds per evaluation run; a run ends at the target, and one that has not reached it by then counts as
never reaching it."""
TUNING_BUDGET_S = 8.0
EVAL_INTERVAL_S = 0.1
"""Virtual seconds between evaluations: the resolution of a time to target (the job reaches it in seconds)."""
SCALE_DEVICES = 1000
SCALE_WALL_S = 600.0
"""Wall seconds the scale run may take before it is stopped (and reported as not fitting)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Bench:
    """What one ``bench policies`` measures."""

    policies: tuple[Policy, ...] = POLICIES
    cases: tuple[str, ...] = (*SCENARIOS, STRAGGLER)
    seeds: tuple[int, ...] = tuple(range(SEEDS))
    tuning_seeds: tuple[int, ...] = TUNING_SEEDS
    lr_grid: tuple[float, ...] = LR_GRID
    fleet: tuple[str, ...] = DEFAULT_FLEET
    model: str = MODEL
    target: float = TARGET
    eval_interval_s: float = EVAL_INTERVAL_S
    budget_s: float = BUDGET_S
    tuning_budget_s: float = TUNING_BUDGET_S
    jobs: int = 1
    scale_devices: int = 0
    """0: no scale run."""
    scale_policy: Policy = "adaptive"
    scale_wall_s: float = SCALE_WALL_S
    search_adaptive: bool = False
    """Also search the adaptive rule's parameters (``policies_search``); needs ``sync`` and ``adaptive``."""
    overrides: tuple[tuple[str, str], ...] = ()
    """``--set``: settings of every simulated run, by dotted key (``ps.round_scaling``, ``ps.aggregation``...)."""

    @property
    def command(self) -> str:
        return (f"edgemesh bench policies --policies {','.join(self.policies)} --cases {','.join(self.cases)} "
                f"--seeds {len(self.seeds)} --lrs {','.join(f'{x:g}' for x in self.lr_grid)} --budget-s "
                f"{self.budget_s:g} --tuning-budget-s {self.tuning_budget_s:g} --fleet {','.join(self.fleet)} "
                f"--model {self.model} --target {self.target:g} --eval-interval-s {self.eval_interval_s:g}"
                + (f" --scale-devices {self.scale_devices} --scale-policy {self.scale_policy}"
                   if self.scale_devices else "") + (" --search-adaptive" if self.search_adaptive else "")
                + "".join(f" --set {key}={value}" for key, value in self.overrides))


QUICK = Bench(policies=("sync", "adaptive"), cases=("steady",), seeds=(0, 1), tuning_seeds=(1000,),
              lr_grid=(0.05,), fleet=("pi5", "laptop"), target=0.5, budget_s=3.0, tuning_budget_s=3.0)
"""``--quick``: 2 seeds, 2 policies, 1 scenario, two boards, a low target; the report's full structure."""


def case_settings(bench: Bench, case: str) -> SimSettings:
    """The base settings of one case (policy, seed and rate are the runs')."""
    base = SimSettings(fleet=bench.fleet, target=bench.target, budget_s=bench.budget_s, stop_at_target=True,
                       eval_interval_s=bench.eval_interval_s,
                       overrides={"training.model_spec": bench.model, **dict(bench.overrides)})
    if case == STRAGGLER:
        fleet, scale = straggler_fleet(STRAGGLER_DEVICES, STRAGGLER_SPREAD)
        # uniform batches: every device does the same work per update, as federated clients do; balanced batches
        # would hand the slow boards small batches and take the stragglers away
        return dataclasses.replace(base, fleet=fleet, compute_scale=scale, scenario="steady",
                                   overrides={**base.overrides, "planner.batching": "uniform"})
    return dataclasses.replace(base, scenario=case)


def tuning_case(case: str) -> str:
    """The case a case's rates are tuned on: its fleet in ``steady``."""
    return STRAGGLER if case == STRAGGLER else "steady"


def _run(settings: SimSettings) -> SimRun:
    import torch

    torch.set_num_threads(1)  # a board trains on its own; processes, not threads, use the cores
    return simulate(settings)


def run_all(settings: Sequence[SimSettings], jobs: int, progress: Callable[[str], None]) -> list[SimRun]:
    """Every run of ``settings``, in order, over ``jobs`` processes."""
    def said(s: SimSettings, r: SimRun) -> None:
        reached = "not reached" if r.time_to_target_s is None else f"{r.time_to_target_s:.2f} s"
        progress(f"{s.scenario}{'/straggler' if s.compute_scale else ''} {s.policy} lr {s.lr:g} seed {s.seed}: "
                 f"{reached} to {s.target:g}, {r.versions} versions, {r.gradients} gradients, {r.wall_s:.1f} wall s")

    if jobs <= 1:
        out = []
        for s in settings:
            out.append(_run(s))
            said(s, out[-1])
        return out
    runs = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for s, r in zip(settings, pool.map(_run, settings), strict=True):
            runs.append(r)
            said(s, r)
    return runs


def measure(bench: Bench, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The report: tuning, evaluation, headroom and figures per case (module docstring)."""
    started = time.perf_counter()
    fleets = sorted({tuning_case(c) for c in bench.cases})
    tuning_runs = [dataclasses.replace(case_settings(bench, f), policy=p, lr=lr, seed=seed,
                                       budget_s=bench.tuning_budget_s)
                   for f in fleets for p in bench.policies for lr in bench.lr_grid for seed in bench.tuning_seeds]
    progress(f"tuning: {len(tuning_runs)} runs")
    done = run_all(tuning_runs, bench.jobs, progress)
    tuning: dict[str, dict[str, Any]] = {}
    for f in fleets:
        tuning[f] = {}
        for p in bench.policies:
            by_lr = {lr: [r for s, r in zip(tuning_runs, done, strict=True)
                          if tuning_case(_case_of(s)) == f and s.policy == p and s.lr == lr]
                     for lr in bench.lr_grid}
            tuning[f][p] = choose_lr(by_lr)
    evaluation = [dataclasses.replace(case_settings(bench, c), policy=p, lr=tuning[tuning_case(c)][p]["lr"],
                                      seed=seed)
                  for c in bench.cases for p in bench.policies for seed in bench.seeds]
    progress(f"evaluation: {len(evaluation)} runs")
    runs = run_all(evaluation, bench.jobs, progress)
    cases: dict[str, Any] = {}
    for c in bench.cases:
        base = case_settings(bench, c)
        by_policy = {p: [brief(r) for s, r in zip(evaluation, runs, strict=True)
                         if _case_of(s) == c and s.policy == p]
                     for p in bench.policies}
        cases[c] = {"fleet": list(base.fleet), "compute_scale": [round(f, 4) for f in base.compute_scale] or None,
                    "scenario": base.scenario, "overrides": dict(base.overrides),
                    "lr": {p: tuning[tuning_case(c)][p]["lr"] for p in bench.policies},
                    "headroom": headroom_of(base, bench.seeds), "runs": by_policy}
    result: dict[str, Any] = {
        "command": bench.command,
        "settings": {"policies": list(bench.policies), "cases": list(bench.cases), "seeds": list(bench.seeds),
                     "tuning_seeds": list(bench.tuning_seeds), "lr_grid": list(bench.lr_grid),
                     "model": bench.model, "eval_interval_s": bench.eval_interval_s,
                     "target": bench.target, "budget_s": bench.budget_s, "tuning_budget_s": bench.tuning_budget_s,
                     "times": "virtual board seconds", "jobs": bench.jobs, "overrides": dict(bench.overrides),
                     "tuning_rule": "per policy and fleet, on steady and the tuning seeds: the grid's rate with the "
                                    "best median time to target (unreached = slower than any reached; ties: the "
                                    "smaller rate; none reached: the best median final accuracy)"},
        "tuning": tuning,
        "cases": cases,
    }
    refigure(result)
    if bench.search_adaptive:
        from edgemesh.bench.policies_search import search

        rates = {f: {p: t["lr"] for p, t in by_policy.items()} for f, by_policy in tuning.items()}
        result["adaptive_search"] = search(
            bench, rates, lambda c: case_settings(bench, c), tuning_case, lambda s: run_all(s, bench.jobs, progress),
            {c: result["cases"][c]["runs"] for c in bench.cases}, progress)
    if bench.scale_devices:
        result["scale"] = scale_run(bench, tuning, progress)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def refigure(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of ``result`` (each case's per-policy figures, the straggler's ratios) from its runs and
    headroom: what ``measure`` writes, and what ``--refigure`` recomputes from a report's runs alone."""
    for case in result["cases"].values():
        case["policies"] = case_figures(case["runs"], case["headroom"]["ratio"])
        case["runs"] = case.pop("runs")  # after the figures: the report reads figures first
    result["straggler"] = ratios_over_sync(result["cases"].get(STRAGGLER))
    return result


def _case_of(s: SimSettings) -> str:
    return STRAGGLER if s.compute_scale else s.scenario


def scale_run(bench: Bench, tuning: dict[str, Any], progress: Callable[[str], None]) -> dict[str, Any]:
    """One run of ``scale_policy`` on ``scale_devices`` devices (the default profiles replicated), ``steady``, seed
    0, at the rate tuned on the default fleet; stopped at ``scale_wall_s`` wall seconds if it has not reached the
    target by then."""
    fleet = tuple(bench.fleet[i % len(bench.fleet)] for i in range(bench.scale_devices))
    lr = tuning.get("steady", {}).get(bench.scale_policy, {}).get("lr")
    settings = dataclasses.replace(case_settings(bench, "steady"), fleet=fleet, policy=bench.scale_policy, lr=lr,
                                   wall_limit_s=bench.scale_wall_s)
    progress(f"scale: {bench.scale_policy} on {len(fleet)} devices, at most {bench.scale_wall_s:g} wall s")
    run = _run(settings)
    out = {"devices": len(fleet), "policy": bench.scale_policy, "lr": lr, "wall_limit_s": bench.scale_wall_s,
           **brief(run)}
    out["fits"] = run.time_to_target_s is not None and run.wall_s <= bench.scale_wall_s
    out["wall_s_per_gradient"] = round(run.wall_s / run.gradients, 4) if run.gradients else None
    progress(f"scale: {out['time_to_target_s']}s to target, {run.versions} versions, {run.gradients} gradients, "
             f"{run.wall_s:.0f} wall s")
    return out


def scale_only(report: Path, *, devices: int, policy: Policy, wall_s: float, overrides: dict[str, str]) -> int:
    """``--scale-only``: the scale run of the bench whose report is ``report`` (its fleet, model, target and
    settings, the rates it tuned, and ``overrides`` over its settings: ``--set``), written into that report; the
    other figures are left as they are."""
    try:
        result = json.loads(report.read_text())
        s, fleet, tuning = result["settings"], result["cases"]["steady"]["fleet"], result["tuning"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--scale-only needs a report of a bench that ran steady ({report}): {exc}") from None
    bench = Bench(fleet=tuple(fleet), model=s["model"], target=s["target"], eval_interval_s=s["eval_interval_s"],
                  budget_s=s["budget_s"], overrides=tuple({**s["overrides"], **overrides}.items()),
                  scale_devices=devices, scale_policy=policy, scale_wall_s=wall_s)
    result["scale"] = scale_run(bench, tuning, lambda line: print(line, file=sys.stderr, flush=True))
    sets = "".join(f" --set {k}={v}" for k, v in overrides.items())
    result["scale"]["overrides"] = dict(bench.overrides)
    result["scale"]["measured"] = (f"edgemesh bench policies --scale-only --scale-devices {devices} --scale-policy "
                                   f"{policy} --scale-wall-s {wall_s:g} --report {report}{sets}, after the bench")
    write_report(report, result, plot, progress=lambda line: print(line, flush=True))
    return 0


# ---------------------------------------------------------------------------------------------------- the command
def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench policies``."""
    parser.add_argument("--report", default="bench/reports/policies.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--quick", action="store_true", help="2 seeds, sync and adaptive, steady, two boards")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    parser.add_argument("--cases", default=",".join((*SCENARIOS, STRAGGLER)),
                        help="steady, dynamic, harsh (the default fleet) and straggler, comma-separated")
    parser.add_argument("--seeds", type=int, default=SEEDS, help="evaluation seeds 0 .. N-1")
    parser.add_argument("--lrs", default=",".join(f"{x:g}" for x in LR_GRID), help="the tuning grid")
    parser.add_argument("--fleet", default=",".join(DEFAULT_FLEET), help="the default fleet's profiles")
    parser.add_argument("--model", default=MODEL, help="the job's model spec")
    parser.add_argument("--target", type=float, default=TARGET, help="target held-out accuracy")
    parser.add_argument("--eval-interval-s", type=float, default=EVAL_INTERVAL_S)
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="virtual seconds per evaluation run")
    parser.add_argument("--tuning-budget-s", type=float, default=TUNING_BUDGET_S)
    parser.add_argument("--jobs", type=int, default=1, help="processes running simulations side by side")
    parser.add_argument("--scale-devices", type=int, default=0,
                        help=f"also time one run on this many devices (e.g. {SCALE_DEVICES}; 0: none)")
    parser.add_argument("--scale-policy", default="adaptive")
    parser.add_argument("--scale-wall-s", type=float, default=SCALE_WALL_S)
    parser.add_argument("--scale-only", action="store_true",
                        help="only the scale run (--scale-devices, default 1000), at the rates and settings of the "
                             "report at --report (and any --set), written into that report")
    parser.add_argument("--search-adaptive", action="store_true",
                        help="also choose the adaptive rule's parameters on seeds of their own, and check the winner")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of every simulated run, e.g. --set ps.round_scaling=adascale")
    parser.add_argument("--refigure", metavar="REPORT", help="recompute a report's figures from its runs (no run)")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    parser.set_defaults(func=main)


def bench_of(args: argparse.Namespace) -> Bench:
    """The ``Bench`` the arguments ask for (ConfigError for an unknown policy or case)."""
    overrides = tuple(cli.overrides(argparse.Namespace(set=args.set, config_keys={})).items())
    if args.quick:
        return dataclasses.replace(QUICK, jobs=args.jobs, search_adaptive=args.search_adaptive, overrides=overrides)
    policies = _names(args.policies, POLICIES, "policy")
    cases = _names(args.cases, (*SCENARIOS, STRAGGLER), "case")
    if args.seeds < 1 or args.jobs < 1:
        raise ConfigError("--seeds and --jobs must be >= 1")
    scale_policy = _names(args.scale_policy, POLICIES, "policy")[0]
    if args.search_adaptive and not {"sync", "adaptive"} <= set(policies):
        raise ConfigError("--search-adaptive compares with sync and adaptive: --policies must name both")
    return Bench(policies=policies, cases=cases, seeds=tuple(range(args.seeds)),
                 lr_grid=tuple(float(x) for x in args.lrs.split(",") if x), fleet=tuple(args.fleet.split(",")),
                 model=args.model, target=args.target, eval_interval_s=args.eval_interval_s,
                 budget_s=args.budget_s, tuning_budget_s=args.tuning_budget_s, jobs=args.jobs,
                 scale_devices=args.scale_devices, scale_policy=scale_policy, scale_wall_s=args.scale_wall_s,
                 search_adaptive=args.search_adaptive,
                 overrides=overrides)


def _names(text: str, known: Iterable[Any], what: str) -> tuple[Any, ...]:
    chosen = tuple(n.strip() for n in text.split(",") if n.strip())
    known = tuple(known)
    unknown = [n for n in chosen if n not in known]
    if unknown or not chosen:
        raise ConfigError(f"unknown {what} {', '.join(unknown) or repr(text)}; known: {', '.join(known)}")
    return chosen


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    if args.refigure:
        result = refigure(json.loads(Path(args.refigure).read_text()))
        write_report(Path(args.report), result, plot, progress=lambda line: print(line, flush=True))
        print(tables(result))
        return 0
    if args.scale_only:
        return scale_only(Path(args.report), devices=args.scale_devices or SCALE_DEVICES,
                          policy=_names(args.scale_policy, POLICIES, "policy")[0], wall_s=args.scale_wall_s,
                          overrides=cli.overrides(argparse.Namespace(set=args.set, config_keys={})))
    bench = bench_of(args)
    result = measure(bench, progress=lambda line: print(line, file=sys.stderr, flush=True))
    write_report(Path(args.report), result, plot, progress=lambda line: print(line, flush=True))
    print(tables(result))
    return 0
