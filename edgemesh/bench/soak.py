"""``edgemesh bench soak``: a cluster under churn for N minutes: memory, queues and exactly-once.

A whole local cluster on one broker, as in ``bench fleet``: the planner, the parameter server, the
compressor and one ``--emulate PROFILE`` worker process per device (default 2 x pi4 and 2 x pi5) train the
digits CNN under the ``adaptive`` policy for ``--minutes``, counted from the moment the plan names every
device (t0). Meanwhile:

* **churn**: every ``--kill-every-s LO,HI`` seconds (uniform, seeded by ``--seed``) one running worker is
  killed with SIGKILL, any but the first device (the *steady* worker, never killed). It is started again
  ``--restart-after-s LO,HI`` seconds later with the same ``--device``, the same ``worker.state_dir`` (its
  incarnation counter) and the same ``worker.ack_log``;
* **samples**: every ``SAMPLE_INTERVAL_S`` (shorter in short runs: at least ``MIN_SAMPLES`` per run), the
  resident size now (``VmRSS``) of every process, and the queue depths its metrics show: every service's
  bus inbox (``edgemesh_<service>_inbox_messages``), the PS's pending updates and its model-parallel steps
  assembling.

At the end every process is stopped (SIGTERM) and the PS's ledger (``{ps.state_dir}/ledger.log``) is
audited against the workers' ack logs (:mod:`edgemesh.bench.audit`). The report's fixed keys:

* ``rss_growth``: per service (``planner``, ``ps``, ``compressor``, ``worker``: the steady worker) the mean
  RSS over the run's *last window* divided by its mean over the *first window* after warm-up (:func:`windows`:
  the first window starts ``WARMUP_S`` after t0; windows are ``WINDOW_S`` long; both shrink to a third of
  the run in runs shorter than three times that). 1.05 is 5 % more memory at the end than just after warm-up;
* ``updates_lost``: updates a worker saw acked applied that the PS's ledger lacks;
* ``updates_applied_twice``: updates in the ledger more than once.

RSS over time per process, with the kills marked, and the queue depths go to a PNG beside the report.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgemesh import cli
from edgemesh.bench.audit import audit
from edgemesh.bench.reporting import finish, pyplot, save
from edgemesh.bench.runs import Timeline, cluster_flags, device_names, drive, fleet_profiles, names, observe
from edgemesh.common.config import Config, load_config
from edgemesh.common.emulation.compute import measure_host_gflops
from edgemesh.common.errors import ConfigError, EdgeMeshError
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import Child, LocalCluster, rss_kb

logger = logging.getLogger(__name__)

POLICY = "adaptive"
LR = 0.1
"""The learning rate the kept reports were measured at, per round (``ps.round_scaling = none``: a version of every
device's batch takes one step of it; the default, 0.05 per batch, grows with the round's batches)."""
DEFAULT_FLEET = ("pi4", "pi4", "pi5", "pi5")
DEFAULT_KILL_EVERY_S = (20.0, 40.0)
DEFAULT_RESTART_AFTER_S = (2.0, 6.0)
SERVICES = ("planner", "ps", "compressor")
WARMUP_S = 60.0
"""Seconds after t0 before the first window (imports, first plan, first codec policies, caches filling)."""
WINDOW_S = 60.0
"""Length of the first and of the last window whose mean RSS ``rss_growth`` compares."""
SAMPLE_INTERVAL_S = 10.0
"""Seconds between two samples of every process."""
MIN_SAMPLES = 15
"""Samples a short run takes at the least (its interval shrinks)."""
EVAL_INTERVAL_S = 5.0
"""How often the PS evaluates the held-out split during the run."""
FINAL_EVALUATIONS = 5
"""Evaluations averaged into ``final_accuracy`` (the last ones of the run)."""
KILL_WAIT_S = 5.0
"""Longest wait for a killed worker to be reaped."""
START_TIMEOUT_S = 120.0
"""Longest wait for the plan to name every device."""
QUEUES = {"inbox": "edgemesh_{role}_inbox_messages", "pending_updates": "edgemesh_ps_pending_updates",
          "assembling_steps": "edgemesh_ps_mesh_assembling_steps"}
"""Queue name in the samples -> the gauge of its depth (``role``: the process's)."""
KIB = 1024


def windows(duration_s: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """The first window after warm-up and the last window of a run of ``duration_s``, seconds since t0:
    ``WARMUP_S`` then ``WINDOW_S`` each, or thirds of a run shorter than ``3 * WINDOW_S``."""
    warmup, window = min(WARMUP_S, duration_s / 3), min(WINDOW_S, duration_s / 3)
    return (warmup, warmup + window), (duration_s - window, duration_s)


def growth(samples: list[tuple[float, float]], duration_s: float) -> float | None:
    """Mean of ``(t, rss)`` samples in the last window over their mean in the first (None without both)."""
    (a0, a1), (b0, b1) = windows(duration_s)
    first = [rss for t, rss in samples if a0 <= t < a1 and rss]
    last = [rss for t, rss in samples if t >= b0 and rss]
    return round(statistics.fmean(last) / statistics.fmean(first), 4) if first and last else None


@dataclass(frozen=True, slots=True)
class Churn:
    """When workers die and come back: uniform draws from ``random.Random(seed)``."""

    kill_every_s: tuple[float, float]
    restart_after_s: tuple[float, float]
    seed: int


@dataclass(slots=True)
class Incarnation:
    """One worker process: its device and when it ran, seconds since t0 (None: from before t0, or to the end)."""

    name: str
    device: str
    child: Child
    started_s: float | None = None
    killed_s: float | None = None


@dataclass(slots=True)
class Soak:
    """One soak run: its cluster, its schedule and what it saw. ``tick`` is the run's clock (``drive`` awaits it)."""

    cluster: LocalCluster
    devices: list[tuple[str, str]]
    churn: Churn
    duration_s: float
    progress: Callable[[str], None]
    timeline: Timeline = field(default_factory=Timeline)
    incarnations: list[Incarnation] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    rng: random.Random = field(init=False)
    interval_s: float = field(init=False)
    next_sample_s: float = 0.0
    next_kill_s: float = field(init=False)
    restart_at: dict[str, float] = field(default_factory=dict)
    """Device -> when its killed worker starts again."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.churn.seed)  # noqa: S311 - a seeded schedule, not a secret
        self.interval_s = min(SAMPLE_INTERVAL_S, self.duration_s / MIN_SAMPLES)
        self.next_kill_s = self.rng.uniform(*self.churn.kill_every_s)

    # --- workers -------------------------------------------------------------------------
    def worker_dir(self, device: str) -> Path:
        return self.cluster.workdir / f"{self.cluster.cfg.job}-{device}"

    def ack_logs(self) -> dict[str, Path]:
        return {device: self.worker_dir(device) / "acks.log" for device, _ in self.devices}

    def flags(self) -> dict[str, list[str]]:
        """Every device's own flags: its state directory and ack log, kept across its restarts."""
        return {device: ["--set", f"worker.state_dir={self.worker_dir(device)}",
                         "--set", f"worker.ack_log={self.worker_dir(device) / 'acks.log'}"]
                for device, _ in self.devices}

    def running(self) -> dict[str, Incarnation]:
        return {i.device: i for i in self.incarnations if i.killed_s is None}

    def adopt(self) -> None:
        """Take the workers ``drive`` started as the first incarnations."""
        self.incarnations = [Incarnation(c.name, c.name, c) for c in self.cluster.children if c.role == "worker"]

    @property
    def steady(self) -> str:
        """The device never killed."""
        return self.devices[0][0]

    async def kill(self, at_s: float) -> None:
        """SIGKILL one running worker (not the steady one) and plan its restart."""
        running = self.running()
        victims = sorted(d for d in running if d != self.steady)
        if not victims:
            return
        victim = running[self.rng.choice(victims)]
        rss = rss_kb(victim.child.proc.pid) / KIB
        victim.child.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.child.proc.wait, KILL_WAIT_S)
        self.cluster.children.remove(victim.child)  # it did not fail: the run goes on
        victim.killed_s = at_s
        back = at_s + self.rng.uniform(*self.churn.restart_after_s)
        self.restart_at[victim.device] = back
        self.kills.append({"t": round(at_s, 2), "device": victim.device, "process": victim.name,
                           "rss_mb": round(rss, 1), "restart_t": round(back, 2)})
        self.progress(f"  {at_s:6.1f}s: killed {victim.name} ({rss:.0f} MiB); back at {back:.1f}s")

    def restart(self, device: str, at_s: float) -> None:
        profile = dict(self.devices)[device]
        name = f"{device}.r{sum(1 for i in self.incarnations if i.device == device)}"
        child = self.cluster.spawn("worker", name, ["--device", device, "--emulate", profile,
                                                    *self.flags()[device]])
        self.incarnations.append(Incarnation(name, device, child, started_s=at_s))
        self.progress(f"  {at_s:6.1f}s: restarted {device} as {name}")

    # --- the clock ---------------------------------------------------------------------------
    async def tick(self, elapsed: float) -> None:
        """Kill, restart and sample what is due at ``elapsed`` seconds since t0."""
        if not self.incarnations:
            self.adopt()
        if elapsed >= self.duration_s:
            if not self.samples or self.samples[-1]["t"] < self.duration_s:
                await self.sample(elapsed)
            return
        for device, at in sorted(self.restart_at.items()):
            if elapsed >= at:
                del self.restart_at[device]
                self.restart(device, elapsed)
        if elapsed >= self.next_kill_s:
            await self.kill(elapsed)
            self.next_kill_s = elapsed + self.rng.uniform(*self.churn.kill_every_s)
        if elapsed >= self.next_sample_s:
            await self.sample(elapsed)
            self.next_sample_s += self.interval_s

    async def sample(self, elapsed: float) -> None:
        """RSS now and queue depths of every running process."""
        await asyncio.to_thread(self.cluster.scrape_all)
        rss: dict[str, float] = {}
        queues: dict[str, dict[str, float]] = {}
        for child in self.cluster.children:
            rss[child.name] = round(rss_kb(child.proc.pid) / KIB, 2)
            gauges = {metric: value for (metric, _), value in child.samples.items()}
            depth = {queue: gauges[metric] for queue, gauge in QUEUES.items()
                     if (metric := gauge.format(role=child.role)) in gauges}
            if depth:
                queues[child.name] = depth
        version = int(self.cluster.total("edgemesh_ps_model_version", "ps"))
        self.samples.append({"t": round(elapsed, 2), "version": version, "rss_mb": rss, "queues": queues})

    def status(self, elapsed: float) -> str:
        """The progress line: time, model, kills and the last sample's RSS of the services and the steady worker."""
        accuracy = self.timeline.evaluations[-1][2] if self.timeline.evaluations else 0.0
        last: dict[str, Any] = self.samples[-1] if self.samples else {"version": 0, "rss_mb": {}}
        rss = ", ".join(f"{name} {mb:.0f}" for name, mb in last["rss_mb"].items()
                        if name in SERVICES or name == self.steady)
        return (f"{elapsed:6.1f}s of {self.duration_s:.0f}s: version {last['version']}, accuracy {accuracy:.4f}, "
                f"{len(self.kills)} kill(s); RSS MiB {rss}")


def run_config(base: dict[str, str], *, job: str, broker_url: str, host_gflops: float, seed: int,
               devices: int) -> Config:
    """The soak's configuration: its settings, then the user's ``--set`` overrides."""
    overrides = {
        "job": job, "broker.url": broker_url, "log_level": "INFO",
        "training.sync_policy": POLICY, "training.lr": str(LR), "training.staleness_bound": str(2 * devices),
        "training.seed": str(seed), "ps.round_scaling": "none",
        "ps.eval_every": "0", "ps.eval_interval_s": str(EVAL_INTERVAL_S),
        "worker.emulation_host_gflops": str(host_gflops), "worker.emulation_seed": str(seed),
    }
    overrides.update(base)
    return load_config(env={}, overrides=overrides)


async def _run(soak: Soak) -> str | None:
    cluster = soak.cluster
    watch = observe(cluster.cfg, *soak.timeline.routes(Topics(cluster.cfg.job), {d for d, _ in soak.devices}))
    return await drive(cluster, soak.devices, watch, started=lambda: soak.timeline.t0, status=soak.status,
                       progress=soak.progress, done=lambda elapsed: elapsed >= soak.duration_s,
                       start_timeout_s=START_TIMEOUT_S, flags=soak.flags(), tick=soak.tick)


def summarize(soak: Soak, failure: str | None) -> dict[str, Any]:
    """The report's figures of one run (the ledger audited after every process stopped)."""
    duration = soak.duration_s
    series: dict[str, list[tuple[float, float]]] = {}
    for s in soak.samples:
        for name, mb in s["rss_mb"].items():
            series.setdefault(name, []).append((s["t"], mb))
    throughout = {i.name for i in soak.incarnations if i.started_s is None and i.killed_s is None}
    by_process = {name: growth(points, duration) for name, points in series.items()
                  if name in SERVICES or name in throughout}  # a restarted worker's windows are not these
    ratios: dict[str, float | None] = {service: by_process.get(service) for service in SERVICES}
    ratios["worker"] = by_process.get(soak.steady)
    (a0, a1), (b0, b1) = windows(duration)
    mean_mb = {name: {"first": _mean([mb for t, mb in points if a0 <= t < a1]),
                      "last": _mean([mb for t, mb in points if t >= b0])} for name, points in series.items()}
    checked = audit(soak.cluster.ps_state_dir / "ledger.log", soak.ack_logs())
    evaluations = soak.timeline.evaluations
    last = [a for _, _, a in evaluations[-FINAL_EVALUATIONS:]]
    device = {i.name: i.device for i in soak.incarnations}
    queues_max: dict[str, dict[str, float]] = {}  # per service and device (a device's processes together)
    for s in soak.samples:
        for name, depth in s["queues"].items():
            entry = queues_max.setdefault(device.get(name, name), {})
            for queue, value in depth.items():
                entry[queue] = max(entry.get(queue, 0.0), value)
    return {
        "minutes": round(duration / 60, 4),
        "rss_growth": ratios,
        **checked.as_dict(),
        "rss_growth_by_process": by_process,
        "rss_mb_windows": mean_mb,
        "windows_s": {"first": [a0, a1], "last": [b0, b1]},
        "steady_worker": soak.steady,
        "kills": soak.kills,
        "restarts": sum(1 for i in soak.incarnations if i.started_s is not None),
        "queues_max": queues_max,
        "final_accuracy": round(statistics.fmean(last), 4) if last else None,
        "best_accuracy": round(max((a for _, _, a in evaluations), default=0.0), 4),
        "model_versions": int(soak.cluster.total("edgemesh_ps_model_version", "ps")),
        "samples": soak.samples,
        "curve": [[round(t, 3), v, round(a, 4)] for t, v, a in evaluations],
        "failure": failure,
    }


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 2) if values else None


def run_bench(report: Path, *, minutes: float, fleet: list[str], churn: Churn, overrides: dict[str, str],
              progress: Callable[[str], None], keep_logs: bool = False) -> dict[str, Any]:
    if len(fleet) < 2:
        raise ConfigError("a soak needs 2 devices at the least: the first is never killed")
    profiles = fleet_profiles(fleet, fleet[0], overrides)
    host = measure_host_gflops(1)
    devices = device_names(fleet)
    duration = minutes * 60
    progress(f"soak of {minutes:g} min: {len(devices)} workers ({', '.join(fleet)}), one killed every "
             f"{churn.kill_every_s[0]:g}-{churn.kill_every_s[1]:g}s, back after "
             f"{churn.restart_after_s[0]:g}-{churn.restart_after_s[1]:g}s; host {host:.1f} GFLOP/s per thread")
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-soak-"))
    broker = BrokerProcess.default()
    broker.start()
    try:
        cfg = run_config(overrides, job=f"soak-{uuid.uuid4().hex[:6]}", broker_url=broker.url, host_gflops=host,
                         seed=churn.seed, devices=len(devices))
        soak = Soak(LocalCluster(cfg, workdir), devices, churn, duration, progress)
        failure = asyncio.run(_run(soak))
    finally:
        broker.stop()
    result = {**summarize(soak, failure), "fleet": [{"device": name, **profiles[p].summary()} for name, p in devices],
              "churn": {"kill_every_s": list(churn.kill_every_s), "restart_after_s": list(churn.restart_after_s),
                        "seed": churn.seed},
              "settings": _settings(cfg, soak.interval_s), "host_gflops": round(host, 2), "broker": broker.kind}
    progress(f"rss growth {result['rss_growth']}; {len(soak.kills)} kills; updates applied "
             f"{result['updates_applied']}, acked {result['updates_acked']}, lost {result['updates_lost']}, "
             f"applied twice {result['updates_applied_twice']}; final accuracy {result['final_accuracy']}"
             + (f"; FAILED: {failure}" if failure else ""))
    finish(report, result, _plot, progress, workdir, keep_logs=failure is not None or keep_logs)
    return result


def _settings(cfg: Config, interval_s: float) -> dict[str, Any]:
    t = cfg.training
    return {"model": t.model_spec, "dataset": t.dataset, "policy": t.sync_policy, "lr": t.lr,
            "batch_size": t.batch_size, "staleness_bound": t.staleness_bound, "eval_interval_s": EVAL_INTERVAL_S,
            "sample_interval_s": round(interval_s, 3), "compressor_mode": cfg.compressor.mode,
            "ps_broadcast": cfg.ps.broadcast, "ps_fsync": cfg.ps.fsync, "ps_checkpoint_every": cfg.ps.checkpoint_every}


def _plot(result: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=[3, 1])
    samples = result["samples"]
    names_seen = list(dict.fromkeys(name for s in samples for name in s["rss_mb"]))
    for name in names_seen:
        points = [(s["t"], s["rss_mb"][name]) for s in samples if name in s["rss_mb"]]
        service = name in SERVICES or name == result["steady_worker"]
        top.plot([p[0] for p in points], [p[1] for p in points], linewidth=1.5 if service else 0.8,
                 alpha=1.0 if service else 0.5, label=name if service else None)
    for kill in result["kills"]:
        top.axvline(kill["t"], color="red", alpha=0.25, linewidth=0.8)
    for (a, b), colour in zip(result["windows_s"].values(), ("tab:green", "tab:purple"), strict=True):
        top.axvspan(a, b, color=colour, alpha=0.1)
    top.set(ylabel="RSS, MiB", title=f"soak of {result['minutes']:g} min: {len(result['kills'])} kills (red); first "
                                     "(green) and last (purple) windows; thin: the other workers")
    top.legend(loc="center right")
    top.grid(alpha=0.3)
    for name in ("ps", "planner", "compressor", result["steady_worker"]):
        for queue in ("inbox", "pending_updates"):
            points = [(s["t"], s["queues"][name][queue]) for s in samples if queue in s["queues"].get(name, {})]
            if points and any(p[1] for p in points):
                bottom.plot([p[0] for p in points], [p[1] for p in points], linewidth=1, label=f"{name} {queue}")
    bottom.set(xlabel="seconds since the plan named every device", ylabel="queue depth")
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(loc="upper right", fontsize="small")
    bottom.grid(alpha=0.3)
    return save(fig, path)


def _range(text: str) -> tuple[float, float]:
    """``LO,HI`` seconds from the command line."""
    try:
        lo, hi = (float(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI seconds, got {text!r}") from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 0 < LO <= HI, got {text!r}")
    return lo, hi


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench soak``."""
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes from the plan naming every device")
    parser.add_argument("--report", default="bench/reports/soak.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--fleet", default=",".join(DEFAULT_FLEET),
                        help="device profiles, comma-separated; the first device is never killed")
    parser.add_argument("--kill-every-s", type=_range, default=DEFAULT_KILL_EVERY_S, metavar="LO,HI",
                        help="seconds between two kills (uniform)")
    parser.add_argument("--restart-after-s", type=_range, default=DEFAULT_RESTART_AFTER_S, metavar="LO,HI",
                        help="seconds a killed worker stays down (uniform)")
    cluster_flags(parser, seed="seed of the kills, of training and of the emulated links")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    if args.minutes <= 0:
        raise EdgeMeshError("--minutes must be > 0")
    churn = Churn(kill_every_s=args.kill_every_s, restart_after_s=args.restart_after_s, seed=args.seed)
    try:
        result = run_bench(Path(args.report), minutes=args.minutes, fleet=names(args.fleet), churn=churn,
                           overrides=cli.overrides(args), keep_logs=args.keep_logs,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    except EdgeMeshError as exc:
        print(f"edgemesh bench soak: {exc}", file=sys.stderr)
        return 2
    return 1 if result["failure"] else 0
