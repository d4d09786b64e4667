"""The process spawner: the services and workers of one job as child processes of this host.

``edgemesh demo`` and the benchmarks run a :class:`LocalCluster`. Each child is its own Python
process (``python -m edgemesh ROLE``) with the cluster's whole configuration in a TOML file, its
own log, and its metrics on a free port written to a port file. Children die with the parent
(:func:`parent_death_signal`) and are stopped with SIGTERM, then SIGKILL.

An emulated worker runs in cgroups of its own under the spawner's (``emulation.limits``). When a child ends, the
spawner reads what its memory cgroup recorded and removes it: a child killed by SIGKILL whose cgroup counted an
OOM kill left *for memory* (``out_of_memory``). That is logged, named in :meth:`LocalCluster.failure`, and
published by :meth:`LocalCluster.say_departures` (the device's retained ``left`` status and a ``device_left``
event), as an operator watching the job sees a device that leaves it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from edgemesh.common.config import Config, to_toml
from edgemesh.common.emulation import limits
from edgemesh.common.messages import DeviceStatus, Event
from edgemesh.common.metrics import parse_metrics
from edgemesh.common.topics import Topics

if TYPE_CHECKING:
    from edgemesh.common.bus import Bus

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long children get to exit after SIGTERM before SIGKILL."""
SCRAPE_TIMEOUT_S = 3.0
"""Timeout of one ``/metrics`` request to a child."""
LOG_TAIL_LINES = 15
"""Lines of a failed child's log shown in its failure."""
OUT_OF_MEMORY = "out_of_memory"
"""The reason a child killed by the kernel at its board's memory limit left (events, its ``left`` status)."""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes Linux SIGTERM the child if this process dies without cleanup.

    The signal follows the thread that forked, so it is armed only for children started
    from the main thread (a worker thread of ``asyncio.to_thread`` may end any time).
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def arm() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)

    return arm


@dataclass(slots=True)
class Child:
    role: str
    name: str
    proc: subprocess.Popen[bytes]
    port_file: Path
    log_path: Path
    peak_rss_kb: int = 0
    samples: Samples = field(default_factory=dict)
    """The child's metrics, as last scraped."""
    device: str = ""
    """The device a worker trains as (its ``--device``; else its name)."""
    ending: limits.Ending | None = None
    """What its memory cgroup recorded, once it ended (None: it had none, or runs)."""
    reaped: bool = False
    said: bool = False
    """Its leaving for memory was published (``say_departures``)."""

    @property
    def out_of_memory(self) -> bool:
        """It ended by SIGKILL, and its memory cgroup counted an OOM kill: the kernel ended it at its limit."""
        return self.proc.returncode == -signal.SIGKILL and self.ending is not None and self.ending.out_of_memory

    def memory_reason(self) -> str:
        limit = f" of {self.ending.limit_bytes / 2**20:.0f} MiB" if self.ending is not None else ""
        return f"{OUT_OF_MEMORY}: killed by the kernel at its board's memory limit{limit}"


def peak_rss_kb(pid: int) -> int:
    """Peak resident size of a process (``VmHWM``), KiB; 0 when it is gone."""
    return _status_kb(pid, "VmHWM:")


def rss_kb(pid: int) -> int:
    """Resident size of a process now (``VmRSS``), KiB; 0 when it is gone."""
    return _status_kb(pid, "VmRSS:")


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process so far; 0 when it is gone (or ``pid`` is None)."""
    import psutil

    if pid is None:
        return 0.0
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def scrape(port_file: Path) -> Samples:
    """A child's metrics; its port is in the file it wrote once serving."""
    port = int(port_file.read_text().strip())
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:  # noqa: S310 - our own child
        return parse_metrics(resp.read().decode())


class LocalCluster:
    """The processes of one job. ``config.broker.url`` must point at a running broker."""

    def __init__(self, config: Config, workdir: Path, *, write_config: bool = True, serve_jobs: bool = False) -> None:
        self.cfg = config
        self.workdir = workdir
        self.serve_jobs = serve_jobs
        """The services serve submitted jobs (no ``--job``): ``config.job`` only names the files."""
        self.children: list[Child] = []
        self.config_file = workdir / f"{config.job}.toml"
        if write_config:
            self.config_file.write_text(to_toml(replace(config, job="") if serve_jobs else config))

    @classmethod
    def empty(cls, config: Config, workdir: Path) -> LocalCluster:
        """A cluster that started nothing (for reports of a run that failed early)."""
        return cls(config, workdir, write_config=False)

    def spawn(self, role: str, name: str, extra: list[str] | None = None, *, prefix: list[str] | None = None) -> Child:
        """Start ``edgemesh ROLE`` with the cluster's configuration plus ``extra`` flags (run under ``prefix``,
        e.g. ``ip netns exec NS``, if given).

        Call from the main thread: the parent-death signal of a child is tied to the spawning thread.
        """
        log_path = self.workdir / f"{self.cfg.job}-{name}.log"
        port_file = self.workdir / f"{self.cfg.job}-{name}.port"
        # job and broker are in the file too; on the command line they tell processes apart in `ps` (the
        # config file's name too, which names the job: services serving submitted jobs have no --job)
        job = [] if self.serve_jobs else ["--job", self.cfg.job]
        cmd = [*(prefix or []), sys.executable, "-m", "edgemesh", role, "--config", str(self.config_file), *job,
               "--broker", self.cfg.broker.url,
               "--metrics", "127.0.0.1:0", "--set", f"metrics.port_file={port_file}",
               "--log-level", self.cfg.log_level, *(extra or [])]
        # appended to: a service started again after a crash (a test's kill -9, the soak's churn) goes on after
        # what the crashed one said, which is what tells why it crashed
        log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=parent_death_signal(), env=env)
        log.close()
        flags = extra or []
        device = flags[flags.index("--device") + 1] if "--device" in flags[:-1] else name
        child = Child(role=role, name=name, proc=proc, port_file=port_file, log_path=log_path, device=device)
        self.children.append(child)
        return child

    @property
    def ps_state_dir(self) -> Path:
        """The PS's state directory (checkpoint, write-ahead log, ledger), as ``start_services`` gives it."""
        return self.workdir / f"{self.cfg.job}-ps"

    def start_services(self, *, min_devices: int) -> None:
        """The planner (waiting for ``min_devices`` before its first plan), the PS (one process per shard of
        ``ps.shards``) and the compressor."""
        self.spawn("planner", "planner", ["--set", f"planner.min_devices={min_devices}"])
        shards = self.cfg.ps.shards
        for shard in range(shards):
            which = ["--shard", f"{shard}/{shards}"] if shards > 1 else []
            self.spawn("ps", "ps" if shards == 1 else f"ps-{shard}", ["--state-dir", str(self.ps_state_dir), *which])
        self.spawn("compressor", "compressor")

    def failure(self) -> str | None:
        """The first child that exited on its own, with the end of its log; None while all run.

        Also records every child's peak memory.
        """
        for child in self.children:
            child.peak_rss_kb = max(child.peak_rss_kb, peak_rss_kb(child.proc.pid))
            code = child.proc.poll()
            if code is not None:
                self.reap(child)
                tail = child.log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                how = (f"left for memory ({child.memory_reason()})" if child.out_of_memory
                       else f"exited with code {code}")
                return f"{child.name} {how}:\n  " + "\n  ".join(tail)
        return None

    def reap(self, child: Child) -> None:
        """Once ``child`` ended: read and remove its cgroups (``emulation.limits.release``), and say loudly if the
        kernel killed it for memory."""
        if child.reaped or child.proc.poll() is None:
            return
        child.reaped = True
        root = self.cfg.worker.emulation_cgroup_root
        child.ending = limits.release(child.proc.pid, root=root) if root else None
        if child.out_of_memory:
            logger.error("%s (device %s) left for memory: %s", child.name, child.device, child.memory_reason())

    async def say_departures(self, bus: Bus) -> int:
        """Publish, for every child that left for memory and was not said yet, the device's retained ``left``
        status (reason ``out_of_memory: ...``) and a ``device_left`` event (``data.reason = "out_of_memory"``) on
        the job's topics; how many."""
        topics, said = Topics(self.cfg.job), 0
        for child in self.children:
            self.reap(child)
            if not child.out_of_memory or child.said:
                continue
            child.said, reason = True, child.memory_reason()
            await bus.publish(topics.status(child.device), DeviceStatus(
                device=child.device, state="left", time=time.time(), reason=reason), retain=True)
            await bus.publish(topics.events(), Event(
                kind="device_left", source="local", time=time.time(), message=f"{child.device} left: {reason}",
                data={"device": child.device, "reason": OUT_OF_MEMORY,
                      "limit_bytes": child.ending.limit_bytes if child.ending is not None else 0}))
            said += 1
        return said

    def scrape_all(self) -> None:
        """Read every running child's metrics into ``Child.samples`` (blocking: call in a thread)."""
        for child in self.children:
            if child.proc.poll() is None:
                with contextlib.suppress(Exception):
                    child.samples = scrape(child.port_file)

    def stop(self) -> None:
        """SIGTERM every child, SIGKILL those that do not exit within ``STOP_GRACE_S``."""
        for child in self.children:
            child.peak_rss_kb = max(child.peak_rss_kb, peak_rss_kb(child.proc.pid))
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
            self.reap(child)
        if self.cfg.worker.emulation_cgroup_root:  # children a run stopped itself, no longer in the list
            limits.sweep_children(root=self.cfg.worker.emulation_cgroup_root)

    # ------------------------------------------------------------------ reading
    def total(self, name: str, role: str | None = None, **labels: str) -> float:
        """Sum of a metric over the children (of ``role``), over samples whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for c in self.children if role is None or c.role == role
                   for (n, lab), v in c.samples.items() if n == name and want <= set(lab))

    def over_services(self, suffix: str) -> int:
        """Sum of every ``edgemesh_*{suffix}`` metric of every child (bytes published, received)."""
        return int(sum(v for c in self.children for (n, _), v in c.samples.items()
                       if n.startswith("edgemesh_") and n.endswith(suffix)))

    def peak_rss_mb(self) -> dict[str, float]:
        """Largest peak RSS per role, MiB."""
        rss: dict[str, float] = {}
        for c in self.children:
            rss[c.role] = max(rss.get(c.role, 0.0), c.peak_rss_kb / 1024)
        return {k: round(v, 1) for k, v in rss.items()}

    def samples_of(self, role: str) -> list[Any]:
        return [c.samples for c in self.children if c.role == role]
