"""Fault injection with a ledger: one run of real processes through every failure the issue names.

Planner, parameter server, compressor and three workers train digits under ``adaptive`` on a Mosquitto of the
test's own. One worker lives in a network namespace of the test's own, reaching the broker over a veth pair.
In one run:

1. that worker's link goes down for 60 s (the test takes the host end of the veth pair down): a real
   partition, which only keepalives notice;
2. meanwhile another worker is killed with SIGKILL (its will goes out at once) and started again;
3. the parameter server is killed with SIGKILL and started again from its checkpoint and log;
4. the broker is stopped with SIGTERM and started again, then killed with SIGKILL and started again.

A client of the test watches plans, statuses and acks throughout. Afterwards the workers' ack logs are
compared with the PS's ledger (``edgemesh.bench.audit``): every update a worker saw acked was applied
exactly once, and model versions never went back; training went on within 10 s of the broker's return, and
a re-plan came within 5 s of each will.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import WAIT_S, require_binary, require_root, until

from edgemesh.bench.audit import audit
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config, load_config
from edgemesh.common.messages import DeviceStatus, Plan, UpdateAck
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.broker import BrokerProcess, free_port
from edgemesh.local.processes import Child, LocalCluster

JOB = "faults"
DEVICES = ("w1", "w2", "w3")
PARTITIONED = "w3"
KILLED = "w2"
PARTITION_S = 60.0
KEEPALIVE_S = 10
"""The clients' MQTT keepalive: the broker gives up on a silent client after 1.5 times this."""
RESUME_S = 10.0
"""Training goes on within this long after the broker is back."""
REPLAN_S = 5.0
"""A new plan follows a device's will within this long."""
PHASE_S = 90.0
"""Longest wait for any one phase (training under way again, a rejoin)."""


# --------------------------------------------------------------------------- a partitionable link


@dataclass
class Namespace:
    """A network namespace joined to this host's by a veth pair; the host end can be taken down."""

    name: str
    host_end: str
    host_ip: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def link(self, up: bool) -> None:
        subprocess.run(["ip", "link", "set", self.host_end, "up" if up else "down"], check=True, timeout=10)


@contextlib.contextmanager
def namespace() -> Iterator[Namespace]:
    require_root("a network namespace (the partitioned worker)")
    require_binary("ip")
    tag = uuid.uuid4().hex[:6]
    name, host_end, ns_end = f"emf{tag}", f"emh{tag}", f"emn{tag}"
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    host_ip, ns_ip = f"{subnet}.1", f"{subnet}.2"

    def ip(*args: str, ns: bool = False) -> None:
        prefix = ["ip", "netns", "exec", name] if ns else []
        subprocess.run([*prefix, "ip", *args], check=True, timeout=10, capture_output=True)

    try:
        ip("netns", "add", name)
        ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        ip("link", "set", ns_end, "netns", name)
        ip("addr", "add", f"{host_ip}/30", "dev", host_end)
        ip("link", "set", host_end, "up")
        ip("addr", "add", f"{ns_ip}/30", "dev", ns_end, ns=True)
        ip("link", "set", ns_end, "up", ns=True)
        ip("link", "set", "lo", "up", ns=True)
        yield Namespace(name, host_end, host_ip)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=10, capture_output=True)
        subprocess.run(["ip", "link", "del", host_end], check=False, timeout=10, capture_output=True)


# --------------------------------------------------------------------------- what a watcher sees


@dataclass
class Watch:
    """Plans, statuses and acks with the time each arrived."""

    acks: list[tuple[float, UpdateAck]] = field(default_factory=list)
    plans: list[tuple[float, Plan]] = field(default_factory=list)
    statuses: list[tuple[float, DeviceStatus]] = field(default_factory=list)

    async def on_ack(self, ack: UpdateAck, _: TopicMatch) -> None:
        self.acks.append((time.monotonic(), ack))

    async def on_plan(self, plan: Plan, _: TopicMatch) -> None:
        self.plans.append((time.monotonic(), plan))

    async def on_status(self, status: DeviceStatus, _: TopicMatch) -> None:
        self.statuses.append((time.monotonic(), status))

    def accepted_since(self, t: float, device: str = "") -> list[UpdateAck]:
        return [a for at, a in self.acks if at >= t and a.status == "accepted" and (not device or a.device == device)]

    def first_accepted(self, t: float, device: str = "", above: int = -1) -> float:
        """When the first ack ``accepted`` at or after ``t`` came (of ``device``, if given; naming a version above
        ``above``); 0 if none has."""
        return min((at for at, a in self.acks if at >= t and a.status == "accepted" and a.version > above
                    and (not device or a.device == device)), default=0.0)

    def will_after(self, t: float, device: str) -> float | None:
        return next((at for at, s in self.statuses if at >= t and s.device == device and s.state == "offline"),
                    None)

    def plan_without_after(self, t: float, device: str) -> float | None:
        return next((at for at, p in self.plans if at >= t and p.device(device) is None and p.devices), None)


# --------------------------------------------------------------------------- the run


def cluster_config(broker: BrokerProcess, tmp_path: Path) -> Config:
    return load_config(env={}, overrides={
        "job": JOB, "broker.url": broker.url, "broker.keepalive_s": str(KEEPALIVE_S),
        "broker.backoff_initial_s": "0.05", "broker.backoff_max_s": "0.5", "broker.connect_timeout_s": "3",
        "training.sync_policy": "adaptive", "ps.checkpoint_every": "50", "ps.eval_every": "20",
        "worker.ack_timeout_s": "2", "worker.codec_wait_s": "0.5", "planner.replan_debounce_s": "0.3"})


def worker_flags(tmp_path: Path, device: str) -> list[str]:
    return ["--device", device, "--set", f"worker.state_dir={tmp_path / device}",
            "--set", f"worker.ack_log={tmp_path / f'{device}.acked'}"]


def replace(cluster: LocalCluster, child: Child, extra: list[str], prefix: list[str] | None = None) -> Child:
    """Kill ``child`` with SIGKILL and start its role again with ``extra`` flags."""
    child.proc.kill()
    child.proc.wait(timeout=WAIT_S)
    cluster.children.remove(child)
    return cluster.spawn(child.role, child.name, extra, prefix=prefix)


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.requires_root("a network namespace (the partitioned worker)")
@pytest.mark.requires_binary("mosquitto", "ip")
async def test_every_acked_update_is_applied_once_through_crashes_and_a_partition(tmp_path: Path) -> None:
    ns_port = free_port()
    broker = BrokerProcess.mosquitto(extra_config=f"listener {ns_port}\n", workdir=tmp_path / "broker")
    watch = Watch()
    topics = Topics(JOB)
    figures: dict[str, object] = {}
    with broker, namespace() as ns:
        cfg = cluster_config(broker, tmp_path)
        cluster = LocalCluster(dataclasses.replace(cfg, log_level="INFO"), tmp_path)
        ps_flags = ["--state-dir", str(tmp_path / f"{JOB}-ps")]
        try:
            cluster.start_services(min_devices=len(DEVICES))
            workers: dict[str, Child] = {}
            for d in DEVICES:
                if d == PARTITIONED:
                    workers[d] = cluster.spawn("worker", d, [*worker_flags(tmp_path, d), "--broker",
                                                             f"mqtt://{ns.host_ip}:{ns_port}"],
                                               prefix=ns.exec_prefix())
                else:
                    workers[d] = cluster.spawn("worker", d, worker_flags(tmp_path, d))
            bus = Bus(cfg.broker, client_id="fault-watch", metrics=ServiceMetrics("watch"))
            bus.route(topics.ack_filter("+"), UpdateAck, watch.on_ack)
            bus.route(topics.plan_filter(), Plan, watch.on_plan)
            bus.route(topics.status_filter(), DeviceStatus, watch.on_status)
            async with bus:
                await run_faults(cluster, broker, ns, workers, watch, tmp_path, ps_flags, figures)
            assert cluster.failure() is None, cluster.failure()
        finally:
            cluster.stop()
    result = audit(tmp_path / f"{JOB}-ps" / "ledger.log",
                   {d: tmp_path / f"{d}.acked" for d in DEVICES})
    assert result.acked >= 50, result.as_dict()
    assert result.lost == [] and result.applied_twice == [], result.as_dict()
    assert result.versions_back == 0
    versions = [a.version for _, a in watch.acks if a.status == "accepted"]
    assert versions == sorted(versions)  # the acked model version never went back, PS crash included
    figures.update(result.as_dict(), final_version=versions[-1])
    print("fault injection:", json.dumps(figures))  # the figures behind docs/reliability.md


async def run_faults(cluster: LocalCluster, broker: BrokerProcess, ns: Namespace, workers: dict[str, Child],
                     watch: Watch, tmp_path: Path, ps_flags: list[str], figures: dict[str, object]) -> None:
    def training(since: float, device: str = "", n: int = 3) -> bool:
        return len(watch.accepted_since(since, device)) >= n

    def alive() -> str | None:  # a service that exited, or the broker when no step of the test stopped it
        if not broker.running and not stopping:
            return f"the broker exited with code {broker.returncode}:\n{broker.log_text()[-2000:]}"
        return cluster.failure()

    stopping = False

    start = time.monotonic()
    await until("every worker training", lambda: all(training(start, d) for d in DEVICES) or alive(), PHASE_S)
    assert alive() is None, alive()

    # 1. the partition starts
    cut = time.monotonic()
    await asyncio.to_thread(ns.link, False)

    # 2. a worker killed with SIGKILL: its will, a plan without it within 5 s; then it comes back
    killed_at = time.monotonic()
    workers[KILLED] = replace(cluster, workers[KILLED], worker_flags(tmp_path, KILLED))
    await until("the killed worker's will and a plan without it",
                lambda: (w := watch.will_after(killed_at, KILLED)) and watch.plan_without_after(w, KILLED), WAIT_S)
    will = watch.will_after(killed_at, KILLED)
    replanned = watch.plan_without_after(will or 0, KILLED)
    assert will is not None and replanned is not None and replanned - will <= REPLAN_S, (will, replanned)
    figures["replan_after_kill_s"] = round(replanned - will, 3)
    back = time.monotonic()
    await until("the killed worker back", lambda: training(back, KILLED) or alive(), PHASE_S)
    assert alive() is None, alive()

    # 3. the parameter server killed with SIGKILL, started again from its checkpoint and log
    before = max((a.version for _, a in watch.acks), default=0)
    ps = next(c for c in cluster.children if c.role == "ps")
    crashed = time.monotonic()
    replace(cluster, ps, ps_flags)
    await until("training after the PS restart", lambda: training(crashed) or alive(), PHASE_S)
    assert alive() is None, alive()
    assert min(a.version for a in watch.accepted_since(crashed)) >= before  # it went on where it was
    # the new process's: the old one may have applied one more version before it died, acked as it died
    await until("an ack of the restarted PS", lambda: watch.first_accepted(crashed, above=before + 1), PHASE_S)
    figures["training_after_ps_kill_s"] = round(watch.first_accepted(crashed, above=before + 1) - crashed, 3)

    # the partitioned worker's will (keepalive expiry): a plan without it within 5 s
    await until("the partitioned worker's will", lambda: watch.will_after(cut, PARTITIONED), 3 * KEEPALIVE_S)
    will = watch.will_after(cut, PARTITIONED)
    await until("a plan without the partitioned worker",
                lambda: watch.plan_without_after(will or 0, PARTITIONED), REPLAN_S + 1)
    replanned = watch.plan_without_after(will or 0, PARTITIONED)
    assert will is not None and replanned is not None and replanned - will <= REPLAN_S, (will, replanned)
    figures["will_after_partition_s"] = round(will - cut, 3)
    figures["replan_after_partition_will_s"] = round(replanned - will, 3)

    # 4. the broker: SIGTERM then back, SIGKILL then back; training goes on within 10 s each time
    for stop in (broker.stop, broker.kill):
        stopping = True
        await asyncio.to_thread(stop)
        await asyncio.to_thread(broker.start)
        stopping = False
        returned = time.monotonic()
        await until("training after the broker's return",
                    lambda returned=returned: training(returned, n=1) or alive(), PHASE_S)
        assert alive() is None, alive()
        resumed = watch.first_accepted(returned)
        assert resumed - returned <= RESUME_S, f"training resumed {resumed - returned:.1f}s after the broker"
        figures[f"training_after_broker_{stop.__name__}_s"] = round(resumed - returned, 3)

    # the partition ends after 60 s: the worker comes back and trains
    await asyncio.sleep(max(0.0, cut + PARTITION_S - time.monotonic()))  # the partition's length, by design
    healed = time.monotonic()
    await asyncio.to_thread(ns.link, True)
    await until("the partitioned worker back", lambda: training(healed, PARTITIONED) or alive(), PHASE_S)
    assert alive() is None, alive()
    figures["partitioned_worker_back_s"] = round(watch.first_accepted(healed, PARTITIONED) - healed, 3)
