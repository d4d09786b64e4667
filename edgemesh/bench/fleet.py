"""``edgemesh bench fleet``: an emulated fleet trains under every sync policy, in a scenario, at each policy's best
learning rate.

Each run is a whole local cluster on one broker: the planner, the parameter server, the compressor and one
worker process per device, every worker started with ``--emulate PROFILE`` (its steps stretched to the
board's speed, its MQTT traffic through the board's link) under the run's scenario (``--scenario``:
``steady``, ``dynamic``, ``harsh`` of ``scenarios.toml``: throttling, link stalls, drop-outs and a varying
link rate, seeded so that every policy meets the same events). Runs:

* ``single``: one device of the fleet alone, its ``pi4-0`` if it has one, else its first (the same services,
  one device; it meets that device's events);
* ``sync``, ``async``, ``ssp``, ``adaptive``: the whole fleet (default: 2 x pi3, 2 x pi4, 2 x pi5, a
  jetson-nano and a laptop) under that policy, with balanced batches (every device's batch sized to its
  measured speed, so that ``sync`` waits for no one in a steady fleet).

**Faithful.** Eight boards share this host's cores, so the emulation runs ``--dilation`` times slower than
the boards in every respect (compute, link rates and latency, the scenario's events, and every setting that
is a time on the fleet: ack timeout, stats interval, re-plan intervals, deadline clamps, reconnect backoff).
A step the host could not finish in its emulated time is an *overrun*; a run with more than
``MAX_OVERRUN_SHARE`` of its steps overrun is marked invalid. Every time in the report is board time (wall
time divided by the dilation), so the dilation changes no result, only how long the benchmark takes.

**Fair.** Each policy runs at the best learning rate of a grid (``--lrs``), chosen once on the ``steady``
scenario with another seed (``seed + 1``): a tuning run ends when it reaches the target or once it has run
longer than the policy's best so far. ``--lr-from REPORT`` reuses a report's choices (its steady run's: the other
scenarios use those), ``--lr`` sets one rate for every policy.

Per policy the report gives, in board seconds: ``time_to_target_s`` (the first evaluation at or above
``--target``, None if never), ``avg_iteration_delay_s`` (mean over devices of the time between two of its
updates), ``final_accuracy`` (mean of the last ``FINAL_EVALUATIONS`` evaluations), ``updates_discarded``,
``bytes_published`` (every payload byte every process published), ``emulation_overrun_share``, ``valid``,
``lr``, the workload's ``slowest_step_s`` and ``round_overhead_s``, and the accuracy curve; the report lists
the scenario's events (throttled spells, stalls, drop-outs) per device. One report holds the latest run of each
scenario (``fleet_report``); its PNG plots, per scenario, accuracy against board time per policy above the events.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgemesh import cli
from edgemesh.bench import headroom
from edgemesh.bench.fleet_report import acceptance, merged, plot, ratios, read_runs, scenario_events
from edgemesh.bench.reporting import finish
from edgemesh.bench.runs import Timeline, cluster_flags, device_names, drive, fleet_profiles, names, observe
from edgemesh.common.config import Config, describe, load_config
from edgemesh.common.emulation.compute import measure_host_gflops
from edgemesh.common.emulation.scenarios import load_scenarios
from edgemesh.common.errors import ConfigError, EdgeMeshError
from edgemesh.common.metrics import sum_samples
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import LocalCluster

logger = logging.getLogger(__name__)

POLICIES = ("single", "sync", "async", "ssp", "adaptive")
DEFAULT_FLEET = ("pi3", "pi3", "pi4", "pi4", "pi5", "pi5", "jetson-nano", "laptop")
SINGLE_PROFILE = "pi4"
MODEL = "digits-wide-cnn"
"""The workload: a step of it on the slowest board is many times the system's per-round overhead."""
DEFAULT_TARGET = 0.96
BATCH = 64
"""Samples per device and step (``training.batch_size``; balanced batching sizes each device's batch around it, the
round carrying devices x this many)."""
DEFAULT_BUDGET_S = 40.0
"""Board seconds of training per run."""
DEFAULT_TUNING_BUDGET_S = 30.0
"""Most board seconds of one tuning run (a rate that has not reached the target by then loses to one that has)."""
DEFAULT_DILATION = 3.0
DEFAULT_LRS = (0.025, 0.05, 0.1, 0.2, 0.4)
TUNING_SCENARIO = "steady"
EVAL_INTERVAL_S = 0.5
"""How often, in board seconds, the PS evaluates the held-out split during a run."""
FINAL_EVALUATIONS = 5
"""Evaluations averaged into ``final_accuracy`` (the last ones of the run)."""
MILESTONES = (0.9, 0.95, 0.96, 0.97)
"""Accuracies whose first time is reported for every policy besides the target."""
MAX_OVERRUN_SHARE = 0.05
"""A run with a larger share of overrun steps did not emulate its fleet faithfully: marked invalid."""
START_TIMEOUT_S = 180.0
"""Longest wall wait for the plan to name every device."""
FLEET_TIMES = ("worker.ack_timeout_s", "worker.stats_interval_s", "worker.codec_wait_s", "planner.replan_debounce_s",
               "planner.rebalance_interval_s", "ps.sync_state_interval_s", "ps.adaptive.min_deadline_s",
               "ps.adaptive.max_deadline_s", "broker.backoff_initial_s", "broker.backoff_max_s")
"""Settings that are times on the fleet: a dilated emulation stretches them like everything else."""
QUICK = {"fleet": "pi5,laptop", "policies": "single,adaptive", "budget_s": 6.0, "target": 0.8, "lrs": "0.1,0.2",
         "dilation": 2.0}
"""``--quick``: what the test suite runs (a minute or two)."""


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One run: a policy at a learning rate in a scenario, for ``budget_s`` board seconds; a tuning run also
    ends at the target, or once it has run ``give_up_s`` (another rate's time to the target)."""

    policy: str
    lr: float
    scenario: str
    seed: int
    budget_s: float
    tuning: bool = False
    give_up_s: float | None = None


@dataclass(slots=True)
class Bench:
    """What every run of one benchmark shares."""

    fleet: list[tuple[str, str]]
    """(device, profile) of the fleet runs."""
    overrides: dict[str, str]
    broker_url: str
    host_gflops: float
    dilation: float
    target: float
    workdir: Path
    progress: Callable[[str], None]

    def members(self, policy: str) -> list[tuple[str, str]]:
        return [single_device(self.fleet)] if policy == "single" else self.fleet


def single_device(fleet: list[tuple[str, str]]) -> tuple[str, str]:
    """The device the ``single`` run trains on alone: the fleet's first ``SINGLE_PROFILE`` board, else its first
    (a fleet without a Pi 4 still has a baseline that meets one of its own devices' events)."""
    return next((d for d in fleet if d[1] == SINGLE_PROFILE), fleet[0])


def staleness_bound(policy: str, devices: int) -> int:
    """A run's ``training.staleness_bound``: an update at most twice the devices' versions late is applied, as when
    these figures were first measured. Under ``adaptive`` (and the simulator's reference rule) that is ``2 x
    devices``; under ``async`` and ``ssp``, whose bound counts rounds of the fleet (``scheduler.rounds_bound``), one
    round: ``2 x devices - 1`` versions."""
    return 1 if policy in ("async", "ssp") else 2 * devices


def run_config(bench: Bench, spec: RunSpec, *, devices: int, job: str) -> Config:
    """The configuration of one run: the benchmark's settings, then the user's ``--set`` overrides."""
    d = bench.dilation
    defaults = {key: value for key, value, _ in describe(load_config(env={}, overrides={}))}
    overrides = {
        **{key: str(defaults[key] * d) for key in FLEET_TIMES},
        "job": job, "broker.url": bench.broker_url, "log_level": "INFO",
        "broker.keepalive_s": str(round(defaults["broker.keepalive_s"] * d)),
        "training.model_spec": MODEL, "training.lr": repr(spec.lr), "training.batch_size": str(BATCH),
        "training.sync_policy": "sync" if spec.policy == "single" else spec.policy,
        "training.staleness_bound": str(staleness_bound(spec.policy, devices)), "planner.batching": "balanced",
        "ps.eval_every": "0", "ps.eval_interval_s": str(EVAL_INTERVAL_S * d),
        "training.seed": str(spec.seed),
        "worker.emulation_host_gflops": str(bench.host_gflops), "worker.emulation_seed": str(spec.seed),
        "worker.emulation_dilation": str(d), "worker.emulation_scenario": spec.scenario,
    }
    overrides.update(bench.overrides)
    return load_config(env={}, overrides=overrides)


@dataclass(slots=True)
class Run:
    """One run's timeline (board seconds) and how long it lasted."""

    timeline: Timeline
    elapsed_s: float = 0.0
    """Board seconds from t0 to the end of the run."""


def _reached(timeline: Timeline, target: float) -> bool:
    return any(a >= target for _, _, a in timeline.evaluations)


async def _run(bench: Bench, cluster: LocalCluster, spec: RunSpec, label: str) -> Run:
    timeline = Timeline()
    run = Run(timeline)
    members = bench.members(spec.policy)
    d = bench.dilation

    def done(wall: float) -> bool:
        board = wall / d
        run.elapsed_s = board
        if board >= spec.budget_s:
            return True
        if spec.tuning and _reached(timeline, bench.target):
            return True
        return spec.give_up_s is not None and board > spec.give_up_s

    def status(wall: float) -> str:
        accuracy = timeline.evaluations[-1][2] if timeline.evaluations else 0.0
        return f"{label}: {wall / d:5.1f}s of {spec.budget_s:.0f}s board time, accuracy {accuracy:.4f}"

    watch = observe(cluster.cfg, *timeline.routes(Topics(cluster.cfg.job), {name for name, _ in members}))
    timeline.failure = await drive(cluster, members, watch, started=lambda: timeline.t0, done=done, status=status,
                                   progress=bench.progress, start_timeout_s=START_TIMEOUT_S)
    # board time from here on; an evaluation that came in after the run's end (while it stopped) is not its own
    timeline.evaluations = [(t / d, v, a) for t, v, a in timeline.evaluations if t / d <= run.elapsed_s]
    return run


def _first_at(evaluations: list[tuple[float, int, float]], accuracy: float) -> float | None:
    return next((round(t, 3) for t, _, a in evaluations if a >= accuracy), None)


def _per_device(cluster: LocalCluster, name: str) -> dict[str, float]:
    return {c.name: sum_samples(c.samples, name) for c in cluster.children if c.role == "worker"}


def summarize(run: Run, cluster: LocalCluster, spec: RunSpec, *, target: float, dilation: float) -> dict[str, Any]:
    """One run's entry of the report (board seconds)."""
    evaluations = run.timeline.evaluations
    elapsed = run.elapsed_s
    steps = _per_device(cluster, "edgemesh_worker_steps_total")
    compute = _per_device(cluster, "edgemesh_worker_step_seconds_sum")
    step_s = {dev: round(compute[dev] / n / dilation, 4) for dev, n in steps.items() if n}
    iteration = [elapsed / n for n in steps.values() if n]
    steps_total = sum(steps.values())
    overruns = sum(sum_samples(s, "edgemesh_worker_emulation_overruns_total") for s in cluster.samples_of("worker"))
    versions = cluster.total("edgemesh_ps_model_version", "ps")
    seconds_per_version = elapsed / versions if versions else None
    slowest = max(step_s.values(), default=None)
    link_s = _link_seconds(cluster, steps, dilation)
    round_overhead = (seconds_per_version - slowest if spec.policy in ("single", "sync") and seconds_per_version
                      and slowest else None)
    delays = (cluster.total("edgemesh_ps_update_delay_versions_sum", "ps"),
              cluster.total("edgemesh_ps_update_delay_versions_count", "ps"))
    overrun_share = round(overruns / steps_total, 4) if steps_total else None
    last = [a for _, _, a in evaluations[-FINAL_EVALUATIONS:]]
    plan = run.timeline.plan
    ps = [c for c in cluster.children if c.role == "ps"]
    return {
        "lr": spec.lr,
        "devices": len(steps),
        "time_to_target_s": _first_at(evaluations, target),
        "avg_iteration_delay_s": round(sum(iteration) / len(iteration), 4) if iteration else None,
        "final_accuracy": round(sum(last) / len(last), 4) if last else None,
        "updates_discarded": int(cluster.total("edgemesh_ps_updates_total", "ps", status="discarded")),
        "bytes_published": cluster.over_services("_published_bytes_total"),
        "emulation_overrun_share": overrun_share,
        "valid": overrun_share is not None and overrun_share <= MAX_OVERRUN_SHARE,
        "updates_accepted": int(cluster.total("edgemesh_ps_updates_total", "ps", status="accepted")),
        "discarded_by_reason": {dict(lab).get("reason", ""): int(v) for c in ps for (n, lab), v in c.samples.items()
                                if n == "edgemesh_ps_updates_total" and dict(lab).get("status") == "discarded" and v},
        "model_versions": int(versions),
        "seconds_per_version": round(seconds_per_version, 4) if seconds_per_version else None,
        "slowest_step_s": slowest,
        "round_overhead_s": round(round_overhead, 4) if round_overhead is not None else None,
        "link_s": link_s,
        "link_up_s": _link_seconds(cluster, steps, dilation, ("up",)),
        "link_down_s": _link_seconds(cluster, steps, dilation, ("down",)),
        "bus_overhead_s": (round(round_overhead - max(link_s.values()), 4)
                           if round_overhead is not None and link_s else None),
        "mean_update_delay": round(delays[0] / delays[1], 3) if delays[1] else None,
        "updates_per_version": round(delays[1] / versions, 3) if versions else None,
        "step_s": step_s,
        "elapsed_s": round(elapsed, 3),
        "best_accuracy": round(max((a for _, _, a in evaluations), default=0.0), 4),
        "time_to_accuracy_s": {f"{m:.2f}": _first_at(evaluations, m) for m in MILESTONES},
        "worker_steps": int(steps_total),
        "link_disconnects": int(cluster.total("edgemesh_worker_emulation_link_disconnects", "worker")),
        "link_stalls": int(cluster.total("edgemesh_worker_emulation_link_stalls", "worker")),
        "replans": int(cluster.total("edgemesh_planner_replans_total", "planner")),
        "rollbacks": int(cluster.total("edgemesh_ps_guard_rollbacks_total", "ps")),
        "gradient_bytes_by_codec": {dict(lab).get("codec", ""): int(v) for c in ps for (n, lab), v in c.samples.items()
                                    if n == "edgemesh_ps_received_gradient_bytes_total" and v},
        "batch_sizes": {d.device: d.batch_size for d in plan.devices} if plan is not None else {},
        "peak_rss_mb": cluster.peak_rss_mb(),
        "curve": [[round(t, 3), v, round(a, 4)] for t, v, a in evaluations],
        "failure": run.timeline.failure,
    }


def _link_seconds(cluster: LocalCluster, steps: dict[str, float], dilation: float,
                  directions: tuple[str, ...] = ("up", "down")) -> dict[str, float]:
    """Board seconds each device's emulated link spent per step busy sending in ``directions``: the part of a
    round that is the fleet's Wi-Fi, not the system's overhead (the latencies, 2 ms each way, are left in the
    overhead)."""
    out = {}
    for c in cluster.children:
        n = steps.get(c.name)
        if c.role != "worker" or not n:
            continue
        busy = sum(v for (name, labels), v in c.samples.items()
                   if name == "edgemesh_worker_emulation_link_busy_seconds" and dict(labels).get("direction")
                   in directions)
        out[c.name] = round(busy / n / dilation, 4)
    return out


def run_one(bench: Bench, spec: RunSpec, label: str) -> dict[str, Any]:
    """Start a cluster, run ``spec`` on it, and summarize it."""
    members = bench.members(spec.policy)
    job = f"fleet-{spec.policy}-{uuid.uuid4().hex[:6]}"
    cfg = run_config(bench, spec, devices=len(members), job=job)
    cluster = LocalCluster(cfg, bench.workdir)
    bench.progress(f"{label}: {len(members)} device(s), lr {spec.lr:g}, scenario {spec.scenario}")
    started = time.monotonic()
    run = asyncio.run(_run(bench, cluster, spec, label))
    entry = summarize(run, cluster, spec, target=bench.target, dilation=bench.dilation)
    entry["wall_s"] = round(time.monotonic() - started, 1)
    bench.progress(f"{label}: time to {bench.target:.2f} {entry['time_to_target_s']}s, final accuracy "
                   f"{entry['final_accuracy']}, iteration {entry['avg_iteration_delay_s']}s, discarded "
                   f"{entry['updates_discarded']}, overruns {entry['emulation_overrun_share']}"
                   + ("" if entry["valid"] else " (INVALID: overrun share above 5%)")
                   + (f"; FAILED: {entry['failure']}" if entry["failure"] else ""))
    return entry


def tune(bench: Bench, policies: list[str], lrs: list[float], *, seed: int, budget_s: float) -> dict[str, Any]:
    """Each policy's best learning rate of ``lrs`` on the tuning scenario with ``seed``: the one that reaches the
    target soonest (failing that, the best accuracy). A run ends at the target or once it is slower than the
    policy's best so far."""
    out: dict[str, Any] = {}
    for policy in policies:
        grid: dict[str, dict[str, Any]] = {}
        best: float | None = None
        for lr in middle_out(lrs):
            spec = RunSpec(policy, lr, TUNING_SCENARIO, seed, budget_s, tuning=True, give_up_s=best)
            entry = run_one(bench, spec, f"tuning {policy} lr {lr:g}")
            t = entry["time_to_target_s"]
            grid[repr(lr)] = {k: entry[k] for k in ("time_to_target_s", "best_accuracy", "elapsed_s",
                                                     "emulation_overrun_share", "valid", "failure")}
            if t is not None and (best is None or t < best):
                best = t
        chosen = _choose(grid)
        out[policy] = {"lr": chosen, "grid": dict(sorted(grid.items(), key=lambda item: float(item[0])))}
        bench.progress(f"tuning {policy}: lr {chosen:g}")
    return out


def middle_out(values: list[float]) -> list[float]:
    """``values`` sorted, from the middle outwards (0.1, 0.2, 0.05, 0.4, 0.025): the first run sets the time the
    others must beat, and a middle rate is likelier to reach the target than an extreme one."""
    ordered = sorted(values)
    middle = (len(ordered) - 1) // 2
    out = [ordered[middle]]
    for step in range(1, len(ordered)):
        for i in (middle + step, middle - step):
            if 0 <= i < len(ordered):
                out.append(ordered[i])
    return out


def _choose(grid: dict[str, dict[str, Any]]) -> float:
    """The rate that reached the target soonest, else the one with the best accuracy (runs that failed last)."""
    def key(item: tuple[str, dict[str, Any]]) -> tuple[int, float, float]:
        _, e = item
        reached = e["time_to_target_s"] is not None and not e["failure"]
        return (0 if reached else 1, e["time_to_target_s"] if reached else 0.0, -(e["best_accuracy"] or 0.0))
    return float(min(grid.items(), key=key)[0])


def steady_run(*paths: Path | None) -> dict[str, Any] | None:
    """The ``steady`` run of the first of the fleet reports at ``paths`` that holds one (None: none does)."""
    return next((runs[TUNING_SCENARIO] for path in paths if TUNING_SCENARIO in (runs := read_runs(path))), None)


def tuned_from(path: Path, policies: list[str]) -> dict[str, Any]:
    """The tuning of an earlier report (its steady run's, else its only run's), which must cover ``policies``."""
    runs = read_runs(path)
    run = runs.get(TUNING_SCENARIO) or (next(iter(runs.values())) if len(runs) == 1 else None)
    tuning = run.get("tuning") if run is not None else None
    if not isinstance(tuning, dict):
        raise ConfigError(f"--lr-from {path}: not a fleet report with a tuning section (of its "
                          f"{TUNING_SCENARIO!r} run, or of its only run)")
    missing = [p for p in policies if not isinstance(tuning.get(p), dict) or "lr" not in tuning[p]]
    if missing:
        raise ConfigError(f"--lr-from {path}: no tuned learning rate for {', '.join(missing)}")
    return {p: {**tuning[p], "from": str(path)} for p in policies}


def run_bench(report: Path, *, fleet: list[str], policies: list[str], scenario: str, target: float, budget_s: float,
              dilation: float, seed: int, lrs: list[float], lr_from: Path | None, overrides: dict[str, str],
              progress: Callable[[str], None], tuning_budget_s: float = DEFAULT_TUNING_BUDGET_S,
              keep_logs: bool = False) -> dict[str, Any]:
    profiles = fleet_profiles(fleet, SINGLE_PROFILE, overrides)
    scenarios = load_scenarios(overrides.get("worker.emulation_scenarios") or None, profiles=set(profiles))
    if scenario not in scenarios or TUNING_SCENARIO not in scenarios:
        raise ConfigError(f"unknown scenario {scenario!r} (or no {TUNING_SCENARIO!r} to tune on); known: "
                          f"{', '.join(sorted(scenarios))}")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ConfigError(f"unknown polic(ies) {', '.join(bad)}; known: {', '.join(POLICIES)}")
    host = measure_host_gflops(1)
    devices = device_names(fleet)
    single = single_device(devices)
    progress(f"fleet of {len(devices)}: {', '.join(fleet)}; scenario {scenario}; host {host:.1f} GFLOP/s per "
             f"thread; time dilation {dilation:g}; {len(policies)} runs of {budget_s:g} board seconds")
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-fleet-"))
    broker = BrokerProcess.default()
    broker.start()
    bench = Bench(devices, overrides, broker.url, host, dilation, target, workdir, progress)
    settings = run_config(bench, RunSpec("sync", lrs[0] if lrs else 0.1, scenario, seed, budget_s),
                          devices=len(devices), job="settings")
    result: dict[str, Any] = {
        "scenario": scenarios[scenario].summary(),
        "target_accuracy": target,
        "fleet": [{"device": name, **profiles[p].summary()} for name, p in devices],
        "single": {"device": single[0], **profiles[single[1]].summary()},
        "budget_s": budget_s,
        "time_dilation": dilation,
        "times": "board seconds (wall seconds / time_dilation)",
        "host_gflops": round(host, 2),
        "broker": broker.kind,
        "seed": seed,
        "settings": _settings(settings, len(devices)),
        "events": scenario_events(scenarios[scenario], devices, seed, budget_s),
        "policies": {},
    }
    started = time.monotonic()
    failed = False
    try:
        if lr_from is not None:
            result["tuning"] = tuned_from(lr_from, policies)
        elif len(lrs) == 1:
            result["tuning"] = {p: {"lr": lrs[0], "grid": {}} for p in policies}
        else:
            result["tuning"] = tune(bench, policies, lrs, seed=seed + 1, budget_s=min(budget_s, tuning_budget_s))
        for policy in policies:
            spec = RunSpec(policy, float(result["tuning"][policy]["lr"]), scenario, seed, budget_s)
            entry = run_one(bench, spec, policy)
            result["policies"][policy] = entry
            failed = failed or entry["failure"] is not None
    finally:
        broker.stop()
    d = settings.worker.emulation_dilation
    result["headroom"] = headroom.of_bench(
        result, scenario=scenarios[scenario], steady=scenarios[TUNING_SCENARIO], model=MODEL, profiles=profiles,
        steady_report=steady_run(lr_from, report), detect_s=settings.planner.replan_debounce_s / d,
        lag_s=(settings.worker.stats_interval_s + settings.planner.rebalance_interval_s) / d)
    result["ratios"] = ratios(result["policies"], budget_s)
    result["acceptance"] = acceptance(scenario, result["policies"], budget_s)
    result["bench_wall_s"] = round(time.monotonic() - started, 1)
    finish(report, merged(report, scenario, result), plot, progress, workdir, keep_logs=failed or keep_logs)
    return result


def _settings(cfg: Config, devices: int) -> dict[str, Any]:
    t, rule, d = cfg.training, cfg.ps.adaptive, cfg.worker.emulation_dilation
    adaptive = {k: getattr(rule, k) / d if k.endswith("_s") else getattr(rule, k) for k in rule.__slots__}
    return {"model": t.model_spec, "dataset": t.dataset, "momentum": t.momentum, "batch_size": t.batch_size,
            "fleet_staleness_bound": 2 * devices, "staleness_bound_rounds_async_ssp": staleness_bound("async", devices),
            "devices": devices, "eval_interval_s": EVAL_INTERVAL_S,
            "planner_batching": cfg.planner.batching, "compressor_mode": cfg.compressor.mode,
            "ps_broadcast": cfg.ps.broadcast, "adaptive": adaptive, "max_overrun_share": MAX_OVERRUN_SHARE}


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench fleet``."""
    parser.add_argument("--report", default="bench/reports/fleet.json", help="JSON report path (PNG beside it): "
                        "the run replaces its scenario's in it and keeps the other scenarios'")
    parser.add_argument("--scenario", default="steady", help="emulation scenario: steady, dynamic, harsh "
                        "(worker.emulation_scenarios for your own file)")
    parser.add_argument("--fleet", default=",".join(DEFAULT_FLEET), help="device profiles, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES), help="runs, comma-separated")
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET, help="target held-out accuracy")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="board seconds of training per run")
    parser.add_argument("--dilation", type=float, default=DEFAULT_DILATION,
                        help="the emulation runs this many times slower than the boards (overrun share < 5%%)")
    parser.add_argument("--lrs", default=",".join(map(str, DEFAULT_LRS)), help="learning-rate grid each policy "
                        "is tuned on (steady scenario, seed + 1)")
    parser.add_argument("--tuning-budget-s", type=float, default=DEFAULT_TUNING_BUDGET_S,
                        help="most board seconds of one tuning run")
    parser.add_argument("--lr", type=float, help="one learning rate for every policy (no tuning)")
    parser.add_argument("--lr-from", type=Path, help="reuse the tuned learning rates of this report")
    parser.add_argument("--quick", action="store_true", help="a small, short variant (what the tests run): "
                        + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    cluster_flags(parser, seed="seed of the scenario's events and the emulated links")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    try:
        lrs = [args.lr] if args.lr is not None else [float(x) for x in names(str(args.lrs))]
    except ValueError:
        print(f"edgemesh bench fleet: --lrs expects numbers, got {args.lrs!r}", file=sys.stderr)
        return 2
    if (min(args.budget_s, args.tuning_budget_s) <= 0 or not 0 < args.target <= 1 or args.dilation < 1 or not lrs
            or min(lrs) <= 0):
        print("edgemesh bench fleet: budgets and learning rates must be > 0, --target in (0, 1], "
              "--dilation >= 1", file=sys.stderr)
        return 2
    report = Path(args.report)
    try:
        result = run_bench(report, fleet=names(args.fleet), policies=names(args.policies), scenario=args.scenario,
                           target=args.target, budget_s=args.budget_s, dilation=args.dilation, seed=args.seed,
                           lrs=lrs, lr_from=args.lr_from, overrides=cli.overrides(args), keep_logs=args.keep_logs,
                           tuning_budget_s=args.tuning_budget_s,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    except EdgeMeshError as exc:
        print(f"edgemesh bench fleet: {exc}", file=sys.stderr)
        return 2
    return 1 if any(entry["failure"] for entry in result["policies"].values()) else 0
