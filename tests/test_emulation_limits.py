"""Emulated boards under the kernel's limits (edgemesh/common/emulation/limits.py): a worker process in its own
cgroups under its board's memory and CPU share, an out-of-memory kill told from any other kill and reported by
the spawner as the device leaving for memory, nothing left behind, and stretched compute where cgroups cannot be
used.

The processes under limits are small Python children that enter them through the worker's own entry
(``command.board_limits``) and build the worker's ``EmulatedBoard``; the test process itself never enters a
cgroup. Limits are 64-128 MiB.
"""

from __future__ import annotations

import asyncio
import json
import platform
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import WAIT_S, inbox, make_config, missing_requirement

from edgemesh.bench.mesh import limits_in_force
from edgemesh.common.config import load_config
from edgemesh.common.emulation import limits
from edgemesh.common.emulation.profiles import get_profile
from edgemesh.common.messages import DeviceStatus, Event
from edgemesh.common.metrics import ServiceMetrics, parse_metrics
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import OUT_OF_MEMORY, Child, LocalCluster
from edgemesh.services.worker.board import EmulatedBoard
from edgemesh.services.worker.command import board_limits
from edgemesh.services.worker.link import LinkMeter

MIB = 2**20
HOST_GFLOPS = 50.0
"""The host's GFLOP/s per thread the children are given (not benchmarked)."""
DILATION = 2.0
CHILD = """
import json, sys
from prometheus_client import generate_latest
from edgemesh.common.config import load_config
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.services.worker.board import EmulatedBoard
from edgemesh.services.worker.command import board_limits
from edgemesh.services.worker.link import LinkMeter

settings = json.loads(sys.argv[1])
config = load_config(env={}, overrides=settings["config"])
with board_limits(config) as held:
    metrics = ServiceMetrics("worker")
    board = EmulatedBoard(config.worker, config.worker.device, LinkMeter(0.0), metrics, config.broker)
    board.measure()
    def quota():
        return int((held.cpu / "cpu.cfs_quota_us").read_text()) if held.cpu else None
    with held.cpu_lifted():
        lifted = quota()
    print(json.dumps({"mode": held.mode, "reason": held.reason, "memory": str(held.memory), "cpu": str(held.cpu),
                      "quota_us": quota(), "period_us": int((held.cpu / "cpu.cfs_period_us").read_text()),
                      "lifted_us": lifted, "metrics": generate_latest(metrics.registry).decode()}), flush=True)
    block = b"\\x01" * (settings["allocate_mib"] * 2**20)  # every page written
    print("allocated", flush=True)
    sys.stdin.readline()  # until the test lets it go
print("closed", flush=True)
"""
"""A worker's start as far as its limits go: enter them, build and measure the emulated board, say what holds
(one JSON line), allocate, wait for a line on stdin, leave them."""


def worker_settings(device: str, memory_mib: int, **more: str) -> dict[str, str]:
    return {"worker.emulate": "pi3", "worker.device": device, "worker.memory_bytes": str(memory_mib * MIB),
            "worker.emulation_host_gflops": str(HOST_GFLOPS), "worker.emulation_dilation": str(DILATION), **more}


def start_board(log: Path, device: str, *, memory_mib: int, allocate_mib: int) -> subprocess.Popen[str]:
    """A child process under a pi3's limits with ``memory_mib`` of memory that allocates ``allocate_mib``."""
    settings = {"config": worker_settings(device, memory_mib), "allocate_mib": allocate_mib}
    with open(log, "a") as err:
        return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(settings)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)


async def line_of(proc: subprocess.Popen[str]) -> str:
    """The child's next line of output (fails after ``WAIT_S``)."""
    assert proc.stdout is not None
    async with asyncio.timeout(WAIT_S):
        return (await asyncio.to_thread(proc.stdout.readline)).strip()


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """The test's children, killed and reaped (their cgroups released) if still running at its end."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)
        limits.release(proc.pid)


def cgroup_of(pid: int, controller: str) -> Path:
    """Where process ``pid`` is in ``controller``'s hierarchy."""
    own = limits.own_cgroup(controller, pid)
    assert own is not None
    return Path(limits.CGROUP_ROOT, controller, own.lstrip("/"))


def spawned(cluster: LocalCluster, proc: subprocess.Popen[str], device: str, log: Path) -> Child:
    """``proc`` as the local cluster's child worker ``device``."""
    child = Child(role="worker", name=f"worker-{device}", proc=proc, port_file=log.with_suffix(".port"), log_path=log,
                  device=device)
    cluster.children.append(child)
    return child


# --------------------------------------------------------------------------- under cgroup v1


@pytest.mark.requires_root("creating cgroups")
async def test_a_board_within_its_memory_runs_under_its_limits_and_leaves_nothing_behind(
        tmp_path: Path, children: list[subprocess.Popen[str]]) -> None:
    proc = start_board(tmp_path / "w.log", "within", memory_mib=128, allocate_mib=32)
    children.append(proc)
    held = json.loads(await line_of(proc))
    assert held["mode"] == "cgroup-v1", held["reason"]
    memory, cpu = Path(held["memory"]), Path(held["cpu"])
    assert cgroup_of(proc.pid, "memory") == memory and cgroup_of(proc.pid, "cpu") == cpu
    assert int((memory / "memory.limit_in_bytes").read_text()) == 128 * MIB
    assert await line_of(proc) == "allocated"  # 32 MiB under 128: unaffected
    ending = limits.read_ending(memory)
    assert ending is not None and ending.oom_kills == 0
    proc.stdin.write("\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    assert await line_of(proc) == "closed"
    assert proc.wait(timeout=WAIT_S) == 0
    assert not memory.exists() and not cpu.exists()
    assert not any(memory.parent.parent.glob(f"{limits.GROUP}/*.{proc.pid}"))


@pytest.mark.requires_root("creating cgroups")
async def test_the_cpu_quota_is_the_boards_share_of_the_host_and_lifted_to_measure_it(
        tmp_path: Path, children: list[subprocess.Popen[str]]) -> None:
    proc = start_board(tmp_path / "w.log", "quota", memory_mib=128, allocate_mib=1)
    children.append(proc)
    held = json.loads(await line_of(proc))
    pi3 = get_profile("pi3")
    share = limits.cpu_share(pi3.gflops / DILATION, HOST_GFLOPS)  # the time-dilated board's whole CPU
    assert share == pytest.approx(pi3.gflops / DILATION / HOST_GFLOPS)
    assert held["period_us"] == limits.CFS_PERIOD_US
    assert held["quota_us"] == limits.quota_us(share) == round(share * limits.CFS_PERIOD_US)
    assert held["lifted_us"] == -1  # what measures the host runs unthrottled; the quota is back after
    metrics = parse_metrics(held["metrics"])
    assert metrics[("edgemesh_worker_emulation_limits", (("mode", "cgroup-v1"),))] == 1
    assert metrics[("edgemesh_worker_emulation_limits", (("mode", "stretched"),))] == 0
    assert metrics[("edgemesh_worker_emulation_memory_limit_bytes", ())] == 128 * MIB
    assert metrics[("edgemesh_worker_emulation_cpu_quota_cpus", ())] == pytest.approx(share)


@pytest.mark.requires_root("creating cgroups")
async def test_a_board_over_its_memory_is_killed_and_its_spawner_says_it_left_for_memory(
        mosquitto_broker: BrokerProcess, tmp_path: Path, children: list[subprocess.Popen[str]]) -> None:
    config = make_config(mosquitto_broker, job=f"oom-{uuid.uuid4().hex[:6]}")
    cluster = LocalCluster.empty(config, tmp_path)
    log = tmp_path / "worker-big.log"
    proc = start_board(log, "big", memory_mib=64, allocate_mib=200)
    children.append(proc)
    child = spawned(cluster, proc, "big", log)
    held = json.loads(await line_of(proc))
    assert held["mode"] == "cgroup-v1", held["reason"]
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    failure = cluster.failure()
    assert failure is not None and failure.startswith("worker-big left for memory")
    assert child.out_of_memory and child.ending is not None and child.ending.limit_bytes == 64 * MIB
    assert not Path(held["memory"]).exists() and not Path(held["cpu"]).exists()  # the spawner removed them
    topics = Topics(config.job)
    async with inbox(config, (topics.status_filter(), DeviceStatus), (topics.events_filter(), Event)) as box:
        assert await cluster.say_departures(box.bus) == 1
        status = await box.next(DeviceStatus, lambda s: s.device == "big")
        event = await box.next(Event, lambda e: e.kind == "device_left")
        assert await cluster.say_departures(box.bus) == 0  # said once
    assert status.state == "left" and status.reason.startswith(OUT_OF_MEMORY)
    assert event.data == {"device": "big", "reason": OUT_OF_MEMORY, "limit_bytes": 64 * MIB}


@pytest.mark.requires_root("creating cgroups")
async def test_a_kill_that_is_not_for_memory_is_not_reported_as_one(
        tmp_path: Path, children: list[subprocess.Popen[str]]) -> None:
    config = load_config(env={}, overrides={"job": "kill"})
    cluster = LocalCluster.empty(config, tmp_path)
    log = tmp_path / "worker-killed.log"
    proc = start_board(log, "killed", memory_mib=128, allocate_mib=8)
    children.append(proc)
    child = spawned(cluster, proc, "killed", log)
    held = json.loads(await line_of(proc))
    assert await line_of(proc) == "allocated"
    proc.kill()
    assert proc.wait(timeout=WAIT_S) == -signal.SIGKILL
    failure = cluster.failure()
    assert failure is not None and failure.startswith("worker-killed exited with code -9")
    assert not child.out_of_memory and child.ending is not None and child.ending.oom_kills == 0
    assert not Path(held["memory"]).exists() and not Path(held["cpu"]).exists()


@pytest.mark.requires_root("creating cgroups")
def test_the_cgroup_of_a_process_killed_outright_is_swept_by_the_next(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", ""])  # a pid that is gone
    dead.wait(timeout=WAIT_S)
    group = limits.group_dir(limits.CGROUP_ROOT, "memory")
    assert group is not None
    group.mkdir(exist_ok=True)
    stale = group / limits.cgroup_name("ghost", dead.pid)
    stale.mkdir()
    try:
        swept = limits.sweep_children()
        assert [e.name for e in swept] == [stale.name] and not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()


# --------------------------------------------------------------------------- the fallback


def stretched_board(tmp_path: Path, root: Path) -> tuple[limits.Limits, ServiceMetrics, str]:
    """Enter a pi3's limits with the cgroup root at ``root`` (in this process: nothing can be entered there) and
    build its board; the limits, the board's metrics and its description."""
    config = load_config(env={}, overrides=worker_settings("fallback", 64, **{
        "worker.emulation_cgroup_root": str(root)}))
    with board_limits(config) as held:
        assert held is not None and limits.current() is held
        metrics = ServiceMetrics("worker")
        board = EmulatedBoard(config.worker, "fallback", LinkMeter(0.0), metrics, config.broker)
        board.measure()
        described = board.describe()
    assert limits.current() is None
    return held, metrics, described


def metric(metrics: ServiceMetrics, name: str, **labels: str) -> Any:
    return metrics.registry.get_sample_value(f"edgemesh_worker_{name}", labels)


def test_without_a_cgroup_hierarchy_the_board_is_stretched_and_says_so(tmp_path: Path) -> None:
    held, metrics, described = stretched_board(tmp_path, tmp_path / "missing")
    assert held.mode == "stretched" and "no cgroup v1 memory controller" in held.reason
    assert metric(metrics, "emulation_limits", mode="stretched") == 1
    assert metric(metrics, "emulation_limits", mode="cgroup-v1") == 0
    assert metric(metrics, "emulation_memory_limit_bytes") == 0
    assert metric(metrics, "emulation_cpu_quota_cpus") == 0
    assert "limits stretched" in described


def test_a_cgroup_root_that_is_not_a_cgroup_hierarchy_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    own = limits.own_cgroup("memory")
    if own is None:
        missing_requirement("this process is in no cgroup v1 memory hierarchy to mirror")
    mirrored = tmp_path / "memory" / own.lstrip("/")
    mirrored.mkdir(parents=True)  # writable, but a plain folder: no cgroup.procs appears in what is made in it
    held, metrics, _ = stretched_board(tmp_path, tmp_path)
    assert held.mode == "stretched" and "not in a cgroup hierarchy" in held.reason
    assert metric(metrics, "emulation_limits", mode="stretched") == 1
    assert list(mirrored.iterdir()) == []  # nothing left behind


def test_no_cgroup_root_means_stretched_compute_alone(tmp_path: Path) -> None:
    held, _, _ = stretched_board(tmp_path, Path(""))
    assert held.mode == "stretched"


def test_the_cpu_share_is_the_boards_whole_cpu_over_one_host_thread_within_bounds() -> None:
    assert limits.cpu_share(10.0, 50.0) == pytest.approx(0.2)
    assert limits.cpu_share(10.0, 100.0, threads=2) == pytest.approx(0.2)  # the host rate was of two threads
    assert limits.cpu_share(0.1, 50.0) == limits.MIN_QUOTA_CPUS
    assert limits.cpu_share(500.0, 50.0, host_cpus=2) == 2.0
    assert limits.quota_us(0.001) == limits.MIN_QUOTA_US


def test_the_bench_report_says_which_limits_held() -> None:
    def worker(mode: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {("edgemesh_worker_emulation_limits", (("mode", m),)): float(m == mode)
                for m in ("cgroup-v1", "stretched")}

    assert limits_in_force([worker("cgroup-v1"), worker("cgroup-v1")]) == "cgroup-v1"
    assert limits_in_force([worker("stretched")]) == "stretched"
    assert limits_in_force([worker("cgroup-v1"), worker("stretched")]) == "mixed"
    assert limits_in_force([{}]) is None


def test_a_worker_holds_glibcs_allocator_to_what_training_holds() -> None:
    """``worker.lean_allocator`` (on by default): glibc's mmap threshold fixed and its heaps capped, in a process of
    its own (``mallopt`` changes the calling process)."""
    assert load_config(env={}).worker.lean_allocator
    probe = "from edgemesh.common import allocator; print(allocator.lean())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ("True" if platform.libc_ver()[0] == "glibc" else "False")
