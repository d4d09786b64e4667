"""Emulated boards under the kernel's limits: the cgroup v1 memory and cpu controllers (docs/emulation.md).

An emulated worker runs in a cgroup of its own, ``{root}/{controller}/{own}/edgemesh/{device}.{pid}``, where
``{own}`` is the cgroup the process started in. Nesting there keeps whatever limits a service manager (or a
sandbox) already puts on the process, and the pid in the name tells the spawner which cgroup was its child's.

* **memory**: ``memory.limit_in_bytes`` is the board's memory, and so is ``memory.memsw.limit_in_bytes`` where
  the kernel accounts swap (``memory.swappiness`` 0 otherwise): over it the kernel's OOM killer ends the process
  with SIGKILL, as on the board. What the process held before it joined (the interpreter and its imports)
  stays charged where it was: the kernel no longer moves charges with a process.
* **cpu**: ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` caps the process at the board's share of this host's
  CPU (:func:`cpu_share`). The stretch of ``compute`` still holds every training step to the board's time; the
  quota is a ceiling on top, so what the stretch does not slow (encoding, decoding, the MQTT client) runs at
  about the board's pace too. A held step waits only for what the quota did not already take, so the two never
  add up (docs/emulation.md#two-modes).

Where the controllers are not there or not writable (not root, cgroup v2 only, a container), the mode is
``stretched``: today's stretched compute alone, and the reason is said. The worker's own cgroup is removed when
it ends (it moves itself back out first); one killed outright leaves an empty cgroup that its spawner removes
(:func:`release`), or the next emulated worker started under the same cgroup (:func:`sweep`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

Mode = Literal["cgroup-v1", "stretched"]
"""How an emulated board is held to its limits: the kernel's cgroup v1 controllers, or stretched compute only."""
CGROUP_ROOT = "/sys/fs/cgroup"
"""Where the cgroup v1 hierarchies are mounted, one directory per controller."""
GROUP = "edgemesh"
"""The folder of EdgeMesh's cgroups under the process's own cgroup."""
CFS_PERIOD_US = 100_000
"""The CPU quota's period, microseconds (the kernel's default)."""
MIN_QUOTA_CPUS = 0.05
"""The smallest CPU share given: below it (a Pi 3 under heavy time dilation) the interpreter's own work and the
MQTT keepalives would starve; the stretch still holds steps to the board's time."""
MIN_QUOTA_US = 1_000
"""The smallest quota the kernel takes."""


def own_cgroup(controller: str, pid: int | str = "self") -> str | None:
    """The cgroup path (``/a/b``) of process ``pid`` in the v1 hierarchy of ``controller``; None if it has none."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None


def group_dir(root: str | Path, controller: str) -> Path | None:
    """``{root}/{controller}/{own cgroup}/edgemesh``: where this process's children's cgroups go (None: no such
    hierarchy)."""
    own = own_cgroup(controller)
    if own is None:
        return None
    return Path(root, controller, own.lstrip("/"), GROUP)


def cgroup_name(device: str, pid: int) -> str:
    return f"{device}.{pid}"


def cpu_share(board_gflops: float, host_gflops: float, *, threads: int = 1, host_cpus: int | None = None) -> float:
    """The CPUs of this host the board's whole CPU is worth: its all-core rate (time-dilated, if it is) over the
    rate of one host thread (``host_gflops`` measured on ``threads`` threads), at least ``MIN_QUOTA_CPUS`` and at
    most the host's CPUs. The all-core rate, not the training rate: a ceiling with room over the stretch's
    target, so the quota alone does not make a step overrun."""
    if board_gflops <= 0 or host_gflops <= 0:
        raise ValueError("GFLOP/s figures must be > 0")
    per_cpu = host_gflops / max(threads, 1)
    cpus = host_cpus or os.cpu_count() or 1
    return min(max(board_gflops / per_cpu, MIN_QUOTA_CPUS), float(cpus))


def quota_us(cpus: float, period_us: int = CFS_PERIOD_US) -> int:
    """``cpu.cfs_quota_us`` for ``cpus`` CPUs per ``period_us``."""
    return max(round(cpus * period_us), MIN_QUOTA_US)


@dataclass(frozen=True, slots=True)
class Ending:
    """What a process's memory cgroup recorded when it ended."""

    name: str
    oom_kills: int
    """Processes the kernel's OOM killer ended in it (``memory.oom_control``)."""
    limit_bytes: int
    failcnt: int = 0
    """Times its usage hit the limit (reclaim included: not on its own a kill)."""

    @property
    def out_of_memory(self) -> bool:
        return self.oom_kills > 0


_current: Limits | None = None
"""The limits this process entered (``enter``), until it leaves them: a cgroup holds the whole process."""


def current() -> Limits | None:
    """The limits this process runs under, if it entered any (``enter``; None in a process that did not)."""
    return _current


@dataclass(slots=True)
class Limits:
    """The limits this process runs under: its cgroups (``cgroup-v1``) or none (``stretched``, and why)."""

    mode: Mode
    reason: str = ""
    """What is limited (cgroup-v1), or why nothing is (stretched)."""
    memory_bytes: int = 0
    """The memory limit in force (0: none)."""
    memory: Path | None = None
    cpu: Path | None = None
    """The process's cpu cgroup (None: no cpu controller; memory only)."""
    home: dict[Path, Path] = field(default_factory=dict)
    """Each of its cgroups -> the one it came from (it goes back there to end)."""
    cpus: float = 0.0
    """The CPU quota in force, in CPUs (0: none)."""
    period_us: int = CFS_PERIOD_US

    def set_cpus(self, cpus: float, period_us: int = CFS_PERIOD_US) -> float:
        """Cap the process at ``cpus`` CPUs (``cpu.cfs_quota_us`` per ``cpu.cfs_period_us``); the share in force
        (0 where there is no cpu cgroup, or it refused)."""
        if self.cpu is None:
            return 0.0
        try:
            _write(self.cpu / "cpu.cfs_period_us", period_us)
            _write(self.cpu / "cpu.cfs_quota_us", quota_us(cpus, period_us))
        except OSError as exc:
            logger.warning("cpu quota not set in %s: %s", self.cpu, exc)
            return 0.0
        self.cpus, self.period_us = cpus, period_us
        return cpus

    @contextlib.contextmanager
    def cpu_lifted(self) -> Iterator[None]:
        """No CPU quota while inside: for what measures the host (its GFLOP/s, its step times), which the
        stretch's ratio is taken against."""
        if self.cpu is None or not self.cpus:
            yield
            return
        cpus = self.cpus
        with contextlib.suppress(OSError):
            _write(self.cpu / "cpu.cfs_quota_us", -1)
        try:
            yield
        finally:
            self.set_cpus(cpus, self.period_us)

    def close(self) -> None:
        """Move the process back to the cgroups it came from and remove its own."""
        global _current
        if _current is self:
            _current = None
        for mine, home in self.home.items():
            with contextlib.suppress(OSError):
                _write(home / "cgroup.procs", os.getpid())
            _remove(mine)
        self.home.clear()


def sweep(group: Path) -> list[Ending]:
    """Remove the cgroups under ``group`` of processes that are gone (a worker killed outright leaves its own);
    what each recorded."""
    ended = []
    for path in sorted(_children(group, "*.*")):
        pid = path.name.rsplit(".", 1)[-1]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        ending = read_ending(path)
        if _remove(path) and ending is not None:
            ended.append(ending)
    return ended


def sweep_children(*, root: str | Path = CGROUP_ROOT) -> list[Ending]:
    """Remove the cgroups of this process's children (in its own cgroup's group) that are gone (``sweep``)."""
    ended = []
    for controller in ("memory", "cpu"):
        group = group_dir(root, controller)
        if group is not None:
            swept = sweep(group)
            ended += swept if controller == "memory" else []
    return ended


def enter(device: str, memory_bytes: int, *, root: str | Path = CGROUP_ROOT) -> Limits:
    """Put this process under ``memory_bytes`` in a memory cgroup of its own (and a cpu cgroup, for a quota set
    later: ``Limits.set_cpus``); ``stretched`` with the reason where that cannot be done. The result is also
    ``current()``, until closed."""
    global _current
    _current = _enter(device, memory_bytes, root)
    return _current


def _enter(device: str, memory_bytes: int, root: str | Path) -> Limits:
    if not str(root):
        return Limits("stretched", "no cgroup root given")
    memory_group = group_dir(root, "memory")
    if memory_group is None or not memory_group.parent.is_dir():
        return Limits("stretched", f"no cgroup v1 memory controller at {Path(root, 'memory')}")
    for ending in sweep_children(root=root):
        logger.warning("a process of cgroup %s ended%s; its cgroup removed", ending.name,
                       " killed for memory" if ending.out_of_memory else "")
    name = cgroup_name(device, os.getpid())
    limits = Limits("cgroup-v1", memory_bytes=memory_bytes)
    try:
        memory = _make(memory_group / name)
        _limit_memory(memory, memory_bytes)  # before joining: nothing is charged to it yet
        limits.memory = _move_in(memory, limits.home)
    except OSError as exc:
        _remove(memory_group / name)
        limits.close()
        return Limits("stretched", f"cannot use the cgroup v1 memory controller at {memory_group}: {exc}")
    cpu_group = group_dir(root, "cpu")
    try:
        if cpu_group is not None and cpu_group.parent.is_dir():
            limits.cpu = _move_in(_make(cpu_group / name), limits.home)
    except OSError as exc:
        logger.warning("%s: no cpu quota (the cgroup v1 cpu controller at %s refused: %s)", device, cpu_group, exc)
    limits.reason = f"memory {memory_bytes / 2**20:.0f} MiB in {limits.memory}" + (
        "" if limits.cpu is not None else "; no cpu controller: no CPU quota")
    return limits


def release(pid: int, *, root: str | Path = CGROUP_ROOT) -> Ending | None:
    """After child ``pid`` ended: what its memory cgroup recorded (None if it had none), and its cgroups removed.
    For the spawner: its children's cgroups are under the spawner's own cgroup, where they started."""
    ending = None
    for controller in ("memory", "cpu"):
        group = group_dir(root, controller)
        for path in _children(group, f"*.{pid}"):
            if controller == "memory":
                ending = read_ending(path)
            _remove(path)
    return ending


def _children(group: Path | None, pattern: str) -> list[Path]:
    """The cgroups in ``group`` named by ``pattern``; none when it is not there, or goes meanwhile (a worker that
    ends removes the folder once it is empty, while its spawner may be looking in it)."""
    if group is None:
        return []
    try:
        return list(group.glob(pattern))
    except FileNotFoundError:
        return []


def read_ending(memory: Path) -> Ending | None:
    """What memory cgroup ``memory`` recorded: its OOM kills, limit and failures (None if it is gone)."""
    try:
        control = dict(line.split() for line in (memory / "memory.oom_control").read_text().splitlines()
                       if len(line.split()) == 2)
        limit = int((memory / "memory.limit_in_bytes").read_text())
        failcnt = int((memory / "memory.failcnt").read_text())
    except (OSError, ValueError):
        return None
    return Ending(name=memory.name, oom_kills=int(control.get("oom_kill", 0)), limit_bytes=limit, failcnt=failcnt)


# --------------------------------------------------------------------------- files


def _make(path: Path) -> Path:
    """Create cgroup ``path`` (and its group folder, which another process may be pruning just then); a folder
    that is not a cgroup (no ``cgroup.procs`` appears in it) is refused."""
    for _ in range(2):
        path.parent.mkdir(exist_ok=True)
        try:
            path.mkdir(exist_ok=True)
            break
        except FileNotFoundError:  # the group folder was pruned between the two
            continue
    if not (path / "cgroup.procs").exists():
        _remove(path)
        _prune(path.parent)
        raise OSError(f"{path.parent.parent} is not in a cgroup hierarchy")
    return path


def _move_in(path: Path, home: dict[Path, Path]) -> Path:
    """Move this process into cgroup ``path``, noting where it came from (its own cgroup, the group's parent)."""
    _write(path / "cgroup.procs", os.getpid())
    home[path] = path.parent.parent
    return path


def _limit_memory(memory: Path, limit_bytes: int) -> None:
    _write(memory / "memory.limit_in_bytes", limit_bytes)
    swap = memory / "memory.memsw.limit_in_bytes"
    try:
        _write(swap, limit_bytes)  # memory + swap: no swapping past the board's memory
    except OSError:  # no swap accounting: keep the process out of swap instead
        with contextlib.suppress(OSError):
            _write(memory / "memory.swappiness", 0)


def _write(path: Path, value: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


def _remove(path: Path) -> bool:
    """Remove cgroup ``path``, then its group folder if that is empty now."""
    try:
        path.rmdir()
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.warning("cgroup %s not removed: %s", path, exc)
        return False
    _prune(path.parent)
    return True


def _prune(group: Path) -> None:
    """Remove the group folder once no cgroup is left in it (nothing of EdgeMesh's stays behind)."""
    if group.name == GROUP:
        with contextlib.suppress(OSError):  # another process's cgroup is still in it
            group.rmdir()
