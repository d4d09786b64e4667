"""``edgemesh bench fleet``: an emulated fleet trains the default CNN under every sync policy.

Each run is a whole local cluster on one broker: the planner, the parameter server, the
compressor and one worker process per device, every worker started with ``--emulate PROFILE``
(its steps stretched to the board's speed, its MQTT traffic through the board's link). Runs:

* ``single``: one ``pi4`` alone (the same services, one device);
* ``sync``, ``async``, ``ssp``, ``adaptive``: the whole fleet (default: 2 x pi3, 2 x pi4,
  2 x pi5, a jetson-nano and a laptop) under that policy.

Every run uses the same training settings (model, data, learning rate, per-device batch,
staleness bound) and lasts ``budget_s`` seconds from the moment the plan names every device.
The PS evaluates the held-out split every ``EVAL_INTERVAL_S``; per policy the report gives:

* ``time_to_target_s``: first evaluation at or above ``target_accuracy`` (None if never);
* ``avg_iteration_delay_s``: mean over devices of the time between two of its updates
  (compute, communication and any wait for the others);
* ``final_accuracy``: mean of the last ``FINAL_EVALUATIONS`` evaluations;
* ``updates_discarded``, ``updates_accepted``, ``model_versions``, ``bytes_published`` (every
  payload byte every process published), the accuracy curve and more.

Accuracy against time per policy goes to a PNG beside the report.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgemesh import cli
from edgemesh.bench.reporting import finish, pyplot, save
from edgemesh.bench.runs import Timeline, cluster_flags, device_names, drive, fleet_profiles, names, observe
from edgemesh.common.config import Config, load_config
from edgemesh.common.emulation.compute import measure_host_gflops
from edgemesh.common.errors import ConfigError, EdgeMeshError
from edgemesh.common.metrics import sum_samples
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import LocalCluster

logger = logging.getLogger(__name__)

POLICIES = ("single", "sync", "async", "ssp", "adaptive")
DEFAULT_FLEET = ("pi3", "pi3", "pi4", "pi4", "pi5", "pi5", "jetson-nano", "laptop")
SINGLE_PROFILE = "pi4"
DEFAULT_TARGET = 0.96
DEFAULT_BUDGET_S = 40.0
EVAL_INTERVAL_S = 0.25
"""How often the PS evaluates the held-out split during a run."""
FINAL_EVALUATIONS = 5
"""Evaluations averaged into ``final_accuracy`` (the last ones of the run)."""
MILESTONES = (0.9, 0.95, 0.96, 0.97)
"""Accuracies whose first time is reported for every policy besides the target."""
START_TIMEOUT_S = 120.0
"""Longest wait for the plan to name every device."""


Run = Timeline
"""What one policy's run observed (the last plan gives the batch sizes)."""


def run_config(base: dict[str, str], *, policy: str, devices: int, job: str, broker_url: str,
               host_gflops: float, seed: int) -> Config:
    """The configuration of one run: the benchmark's settings, then the user's ``--set`` overrides."""
    overrides = {
        "job": job, "broker.url": broker_url, "log_level": "INFO",
        "training.sync_policy": "sync" if policy == "single" else policy,
        "training.staleness_bound": str(2 * devices),
        "ps.eval_every": "0", "ps.eval_interval_s": str(EVAL_INTERVAL_S),
        "worker.emulation_host_gflops": str(host_gflops), "worker.emulation_seed": str(seed),
    }
    overrides.update(base)
    return load_config(env={}, overrides=overrides)


async def _watch(cfg: Config, run: Run, devices: set[str]) -> None:
    """Note when the plan first names every device (t0) and every evaluation after it."""
    await observe(cfg, *run.routes(Topics(cfg.job), devices))


async def _run_policy(cluster: LocalCluster, devices: list[tuple[str, str]], budget_s: float,
                      progress: Callable[[str], None], label: str) -> Run:
    run = Run()

    def status(elapsed: float) -> str:
        accuracy = run.evaluations[-1][2] if run.evaluations else 0.0
        return f"{label}: {elapsed:5.1f}s of {budget_s:.0f}s, accuracy {accuracy:.4f}"

    watch = _watch(cluster.cfg, run, {name for name, _ in devices})
    run.failure = await drive(cluster, devices, watch, started=lambda: run.t0,
                              done=lambda elapsed: elapsed >= budget_s, status=status, progress=progress,
                              start_timeout_s=START_TIMEOUT_S)
    return run


def _first_at(evaluations: list[tuple[float, int, float]], accuracy: float) -> float | None:
    return next((round(t, 3) for t, _, a in evaluations if a >= accuracy), None)


def summarize(run: Run, cluster: LocalCluster, *, target: float, budget_s: float) -> dict[str, Any]:
    """One policy's entry of the report."""
    evaluations = run.evaluations
    workers = cluster.samples_of("worker")
    iteration = []
    for samples in workers:
        steps = sum_samples(samples, "edgemesh_worker_steps_total")
        if steps:
            iteration.append(budget_s / steps)
    versions = cluster.total("edgemesh_ps_model_version", "ps")
    steps_total = sum(sum_samples(s, "edgemesh_worker_steps_total") for s in workers)
    overruns = sum(sum_samples(s, "edgemesh_worker_emulation_overruns_total") for s in workers)
    last = [a for _, _, a in evaluations[-FINAL_EVALUATIONS:]]
    plan = run.plan
    return {
        "devices": len(workers),
        "time_to_target_s": _first_at(evaluations, target),
        "avg_iteration_delay_s": round(sum(iteration) / len(iteration), 4) if iteration else None,
        "final_accuracy": round(sum(last) / len(last), 4) if last else None,
        "updates_discarded": int(cluster.total("edgemesh_ps_updates_total", "ps", status="discarded")),
        "bytes_published": cluster.over_services("_published_bytes_total"),
        "updates_accepted": int(cluster.total("edgemesh_ps_updates_total", "ps", status="accepted")),
        "discarded_by_reason": {dict(lab).get("reason", ""): int(v) for c in cluster.children if c.role == "ps"
                                for (n, lab), v in c.samples.items()
                                if n == "edgemesh_ps_updates_total" and dict(lab).get("status") == "discarded" and v},
        "model_versions": int(versions),
        "seconds_per_version": round(budget_s / versions, 4) if versions else None,
        "best_accuracy": round(max((a for _, _, a in evaluations), default=0.0), 4),
        "time_to_accuracy_s": {f"{m:.2f}": _first_at(evaluations, m) for m in MILESTONES},
        "worker_steps": int(steps_total),
        "emulation_overrun_share": round(overruns / steps_total, 4) if steps_total else None,
        "link_disconnects": int(cluster.total("edgemesh_worker_emulation_link_disconnects", "worker")),
        "replans": int(cluster.total("edgemesh_planner_replans_total", "planner")),
        "gradient_bytes_by_codec": {dict(lab).get("codec", ""): int(v) for c in cluster.children if c.role == "ps"
                                    for (n, lab), v in c.samples.items()
                                    if n == "edgemesh_ps_received_gradient_bytes_total" and v},
        "batching": plan.batching if plan is not None else None,
        "batch_sizes": {d.device: d.batch_size for d in plan.devices} if plan is not None else {},
        "predicted_round_s": round(plan.round_time_s, 4) if plan is not None and plan.round_time_s else None,
        "peak_rss_mb": cluster.peak_rss_mb(),
        "curve": [[round(t, 3), v, round(a, 4)] for t, v, a in evaluations],
        "failure": run.failure,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(policies: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """How much sooner ``adaptive`` reaches the target than each other policy (time ratios)."""
    ours = policies.get("adaptive", {}).get("time_to_target_s")
    return {f"{other}_over_adaptive_time_to_target": _ratio(policies[other].get("time_to_target_s"), ours)
            for other in policies if other != "adaptive"}


def run_bench(report: Path, *, fleet: list[str], policies: list[str], target: float, budget_s: float, seed: int,
              overrides: dict[str, str], progress: Callable[[str], None], keep_logs: bool = False) -> dict[str, Any]:
    profiles = fleet_profiles(fleet, SINGLE_PROFILE, overrides)
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ConfigError(f"unknown polic(ies) {', '.join(bad)}; known: {', '.join(POLICIES)}")
    host = measure_host_gflops(1)
    devices = device_names(fleet)
    progress(f"fleet of {len(devices)}: {', '.join(fleet)}; host {host:.1f} GFLOP/s per thread; "
             f"{len(policies)} runs of {budget_s:.0f}s")
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-fleet-"))
    broker = BrokerProcess.default()
    broker.start()
    result: dict[str, Any] = {
        "target_accuracy": target,
        "fleet": [{"device": name, **profiles[p].summary()} for name, p in devices],
        "single": {"device": f"{SINGLE_PROFILE}-0", **profiles[SINGLE_PROFILE].summary()},
        "budget_s": budget_s,
        "host_gflops": round(host, 2),
        "broker": broker.kind,
        "policies": {},
    }
    failed = False
    try:
        for policy in policies:
            members = [(f"{SINGLE_PROFILE}-0", SINGLE_PROFILE)] if policy == "single" else devices
            job = f"fleet-{policy}-{uuid.uuid4().hex[:6]}"
            cfg = run_config(overrides, policy=policy, devices=len(members), job=job, broker_url=broker.url,
                             host_gflops=host, seed=seed)
            result.setdefault("settings", _settings(cfg, len(devices)))
            cluster = LocalCluster(cfg, workdir)
            progress(f"{policy}: {len(members)} device(s)")
            run = asyncio.run(_run_policy(cluster, members, budget_s, progress, policy))
            entry = summarize(run, cluster, target=target, budget_s=budget_s)
            result["policies"][policy] = entry
            failed = failed or run.failure is not None
            progress(f"{policy}: time to {target:.2f} {entry['time_to_target_s']}s, final accuracy "
                     f"{entry['final_accuracy']}, iteration {entry['avg_iteration_delay_s']}s, "
                     f"discarded {entry['updates_discarded']}" + (f"; FAILED: {run.failure}" if run.failure else ""))
    finally:
        broker.stop()
    result["ratios"] = ratios(result["policies"])
    finish(report, result, _plot, progress, workdir, keep_logs=failed or keep_logs)
    return result


def _settings(cfg: Config, devices: int) -> dict[str, Any]:
    t = cfg.training
    return {"model": t.model_spec, "dataset": t.dataset, "lr": t.lr, "momentum": t.momentum,
            "batch_size": t.batch_size, "staleness_bound": t.staleness_bound, "devices": devices,
            "eval_interval_s": EVAL_INTERVAL_S, "planner_batching": cfg.planner.batching,
            "compressor_mode": cfg.compressor.mode, "ps_broadcast": cfg.ps.broadcast}


def _plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 5))
    for policy, entry in result["policies"].items():
        curve = entry["curve"]
        if curve:
            ax.plot([c[0] for c in curve], [c[2] for c in curve], label=policy, linewidth=1.5)
    ax.axhline(result["target_accuracy"], color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("seconds since the plan named every device")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0.5, 1.0)
    kinds = ", ".join(sorted({d["profile"] for d in result["fleet"]}))
    ax.set_title(f"emulated fleet of {len(result['fleet'])} ({kinds}); single = one {result['single']['profile']}")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    return save(fig, path)


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench fleet``."""
    parser.add_argument("--report", default="bench/reports/fleet.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--fleet", default=",".join(DEFAULT_FLEET), help="device profiles, comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES), help="runs, comma-separated")
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET, help="target held-out accuracy")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds of training per run")
    cluster_flags(parser, seed="seed of the emulated links' disconnects")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    if args.budget_s <= 0 or not 0 < args.target <= 1:
        raise EdgeMeshError("--budget-s must be > 0 and --target in (0, 1]")
    try:
        result = run_bench(Path(args.report), fleet=names(args.fleet), policies=names(args.policies),
                           target=args.target, budget_s=args.budget_s, seed=args.seed, overrides=cli.overrides(args),
                           keep_logs=args.keep_logs, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except EdgeMeshError as exc:
        print(f"edgemesh bench fleet: {exc}", file=sys.stderr)
        return 2
    return 1 if any(entry["failure"] for entry in result["policies"].values()) else 0
