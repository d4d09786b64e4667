"""``edgemesh bench mesh --job FILE``: single board, data parallelism and Edge Mesh on a model a user brings.

The user's job file (default ``examples/mobilenetv2-32.toml``: batch norm, depthwise convolutions, inverted
residual blocks) is submitted, as ``edgemesh job submit`` does, to a fleet of hosts serving submitted jobs: the
planner, the parameter server (its held-out folder under ``ps.data_dir``), the compressor and one ``--emulate
PROFILE`` worker per device (default a Pi 3, a Pi 4 and a Jetson Nano), each holding its own image folder of drawn
glyphs with a class mix of its own (:mod:`edgemesh.bench.mesh_data`). Each run is a fresh broker and fresh
processes, so that a process's peak RSS is one mode's.

**The same SGD step in every mode.** Every iteration trains ``samples`` = devices x ``training.batch_size`` (the
job's), under ``sync``, with ``training.batch_size`` the job's in every mode: the parameter server counts a round
as ``samples / batch_size`` batches of the job's learning rate (``ps.round_scaling = linear``), whichever way the
samples were split. ``single``: the single board alone (``planner.parallelism = mesh``, ``round_samples``: one
cluster of one, the whole batch); ``data_parallel``: ``planner.parallelism = data``, uniform batches, each device
``batch_size``; ``edge_mesh``: ``planner.parallelism = mesh``, ``round_samples``, the grid's own layout.

**Time and memory** (emulated boards, ``dilation``): ``iterations`` model versions after ``WARMUP_VERSIONS``;
``avg_iteration_delay_s`` the mean time between versions (dilated), ``predicted_iteration_s`` the planner's cost
model, ``peak_rss_mb_by_device`` each worker process's peak RSS (``VmHWM``) under its board's limits (``limits``:
``cgroup-v1``, the kernel's memory limit and CPU quota, or ``stretched``), ``clusters`` the layout that trained.

**Accuracy at equal samples**: ``accuracy_iterations`` versions per mode, the held-out folder evaluated every
``EVAL_EVERY`` versions (the same versions in every mode); ``final_accuracy`` the mean of the last
``FINAL_EVALUATIONS``; ``collapsed`` a model that learned and ended at chance, ``dips_to_chance`` the evaluations
at chance on the way (:func:`accuracy_figures`). 600 versions by default (28,800 samples at three devices): at 150
every mode, the single board's included, still answered one class at some evaluations, at 600 each has settled
(docs/benchmarks.md). Under ``sync`` what a run trains does not depend on how fast it goes, so these runs use
plain workers at the host's speed (same folders, same processes, no board emulation): a model-parallel cluster of
this model on the boards' Wi-Fi exchanges megabytes of activations per layer (the cost model puts it at tens of
seconds per iteration). The grid lays out a cluster only where its cost model predicts one faster; for the
acceptance line the ``edge_mesh`` accuracy run forces one cluster of every device (``planner.min_batch`` =
``samples``: no more clusters than ``samples / min_batch``), and the report names the clusters that trained.

**A model no Pi 3 trains alone** (``--oom``): the job's data and settings with :data:`OOM_LAYERS` (a convolution,
then one of :data:`OOM_WIDTH` maps at 32x32: few parameters, wide activations). One Pi 3 trains it alone
under the Pi 3's memory limit; the kernel kills its worker, and the spawner publishes the device's ``left`` status
and a ``device_left`` event (reason ``out_of_memory``) with what the cgroup recorded. Then ``OOM_DEVICES`` Pi 3s
train it as one model-parallel cluster (each member holds its rows of the linear layer) until the held-out
accuracy reaches ``--oom-target`` or ``--oom-iterations`` versions. Where the host cannot enforce cgroup memory
limits, the part is skipped with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgemesh.bench import mesh_data
from edgemesh.bench.mesh import JOB_ACCURACY_ITERATIONS, MODES, WARMUP_VERSIONS, Run, _watch, limits_in_force, summarize
from edgemesh.bench.model_jobs import EXAMPLES
from edgemesh.bench.reporting import finish, pyplot, save
from edgemesh.bench.runs import device_names, drive, fleet_profiles
from edgemesh.common import costs
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config, load_config
from edgemesh.common.emulation import limits
from edgemesh.common.emulation.compute import measure_host_gflops
from edgemesh.common.errors import ConfigError, EdgeMeshError
from edgemesh.common.jobs import parse_job
from edgemesh.common.messages import DeviceStatus, Event
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import OUT_OF_MEMORY, LocalCluster
from edgemesh.operator.job import submission_of, submit

DEFAULT_JOB = EXAMPLES / "mobilenetv2-32.toml"
DEFAULT_FLEET = ("pi3", "pi4", "jetson-nano")
SINGLE_PROFILE = "pi4"
EVAL_EVERY = 5
FINAL_EVALUATIONS = 10
ACCURACY_GAP_PT = 2.0
"""The acceptance line: Edge Mesh within this many points of data parallelism at equal samples."""
COLLAPSE_MARGIN = 0.05
"""An accuracy at or below chance plus this is at chance."""
START_TIMEOUT_S = 240.0
"""Longest a run may take from its processes' start until the plan names every device."""
RUN_TIMEOUT_S = 1800.0
"""Longest a run may take once it started, at least (a run of many versions gets :data:`RUN_TIMEOUT_PER_VERSION_S`
for each)."""
RUN_TIMEOUT_PER_VERSION_S = 6.0
SUBMIT_WAIT_S = 120.0
DEPARTURE_WAIT_S = 10.0
"""How long the benchmark waits to see the ``device_left`` event it asked the spawner to publish."""
OOM_PROFILE = "pi3"
OOM_DEVICES = 3
OOM_WIDTH = 768
"""Wide enough that one Pi 3 is killed for memory with the worker's lean allocator (at 512 it peaked at 655 MiB and
was not always killed: its limit, 566 MiB, counts page cache the kernel can reclaim first)."""
OOM_LAYERS: list[Any] = [{"conv2d": 16, "kernel": 3, "padding": 1}, "relu",
                         {"conv2d": OOM_WIDTH, "kernel": 3, "padding": 1}, "relu", "globalavgpool", {"linear": 5}]
"""Wide activations, few parameters (116 k): the second convolution's 768 maps of 32x32 for every sample of the batch
(150 MiB as float32 at 48 samples, kept for the backward pass with the relu's, and their gradients) are what no Pi 3
holds alone. A member of a model-parallel cluster computes, keeps and differentiates only its own maps: the cluster
gathers them after the global average pooling (one value per map and sample), and the first convolution's 16 maps
of each sample. The last layer's width is the job's classes (set when the job is built)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """One run of the benchmark on a user's job."""

    job_file: Path
    fleet: tuple[str, ...]
    modes: tuple[str, ...]
    dilation: float
    iterations: int
    accuracy_iterations: int
    per_class: int
    held_out_per_class: int
    oom: bool
    oom_iterations: int
    oom_target: float
    oom_dilation: float
    force_cluster: bool = True
    quick: bool = False


# the mesh of Pi 3s stops at its target: at most 200 versions (it reached 0.6 at version 84 here, 872 s, after a run
# capped at 80 stopped at 0.507)
FULL = {"fleet": ",".join(DEFAULT_FLEET), "dilation": 8.0, "iterations": 10,
        "accuracy_iterations": JOB_ACCURACY_ITERATIONS,
        "per_class": 80, "held_out_per_class": 60, "oom_iterations": 200, "oom_target": 0.6}
QUICK = {"fleet": "pi4,jetson-nano", "dilation": 1.0, "iterations": 2, "accuracy_iterations": 10,
         "per_class": 12, "held_out_per_class": 8, "oom_iterations": 3, "oom_target": 0.0}
"""``--quick``: two boards that start fast under their CPU quota, two timed versions, ten of accuracy, tiny folders,
three versions of the mesh of Pi 3s."""


@dataclass(slots=True)
class Bench:
    """What every run of one benchmark shares."""

    settings: Settings
    workdir: Path
    data: Path
    host_gflops: float
    seed: int
    overrides: dict[str, str]
    progress: Callable[[str], None]


# --------------------------------------------------------------------------- one run


def host_config(bench: Bench, broker: BrokerProcess, job: str, *, dilation: float) -> Config:
    """The hosts' own configuration (they serve submitted jobs): the broker, the emulation's figures, the PS's
    data directory."""
    overrides = {"job": job, "broker.url": broker.url, "log_level": "INFO",
                 "ps.data_dir": str(bench.data / mesh_data.HELD_OUT),
                 "worker.emulation_host_gflops": str(bench.host_gflops), "worker.emulation_seed": str(bench.seed),
                 "worker.emulation_dilation": str(dilation), **bench.overrides}
    return load_config(env={}, overrides=overrides)


async def _submit(cfg: Config, text: str, outcome: dict[str, Any]) -> None:
    """Submit the job file ``text`` as ``edgemesh job submit`` does (its model built and measured in this process,
    which registers its cost figures here too); ``outcome["code"]`` its exit code."""
    spec = parse_job(text)
    submission = await asyncio.to_thread(submission_of, spec, search_path=[])
    with contextlib.redirect_stdout(io.StringIO()):  # its one line of success
        outcome["code"] = await submit(cfg, spec, submission, wait_s=SUBMIT_WAIT_S)


def run_job(bench: Bench, text: str, devices: list[tuple[str, str]], data_dirs: dict[str, str], *,
            versions: int, dilation: float, label: str, eval_every: int = 0, until: Callable[[Run], bool] | None = None,
            after: Callable[[LocalCluster], Awaitable[Any]] | None = None) -> tuple[Run, LocalCluster, Any]:
    """On a broker of its own, start a fleet serving submitted jobs (``devices``: an empty profile is a plain
    worker), submit ``text``, run until the PS reached ``versions`` (or ``until``), stop; what the bus showed, the
    stopped cluster (its children's peak RSS and endings) and what ``after(cluster)``, awaited once the fleet
    stopped and before the broker does, returned."""
    job = parse_job(text).name
    broker = BrokerProcess.default()
    broker.start()
    cfg = host_config(bench, broker, job, dilation=dilation)
    cluster = LocalCluster(cfg, _made(bench.workdir / job), serve_jobs=True)
    run, outcome = Run(), {"code": None}
    last_eval = versions - eval_every + 1 if eval_every else 0

    async def watch() -> None:
        await asyncio.gather(_watch(cfg, run, {n for n, _ in devices}), _submit(cfg, text, outcome))

    def done(_: float) -> bool:
        if until is not None and until(run):
            return True
        return run.version >= versions and (not last_eval or any(v >= last_eval for _, v, _ in run.evaluations))

    async def go() -> Any:
        flags = {name: ["--set", f"worker.data_dir={data_dirs[name]}"] for name, _ in devices}
        run.failure = await drive(cluster, devices, watch(), started=lambda: run.t0, done=done, flags=flags,
                                  status=lambda t: f"{label}: version {run.version} of {versions}, {t:.0f}s",
                                  progress=bench.progress, start_timeout_s=START_TIMEOUT_S,
                                  run_timeout_s=max(RUN_TIMEOUT_S, versions * RUN_TIMEOUT_PER_VERSION_S))
        return await after(cluster) if after is not None else None

    try:
        extra = asyncio.run(go())
    finally:
        broker.stop()
    if run.failure is None and outcome["code"] not in (0, None):
        run.failure = f"the job was not taken (edgemesh job submit exit code {outcome['code']})"
    return run, cluster, extra


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def mode_settings(mode: str, *, samples: int, batch_size: int, force_cluster: bool = False) -> tuple[dict[str, Any],
                                                                                                     dict[str, Any]]:
    """``[training]`` and ``[planner]`` of a mode (module docstring: the same SGD step in every mode)."""
    training = {"sync_policy": "sync", "batch_size": batch_size}
    if mode == "data_parallel":
        return training, {"parallelism": "data", "batching": "uniform"}
    planner: dict[str, Any] = {"parallelism": "mesh", "batching": "uniform", "round_samples": samples,
                               "max_batch": max(samples, 128)}
    if force_cluster:
        planner["min_batch"] = samples
    return training, planner


def rss_by_device(cluster: LocalCluster) -> dict[str, float]:
    """Each worker process's peak RSS (``VmHWM``), MiB, by device."""
    return {c.device: round(c.peak_rss_kb / 1024, 1) for c in cluster.children if c.role == "worker"}


def layout(run: Run) -> list[list[str]]:
    """The members of each cluster of the run's last plan."""
    return [list(c.members) for c in run.plan.clusters] if run.plan else []


def accuracy_figures(run: Run, versions: int, classes: int) -> dict[str, Any]:
    """The mean of the last evaluations up to ``versions``, the lowest of them, the best, whether the model
    collapsed, how often it dipped to chance on the way, and the curve.

    ``collapsed``: the run *ended* at chance after it had learned (its final accuracy, the mean of the last
    evaluations, at most chance plus :data:`COLLAPSE_MARGIN`, after a best well above it), as the mesh job that
    reported 0.197 for 6,500 versions had. ``dips_to_chance``: the evaluations at chance after the model had
    learned, however it ended (a batch-normalized model early in training, evaluated with running statistics that
    trail its weights, answers one class now and then and recovers at the next evaluation)."""
    trained = sorted((v, a) for _, v, a in run.evaluations if v <= versions)
    last = [a for _, a in trained[-FINAL_EVALUATIONS:]]
    floor = 1.0 / classes + COLLAPSE_MARGIN
    learned = floor + 2 * COLLAPSE_MARGIN
    best, dips = 0.0, 0
    for _, a in trained:
        dips += best > learned and a <= floor
        best = max(best, a)
    final = statistics.fmean(last) if last else None
    return {"final_accuracy": round(final, 4) if final is not None else None,
            "min_final_accuracy": round(min(last), 4) if last else None,
            "best_accuracy": round(best, 4) if trained else None,
            "collapsed": final is not None and best > learned and final <= floor,
            "dips_to_chance": dips,
            "accuracy_curve": [[round(t, 3), v, round(a, 4)] for t, v, a in run.evaluations]}


# --------------------------------------------------------------------------- the three modes


def single_board(fleet: list[tuple[str, str]]) -> tuple[str, str]:
    """The board that trains alone in ``single`` mode: the fleet's first ``SINGLE_PROFILE``, else its first."""
    return next(((name, p) for name, p in fleet if p == SINGLE_PROFILE), fleet[0])


def run_mode(bench: Bench, job: mesh_data.UserJob, mode: str, fleet: list[tuple[str, str]]) -> dict[str, Any]:
    """One mode: its time and memory run on the emulated boards, then its accuracy run."""
    s = bench.settings
    members = [single_board(fleet)] if mode == "single" else fleet
    samples = job.batch_size * len(fleet)
    dirs = {name: str(bench.data / (mesh_data.POOLED if mode == "single" else name)) for name, _ in members}
    key = uuid.uuid4().hex[:6]
    training, planner = mode_settings(mode, samples=samples, batch_size=job.batch_size)
    versions = WARMUP_VERSIONS + s.iterations + 1
    text = mesh_data.job_text(job, name=f"{job.name}-{mode.replace('_', '-')}-{key}", training=training,
                              planner=planner, versions=versions + 50, eval_every=versions + 50)
    bench.progress(f"{mode}: {', '.join(n for n, _ in members)}; {samples} samples per iteration, dilation "
                   f"{s.dilation:g}")
    run, cluster, _ = run_job(bench, text, members, dirs, versions=versions, dilation=s.dilation, label=mode)
    spec = parse_job(text).model_key
    entry = summarize(run, cluster, spec=spec, batch=samples)
    rss = rss_by_device(cluster)
    entry.update(peak_rss_mb_by_device=rss, peak_rss_mb_mean=round(statistics.fmean(rss.values()), 1) if rss else None,
                 layout=layout(run), job=parse_job(text).name)
    if s.accuracy_iterations:
        force = s.force_cluster and mode == "edge_mesh"
        training, planner = mode_settings(mode, samples=samples, batch_size=job.batch_size, force_cluster=force)
        every = min(EVAL_EVERY, s.accuracy_iterations)
        text = mesh_data.job_text(job, name=f"{job.name}-{mode.replace('_', '-')}-acc-{key}", training=training,
                                  planner=planner, versions=s.accuracy_iterations + 50, eval_every=every)
        plain = [(name, "") for name, _ in members]
        bench.progress(f"{mode}: accuracy, {s.accuracy_iterations} versions" + (
            f" (one cluster forced: planner.min_batch = {samples})" if force else ""))
        acc, _, _ = run_job(bench, text, plain, dirs, versions=s.accuracy_iterations, dilation=1.0,
                            label=f"{mode} accuracy", eval_every=every)
        entry.update(accuracy_figures(acc, s.accuracy_iterations, len(job.classes)))
        entry.update(accuracy_layout=layout(acc), accuracy_forced=f"planner.min_batch = {samples}" if force else None,
                     accuracy_samples_per_iteration=entry["samples_per_iteration"] if acc.plan is None else
                     sum({d.cluster: d.batch_size for d in acc.plan.devices}.values()),
                     accuracy_iteration_s_host=_median_gap(acc), accuracy_failure=acc.failure)
    bench.progress(f"{mode}: iteration {entry['avg_iteration_delay_s']}s (predicted {entry['predicted_iteration_s']}s)"
                   f", layout {entry['layout']}, peak RSS {rss} MiB, accuracy {entry.get('final_accuracy')} on "
                   f"{entry.get('accuracy_layout')}" + (f"; FAILED: {run.failure}" if run.failure else ""))
    return entry


def _median_gap(run: Run) -> float | None:
    """Median seconds between versions of an accuracy run (host speed, no board emulation)."""
    times = [run.versions[v] for v in sorted(run.versions)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return round(statistics.median(gaps), 4) if gaps else None


def compute_ceiling(fleet: list[dict[str, Any]], single: dict[str, Any]) -> float:
    """How many times the single board's training rate the whole fleet's is: no layout of the same FLOPs, data or
    model parallel, brings an iteration lower than this below the single board's (links and exchanges only add)."""
    return round(sum(d["train_gflops"] for d in fleet) / single["train_gflops"], 3)


def ratios(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The paper's three comparisons and the acceptance line, as measured."""
    def get(mode: str, key: str) -> float | None:
        value = modes.get(mode, {}).get(key)
        return float(value) if value else None

    mesh, dp, single = (get("edge_mesh", "avg_iteration_delay_s"), get("data_parallel", "avg_iteration_delay_s"),
                        get("single", "avg_iteration_delay_s"))
    mesh_rss, dp_rss = get("edge_mesh", "peak_rss_mb_mean"), get("data_parallel", "peak_rss_mb_mean")
    mesh_acc, dp_acc = get("edge_mesh", "final_accuracy"), get("data_parallel", "final_accuracy")
    gap = round(100 * (mesh_acc - dp_acc), 2) if mesh_acc is not None and dp_acc is not None else None
    return {
        "single_over_edge_mesh_delay": round(single / mesh, 3) if single and mesh else None,
        "data_parallel_over_edge_mesh_delay": round(dp / mesh, 3) if dp and mesh else None,
        "edge_mesh_rss_below_data_parallel": round(1 - mesh_rss / dp_rss, 3) if mesh_rss and dp_rss else None,
        "accuracy_edge_mesh_minus_data_parallel_pt": gap,
        "claims": {
            "edge_mesh_3.2x_below_single": bool(single and mesh and single / mesh >= 3.2),
            "edge_mesh_below_data_parallel": bool(dp and mesh and mesh < dp),
            "edge_mesh_rss_43pct_below_data_parallel": bool(mesh_rss and dp_rss and 1 - mesh_rss / dp_rss >= 0.43),
            "accuracy_within_2pt_no_collapse": gap is not None and abs(gap) <= ACCURACY_GAP_PT and not any(
                modes.get(m, {}).get("collapsed") for m in ("edge_mesh", "data_parallel")),
        },
    }


# --------------------------------------------------------------------------- the model no Pi 3 trains alone


def cgroup_memory_reason() -> str | None:
    """Why this host cannot hold a process to a memory limit with cgroup v1 (None: it can)."""
    group = limits.group_dir(limits.CGROUP_ROOT, "memory")
    if group is None:
        return f"no cgroup v1 memory controller at {limits.CGROUP_ROOT}/memory"
    if not group.parent.is_dir() or not os.access(group.parent, os.W_OK):
        return f"the cgroup v1 memory hierarchy at {group.parent} is not writable here"
    return None


async def departures(cluster: LocalCluster) -> list[dict[str, Any]]:
    """Have the spawner publish what left for memory (``say_departures``: the device's retained ``left`` status and
    a ``device_left`` event), and what the bus then carried of it."""
    topics = Topics(cluster.cfg.job)
    seen: list[dict[str, Any]] = []
    arrived = asyncio.Event()

    async def on_event(event: Event, _: TopicMatch) -> None:
        if event.kind == "device_left":
            seen.append({"event": "device_left", "device": event.data.get("device"), "reason": event.data.get("reason"),
                         "limit_bytes": event.data.get("limit_bytes"), "message": event.message})
            arrived.set()

    async def on_status(status: DeviceStatus, _: TopicMatch) -> None:
        if status.state == "left" and status.reason.startswith(OUT_OF_MEMORY):
            seen.append({"status": "left", "device": status.device, "reason": status.reason})

    bus = Bus(cluster.cfg.broker, client_id=f"edgemesh-bench-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("bench"))
    bus.route(topics.events_filter(), Event, on_event)
    bus.route(topics.status_filter(), DeviceStatus, on_status)
    async with bus:
        said = await cluster.say_departures(bus)
        if said:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DEPARTURE_WAIT_S):
                    await arrived.wait()
    return seen


def run_oom(bench: Bench, job: mesh_data.UserJob) -> dict[str, Any]:
    """One Pi 3 trains the big model alone (the kernel kills it), then a mesh of Pi 3s trains it."""
    s = bench.settings
    reason = cgroup_memory_reason()
    big = job.with_model(f"{job.name}-wide", [*OOM_LAYERS[:-1], {"linear": len(job.classes)}])
    out: dict[str, Any] = {"model": big.tree["model"]["layers"], "profile": OOM_PROFILE,
                           "target_accuracy": s.oom_target}
    if reason is not None:
        out["skipped"] = f"the host cannot enforce memory limits: {reason}"
        bench.progress(f"oom: skipped ({out['skipped']})")
        return out
    devices = device_names([OOM_PROFILE] * OOM_DEVICES)
    samples = big.batch_size * OOM_DEVICES
    key = uuid.uuid4().hex[:6]
    # one Pi 3 alone, the same samples per iteration (one cluster of one)
    training, planner = mode_settings("single", samples=samples, batch_size=big.batch_size)
    text = mesh_data.job_text(big, name=f"{big.name}-single-{key}", training=training, planner=planner,
                              versions=s.oom_iterations + 50, eval_every=EVAL_EVERY)
    spec = parse_job(text)
    bench.progress(f"oom: {devices[0][0]} alone trains a {OOM_WIDTH}-wide model")
    run, cluster, said = run_job(bench, text, devices[:1], {devices[0][0]: str(bench.data / mesh_data.POOLED)},
                                 versions=s.oom_iterations, dilation=s.oom_dilation, label="oom single",
                                 after=departures)
    worker = next(c for c in cluster.children if c.role == "worker")
    ending = worker.ending
    out["params"] = costs.cost(spec.model_key).params  # registered by the submission: this process built it
    out["planner_estimate_mib"] = round(costs.training_memory_bytes(spec.model_key, samples) / 2**20, 1)
    out["single"] = {
        "device": devices[0][0], "killed_for_memory": worker.out_of_memory, "returncode": worker.proc.returncode,
        "limit_mib": round(ending.limit_bytes / 2**20, 1) if ending else None,
        "cgroup_oom_kills": ending.oom_kills if ending else None, "cgroup_failcnt": ending.failcnt if ending else None,
        "peak_rss_mb": round(worker.peak_rss_kb / 1024, 1), "versions": run.version, "layout": layout(run),
        "published": said, "failure": run.failure}
    bench.progress(f"oom: {devices[0][0]} alone: killed for memory {worker.out_of_memory} (limit "
                   f"{out['single']['limit_mib']} MiB, peak RSS {out['single']['peak_rss_mb']} MiB); {said}")
    # a mesh of Pi 3s, one cluster of every member
    training, planner = mode_settings("edge_mesh", samples=samples, batch_size=big.batch_size, force_cluster=True)
    text = mesh_data.job_text(big, name=f"{big.name}-mesh-{key}", training=training, planner=planner,
                              versions=s.oom_iterations + 50, eval_every=EVAL_EVERY)
    target = s.oom_target
    bench.progress(f"oom: a mesh of {OOM_DEVICES} Pi 3s, until accuracy {target} or {s.oom_iterations} versions")
    mesh, cluster, _ = run_job(bench, text, devices, {n: str(bench.data / n) for n, _ in devices},
                               versions=s.oom_iterations, dilation=s.oom_dilation, label="oom mesh",
                               eval_every=EVAL_EVERY,
                               until=lambda r: bool(target) and any(a >= target for _, _, a in r.evaluations))
    reached = next(((v, t) for t, v, a in sorted(mesh.evaluations) if target and a >= target), None)
    rss = rss_by_device(cluster)
    out["mesh"] = {
        "devices": [n for n, _ in devices], "layout": layout(mesh), "forced": f"planner.min_batch = {samples}",
        "versions": mesh.version, "samples_per_iteration": samples,
        "accuracy": mesh.evaluations[-1][2] if mesh.evaluations else None,
        "reached_target_at_version": reached[0] if reached else None,
        "reached_target_after_s": round(reached[1], 1) if reached else None,
        "peak_rss_mb_by_device": rss, "limits": limits_in_force(cluster.samples_of("worker")),
        "killed_for_memory": [c.device for c in cluster.children if c.out_of_memory],
        "accuracy_curve": [[round(t, 3), v, round(a, 4)] for t, v, a in mesh.evaluations], "failure": mesh.failure}
    bench.progress(f"oom: mesh {out['mesh']['layout']}: accuracy {out['mesh']['accuracy']} at version {mesh.version}, "
                   f"peak RSS {rss} MiB" + (f"; FAILED: {mesh.failure}" if mesh.failure else ""))
    return out


# --------------------------------------------------------------------------- the benchmark


def run_bench(report: Path, settings: Settings, *, seed: int, overrides: dict[str, str], command: str,
              progress: Callable[[str], None], keep_logs: bool = False) -> dict[str, Any]:
    s = settings
    profiles = fleet_profiles(list(s.fleet), SINGLE_PROFILE, overrides)
    bad = [m for m in s.modes if m not in MODES]
    if bad:
        raise ConfigError(f"unknown mode(s) {', '.join(bad)}; known: {', '.join(MODES)}")
    if s.iterations < 2 or s.accuracy_iterations < 0 or s.dilation < 1 or s.per_class < 2:
        raise ConfigError("need --iterations >= 2, --accuracy-iterations >= 0, --dilation >= 1, --per-class >= 2")
    job = mesh_data.UserJob.read(s.job_file)
    fleet = device_names(list(s.fleet))
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-mesh-job-"))
    bench = Bench(s, workdir, workdir / "data", measure_host_gflops(1), seed, overrides, progress)
    progress(f"job {s.job_file} on {', '.join(s.fleet)}; host {bench.host_gflops:.1f} GFLOP/s per thread; data in "
             f"{bench.data}")
    oom_devices = [n for n, _ in device_names([OOM_PROFILE] * OOM_DEVICES)] if s.oom else []
    data = mesh_data.draw_folders(bench.data, job, [n for n, _ in fleet], per_class=s.per_class,
                                  held_out_per_class=s.held_out_per_class,
                                  others=[n for n in oom_devices if n not in dict(fleet)])
    result: dict[str, Any] = {
        "command": command, "job_file": str(s.job_file), "job": job.name,
        "fleet": [{"device": name, **profiles[p].summary()} for name, p in fleet],
        "settings": {"samples_per_iteration": job.batch_size * len(fleet), "batch_size": job.batch_size,
                     "lr": job.lr, "sync_policy": "sync", "round_scaling": "linear", "time_dilation": s.dilation,
                     "iterations": s.iterations, "warmup_versions": WARMUP_VERSIONS,
                     "accuracy_iterations": s.accuracy_iterations, "eval_every": EVAL_EVERY,
                     "final_evaluations": FINAL_EVALUATIONS, "accuracy_workers": "plain (no board emulation)",
                     "accuracy_edge_mesh_forced": s.force_cluster, "quick": s.quick, "overrides": overrides},
        "data": data, "host_gflops": round(bench.host_gflops, 2), "modes": {}, "failure": None,
    }
    failed = False
    try:
        for mode in s.modes:
            entry = run_mode(bench, job, mode, fleet)
            result["modes"][mode] = entry
            failed = failed or bool(entry.get("failure") or entry.get("accuracy_failure"))
        result["limits"] = sorted({e["limits"] for e in result["modes"].values() if e.get("limits")})
        result["ratios"] = ratios(result["modes"])
        result["ratios"]["compute_ceiling_single_over_fleet"] = compute_ceiling(
            result["fleet"], profiles[single_board(fleet)[1]].summary())
        if s.oom:
            result["oom"] = run_oom(bench, job)
            failed = failed or bool(result["oom"].get("mesh", {}).get("failure"))
    except (EdgeMeshError, OSError) as exc:
        result["failure"] = f"{type(exc).__name__}: {exc}"
        failed = True
        progress(f"FAILED: {result['failure']}")
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    finish(report, result, plot, progress, workdir, keep_logs=failed or keep_logs)
    return result


def plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    modes = result["modes"]
    names = list(modes)
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    left.bar(names, [modes[m].get("avg_iteration_delay_s") or 0 for m in names], color="#4878a8", label="measured")
    left.scatter(names, [modes[m].get("predicted_iteration_s") or 0 for m in names], color="#c44e52", zorder=3,
                 label="predicted")
    left.set_ylabel(f"seconds per iteration (dilated x{result['settings']['time_dilation']:g})")
    left.set_title(f"{result['job']}, {result['settings']['samples_per_iteration']} samples per iteration")
    left.legend()
    for m in names:
        rss = modes[m].get("peak_rss_mb_by_device") or {}
        middle.scatter([m] * len(rss), list(rss.values()), color="#55a868", zorder=3)
        middle.bar([m], [modes[m].get("peak_rss_mb_mean") or 0], color="#55a868", alpha=0.4)
    oom = result.get("oom", {})
    for rss in (oom.get("mesh", {}).get("peak_rss_mb_by_device") or {}).values():
        middle.scatter(["oom mesh"], [rss], color="#8172b2", zorder=3)
    if oom.get("single"):
        middle.scatter(["oom single"], [oom["single"]["peak_rss_mb"]], color="#c44e52", marker="x", zorder=3,
                       label=f"killed at {oom['single']['limit_mib']} MiB")
        middle.legend()
    middle.set_ylabel("peak RSS per worker, MiB (bar: mean)")
    middle.set_title(f"memory under {', '.join(result.get('limits', [])) or 'no'} limits")
    for m in names:
        curve = modes[m].get("accuracy_curve") or []
        right.plot([v for _, v, _ in curve], [a for _, _, a in curve], label=m)
    if oom.get("mesh", {}).get("accuracy_curve"):
        curve = oom["mesh"]["accuracy_curve"]
        right.plot([v for _, v, _ in curve], [a for _, _, a in curve], label="oom model, mesh of Pi 3s", ls="--")
    right.set_xlabel("model version (same samples per version in every mode)")
    right.set_ylabel("held-out accuracy")
    right.legend()
    for ax in (left, middle, right):
        ax.grid(alpha=0.3, axis="y")
    return save(fig, path)


def settings_of(job: str, *, fleet: str | None, modes: list[str], dilation: float | None, iterations: int | None,
                accuracy_iterations: int | None, per_class: int | None, oom: bool, oom_iterations: int | None,
                oom_target: float | None, quick: bool) -> Settings:
    """The run's settings: the flags given, else ``--quick``'s or a full run's defaults."""
    d = QUICK if quick else FULL

    def given(value: Any, name: str) -> Any:
        return d[name] if value is None else value

    chosen_fleet = tuple(p.strip() for p in str(given(fleet, "fleet")).split(",") if p.strip())
    return Settings(job_file=Path(job), fleet=chosen_fleet, modes=tuple(modes),
                    dilation=float(given(dilation, "dilation")),
                    iterations=int(given(iterations, "iterations")),
                    accuracy_iterations=int(given(accuracy_iterations, "accuracy_iterations")),
                    per_class=int(given(per_class, "per_class")),
                    held_out_per_class=int(given(None, "held_out_per_class")),
                    oom=oom, oom_iterations=int(given(oom_iterations, "oom_iterations")),
                    oom_target=float(given(oom_target, "oom_target")), oom_dilation=1.0, quick=quick)
