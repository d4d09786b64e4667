"""``edgemesh demo``: a whole local cluster, each service its own process, and one job submitted to it.

Starts a broker unless one is given (Mosquitto if installed, else the embedded amqtt one), then the
planner, the parameter server, the compressor and N workers, all serving submitted jobs as they do
under systemd; submits the digits job (``Demo.job``: the model of ``examples/digits.toml``) as
``edgemesh job submit`` does; follows the PS's evaluation events with a progress bar; stops at the
target accuracy, the version limit or the timeout; reads every process's ``/metrics``; prints a
summary and writes a JSON report (its accuracy curve drawn in a PNG beside it). Ctrl-C (or SIGTERM)
stops every child; none is left behind. A worker the kernel killed at its emulated board's memory limit
(``worker.emulate``) is said on the job's topics as a device that left for memory
(``LocalCluster.say_departures``) before the demo stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from edgemesh import cli
from edgemesh.bench.reporting import pyplot, save, write_report
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.errors import EdgeMeshError
from edgemesh.common.jobs import parse_job, render_job
from edgemesh.common.messages import Event, JobState
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.tasks import cancel_all
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import LocalCluster
from edgemesh.operator.job import submission_of, submit
from edgemesh.operator.progress import ProgressLines, is_terminal
from edgemesh.services.runtime import install_stop_signals

logger = logging.getLogger(__name__)

DIGITS_MODEL: dict[str, Any] = {
    "input_shape": [1, 8, 8],
    "classes": [str(d) for d in range(10)],
    "layers": [{"conv2d": 16, "kernel": 3, "padding": 1}, "relu", {"conv2d": 32, "kernel": 3, "padding": 1}, "relu",
               {"maxpool2d": 2}, "flatten", {"linear": 64}, "relu", {"linear": 10}],
}
"""The demo's CNN: two 3x3 conv layers (16, 32), max-pool, two linear layers (``examples/digits.toml``)."""
DIGITS_NORMALIZATION = {"mean": [0.3055], "std": [0.3761]}
"""Pixel mean and standard deviation of the digits training split (pixels in [0, 1])."""
PROGRESS_WIDTH = 30
REDRAW_S = 0.25
"""How often the demo redraws its progress (off a terminal: looks for a change to print)."""
GUARD_INTERVAL_S = 0.5
"""How often the demo checks that its children still run."""


@dataclass(slots=True)
class Progress:
    version: int = 0
    accuracy: float = 0.0
    loss: float = 0.0
    evaluations: int = 0
    reached_at: float | None = None
    stopped_by: str = ""
    curve: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds since the demo started, model version, held-out accuracy) of every evaluation heard."""


class Demo:
    def __init__(self, config: Config, *, external_broker: bool, quiet: bool, embedded_broker: bool = False,
                 out: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = config
        self.external_broker = external_broker
        self.embedded_broker = embedded_broker
        self.out = out or sys.stderr
        """Where the progress goes: a line redrawn on a terminal, else (or ``quiet``) plain lines."""
        self.clock = clock
        self.lines = ProgressLines(self.out, clock=clock) if quiet or not is_terminal(self.out) else None
        self.cluster: LocalCluster | None = None
        self.broker: BrokerProcess | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="edgemesh-demo-"))
        self.progress = Progress()
        self.started = clock()
        self.stop = asyncio.Event()
        self.failure: str | None = None
        self.bus: Bus | None = None
        """The demo's own connection (``_watch``), while it is up."""

    # ------------------------------------------------------------------ processes
    def _start_all(self) -> None:
        if not self.external_broker:
            self.broker = BrokerProcess.embedded() if self.embedded_broker else BrokerProcess.default()
            self.broker.start()
            self.cfg = replace(self.cfg, broker=replace(self.cfg.broker, url=self.broker.url))
        # every child gets the demo's whole configuration (file, environment, flags) and serves submitted jobs
        self.cluster = LocalCluster(self.cfg, self.workdir, serve_jobs=True)
        self.cluster.start_services(min_devices=self.cfg.demo.workers)
        link = ["--set", f"worker.link_rate_bps={self.cfg.demo.link_rate_bps}"] if self.cfg.demo.link_rate_bps else []
        for i in range(self.cfg.demo.workers):
            self.cluster.spawn("worker", f"worker-{i}", link + ["--device", f"w{i}"])

    def _stop_all(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.broker is not None:
            self.broker.stop()

    def job(self) -> str:
        """The job the demo submits: the digits CNN, stopping at the demo's target or version limit."""
        c = self.cfg
        return render_job({
            "job": {"name": c.job, "target_accuracy": c.demo.target_accuracy, "max_versions": c.demo.max_versions},
            "model": DIGITS_MODEL,
            "data": {"format": "digits", **DIGITS_NORMALIZATION, "partition": c.training.partition,
                     "partition_alpha": c.training.partition_alpha},
            "evaluation": {"every": max(1, c.ps.eval_every)}})

    async def _submit(self) -> None:
        """Submit the job as ``edgemesh job submit`` does, once the parameter server's host is up."""
        spec = parse_job(self.job(), origin="the demo's job")
        submission = await asyncio.to_thread(submission_of, spec, search_path=[])
        with contextlib.redirect_stdout(sys.stderr):
            code = await submit(self.cfg, spec, submission, wait_s=self.cfg.demo.timeout_s)
        if code != 0:
            self.failure = self.failure or "the job was not taken"
            self.stop.set()

    # ------------------------------------------------------------------ watching
    async def _watch(self) -> None:
        """Follow the parameter server's evaluation events until cancelled."""
        topics = Topics(self.cfg.job)
        bus = Bus(self.cfg.broker, client_id=f"edgemesh-demo-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("demo"),
                  connect_first=False)
        bus.route(topics.events_filter(), Event, self._on_event)
        bus.route(topics.job_state_filter(), JobState, self._on_job_state)
        async with bus:
            self.bus = bus
            try:
                await asyncio.Event().wait()  # routed until cancelled
            finally:
                self.bus = None

    async def _on_job_state(self, state: JobState, _: TopicMatch) -> None:
        """The job ended at its stop rule: the evaluation of its last version may never come as an event (the
        parameter server stops serving the job first), so the job's last state ends the demo."""
        if state.name != self.cfg.job or not state.ended:
            return
        p = self.progress
        p.version = max(p.version, state.version)
        if state.accuracy is not None:
            p.accuracy = state.accuracy
            self._heard(state.model_version or state.version, state.accuracy)
        if state.state != "finished":
            self.failure = self.failure or f"the job {state.state}: {state.reason}"
        elif p.accuracy >= self.cfg.demo.target_accuracy:
            p.reached_at = p.reached_at or self.clock()
            p.stopped_by = p.stopped_by or "target"
        else:
            p.stopped_by = p.stopped_by or "max_versions"
        self.stop.set()

    async def _on_event(self, event: Event, _: TopicMatch) -> None:
        if event.kind != "evaluation" or event.source != "ps":
            return
        data = event.data
        p = self.progress
        p.version = int(data.get("version") or 0)
        p.accuracy = float(data.get("accuracy") or 0.0)
        p.loss = float(data.get("loss") or 0.0)
        p.evaluations += 1
        self._heard(p.version, p.accuracy)
        if p.accuracy >= self.cfg.demo.target_accuracy:
            p.reached_at = self.clock()
            p.stopped_by = "target"
            self.stop.set()
        elif p.version >= self.cfg.demo.max_versions:
            p.stopped_by = "max_versions"
            self.stop.set()

    def _heard(self, version: int, accuracy: float) -> None:
        """An evaluation on the curve, if of a later version than the curve's last (the job's final state repeats
        an evaluation heard, or names a kept earlier version)."""
        curve = self.progress.curve
        if not curve or version > curve[-1][1]:
            curve.append((round(self.clock() - self.started, 2), version, round(accuracy, 4)))

    async def _guard(self) -> None:
        """Fail fast when a child dies on its own; keep peak memory readings."""
        assert self.cluster is not None
        while not self.stop.is_set():
            failure = self.cluster.failure()
            if failure is not None:
                self.failure = failure
                if self.bus is not None:  # a worker killed for memory: the operator sees the device leave
                    with contextlib.suppress(EdgeMeshError):
                        await self.cluster.say_departures(self.bus)
                self.stop.set()
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(GUARD_INTERVAL_S):
                    await self.stop.wait()

    async def _show(self, started: float) -> None:
        while not self.stop.is_set():
            self._render(started)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REDRAW_S):
                    await self.stop.wait()
        self._render(started, final=True)

    def _render(self, started: float, final: bool = False) -> None:
        """The progress: a bar redrawn in place on a terminal; else a plain line when it changed (``ProgressLines``:
        at most one per ``progress.LINE_INTERVAL_S``, the final one always)."""
        p = self.progress
        target = self.cfg.demo.target_accuracy
        frac = min(1.0, p.accuracy / target) if target else 0.0
        bar = "#" * int(frac * PROGRESS_WIDTH) + "-" * (PROGRESS_WIDTH - int(frac * PROGRESS_WIDTH))
        shown = f"[{bar}] accuracy {p.accuracy:6.2%} / {target:.0%}  version {p.version:5d}"
        line = f"{shown}  {self.clock() - started:6.1f}s"
        if self.lines is not None:
            self.lines.show(shown, line, final=final)
        else:
            print("\r" + line, end="\n" if final else "", file=self.out, flush=True)

    async def _main(self) -> float:
        install_stop_signals(self.stop)
        started = self.started = self.clock()
        # spawned from the main thread, so the children's parent-death signal is armed:
        # even a kill -9 of the demo leaves no orphan
        self._start_all()
        print(f"edgemesh demo: job {self.cfg.job}, broker {self.cfg.broker.url}"
              f"{'' if self.broker is None else ' (' + self.broker.kind + ')'}, "
              f"{self.cfg.demo.workers} workers, policy {self.cfg.training.sync_policy}; logs in {self.workdir}",
              file=sys.stderr, flush=True)
        tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._guard()),
                 asyncio.create_task(self._show(started)), asyncio.create_task(self._submit())]
        try:
            async with asyncio.timeout(self.cfg.demo.timeout_s):
                await self.stop.wait()
        except TimeoutError:
            self.failure = self.failure or f"timed out after {self.cfg.demo.timeout_s:.0f}s"
            self.stop.set()
        wall = self.clock() - started
        assert self.cluster is not None
        await asyncio.to_thread(self.cluster.scrape_all)
        await cancel_all(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)  # their errors read, not left "never retrieved"
        return wall

    # ------------------------------------------------------------------ report
    def report(self, wall: float) -> dict[str, Any]:
        cluster = self.cluster or LocalCluster.empty(self.cfg, self.workdir)
        by_codec: dict[str, int] = {}
        version = self.progress.version
        ps = next((c for c in cluster.children if c.role == "ps"), None)
        if ps is not None:
            for (name, labels), value in ps.samples.items():
                if name == "edgemesh_ps_received_gradient_bytes_total" and value:
                    codec = dict(labels).get("codec", "?")
                    by_codec[codec] = by_codec.get(codec, 0) + int(value)
            version = int(ps.samples.get(("edgemesh_ps_model_version", ()), version))
        accepted = cluster.total("edgemesh_ps_updates_total", "ps", status="accepted")
        discarded = cluster.total("edgemesh_ps_updates_total", "ps", status="discarded")
        return {
            "final_accuracy": round(self.progress.accuracy, 4),
            "target_accuracy": self.cfg.demo.target_accuracy,
            "reached_target": self.progress.accuracy >= self.cfg.demo.target_accuracy,
            "wall_seconds": round(wall, 2),
            "model_version": version,
            "evaluated_version": self.progress.version,
            "updates_accepted": int(accepted),
            "updates_discarded": int(discarded),
            "bytes_published": cluster.over_services("_published_bytes_total"),
            "bytes_received": cluster.over_services("_received_bytes_total"),
            "gradient_bytes": int(cluster.total("edgemesh_worker_gradient_bytes_total", "worker")),
            "workers": self.cfg.demo.workers,
            "declared_link_rate_bps": self.cfg.demo.link_rate_bps,
            "sync_policy": self.cfg.training.sync_policy,
            "codec": self.cfg.compressor.default_codec,
            "gradient_bytes_by_codec": by_codec,
            "broker": self.broker.kind if self.broker is not None else self.cfg.broker.url,
            "peak_rss_mb": cluster.peak_rss_mb(),
            "stopped_by": self.progress.stopped_by or ("failure" if self.failure else "signal"),
            "failure": self.failure,
            "curve": [list(point) for point in self.progress.curve],
        }


def _print_summary(report: dict[str, Any]) -> None:
    rows = [
        ("final accuracy", f"{report['final_accuracy']:.2%} (target {report['target_accuracy']:.0%})"),
        ("wall time", f"{report['wall_seconds']:.1f} s"),
        ("model version", str(report["model_version"])),
        ("updates accepted", str(report["updates_accepted"])),
        ("updates discarded", str(report["updates_discarded"])),
        ("bytes published", f"{report['bytes_published'] / 1e6:.2f} MB "
                            f"(received by the services: {report['bytes_received'] / 1e6:.2f} MB)"),
        ("workers", f"{report['workers']} ({report['sync_policy']}, uplink "
                    + (f"{report['declared_link_rate_bps'] / 1e6:g} MB/s declared)"
                       if report["declared_link_rate_bps"] else "measured)")),
        ("gradient bytes by codec", ", ".join(f"{k} {v / 1e6:.2f} MB"
                                              for k, v in report["gradient_bytes_by_codec"].items()) or "-"),
        ("broker", str(report["broker"])),
        ("peak RSS per process", ", ".join(f"{k} {v:.0f} MiB" for k, v in report["peak_rss_mb"].items())),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def plot(result: dict[str, Any], path: Path) -> bool:
    """The demo's held-out accuracy against its wall time (False: no matplotlib, or nothing evaluated)."""
    plt = pyplot() if result["curve"] else None
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([c[0] for c in result["curve"]], [c[2] for c in result["curve"]], marker=".", linewidth=1.5,
            label=f"{result['workers']} workers, {result['sync_policy']}")
    ax.axhline(result["target_accuracy"], color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("seconds since the demo started (processes started, job submitted)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.set_title(f"edgemesh demo on {result['broker']}: {result['final_accuracy']:.2%} at version "
                 f"{result['model_version']} in {result['wall_seconds']:.1f} s")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path)


def run_demo(config: Config, *, report: str | None, external_broker: bool, quiet: bool = False,
             embedded_broker: bool = False) -> int:
    """Run the demo; returns the process exit code (0 when the target was reached)."""
    if not config.job:
        config = replace(config, job=f"demo-{uuid.uuid4().hex[:6]}")
    demo = Demo(config, external_broker=external_broker, quiet=quiet, embedded_broker=embedded_broker)
    wall = 0.0
    try:
        wall = asyncio.run(demo._main())
    except KeyboardInterrupt:
        demo.failure = "interrupted"
    except EdgeMeshError as exc:
        demo.failure = str(exc)
    finally:
        demo._stop_all()
    result = demo.report(wall)
    _print_summary(result)
    if report:
        print()
        write_report(Path(report), result, plot, progress=lambda line: print(f"  {line}"))
    if demo.failure:
        print(f"\nedgemesh demo: {demo.failure}", file=sys.stderr)
        return 1
    if not result["reached_target"]:
        print(f"\nedgemesh demo: stopped ({result['stopped_by']}) before reaching the target accuracy",
              file=sys.stderr)
        if result["stopped_by"] != "max_versions":
            return 3
    if demo.cfg.demo.keep_logs:
        print(f"\n  logs kept in {demo.workdir}")
    else:
        shutil.rmtree(demo.workdir, ignore_errors=True)
    return 0


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh demo``: the configuration flags and the demo's own."""
    cli.config_flags(parser, {"workers": "demo.workers", "target_accuracy": "demo.target_accuracy",
                              "max_versions": "demo.max_versions", "timeout": "demo.timeout_s",
                              "policy": "training.sync_policy", "link_rate": "demo.link_rate_bps",
                              "keep_logs": "demo.keep_logs"})
    parser.add_argument("--workers", type=int, help="number of worker processes (default 4)")
    parser.add_argument("--report", help="write a JSON report to this path")
    parser.add_argument("--target-accuracy", type=float, help="stop at this held-out accuracy (default 0.95)")
    parser.add_argument("--max-versions", type=int, help="stop after this many model versions")
    parser.add_argument("--timeout", type=float, help="give up after this many seconds")
    parser.add_argument("--policy", help="sync, async, ssp or adaptive")
    parser.add_argument("--link-rate", type=float, dest="link_rate",
                        help="uplink bytes/s each worker declares (default 1e6; 0 = measure loopback)")
    parser.add_argument("--quiet", action="store_true", help="plain progress lines, not a bar redrawn in place "
                        "(as when stderr is not a terminal)")
    parser.add_argument("--keep-logs", action="store_true", default=None,
                        help="keep the children's logs after a successful run too (demo.keep_logs)")
    parser.add_argument("--embedded-broker", action="store_true",
                        help="use the embedded amqtt broker even if mosquitto is installed")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    config = cli.load(args)
    cli.setup_logging(args.log_level or "WARNING")
    return run_demo(config, report=args.report, external_broker=args.broker is not None, quiet=args.quiet,
                    embedded_broker=args.embedded_broker)
