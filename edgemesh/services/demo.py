"""``edgemesh demo``: a whole local cluster, each service its own process.

Starts a broker unless one is given (Mosquitto if installed, else the embedded amqtt one),
then the planner, the parameter server, the compressor and N workers; follows the PS's
evaluation events with a progress bar; stops at the target accuracy, the version limit or
the timeout; reads every process's ``/metrics``; prints a summary and writes a JSON report.
Ctrl-C (or SIGTERM) stops every child; none is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from edgemesh.common.broker import BrokerProcess, parent_death_signal
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config, to_toml
from edgemesh.common.errors import EdgeMeshError, WireError
from edgemesh.common.messages import Event
from edgemesh.common.metrics import ServiceMetrics, parse_metrics, sum_samples
from edgemesh.common.topics import Topics

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long children get to exit after SIGTERM before SIGKILL."""
SCRAPE_TIMEOUT_S = 3.0
PROGRESS_WIDTH = 30


@dataclass(slots=True)
class Child:
    role: str
    name: str
    proc: subprocess.Popen[bytes]
    port_file: Path
    log_path: Path
    peak_rss_kb: int = 0
    samples: dict[Any, float] = field(default_factory=dict)


@dataclass(slots=True)
class Progress:
    version: int = 0
    accuracy: float = 0.0
    loss: float = 0.0
    evaluations: int = 0
    reached_at: float | None = None
    stopped_by: str = ""


def _peak_rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _scrape(port_file: Path) -> dict[Any, float]:
    """The child's metrics; its port is in the file it wrote once serving."""
    port = int(port_file.read_text().strip())
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:  # noqa: S310 - our own child
        return parse_metrics(resp.read().decode())


class Demo:
    def __init__(self, config: Config, *, external_broker: bool, quiet: bool, embedded_broker: bool = False) -> None:
        self.cfg = config
        self.external_broker = external_broker
        self.embedded_broker = embedded_broker
        self.quiet = quiet or not sys.stderr.isatty()
        self.children: list[Child] = []
        self.broker: BrokerProcess | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="edgemesh-demo-"))
        self.progress = Progress()
        self.stop = asyncio.Event()
        self.failure: str | None = None
        self._last_line = 0.0

    # ------------------------------------------------------------------ processes
    def _spawn(self, role: str, name: str, extra: list[str]) -> Child:
        log_path = self.workdir / f"{name}.log"
        port_file = self.workdir / f"{name}.port"
        cmd = [sys.executable, "-m", "edgemesh.services.cli", role,
               "--broker", self.cfg.broker.url, "--job", self.cfg.job,
               "--metrics", "127.0.0.1:0", "--set", f"metrics.port_file={port_file}",
               "--log-level", self.cfg.log_level, *extra]
        log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - handed to the child
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=parent_death_signal(), env=env)
        log.close()
        child = Child(role=role, name=name, proc=proc, port_file=port_file, log_path=log_path)
        self.children.append(child)
        return child

    def _start_all(self) -> None:
        if not self.external_broker:
            self.broker = BrokerProcess.embedded() if self.embedded_broker else BrokerProcess.default()
            self.broker.start()
            self.cfg = replace(self.cfg, broker=replace(self.cfg.broker, url=self.broker.url))
        # every child gets the demo's whole configuration (file, environment, flags)
        config_file = self.workdir / "edgemesh.toml"
        config_file.write_text(to_toml(self.cfg))
        common = ["--config", str(config_file)]
        self._spawn("planner", "planner", common + ["--set", f"planner.min_devices={self.cfg.demo.workers}"])
        self._spawn("ps", "ps", common + ["--state-dir", str(self.workdir / "ps")])
        self._spawn("compressor", "compressor", common)
        link = ["--set", f"worker.link_rate_bps={self.cfg.demo.link_rate_bps}"] if self.cfg.demo.link_rate_bps else []
        for i in range(self.cfg.demo.workers):
            self._spawn("worker", f"worker-{i}", common + link + ["--device", f"w{i}"])

    def _stop_all(self) -> None:
        for child in self.children:
            child.peak_rss_kb = max(child.peak_rss_kb, _peak_rss_kb(child.proc.pid))
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs; killing it", child.name, STOP_GRACE_S)
                child.proc.kill()
                child.proc.wait()
        if self.broker is not None:
            self.broker.stop()

    # ------------------------------------------------------------------ watching
    async def _watch(self) -> None:
        topics = Topics(self.cfg.job)
        metrics = ServiceMetrics("demo")
        async with Bus(self.cfg.broker, client_id=f"edgemesh-demo-{uuid.uuid4().hex[:8]}", metrics=metrics,
                       subscriptions=[topics.events()]) as bus:
            async for msg in bus.messages():
                try:
                    event = msg.decode(Event)
                except WireError:
                    continue
                if event.kind != "evaluation" or event.source != "ps":
                    continue
                data = event.data
                p = self.progress
                p.version = int(data.get("version") or 0)
                p.accuracy = float(data.get("accuracy") or 0.0)
                p.loss = float(data.get("loss") or 0.0)
                p.evaluations += 1
                if p.accuracy >= self.cfg.demo.target_accuracy:
                    p.reached_at = time.monotonic()
                    p.stopped_by = "target"
                    self.stop.set()
                elif p.version >= self.cfg.demo.max_versions:
                    p.stopped_by = "max_versions"
                    self.stop.set()

    async def _guard(self) -> None:
        """Fail fast when a child dies on its own; keep peak memory readings."""
        while not self.stop.is_set():
            for child in self.children:
                child.peak_rss_kb = max(child.peak_rss_kb, _peak_rss_kb(child.proc.pid))
                code = child.proc.poll()
                if code is not None:
                    tail = child.log_path.read_text(errors="replace").splitlines()[-15:]
                    self.failure = f"{child.name} exited with code {code}:\n  " + "\n  ".join(tail)
                    self.stop.set()
                    return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await self.stop.wait()

    async def _show(self, started: float) -> None:
        while not self.stop.is_set():
            self._render(started)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.25 if not self.quiet else 5.0):
                    await self.stop.wait()
        self._render(started, final=True)

    def _render(self, started: float, final: bool = False) -> None:
        p = self.progress
        target = self.cfg.demo.target_accuracy
        frac = min(1.0, p.accuracy / target) if target else 0.0
        bar = "#" * int(frac * PROGRESS_WIDTH) + "-" * (PROGRESS_WIDTH - int(frac * PROGRESS_WIDTH))
        line = (f"[{bar}] accuracy {p.accuracy:6.2%} / {target:.0%}  version {p.version:5d}  "
                f"{time.monotonic() - started:6.1f}s")
        if self.quiet:
            if final or time.monotonic() - self._last_line >= 5.0:
                print(line, file=sys.stderr, flush=True)
                self._last_line = time.monotonic()
        else:
            print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)

    async def _main(self) -> float:
        from edgemesh.services.runtime import install_stop_signals

        install_stop_signals(self.stop)
        started = time.monotonic()
        # spawned from the main thread, so the children's parent-death signal is armed:
        # even a kill -9 of the demo leaves no orphan
        self._start_all()
        print(f"edgemesh demo: job {self.cfg.job}, broker {self.cfg.broker.url}"
              f"{'' if self.broker is None else ' (' + self.broker.kind + ')'}, "
              f"{self.cfg.demo.workers} workers, policy {self.cfg.training.sync_policy}; logs in {self.workdir}",
              file=sys.stderr, flush=True)
        tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._guard()),
                 asyncio.create_task(self._show(started))]
        try:
            async with asyncio.timeout(self.cfg.demo.timeout_s):
                await self.stop.wait()
        except TimeoutError:
            self.failure = self.failure or f"timed out after {self.cfg.demo.timeout_s:.0f}s"
            self.stop.set()
        wall = time.monotonic() - started
        for child in self.children:
            if child.proc.poll() is None:
                with contextlib.suppress(Exception):
                    child.samples = await asyncio.to_thread(_scrape, child.port_file)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return wall

    # ------------------------------------------------------------------ report
    def report(self, wall: float) -> dict[str, Any]:
        def total(name: str, role: str | None = None) -> float:
            return sum(sum_samples(c.samples, name) for c in self.children if role is None or c.role == role)

        ps = next((c for c in self.children if c.role == "ps"), None)
        by_codec: dict[str, int] = {}
        accepted = discarded = 0.0
        version = self.progress.version
        if ps is not None:
            for (name, labels), value in ps.samples.items():
                if name == "edgemesh_ps_updates_total":
                    status = dict(labels).get("status")
                    if status == "accepted":
                        accepted += value
                    elif status == "discarded":
                        discarded += value
                elif name == "edgemesh_ps_received_gradient_bytes_total" and value:
                    codec = dict(labels).get("codec", "?")
                    by_codec[codec] = by_codec.get(codec, 0) + int(value)
            version = int(ps.samples.get(("edgemesh_ps_model_version", ()), version))
        def over_services(suffix: str) -> int:
            return int(sum(v for c in self.children for (n, _), v in c.samples.items()
                           if n.startswith("edgemesh_") and n.endswith(suffix)))

        published = over_services("_published_bytes_total")
        rss: dict[str, float] = {}
        for c in self.children:
            rss[c.role] = max(rss.get(c.role, 0.0), c.peak_rss_kb / 1024)
        return {
            "final_accuracy": round(self.progress.accuracy, 4),
            "target_accuracy": self.cfg.demo.target_accuracy,
            "reached_target": self.progress.accuracy >= self.cfg.demo.target_accuracy,
            "wall_seconds": round(wall, 2),
            "model_version": version,
            "evaluated_version": self.progress.version,
            "updates_accepted": int(accepted),
            "updates_discarded": int(discarded),
            "bytes_published": published,
            "bytes_received": over_services("_received_bytes_total"),
            "gradient_bytes": int(total("edgemesh_worker_gradient_bytes_total", "worker")),
            "workers": self.cfg.demo.workers,
            "declared_link_rate_bps": self.cfg.demo.link_rate_bps,
            "sync_policy": self.cfg.training.sync_policy,
            "codec": self.cfg.compressor.default_codec,
            "gradient_bytes_by_codec": by_codec,
            "broker": self.broker.kind if self.broker is not None else self.cfg.broker.url,
            "peak_rss_mb": {k: round(v, 1) for k, v in rss.items()},
            "stopped_by": self.progress.stopped_by or ("failure" if self.failure else "signal"),
            "failure": self.failure,
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


def run_demo(config: Config, *, report: str | None, external_broker: bool, quiet: bool = False,
             embedded_broker: bool = False) -> int:
    """Run the demo; returns the process exit code (0 when the target was reached)."""
    if config.job == "default":
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
        path = Path(report)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\n  report written to {path}")
    if demo.failure:
        print(f"\nedgemesh demo: {demo.failure}", file=sys.stderr)
        return 1
    if not result["reached_target"]:
        print(f"\nedgemesh demo: stopped ({result['stopped_by']}) before reaching the target accuracy",
              file=sys.stderr)
        if result["stopped_by"] != "max_versions":
            return 3
    if os.environ.get("EDGEMESH_KEEP_LOGS") != "1":
        shutil.rmtree(demo.workdir, ignore_errors=True)
    return 0
