"""``edgemesh bench robust``: a fleet with faulty devices, trained under each robust aggregation rule.

Each run is a whole local cluster on one broker, as in ``bench fleet``: the planner, the parameter
server, the compressor and one ``--emulate PROFILE`` worker process per device (default 8 x pi5),
training the digits CNN under the ``sync`` policy with the same settings and seed. Runs:

* ``clean``: every device honest, aggregated by ``mean``;
* ``attacked``: the first devices attack (``worker.emulation_attack``; default one ``sign-flip``, sending
  its gradient negated and x10, and one ``noise``, sending Gaussian noise whose standard deviation is 10x
  its own gradient's RMS, per tensor), aggregated by ``mean`` and by each robust rule
  (``ps.aggregation``), set for the attackers there are (f of n): ``ps.krum_f`` = f,
  ``ps.trim_fraction`` = f / n and ``ps.clip_factor`` = (n - f) / 2f (:func:`clip_factor`).

Every run lasts the same number of model versions (``--versions``): the PS evaluates every ``EVAL_EVERY``
versions (versions 9, 19, 29, ...), and a run ends with its last evaluation within ``--versions``, or
after ``--max-s`` when the model stops moving (a diverged model's gradients are NaN, which the PS
discards). ``final_accuracy`` is the mean of the last ``FINAL_EVALUATIONS`` evaluations within
``--versions``; ``duration_s`` the time from the plan naming every device to the last of them.
Gradients are sent dense (``fp16``, static): under a sparsifying codec most coordinates of most updates
are zero, and so is their median.

Accuracy against model version per run goes to a PNG beside the report.
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
from pathlib import Path
from typing import Any, get_args

from edgemesh import cli
from edgemesh.bench.reporting import finish, pyplot, save
from edgemesh.bench.runs import Timeline, cluster_flags, device_names, drive, fleet_profiles, names, observe
from edgemesh.common.config import Config, load_config
from edgemesh.common.emulation.compute import measure_host_gflops
from edgemesh.common.errors import ConfigError, EdgeMeshError
from edgemesh.common.topics import Topics
from edgemesh.common.vocabulary import AGGREGATION_RULES, AttackKind
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import LocalCluster

logger = logging.getLogger(__name__)

ROBUST_RULES = tuple(r for r in AGGREGATION_RULES if r != "mean")
ATTACKS = tuple(a for a in get_args(AttackKind) if a)
DEFAULT_ATTACKS = ("sign-flip", "noise")
DEFAULT_PROFILE = "pi5"
DEFAULT_WORKERS = 8
DEFAULT_VERSIONS = 300
DEFAULT_MAX_S = 240.0
DEFAULT_SCALE = 10.0
POLICY = "sync"
"""Every run's policy: a step is a round of one update per device, what the robust rules compare."""
LR = 0.1
"""The learning rate the kept reports were measured at (a version of every device's batch holds it; the
default, 0.05, is for iterations of one batch in all)."""
CODEC = "fp16"
"""Every device's codec (static): dense, so that coordinate-wise rules see every coordinate."""
EVAL_EVERY = 10
"""The PS evaluates the held-out split every this many versions: the same versions in every run."""
FINAL_EVALUATIONS = 3
"""Evaluations averaged into ``final_accuracy`` (the last ones of the run)."""
START_TIMEOUT_S = 120.0
"""Longest wait for the plan to name every device."""


def clip_factor(workers: int, attackers: int) -> float:
    """Half the factor at which ``attackers`` sign-flipped updates, each clipped to factor x the median norm,
    pull the model up the loss as hard as the honest ones pull it down: (n - f) / 2f. (The default 3.0 is
    that very balance for 2 of 8, and the model diverged: robust-clip3.json, in git history at 2262601.)"""
    return (workers - attackers) / (2 * attackers)


def run_config(base: dict[str, str], *, rule: str, job: str, broker_url: str, host_gflops: float, seed: int,
               attackers: int, workers: int, scale: float) -> Config:
    """One run's configuration: the benchmark's settings, then the user's ``--set`` overrides."""
    overrides = {
        "job": job, "broker.url": broker_url, "log_level": "INFO",
        "training.sync_policy": POLICY, "training.lr": str(LR), "training.seed": str(seed),
        # back to back: under the default budget a busy host skips an evaluation, and runs would compare
        # accuracies at different versions (and a run could miss its last one)
        "ps.eval_every": str(EVAL_EVERY), "ps.eval_interval_s": "0", "ps.eval_budget": "1",
        "ps.aggregation": rule, "ps.krum_f": str(attackers), "ps.trim_fraction": str(min(attackers / workers, 0.49)),
        "ps.clip_factor": str(clip_factor(workers, attackers)),
        "compressor.mode": "static", "compressor.default_codec": CODEC,
        "worker.emulation_host_gflops": str(host_gflops), "worker.emulation_seed": str(seed),
        "worker.emulation_attack_scale": str(scale),
    }
    overrides.update(base)
    return load_config(env={}, overrides=overrides)


async def _run(cluster: LocalCluster, devices: list[tuple[str, str]], attacks: dict[str, str], *, versions: int,
               max_s: float, progress: Callable[[str], None], label: str) -> Timeline:
    run = Timeline()

    def version() -> int:
        return run.evaluations[-1][1] if run.evaluations else 0

    def status(elapsed: float) -> str:
        accuracy = run.evaluations[-1][2] if run.evaluations else 0.0
        return f"{label}: {elapsed:5.1f}s, version {version()} of {versions}, accuracy {accuracy:.4f}"

    watch = observe(cluster.cfg, *run.routes(Topics(cluster.cfg.job), {name for name, _ in devices}))
    flags = {device: ["--set", f"worker.emulation_attack={attack}"] for device, attack in attacks.items()}
    # done once the next evaluation would be past ``versions``
    run.failure = await drive(cluster, devices, watch, started=lambda: run.t0, status=status, progress=progress,
                              done=lambda elapsed: version() + EVAL_EVERY > versions or elapsed >= max_s,
                              start_timeout_s=START_TIMEOUT_S, flags=flags)
    return run


def summarize(run: Timeline, cluster: LocalCluster, *, versions: int) -> dict[str, Any]:
    """One run's entry of the report."""
    evaluations = [e for e in run.evaluations if e[1] <= versions]
    last = [a for _, _, a in evaluations[-FINAL_EVALUATIONS:]]
    end = evaluations[-1] if evaluations else (0.0, 0, 0.0)
    return {
        "final_accuracy": round(sum(last) / len(last), 4) if last else None,
        "best_accuracy": round(max((a for _, _, a in evaluations), default=0.0), 4),
        "model_versions": end[1],
        "reached_versions": end[1] + EVAL_EVERY > versions,
        "duration_s": round(end[0], 2),
        "seconds_per_version": round(end[0] / end[1], 4) if end[1] else None,
        "ps_versions_at_stop": int(cluster.total("edgemesh_ps_model_version", "ps")),
        "updates_accepted": int(cluster.total("edgemesh_ps_updates_total", "ps", status="accepted")),
        "updates_discarded": int(cluster.total("edgemesh_ps_updates_total", "ps", status="discarded")),
        "robust_clipped": int(cluster.total("edgemesh_ps_robust_clipped_total", "ps")),
        "robust_excluded": int(cluster.total("edgemesh_ps_robust_excluded_total", "ps")),
        "curve": [[round(t, 3), v, round(a, 4)] for t, v, a in evaluations],
        "failure": run.failure,
    }


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """How far below the clean run each attacked run ended, in accuracy points, and the best robust rule."""
    clean = result["clean"].get("final_accuracy") or 0.0
    gaps = {rule: round(100 * (clean - (entry.get("final_accuracy") or 0.0)), 2)
            for rule, entry in result["attacked"].items()}
    robust = {rule: gap for rule, gap in gaps.items() if rule != "mean"}
    best = min(robust, key=lambda rule: robust[rule]) if robust else None
    return {"points_below_clean": gaps, "best_robust_rule": best,
            "best_robust_points_below_clean": robust.get(best) if best else None}


def run_bench(report: Path, *, workers: int, profile: str, attacks: list[str], scale: float, rules: list[str],
              versions: int, max_s: float, seed: int, overrides: dict[str, str], progress: Callable[[str], None],
              keep_logs: bool = False) -> dict[str, Any]:
    profiles = fleet_profiles([profile], profile, overrides)
    bad = [r for r in rules if r not in ROBUST_RULES] + [a for a in attacks if a not in ATTACKS]
    if bad:
        raise ConfigError(f"unknown rule(s) or attack(s) {', '.join(bad)}; rules: {', '.join(ROBUST_RULES)}; "
                          f"attacks: {', '.join(ATTACKS)}")
    if not 0 < len(attacks) < workers / 2:
        raise ConfigError(f"give 1 to {(workers - 1) // 2} attacks for {workers} workers: robust rules need an "
                          "honest majority")
    devices = device_names([profile] * workers)
    attackers = {name: attack for (name, _), attack in zip(devices, attacks, strict=False)}
    host = measure_host_gflops(1)
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-robust-"))
    broker = BrokerProcess.default()
    broker.start()
    result: dict[str, Any] = {
        "clean": {}, "attacked": {},
        "workers": workers, "fleet": [{"device": name, **profiles[profile].summary()} for name, _ in devices],
        "attackers": [{"device": name, "attack": attack, "scale": scale} for name, attack in attackers.items()],
        "versions": versions, "max_s": max_s, "seed": seed, "policy": POLICY, "codec": CODEC,
        "eval_every": EVAL_EVERY, "host_gflops": round(host, 2), "broker": broker.kind,
    }
    # (where its entry goes, under which key, the rule, the attackers)
    runs = [(result, "clean", "mean", {}), *((result["attacked"], rule, rule, attackers) for rule in ["mean", *rules])]
    progress(f"{workers} x {profile}, attackers {attackers}; {len(runs)} runs of {versions} versions")
    started = time.monotonic()
    try:
        for into, key, rule, attacking in runs:
            label = "clean" if into is result else f"attacked, {rule}"
            cfg = run_config(overrides, rule=rule, job=f"robust-{key}-{uuid.uuid4().hex[:6]}", broker_url=broker.url,
                             host_gflops=host, seed=seed, attackers=len(attackers), workers=workers, scale=scale)
            result.setdefault("settings", _settings(cfg))
            progress(label)
            cluster = LocalCluster(cfg, workdir)
            run = asyncio.run(_run(cluster, devices, attacking, versions=versions, max_s=max_s, progress=progress,
                                   label=label))
            into[key] = entry = summarize(run, cluster, versions=versions)
            progress(f"{label}: final accuracy {entry['final_accuracy']}, best {entry['best_accuracy']}, "
                     f"{entry['model_versions']} versions, clipped {entry['robust_clipped']}, excluded "
                     f"{entry['robust_excluded']}, failure {run.failure}")
    finally:
        broker.stop()
    result["duration_s"] = round(time.monotonic() - started, 1)
    result["verdict"] = verdict(result)
    failed = any(entry["failure"] for entry in [result["clean"], *result["attacked"].values()])
    finish(report, result, _plot, progress, workdir, keep_logs=failed or keep_logs)
    return result


def _settings(cfg: Config) -> dict[str, Any]:
    t, p = cfg.training, cfg.ps
    return {"model": t.model_spec, "dataset": t.dataset, "lr": t.lr, "momentum": t.momentum,
            "batch_size": t.batch_size, "clip_factor": p.clip_factor, "trim_fraction": p.trim_fraction,
            "krum_f": p.krum_f, "planner_batching": cfg.planner.batching, "ps_shards": p.shards}


def _plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 5))
    runs = [("clean", result["clean"]), *((f"attacked, {rule}", e) for rule, e in result["attacked"].items())]
    for label, entry in runs:
        curve = entry.get("curve") or []
        ax.plot([c[1] for c in curve], [c[2] for c in curve], label=label, linewidth=1.5,
                linestyle="--" if label == "clean" else "-")
    attacks = ", ".join(f"{a['attack']} x{a['scale']:g}" for a in result["attackers"])
    ax.set(xlabel="model version", ylabel="held-out accuracy", ylim=(0.0, 1.0),
           title=f"{result['workers']} workers under {result['policy']}, attackers: {attacks}")
    ax.legend(loc="center right")
    ax.grid(alpha=0.3)
    return save(fig, path)


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench robust``."""
    parser.add_argument("--report", default="bench/reports/robust.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="worker processes (devices)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="the device profile every worker emulates")
    parser.add_argument("--attacks", default=",".join(DEFAULT_ATTACKS),
                        help=f"one attacking worker per entry, comma-separated: {', '.join(ATTACKS)}")
    parser.add_argument("--scale", type=float, default=DEFAULT_SCALE, help="the attacks' factor")
    parser.add_argument("--rules", default=",".join(ROBUST_RULES), help="robust rules to run attacked, besides mean")
    parser.add_argument("--versions", type=int, default=DEFAULT_VERSIONS, help="model versions per run")
    parser.add_argument("--max-s", type=float, default=DEFAULT_MAX_S,
                        help="longest run, seconds from the plan naming every device (a diverged model stalls)")
    cluster_flags(parser, seed="training and emulation seed of every run")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    if args.versions < EVAL_EVERY or args.max_s <= 0 or args.scale <= 0:
        raise EdgeMeshError(f"--versions must be >= {EVAL_EVERY}, --max-s and --scale > 0")
    try:
        result = run_bench(Path(args.report), workers=args.workers, profile=args.profile, attacks=names(args.attacks),
                           scale=args.scale, rules=names(args.rules), versions=args.versions, max_s=args.max_s,
                           seed=args.seed, overrides=cli.overrides(args), keep_logs=args.keep_logs,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    except EdgeMeshError as exc:
        print(f"edgemesh bench robust: {exc}", file=sys.stderr)
        return 2
    runs = [result["clean"], *result["attacked"].values()]
    return 1 if any(entry["failure"] for entry in runs) else 0
