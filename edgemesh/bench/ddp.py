"""``edgemesh bench ddp``: EdgeMesh's ``sync`` beside torch DistributedDataParallel on the same two-worker job.

One run, two trainings of the same job, one after the other on this host:

* **EdgeMesh**: a real local cluster (the planner, the parameter server, the compressor and ``WORKERS`` worker
  processes, not emulated) on a broker of its own, training ``cifar-cnn`` (620k parameters, 2.48 MB of float32)
  on ``synthetic-cifar`` under ``training.sync_policy = sync`` with uniform batches of ``training.batch_size``
  (32) per worker. Gradients and model travel exact, as DDP's all-reduce does and as a lab LAN affords
  (``EXACT``: codec ``none`` both ways, so both sides run the same arithmetic); EdgeMesh's defaults otherwise,
  as a user runs it: model deltas, the write-ahead log fsynced before every ack; one held-out evaluation, at
  version ``--steps`` (``ps.eval_every``), so that neither side evaluates while it is timed (DDP evaluates the
  models it kept after it trained; ``--set ps.eval_every=5`` evaluates as EdgeMesh does by default, within
  ``ps.eval_budget``, on the cores the workers train on). ``--set compressor.mode=adaptive --set
  ps.delta_codec=auto`` runs the edge defaults instead (fp16 then grid gradients, fp16 deltas under ``sync``). It runs
  until the parameter server's first evaluation at or after ``--steps`` model versions.
  ``edgemesh_seconds_per_version`` is the time from version ``--warmup`` to version ``--steps``, as the first
  ack naming each version reached this process, over the versions between;
* **DDP**: ``WORKERS`` processes of torch ``DistributedDataParallel`` (backend gloo on 127.0.0.1), each with the
  same model (``models.build_model`` at the same seed), its own shard of the same training split drawn in the
  same order as the worker of that shard index, the same batch, ``torch.optim.SGD`` with the parameter server's
  ``training.lr``, ``momentum`` and ``weight_decay`` (the same update rule) and torch threads set as a worker
  sets them (``worker.threads``). ``ddp_seconds_per_step`` is the time from step ``--warmup`` to step
  ``--steps`` over the steps between.

``step_time_ratio`` is EdgeMesh's seconds per version over DDP's seconds per step: a model version of ``sync``
is one step of the same SGD over the same samples (each worker's gradient weighted by its samples, as DDP
averages them). With ``--rounds`` n (2; 1 with ``--quick``) each side trains n times, EdgeMesh first in odd
rounds and DDP first in even ones (ABBA: on a shared host whose load drifts, one pair run once has swung the
ratio by a quarter); both seconds are the means over the rounds, each round's under ``rounds``. The losses,
curves and breakdown are the first round's. Round i trains both sides at seed ``--seed`` + i (the model's
initial weights, the data and its order): on one host each side repeats its run to the last digit, yet the two
trainings, the same SGD summed in another order (numpy at the parameter server, gloo's all-reduce), part ways
within a few hundred steps, and where one stands at a single held-out point is a draw between seeds (4 % apart
one way on one host, 8 % the other way on the next). ``final_loss_ratio_of_means`` compares each side's final
held-out loss averaged over the rounds' seeds (``*_final_loss_mean``).

Both final models are evaluated the same way, ``models.evaluate`` on the data set's test split: EdgeMesh's by
the parameter server itself (its evaluation event, float32 weights) at its first evaluation at or after
``--steps`` (``final_version``), DDP's at the same step count (it trains that many steps, and snapshots its
model at every version the parameter server evaluated: the two held-out curves share their points);
``final_loss_ratio`` is EdgeMesh's final held-out loss over DDP's.

Where EdgeMesh's time goes, per version, from the processes' metrics and CPU times between a scrape at the
warm-up and one at the end: ``edgemesh_worker_step_seconds`` (a worker's forward and backward pass: its
``step_seconds`` histogram), ``edgemesh_worker_ack_seconds`` (publishing the update until its ack: the
broker, the parameter server's receive, the round waiting for the other worker, apply, log, broadcast, ack;
``ack_seconds``) and the rest (encoding the gradient, loading and decoding the model, the loop), with the
parameter server's step time and every process's CPU seconds per version (this host has few cores: the
processes share them).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgemesh import cli
from edgemesh.bench.ddp_torch import (
    FIGURES_DIGITS,
    SECONDS_PER_STEP_LIMIT,
    START_TIMEOUT_S,
    WORKERS,
    DdpJob,
    ddp_once,
    mean_per_version,
)
from edgemesh.bench.reporting import finish, pyplot, save
from edgemesh.bench.rounds import alternate, mean, ratio
from edgemesh.bench.runs import Timeline, cluster_flags, drive, observe
from edgemesh.common import models
from edgemesh.common.bus import Route
from edgemesh.common.config import Config, load_config
from edgemesh.common.data import load_dataset
from edgemesh.common.errors import EdgeMeshError
from edgemesh.common.messages import Event, Plan, UpdateAck
from edgemesh.common.metrics import sum_samples
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import LocalCluster, Samples, cpu_seconds

logger = logging.getLogger(__name__)

MODEL = "cifar-cnn"
DATASET = "synthetic-cifar"
POLICY = "sync"
BATCH = 32
"""Samples per worker per step (``training.batch_size``, uniform batches)."""
EXACT = {"compressor.mode": "static", "compressor.default_codec": "none", "ps.delta_codec": "none"}
"""EdgeMesh's settings for a link that carries float32 at no cost worth saving: gradients and model deltas
uncompressed. Its edge defaults (``fp16``, then ``grid`` once a link is measured slow, and ``fp16`` deltas under
``sync``) are lossy and take CPU to encode, against a DDP whose all-reduce is exact."""
HALF = {"compressor.mode": "static", "compressor.default_codec": "fp16", "ps.delta_codec": "fp16"}
"""``--comm fp16``: EdgeMesh's gradients and model deltas in float16, beside DDP with torch's
``fp16_compress_hook`` (its all-reduce in float16): both sides send half the bytes."""
COMMS = {"fp32": EXACT, "fp16": HALF}
LR = 0.02
"""Both sides' learning rate (SGD, momentum 0.9): ``cifar-cnn`` learns ``synthetic-cifar`` smoothly at 0.01-0.05;
at the default 0.1 its held-out loss jumps by tenths between evaluations (one process at batch 32 stalls near
1.8), which would make the final losses' ratio a draw."""
DEFAULT_STEPS = 200
DEFAULT_WARMUP = 20
"""Steps (model versions) before timing starts: building models, first plans and codecs, caches."""
DEFAULT_ROUNDS = 2
"""EdgeMesh, DDP, then DDP, EdgeMesh: a host whose load drifts over the run weighs on both sides."""
QUICK_STEPS = 30
QUICK_WARMUP = 10


# ------------------------------------------------------------------ EdgeMesh
@dataclass(slots=True)
class Scrape:
    """Every process's metrics and CPU seconds at one moment of the EdgeMesh run."""

    at: float
    """Seconds since t0."""
    samples: dict[str, Samples]
    """Child name (``planner``, ``ps``, ``compressor``, ``w0``, ...) -> its metrics."""
    cpu_s: dict[str, float]
    """Process name (the children, ``broker``) -> user + system CPU seconds so far."""

    def ps_version(self) -> int:
        return int(sum_samples(self.samples.get("ps", {}), "edgemesh_ps_model_version"))


@dataclass(slots=True)
class EdgeMeshRun(Timeline):
    """What the EdgeMesh run observed: the timeline, when acks first named each version, the parameter
    server's evaluations with their loss, and the scrapes at the warm-up and at the end."""

    versions: dict[int, float] = field(default_factory=dict)
    """Model version -> when an ack first named it (seconds since t0)."""
    losses: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Model version -> (held-out loss, accuracy), from the parameter server's evaluation events."""
    scrapes: list[Scrape] = field(default_factory=list)

    @property
    def version(self) -> int:
        return max(self.versions, default=0)

    def final_version(self, steps: int) -> int | None:
        """The parameter server's first evaluated version at or after ``steps``."""
        return min((v for v in self.losses if v >= steps), default=None)


async def _watch(cfg: Config, run: EdgeMeshRun, devices: set[str]) -> None:
    """t0 once the plan names every device; acks (the version clock) and the parameter server's evaluations."""
    topics = Topics(cfg.job)
    acks = Topics(cfg.job, 0) if cfg.ps.shards > 1 else topics  # shard 0's acks: every shard steps each round

    async def on_plan(plan: Plan, _: TopicMatch) -> None:
        run.plan = plan
        if run.t0 is None and {d.device for d in plan.devices} >= devices:
            run.t0 = time.monotonic()

    async def on_ack(ack: UpdateAck, _: TopicMatch) -> None:
        if run.t0 is not None and ack.status == "accepted":
            run.versions.setdefault(ack.version, time.monotonic() - run.t0)

    async def on_event(event: Event, _: TopicMatch) -> None:
        if event.kind != "evaluation" or event.source != "ps" or run.t0 is None:
            return
        version, accuracy = int(event.data.get("version") or 0), float(event.data.get("accuracy") or 0.0)
        run.evaluations.append((time.monotonic() - run.t0, version, accuracy))
        run.losses[version] = (float(event.data.get("loss") or 0.0), accuracy)

    await observe(cfg, Route(topics.plan_filter(), Plan, on_plan), Route(acks.ack_filter("+"), UpdateAck, on_ack),
                  Route(topics.events_filter(), Event, on_event))


async def _scrape(cluster: LocalCluster, t0: float, broker_pid: int | None) -> Scrape:
    await asyncio.to_thread(cluster.scrape_all)
    cpu = {c.name: cpu_seconds(c.proc.pid) for c in cluster.children}
    cpu["broker"] = cpu_seconds(broker_pid)
    return Scrape(at=time.monotonic() - t0, samples={c.name: dict(c.samples) for c in cluster.children}, cpu_s=cpu)


async def _drive(cluster: LocalCluster, run: EdgeMeshRun, *, steps: int, warmup: int, broker_pid: int | None,
                 progress: Callable[[str], None]) -> None:
    """Start the services and the workers; scrape at the warm-up and once the parameter server evaluated a
    version at or after ``steps``; stop them all. A failure is left in ``run.failure``."""
    devices = [(f"w{i}", "") for i in range(WORKERS)]  # real workers, not emulated boards

    async def scrape(_: float) -> None:
        assert run.t0 is not None
        if not run.scrapes and run.version >= warmup:
            run.scrapes.append(await _scrape(cluster, run.t0, broker_pid))
        if len(run.scrapes) == 1 and run.final_version(steps) is not None:
            run.scrapes.append(await _scrape(cluster, run.t0, broker_pid))

    run.failure = await drive(
        cluster, devices, _watch(cluster.cfg, run, {d for d, _ in devices}), started=lambda: run.t0,
        done=lambda _: len(run.scrapes) == 2, status=lambda s: f"edgemesh: version {run.version} of {steps}, {s:.0f}s",
        progress=progress, start_timeout_s=START_TIMEOUT_S, run_timeout_s=steps * SECONDS_PER_STEP_LIMIT, tick=scrape)


def edgemesh_config(overrides: dict[str, str], *, job: str, broker_url: str, seed: int, steps: int,
                    comm: str = "fp32") -> Config:
    """The run's configuration: EdgeMesh's defaults, the job (model, data, ``sync``, uniform batches of
    ``BATCH``, ``LR``), the transport of ``comm`` (``EXACT`` or ``HALF``), a held-out evaluation at version
    ``steps`` only (``ps.eval_every``: none while the steps are timed, as DDP evaluates its kept models after it
    trained), then ``--set``."""
    return load_config(env={}, overrides={
        "job": job, "broker.url": broker_url, "log_level": "INFO", "training.model_spec": MODEL,
        "training.dataset": DATASET, "training.sync_policy": POLICY, "training.batch_size": str(BATCH),
        "training.lr": str(LR), "planner.batching": "uniform", "training.seed": str(seed),  # eval_every counts
        "ps.eval_every": str(steps + 1), **COMMS[comm], **overrides})  # from version -1: the first is ``steps``


SETTINGS_RECORDED = (
    "training.model_spec", "training.dataset", "training.partition", "training.seed", "training.batch_size",
    "training.sync_policy", "training.lr", "training.momentum", "training.weight_decay", "planner.batching",
    "planner.parallelism", "ps.broadcast", "ps.delta_codec", "ps.delta_density", "ps.snapshot_every",
    "ps.snapshot_dtype", "ps.fsync", "ps.eval_every", "ps.eval_interval_s", "ps.eval_budget", "ps.eval_threads",
    "ps.checkpoint_every", "ps.aggregation", "compressor.mode", "compressor.default_codec", "compressor.adaptive_codec",
    "worker.threads", "worker.codec_wait_s", "broker.chunk_bytes", "broker.chunk_window")
"""The settings the report records (dotted keys of the run's configuration)."""


def settings_of(cfg: Config) -> dict[str, Any]:
    out = {}
    for key in SETTINGS_RECORDED:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        out[key] = value
    return out


def _delta(first: Scrape, last: Scrape, names: Iterable[str], metric: str, **labels: str) -> float:
    """How much ``metric`` (summed over the children ``names`` and the labels not given) grew between the scrapes."""
    want = set(labels.items())

    def total(scrape: Scrape) -> float:
        return sum(v for n in names for (m, lab), v in scrape.samples.get(n, {}).items()
                   if m == metric and want <= set(lab))

    return total(last) - total(first)


def breakdown(run: EdgeMeshRun, workers: list[str]) -> dict[str, Any]:
    """Per model version between the two scrapes: the window's seconds, the workers' compute and publish-to-ack
    seconds per step (mean over both), the rest, the parameter server's step, CPU seconds per process, bytes."""
    if len(run.scrapes) < 2:
        return {}
    first, last = run.scrapes[0], run.scrapes[-1]
    versions = last.ps_version() - first.ps_version()
    steps = _delta(first, last, workers, "edgemesh_worker_step_seconds_count")
    acks = _delta(first, last, workers, "edgemesh_worker_ack_seconds_count")
    if versions <= 0 or steps <= 0 or acks <= 0:
        return {}
    per_version = (last.at - first.at) / versions
    compute = _delta(first, last, workers, "edgemesh_worker_step_seconds_sum") / steps
    ack = _delta(first, last, workers, "edgemesh_worker_ack_seconds_sum") / acks
    grad_bytes = _delta(first, last, workers, "edgemesh_worker_gradient_bytes_total")
    codecs = sorted({dict(lab).get("codec", "") for n in workers for (m, lab), v in last.samples.get(n, {}).items()
                     if m == "edgemesh_worker_gradient_bytes_total" and v > 0})
    evaluations = [v for v in run.losses if first.ps_version() < v <= last.ps_version()]
    r = FIGURES_DIGITS
    return {
        "versions": versions, "seconds": round(last.at - first.at, 3),
        "from_version": first.ps_version(), "to_version": last.ps_version(),
        "seconds_per_version": round(per_version, r),
        "worker_step_seconds": round(compute, r), "worker_ack_seconds": round(ack, r),
        "other_seconds": round(per_version - compute - ack, r),
        "ps_step_seconds": round(_delta(first, last, ["ps"], "edgemesh_ps_step_seconds_sum") / versions, r),
        "ps_evaluations": len(evaluations),
        "cpu_s_per_version": {name: round((last.cpu_s.get(name, 0.0) - cpu) / versions, r)
                              for name, cpu in first.cpu_s.items()},
        "cpu_s_per_version_total": round(sum(last.cpu_s.get(n, 0.0) - c for n, c in first.cpu_s.items()) / versions,
                                         r),
        "gradient_codecs": codecs,
        "gradient_bytes_per_update": round(grad_bytes / steps),
        "ps_published_bytes_per_version": round(_delta(first, last, ["ps"], "edgemesh_ps_published_bytes_total")
                                                / versions),
    }


def run_edgemesh(cfg: Config, workdir: Path, broker_pid: int | None, *, steps: int, warmup: int,
                 progress: Callable[[str], None]) -> tuple[dict[str, Any], EdgeMeshRun]:
    cluster = LocalCluster(cfg, workdir)
    run = EdgeMeshRun()
    asyncio.run(_drive(cluster, run, steps=steps, warmup=warmup, broker_pid=broker_pid, progress=progress))
    workers = [c.name for c in cluster.children if c.role == "worker"]
    mean, median, timed = mean_per_version(run.versions, warmup, steps)
    final = run.final_version(steps)
    batches = {d.device: d.batch_size for d in run.plan.devices} if run.plan else {}
    # the curve ends at the final version, as DDP's does: a loaded host may step on, and evaluate again, before the
    # services stop
    curve = [(v, kept) for v, kept in sorted(run.losses.items()) if final is None or v <= final]
    if run.failure is None and set(batches.values()) != {cfg.training.batch_size}:
        run.failure = f"the plan's batches are {batches}, not {cfg.training.batch_size} for every worker"
    entry: dict[str, Any] = {
        "seconds_per_version": mean, "median_seconds_per_version": median, "versions_timed": timed,
        "final_version": final,
        "final_loss": round(run.losses[final][0], FIGURES_DIGITS) if final is not None else None,
        "final_accuracy": round(run.losses[final][1], FIGURES_DIGITS) if final is not None else None,
        "plan": {"version": run.plan.version, "batching": run.plan.batching, "batches": batches,
                 "shards": {d.device: d.shard_index for d in run.plan.devices}} if run.plan else None,
        "breakdown": breakdown(run, workers),
        "updates_discarded": int(cluster.total("edgemesh_ps_updates_total", "ps", status="discarded")),
        "curve": [[v, round(loss, FIGURES_DIGITS), round(acc, FIGURES_DIGITS)] for v, (loss, acc) in curve],
        "failure": run.failure,
    }
    return entry, run


# ------------------------------------------------------------------ the benchmark
def _edgemesh_once(cfg: Config, workdir: Path, *, steps: int, warmup: int,
                   progress: Callable[[str], None]) -> tuple[dict[str, Any], EdgeMeshRun, str]:
    """One EdgeMesh training on a broker of its own (a job of its own, in a directory of its own); the broker's
    kind."""
    broker = BrokerProcess.default()
    broker.start()
    try:
        cfg = dataclasses.replace(cfg, job=f"ddp-{uuid.uuid4().hex[:6]}",
                                  broker=dataclasses.replace(cfg.broker, url=broker.url))
        progress(f"edgemesh: planner, parameter server, compressor and {WORKERS} workers on {broker.kind}, {POLICY}")
        workdir.mkdir(parents=True, exist_ok=True)
        entry, run = run_edgemesh(cfg, workdir, broker.pid, steps=steps, warmup=warmup, progress=progress)
    finally:
        broker.stop()
    failed = f"; FAILED: {entry['failure']}" if entry["failure"] else ""
    progress(f"edgemesh: {entry['seconds_per_version']} s per version, held-out loss {entry['final_loss']} at "
             f"version {entry['final_version']}{failed}")
    return entry, run, broker.kind


def run_bench(report: Path, *, steps: int, warmup: int, seed: int, overrides: dict[str, str],
              progress: Callable[[str], None], keep_logs: bool = False, rounds: int = 1,
              comm: str = "fp32") -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-ddp-"))
    cfg = edgemesh_config(overrides, job=f"ddp-{uuid.uuid4().hex[:6]}", broker_url="mqtt://127.0.0.1:1883",
                          seed=seed, steps=steps, comm=comm)
    t = cfg.training
    initial = models.build_model(t.model_spec, seed=t.seed)
    _, test = load_dataset(t.dataset, t.dataset_path or None, seed=t.seed)
    initial_loss, initial_accuracy = models.evaluate(initial, test)
    progress(f"{t.model_spec} on {t.dataset}, {WORKERS} workers x batch {t.batch_size}, lr {t.lr}, momentum "
             f"{t.momentum}: {steps} steps, timed after {warmup}; held-out loss at the start {initial_loss:.4f}")
    edgemesh, run, broker_kind = _edgemesh_once(cfg, workdir / "edgemesh-0", steps=steps, warmup=warmup,
                                                progress=progress)
    final = edgemesh["final_version"] or steps
    every = cfg.ps.eval_every or steps
    evaluated = [v for v in run.losses if v <= final] or list(range(every, steps + 1, every))
    job = DdpJob.of(cfg, port=0, steps=max(steps, final), warmup=warmup, timed_until=steps,
                    evaluate_at=[*evaluated, final], out_dir=workdir / "ddp-0", comm=comm)
    ddp = ddp_once(job, workdir / "ddp-0", progress)

    def again(i: int, ddp_first: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        progress(f"round {i + 1} of {rounds}: {'DDP' if ddp_first else 'EdgeMesh'} first, seed {t.seed + i}")
        mine_cfg = dataclasses.replace(cfg, training=dataclasses.replace(t, seed=t.seed + i))
        theirs = dataclasses.replace(job, seed=t.seed + i)
        other = ddp_once(theirs, workdir / f"ddp-{i}", progress) if ddp_first else None
        mine, _, _ = _edgemesh_once(mine_cfg, workdir / f"edgemesh-{i}", steps=steps, warmup=warmup,
                                    progress=progress)
        return mine, other if other is not None else ddp_once(theirs, workdir / f"ddp-{i}", progress)

    timed = alternate((edgemesh, ddp), rounds - 1 if not (edgemesh["failure"] or ddp["failure"]) else 0, again)
    per_version = mean(r["edgemesh_seconds_per_version"] for r in timed)
    per_step = mean(r["ddp_seconds_per_step"] for r in timed)
    alike = [r for r in timed if r["final_version"] == final]  # rounds whose final evaluations share the version
    losses = mean(r["edgemesh_final_loss"] for r in alike), mean(r["ddp_final_loss"] for r in alike)
    for i, r in enumerate(timed):
        r["seed"] = t.seed + i
    parts = edgemesh["breakdown"]
    failure = next((r["failure"] for r in timed if r["failure"]), None)
    result: dict[str, Any] = {
        "model": t.model_spec, "dataset": t.dataset, "workers": WORKERS, "batch_per_worker": t.batch_size,
        "steps": steps, "warmup_steps": warmup, "final_version": final, "lr": t.lr, "momentum": t.momentum,
        "weight_decay": t.weight_decay, "torch_threads": cfg.worker.threads, "comm": comm,
        "edgemesh_seconds_per_version": per_version, "ddp_seconds_per_step": per_step,
        "step_time_ratio": ratio(per_version, per_step), "rounds": timed,
        "initial_loss": round(initial_loss, FIGURES_DIGITS),
        "initial_accuracy": round(initial_accuracy, FIGURES_DIGITS),
        "edgemesh_final_loss": edgemesh["final_loss"], "ddp_final_loss": ddp.get("final_loss"),
        "final_loss_ratio": ratio(edgemesh["final_loss"], ddp.get("final_loss")),
        "edgemesh_final_loss_mean": losses[0], "ddp_final_loss_mean": losses[1],
        "final_loss_ratio_of_means": ratio(*losses), "rounds_with_losses": len(alike),
        "edgemesh_final_accuracy": edgemesh["final_accuracy"], "ddp_final_accuracy": ddp.get("final_accuracy"),
        "edgemesh_worker_step_seconds": parts.get("worker_step_seconds"),
        "edgemesh_worker_ack_seconds": parts.get("worker_ack_seconds"),
        "edgemesh_other_seconds": parts.get("other_seconds"),
        "edgemesh": edgemesh, "ddp": ddp,
        "settings": {**settings_of(cfg), "broker": broker_kind, "overrides": overrides, "seed": seed,
                     "host_cores": os.cpu_count()},
        "failure": failure,
    }
    finish(report, result, plot, progress, workdir, keep_logs=keep_logs or failure is not None)
    return result


def plot(result: dict[str, Any], png: Path) -> bool:
    plt = pyplot()
    if plt is None or not result["step_time_ratio"]:
        return False
    fig, (speed, final, curves) = plt.subplots(1, 3, figsize=(15, 4.5))
    parts = [("worker compute", result["edgemesh_worker_step_seconds"]),
             ("publish to ack", result["edgemesh_worker_ack_seconds"]),
             ("rest (encode, model, loop)", result["edgemesh_other_seconds"])]
    if all(value is not None for _, value in parts):
        bottom = 0.0
        for label, value in parts:
            speed.bar(0, value, bottom=bottom, label=label)
            bottom += value
        speed.scatter([0], [result["edgemesh_seconds_per_version"]], color="black", zorder=3, label="measured")
    else:
        speed.bar(0, result["edgemesh_seconds_per_version"], label="EdgeMesh")
    speed.bar(1, result["ddp_seconds_per_step"], color="#55a868", label="DDP step")
    speed.set_xticks([0, 1], [f"EdgeMesh {POLICY}\n(per version)", "torch DDP\n(per step)"])
    speed.set_ylabel("seconds")
    speed.set_title(f"{result['workers']} workers x batch {result['batch_per_worker']}: ratio "
                    f"{result['step_time_ratio']}")
    speed.legend(fontsize=8, loc="upper right")
    bars = final.bar([0, 1], [result["edgemesh_final_loss"] or 0, result["ddp_final_loss"] or 0],
                     color=["#4878a8", "#55a868"])
    final.bar_label(bars, fmt="%.4f")
    final.axhline(result["initial_loss"], color="#c44e52", linestyle="--", label="at the start")
    final.set_xticks([0, 1], ["EdgeMesh", "torch DDP"])
    final.set_ylabel("held-out loss (test split)")
    final.set_title(f"final model, version {result['final_version']}: ratio {result['final_loss_ratio']}")
    final.legend(fontsize=8, loc="lower right")
    for name, label in (("edgemesh", f"EdgeMesh {POLICY}"), ("ddp", "torch DDP")):
        curve = result[name].get("curve") or []
        curves.plot([0] + [c[0] for c in curve], [result["initial_loss"]] + [c[1] for c in curve], label=label)
    curves.set_xlabel("model version (step)")
    curves.set_ylabel("held-out loss")
    curves.set_title(f"{result['model']} on {result['dataset']}")
    curves.legend(fontsize=8)
    for ax in (speed, final, curves):
        ax.grid(alpha=0.3, axis="y")
    return save(fig, png)


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench ddp``."""
    parser.add_argument("--report", default="bench/reports/ddp.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"model versions (DDP steps) to train and time up to (default {DEFAULT_STEPS})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"steps before timing starts (default {DEFAULT_WARMUP})")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_STEPS} steps, timed after {QUICK_WARMUP}, one round (what the tests run)")
    parser.add_argument("--comm", choices=sorted(COMMS), default="fp32",
                        help="what both sides send: fp32 (exact, the default), or fp16 (EdgeMesh's fp16 codec, "
                             "DDP's fp16_compress_hook)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"trainings of each side, alternating which goes first; the seconds are their means "
                             f"(default {DEFAULT_ROUNDS}, 1 with --quick)")
    cluster_flags(parser, seed="seed of the model, the data set, its split and the batches (both sides)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    steps = args.steps if args.steps is not None else QUICK_STEPS if args.quick else DEFAULT_STEPS
    warmup = args.warmup if args.warmup is not None else QUICK_WARMUP if args.quick else DEFAULT_WARMUP
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else DEFAULT_ROUNDS
    if rounds < 1:
        print(f"edgemesh bench ddp: --rounds must be >= 1, got {rounds}", file=sys.stderr)
        return 2
    if warmup < 1 or steps < warmup + 2:
        print(f"edgemesh bench ddp: need --warmup >= 1 and --steps >= --warmup + 2 (two timed steps at least); got "
              f"--steps {steps}, --warmup {warmup}", file=sys.stderr)
        return 2
    try:
        overrides = cli.overrides(args)
        edgemesh_config(overrides, job="ddp", broker_url="mqtt://127.0.0.1:1883", seed=args.seed, steps=steps,
                        comm=args.comm)
        result = run_bench(Path(args.report), steps=steps, warmup=warmup, seed=args.seed, overrides=overrides,
                           keep_logs=args.keep_logs, rounds=rounds, comm=args.comm,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    except EdgeMeshError as exc:
        print(f"edgemesh bench ddp: {exc}", file=sys.stderr)
        return 2
    return 1 if result["failure"] else 0
