"""``edgemesh bench mesh``: single device, data parallelism and Edge Mesh on one emulated fleet.

Three modes, each a whole local cluster on one broker (planner, parameter server, compressor and
one ``--emulate PROFILE`` worker process per device), all under the ``sync`` policy, every
iteration training the same number of samples (``batch``), so that an iteration is the same SGD
step in every mode and iteration times compare directly:

* ``single``: one ``pi4`` trains the whole batch alone;
* ``data_parallel``: every device of the fleet is its own cluster (``planner.parallelism = data``)
  and trains an equal part of the batch;
* ``edge_mesh``: the planner's hybrid training grid (``planner.parallelism = mesh``): clusters of
  devices that divide the model's filters among them, data parallel across clusters, the batch
  split among the clusters so that they finish together.

Two runs per mode:

* **time and memory**: the CIFAR-shaped CNN (``cifar-cnn``, 620k parameters) on synthetic 32x32x3
  images, until ``iterations`` model versions after ``WARMUP_VERSIONS``. An *iteration* is one
  model version: every cluster trained one batch and the PS applied their gradients.
  ``avg_iteration_delay_s`` is the mean time between versions, ``measured_iteration_s`` the
  median, ``predicted_iteration_s`` the planner's cost model (``planner.mesh``) for the layout;
* **accuracy**: the digits CNN on digits, ``accuracy_iterations`` versions at ``ACCURACY_LR``;
  ``final_accuracy`` is the mean of the PS's last ``FINAL_EVALUATIONS`` evaluations (every
  ``EVAL_EVERY`` versions in every mode: the same versions, the same samples trained). Runs of the
  same training differ by about a point at 120 versions and lr 0.1 (momentum 0.9 spikes now and
  then); at 300 versions and lr 0.05, averaged over the last 50, by a few tenths (plain torch,
  five seeds).

Also per mode: ``load_imbalance``, the slowest over the fastest member's busy time (computing
its units and publishing its slices, per layer, summed over layers, worst cluster; members with
no unit of a layer left out; for data parallelism the slowest over the fastest
device's step); ``peak_rss_mb_per_device``, the largest peak RSS of a worker process; and
``param_optimizer_activation_bytes_per_device``, measured in this process on real tensors, the
mean over devices (the Edge Mesh paper reports average memory; ``..._max_device`` is the largest): the rows
of the model a worker keeps in its view and trains, their gradients and error-feedback residual
(the optimizer's momentum lives on the parameter server), and every activation autograd saved
for the backward pass (torch saved-tensor hooks; the weights it saves are the parameters, counted
once) plus the layer outputs kept for it.
``planner_1000_devices_s`` times the training grid of 1,000 devices. ``limits`` says how the workers were held to
their boards (docs/emulation.md): ``cgroup-v1``, the kernel's memory limit and CPU quota, or ``stretched``.

Emulation runs ``dilation`` times slower than the boards (``worker.emulation_dilation``: compute
and links alike), so that two host cores can stand in for eight boards; times in the report are
dilated, ratios are not affected.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edgemesh import cli
from edgemesh.bench.memory import held_bytes
from edgemesh.bench.reporting import finish, pyplot, save
from edgemesh.bench.runs import Timeline, cluster_flags, device_names, drive, fleet_profiles, names, observe
from edgemesh.common import costs
from edgemesh.common.bus import Route
from edgemesh.common.config import Config, load_config
from edgemesh.common.emulation.compute import measure_host_gflops
from edgemesh.common.errors import ConfigError, EdgeMeshError
from edgemesh.common.messages import DeviceHello, DeviceStats, PlanCluster, UpdateAck
from edgemesh.common.metrics import sum_samples
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import LocalCluster
from edgemesh.services.planner import mesh as planning
from edgemesh.services.planner.mesh import DeviceInfo, wire_for

logger = logging.getLogger(__name__)

MODES = ("single", "data_parallel", "edge_mesh")
DEFAULT_FLEET = ("pi3", "pi3", "pi4", "pi4", "pi5", "pi5", "jetson-nano", "laptop")
SINGLE_PROFILE = "pi4"
TIME_SPEC, TIME_DATA = "cifar-cnn", "synthetic-cifar"
ACCURACY_SPEC, ACCURACY_DATA = "digits-cnn", "digits"
DEFAULT_BATCH = 64
"""Samples per iteration, whatever the mode (the same SGD step for all three)."""
DEFAULT_DILATION = 4.0
DEFAULT_ITERATIONS = 15
DEFAULT_ACCURACY_ITERATIONS = 300
JOB_ACCURACY_ITERATIONS = 600
"""With ``--job``: versions of each accuracy run (:mod:`edgemesh.bench.mesh_jobs`)."""
ACCURACY_LR = 0.05
WARMUP_VERSIONS = 2
"""Model versions before timing starts (the first steps build models and warm caches)."""
FINAL_EVALUATIONS = 10
EVAL_EVERY = 5
"""The PS evaluates every this many versions: every mode at the same versions, so that its last
``FINAL_EVALUATIONS`` compare equal training."""
START_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 900.0
"""Longest a run may take once the plan names every device."""


@dataclass(slots=True)
class Run(Timeline):
    """What one run observed on the bus."""

    versions: dict[int, float] = field(default_factory=dict)
    """Model version -> when an ack first named it (seconds since t0)."""
    stats: dict[str, DeviceStats] = field(default_factory=dict)
    hellos: dict[str, DeviceHello] = field(default_factory=dict)

    @property
    def version(self) -> int:
        return max(self.versions, default=0)


async def _watch(cfg: Config, run: Run, devices: set[str]) -> None:
    """Note when the plan first names every device (t0), when acks first name each version, the
    devices' hellos and stats, and every evaluation after t0."""
    topics = Topics(cfg.job)

    async def on_ack(ack: UpdateAck, _: TopicMatch) -> None:
        if run.t0 is not None and ack.status == "accepted":
            run.versions.setdefault(ack.version, time.monotonic() - run.t0)

    async def on_stats(stats: DeviceStats, _: TopicMatch) -> None:
        run.stats[stats.device] = stats

    async def on_hello(hello: DeviceHello, _: TopicMatch) -> None:
        run.hellos[hello.device] = hello

    await observe(cfg, *run.routes(topics, devices), Route(topics.ack_filter("+"), UpdateAck, on_ack),
                  Route(topics.stats_filter(), DeviceStats, on_stats),
                  Route(topics.hello_filter(), DeviceHello, on_hello))


async def _run(cluster: LocalCluster, devices: list[tuple[str, str]], versions: int,
               progress: Callable[[str], None], label: str, *, eval_every: int = 0) -> Run:
    """Start the cluster, wait until the PS reached ``versions`` (and its evaluation of the last
    multiple of ``eval_every`` is in), stop; what the bus showed."""
    last_eval = versions - eval_every + 1 if eval_every else 0  # one evaluation in every eval_every versions
    run = Run()
    watch = _watch(cluster.cfg, run, {name for name, _ in devices})
    run.failure = await drive(cluster, devices, watch, started=lambda: run.t0,
                              done=lambda _: run.version >= versions and (
                                  not last_eval or any(v >= last_eval for _, v, _ in run.evaluations)),
                              status=lambda elapsed: f"{label}: version {run.version} of {versions}, {elapsed:.0f}s",
                              progress=progress, start_timeout_s=START_TIMEOUT_S, run_timeout_s=RUN_TIMEOUT_S)
    return run


def run_config(base: dict[str, str], *, mode: str, job: str, broker_url: str, spec: str, dataset: str,
               batch: int, devices: int, dilation: float, host_gflops: float, seed: int, eval_every: int) -> Config:
    # every mode trains ``batch`` samples per iteration: one device all of them, data parallelism
    # an equal part per device, Edge Mesh the grid's split among its clusters
    per_device = batch if mode != "data_parallel" else batch // devices
    overrides = {
        "job": job, "broker.url": broker_url, "log_level": "INFO",
        "training.model_spec": spec, "training.dataset": dataset, "training.batch_size": str(per_device),
        "planner.round_samples": str(batch if mode == "edge_mesh" else 0),
        "training.sync_policy": "sync", "planner.batching": "uniform",
        "planner.parallelism": "mesh" if mode == "edge_mesh" else "data",
        "ps.eval_every": str(eval_every), "ps.eval_interval_s": "0",
        # ACCURACY_LR is the rate of a batch of ``batch``: a data-parallel device's batch is a part of it, and its
        # round of them is scaled back up to the whole (``ps.round_scaling = linear``)
        **({"training.lr": str(ACCURACY_LR * per_device / batch)} if eval_every else {}),
        "worker.emulation_host_gflops": str(host_gflops), "worker.emulation_seed": str(seed),
        "worker.emulation_dilation": str(dilation),
    }
    overrides.update(base)
    return load_config(env={}, overrides=overrides)


# --------------------------------------------------------------------------- summaries


def iteration_times(run: Run) -> list[float]:
    """Seconds between consecutive model versions, after the warm-up."""
    times = [run.versions[v] for v in sorted(run.versions) if v > WARMUP_VERSIONS]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def load_imbalance(run: Run) -> tuple[float | None, dict[str, float]]:
    """Slowest over fastest member's compute time: per layer of every model-parallel cluster
    (overall: summed over layers, worst cluster), or per device step for single-device clusters."""
    plan = run.plan
    if plan is None:
        return None, {}
    worst, per_layer = 1.0, {}
    meshes = [c for c in plan.clusters if len(c.members) > 1]
    for c in meshes:
        busy = [run.stats[m].mesh_layer_busy_s for m in c.members if m in run.stats]
        if len(busy) != len(c.members):
            continue
        slow = fast = 0.0
        for layer, counts in c.counts.items():
            times = [b.get(layer, 0.0) for b, n in zip(busy, counts, strict=True) if n > 0]
            if not times or min(times) <= 0:
                continue
            per_layer[f"{c.cluster}/{layer}"] = round(max(times) / min(times), 3)
            slow, fast = slow + max(times), fast + min(times)
        if fast > 0:
            worst = max(worst, slow / fast)
    singles = [run.stats[c.members[0]].step_time_s for c in plan.clusters
               if len(c.members) == 1 and c.members[0] in run.stats and run.stats[c.members[0]].step_time_s > 0]
    if not meshes and len(singles) > 1:
        worst = max(singles) / min(singles)
    return round(worst, 3), per_layer


def predicted_iteration_s(run: Run, spec: str, wire: planning.Wire) -> float | None:
    """The cost model's iteration time for the run's layout and the devices' announced figures."""
    plan = run.plan
    if plan is None or not plan.clusters:
        return None
    infos = {n: DeviceInfo.from_hello(h) for n, h in run.hellos.items()}
    full = {layer.name: (layer.units,) for layer in costs.layers(spec)}
    batches = {d.cluster: d.batch_size for d in plan.devices}
    worst = 0.0
    for c in plan.clusters:
        if any(m not in infos for m in c.members):
            return None
        counts = c.counts if len(c.members) > 1 else full
        worst = max(worst, planning.cluster_iteration_s(spec, [infos[m] for m in c.members], counts,
                                                        batch=batches[c.cluster], wire=wire))
    return round(worst, 4)


def _cluster_entry(run: Run, c: PlanCluster, spec: str, wire: planning.Wire) -> dict[str, Any]:
    """One cluster of the plan: its members, division and batch, and for a model-parallel one every
    member's busy seconds per layer, measured (``DeviceStats.mesh_layer_busy_s``) and predicted by the
    cost model (latency left out: busy time is computing or moving bytes)."""
    entry: dict[str, Any] = {"cluster": c.cluster, "members": list(c.members), "division": c.counts,
                             "batch": max((d.batch_size for d in run.plan.devices if d.cluster == c.cluster),
                                          default=0) if run.plan else None,  # its members share it
                             "predicted_iteration_s": c.predicted_iteration_s}
    if len(c.members) > 1:
        entry["layer_busy_s"] = {m: {k: round(v, 4) for k, v in run.stats[m].mesh_layer_busy_s.items()}
                                 for m in c.members if m in run.stats}
        layers = costs.layers(spec)
        if all(m in run.hellos for m in c.members) and entry["batch"]:
            predicted = {}
            for i, m in enumerate(c.members):
                device = replace(DeviceInfo.from_hello(run.hellos[m]), latency_s=0.0)
                seconds = planning.layer_seconds(spec, device, [c.counts[la.name][i] for la in layers],
                                                 batch=entry["batch"], cluster_size=len(c.members), wire=wire)
                predicted[m] = {la.name: round(t, 4) for la, t in zip(layers, seconds, strict=True)}
            entry["predicted_layer_busy_s"] = predicted
    return entry


def summarize(run: Run, cluster: LocalCluster, *, spec: str, batch: int) -> dict[str, Any]:
    times = iteration_times(run)
    imbalance, per_layer = load_imbalance(run)
    plan = run.plan
    workers = cluster.samples_of("worker")
    steps = sum(sum_samples(s, "edgemesh_worker_steps_total") for s in workers)
    overruns = sum(sum_samples(s, "edgemesh_worker_emulation_overruns_total") for s in workers)
    rss = [c.peak_rss_kb / 1024 for c in cluster.children if c.role == "worker"]
    return {
        "avg_iteration_delay_s": round(statistics.fmean(times), 4) if times else None,
        "measured_iteration_s": round(statistics.median(times), 4) if times else None,
        "predicted_iteration_s": predicted_iteration_s(run, spec, wire_for(cluster.cfg)),
        "iterations_timed": len(times),
        "samples_per_iteration": sum({d.cluster: d.batch_size for d in plan.devices}.values()) if plan else None,
        "load_imbalance": imbalance,
        "load_imbalance_by_layer": per_layer,
        "peak_rss_mb_per_device": round(max(rss), 1) if rss else None,
        "clusters": [_cluster_entry(run, c, spec, wire_for(cluster.cfg)) for c in plan.clusters] if plan else [],
        "mesh_steps_abandoned": int(cluster.total("edgemesh_worker_mesh_steps_total", "worker", outcome="abandoned")),
        "updates_discarded": int(cluster.total("edgemesh_ps_updates_total", "ps", status="discarded")),
        "bytes_published": cluster.over_services("_published_bytes_total"),
        "emulation_overrun_share": round(overruns / steps, 4) if steps else None,
        "limits": limits_in_force(workers),
        "failure": run.failure,
    }


def limits_in_force(workers: list[Any]) -> str | None:
    """How the run's emulated boards were held to them (``edgemesh_worker_emulation_limits``): ``cgroup-v1``
    (the kernel's memory limit and CPU quota), ``stretched`` (compute held to the board's time alone), ``mixed``,
    or None where no worker said."""
    modes = {dict(labels).get("mode") for samples in workers for (name, labels), value in samples.items()
             if name == "edgemesh_worker_emulation_limits" and value == 1}
    return None if not modes else str(modes.pop()) if len(modes) == 1 else "mixed"


def ratios(modes: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    def get(mode: str, key: str) -> float | None:
        value = modes.get(mode, {}).get(key)
        return float(value) if value else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    mesh_delay = get("edge_mesh", "avg_iteration_delay_s")
    mesh_bytes = get("edge_mesh", "param_optimizer_activation_bytes_per_device")
    dp_bytes = get("data_parallel", "param_optimizer_activation_bytes_per_device")
    return {
        "single_over_edge_mesh_delay": ratio(get("single", "avg_iteration_delay_s"), mesh_delay),
        "data_parallel_over_edge_mesh_delay": ratio(get("data_parallel", "avg_iteration_delay_s"), mesh_delay),
        "edge_mesh_bytes_below_data_parallel": round(1 - mesh_bytes / dp_bytes, 3) if mesh_bytes and dp_bytes
        else None,
        "edge_mesh_predicted_over_measured": ratio(get("edge_mesh", "predicted_iteration_s"),
                                                   get("edge_mesh", "measured_iteration_s")),
        "accuracy_edge_mesh_minus_data_parallel": round(modes["edge_mesh"]["final_accuracy"]
                                                        - modes["data_parallel"]["final_accuracy"], 4)
        if modes.get("edge_mesh", {}).get("final_accuracy") is not None
        and modes.get("data_parallel", {}).get("final_accuracy") is not None else None,
    }


# --------------------------------------------------------------------------- the benchmark


def run_bench(report: Path, *, fleet: list[str], modes: list[str], batch: int, dilation: float, iterations: int,
              accuracy_iterations: int, seed: int, overrides: dict[str, str], progress: Callable[[str], None],
              keep_logs: bool = False) -> dict[str, Any]:
    profiles = fleet_profiles(fleet, SINGLE_PROFILE, overrides)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"unknown mode(s) {', '.join(bad)}; known: {', '.join(MODES)}")
    if batch < len(fleet) or batch % len(fleet) or iterations < 2 or accuracy_iterations < 0 or dilation < 1:
        raise ConfigError(f"need --batch a multiple of the fleet's {len(fleet)} devices (data parallelism splits it "
                          "evenly), --iterations >= 2, --accuracy-iterations >= 0, --dilation >= 1")
    host = measure_host_gflops(1)
    devices = device_names(fleet)
    progress(f"fleet of {len(devices)}: {', '.join(fleet)}; host {host:.1f} GFLOP/s per thread; time dilation "
             f"{dilation:g}")
    planner_s = planning.time_layout(1000, seed=seed)
    progress(f"planner: 1,000 devices laid out in {planner_s:.3f}s")
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-mesh-"))
    broker = BrokerProcess.default()
    broker.start()
    result: dict[str, Any] = {
        "fleet": [{"device": name, **profiles[p].summary()} for name, p in devices],
        "single": {"device": f"{SINGLE_PROFILE}-0", **profiles[SINGLE_PROFILE].summary()},
        "settings": {"time_model": TIME_SPEC, "time_dataset": TIME_DATA, "accuracy_model": ACCURACY_SPEC,
                     "accuracy_dataset": ACCURACY_DATA, "batch_per_iteration": batch, "sync_policy": "sync",
                     "time_dilation": dilation, "iterations": iterations, "warmup_versions": WARMUP_VERSIONS,
                     "accuracy_iterations": accuracy_iterations, "accuracy_lr": ACCURACY_LR,
                     "eval_every": min(EVAL_EVERY, accuracy_iterations),
                     "final_evaluations": FINAL_EVALUATIONS, "overrides": overrides},
        "host_gflops": round(host, 2),
        "broker": broker.kind,
        "modes": {},
        "planner_1000_devices_s": round(planner_s, 4),
    }
    failed = False
    try:
        for mode in modes:
            members = [(f"{SINGLE_PROFILE}-0", SINGLE_PROFILE)] if mode == "single" else devices
            job = f"mesh-{mode.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
            cfg = run_config(overrides, mode=mode, job=job, broker_url=broker.url, spec=TIME_SPEC, dataset=TIME_DATA,
                             batch=batch, devices=len(members), dilation=dilation, host_gflops=host, seed=seed,
                             eval_every=0)
            progress(f"{mode}: {len(members)} device(s), {TIME_SPEC} on {TIME_DATA}")
            cluster = LocalCluster(cfg, _made(workdir / f"{mode}-time"))
            run = asyncio.run(_run(cluster, members, WARMUP_VERSIONS + iterations + 1, progress, mode))
            entry = summarize(run, cluster, spec=TIME_SPEC, batch=batch)
            held = held_bytes(TIME_SPEC, batch, run.plan)
            entry["param_optimizer_activation_bytes_per_device"] = held["mean"]
            entry["param_optimizer_activation_bytes_max_device"] = held["max"]
            entry["held_bytes"] = held
            failed = failed or run.failure is not None
            if accuracy_iterations:
                every = min(EVAL_EVERY, accuracy_iterations)
                cfg = run_config(overrides, mode=mode, job=job + "-acc", broker_url=broker.url, spec=ACCURACY_SPEC,
                                 dataset=ACCURACY_DATA, batch=batch, devices=len(members), dilation=1.0,
                                 host_gflops=host, seed=seed, eval_every=every)
                progress(f"{mode}: accuracy, {ACCURACY_SPEC} on {ACCURACY_DATA}, {accuracy_iterations} versions")
                cluster = LocalCluster(cfg, _made(workdir / f"{mode}-accuracy"))
                acc = asyncio.run(_run(cluster, members, accuracy_iterations, progress, mode, eval_every=every))
                trained = sorted((v, a) for _, v, a in acc.evaluations if v <= accuracy_iterations)
                last = [a for _, a in trained[-FINAL_EVALUATIONS:]]
                entry["final_accuracy"] = round(statistics.fmean(last), 4) if last else None
                entry["accuracy_curve"] = [[round(t, 3), v, round(a, 4)] for t, v, a in acc.evaluations]
                entry["accuracy_failure"] = acc.failure
                failed = failed or acc.failure is not None
            result["modes"][mode] = entry
            progress(f"{mode}: iteration {entry['avg_iteration_delay_s']}s (predicted "
                     f"{entry['predicted_iteration_s']}s), {entry['param_optimizer_activation_bytes_per_device']} "
                     f"bytes/device, imbalance {entry['load_imbalance']}, accuracy {entry.get('final_accuracy')}"
                     + (f"; FAILED: {run.failure}" if run.failure else ""))
    finally:
        broker.stop()
    result["ratios"] = ratios(result["modes"])
    finish(report, result, _plot, progress, workdir, keep_logs=failed or keep_logs)
    return result


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    modes = result["modes"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(modes)
    left.bar(names, [modes[m]["avg_iteration_delay_s"] or 0 for m in names], color="#4878a8", label="measured")
    left.scatter(names, [modes[m]["predicted_iteration_s"] or 0 for m in names], color="#c44e52", zorder=3,
                 label="predicted")
    left.set_ylabel(f"seconds per iteration (dilated x{result['settings']['time_dilation']:g})")
    left.set_title(f"{result['settings']['time_model']}, {result['settings']['batch_per_iteration']} samples per "
                   "iteration")
    left.legend()
    right.bar(names, [modes[m]["param_optimizer_activation_bytes_per_device"] / 2**20 for m in names],
              color="#55a868", label="mean over devices")
    right.scatter(names, [modes[m]["param_optimizer_activation_bytes_max_device"] / 2**20 for m in names],
                  color="#333333", zorder=3, label="largest device")
    right.set_ylabel("MiB per device: parameters, state, activations")
    right.set_title("memory per device")
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    return save(fig, path)


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench mesh``: the built-in models, or with ``--job`` a user's (:mod:`edgemesh.bench.mesh_jobs`)."""
    a = parser.add_argument
    a("--report", default="bench/reports/mesh.json", help="JSON report path (PNG beside it)")
    a("--job", dest="job_file", metavar="FILE", help="a user's job file (a layer list on image folders of 32x32 "
      "RGB images, e.g. examples/mobilenetv2-32.toml): trained on glyph folders drawn for it, a different "
      "class mix per device; default: the built-in cifar-cnn (time) and digits CNN (accuracy)")
    a("--quick", action="store_true", help="with --job: a short run of every part (what the tests run)")
    a("--oom", action="store_true", help="with --job: also a model no Pi 3 trains alone, one Pi 3 (killed by the "
      "kernel at its memory limit) against a mesh of Pi 3s")
    a("--fleet", help="device profiles, comma-separated (default: " + ",".join(DEFAULT_FLEET) + "; with --job "
      "pi3,pi4,jetson-nano)")
    a("--modes", default=",".join(MODES), help="runs, comma-separated")
    a("--batch", type=int, help=f"samples per iteration in every mode (a multiple of the fleet size; default "
      f"{DEFAULT_BATCH}; with --job the job's batch_size x the fleet size)")
    a("--dilation", type=float, help="emulated boards run this many times slower (compute "
      f"and links), so the host keeps up (default {DEFAULT_DILATION:g})")
    a("--iterations", type=int, help=f"timed model versions per mode, after a warm-up (default {DEFAULT_ITERATIONS})")
    a("--accuracy-iterations", type=int, help="model versions of each accuracy run (0 = skip accuracy; default "
      f"{DEFAULT_ACCURACY_ITERATIONS}, with --job {JOB_ACCURACY_ITERATIONS})")
    a("--per-class", type=int, help="with --job: images of a device's two main classes (its others get half)")
    a("--oom-iterations", type=int, help="with --oom: most model versions of the mesh of Pi 3s")
    a("--oom-target", type=float, help="with --oom: the mesh of Pi 3s stops at this held-out accuracy (0: none)")
    cluster_flags(parser, seed="seed of the emulated links and the 1,000-device fleet")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if args.job_file:
            return _main_job(args, progress)
        if args.quick or args.oom:
            raise ConfigError("--quick and --oom go with --job FILE")
        result = run_bench(Path(args.report), fleet=names(args.fleet or ",".join(DEFAULT_FLEET)),
                           modes=names(args.modes), batch=args.batch or DEFAULT_BATCH,
                           dilation=args.dilation or DEFAULT_DILATION, iterations=args.iterations or DEFAULT_ITERATIONS,
                           accuracy_iterations=DEFAULT_ACCURACY_ITERATIONS if args.accuracy_iterations is None
                           else args.accuracy_iterations, seed=args.seed,
                           overrides=cli.overrides(args), keep_logs=args.keep_logs, progress=progress)
    except EdgeMeshError as exc:
        print(f"edgemesh bench mesh: {exc}", file=sys.stderr)
        return 2
    failures = [e.get("failure") or e.get("accuracy_failure") for e in result["modes"].values()]
    return 1 if any(failures) else 0


def _main_job(args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    """``--job FILE``: the user's model on image folders (:mod:`edgemesh.bench.mesh_jobs`)."""
    from edgemesh.bench import mesh_jobs

    settings = mesh_jobs.settings_of(args.job_file, fleet=args.fleet, modes=names(args.modes), dilation=args.dilation,
                                     iterations=args.iterations, accuracy_iterations=args.accuracy_iterations,
                                     per_class=args.per_class, oom=args.oom, oom_iterations=args.oom_iterations,
                                     oom_target=args.oom_target, quick=args.quick)
    if args.batch:
        raise ConfigError("--batch does not go with --job: an iteration is the job's batch_size on every device")
    result = mesh_jobs.run_bench(Path(args.report), settings, seed=args.seed, overrides=cli.overrides(args),
                                 command=" ".join(["edgemesh", *sys.argv[1:]]), progress=progress,
                                 keep_logs=args.keep_logs)
    failures = [result.get("failure"), *(e.get("failure") or e.get("accuracy_failure")
                                         for e in result["modes"].values()),
                result.get("oom", {}).get("mesh", {}).get("failure")]
    return 1 if any(failures) else 0
