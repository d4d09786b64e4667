"""The planner: the data-parallel layout (pure) and the service on real brokers.

Service tests run the planner in-process against each broker of the ``broker`` fixture and
drive it with a test ``Bus`` that plays the devices and the operator. Every wait is bounded
by :data:`WAIT`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import pytest

from edgemesh.common import wire
from edgemesh.common.broker import BrokerProcess
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config, TrainingConfig, load_config
from edgemesh.common.messages import ControlReply, DeviceHello, DeviceStatus, Event, Plan
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.planner.layout import plan_data_parallel
from edgemesh.services.planner.mesh import DeviceInfo, cluster_name
from edgemesh.services.planner.service import Planner

WAIT = 10.0
"""Seconds any single expected event may take."""
DEBOUNCE = 0.2
"""Re-plan debounce of the planners under test: joins within it give one plan."""
JOB = "t-planner"
TOPICS = Topics(JOB)
GIB = 1 << 30
T = TypeVar("T")


# --------------------------------------------------------------------------- layout (pure)


def info(name: str, flops: float = 1e9) -> DeviceInfo:
    return DeviceInfo(device=name, flops=flops, memory_bytes=GIB, link_rate_bps=1e6)


def test_layout_gives_each_device_its_own_cluster_and_shard_in_name_order() -> None:
    training = TrainingConfig(batch_size=16, sync_policy="adaptive", staleness_bound=3, seed=7,
                              partition="dirichlet", partition_alpha=0.3)
    plan = plan_data_parallel([info("pi-b"), info("pi-c", 5e9), info("pi-a")], version=4, training=training,
                              reason="join", created=123.0)

    assert [(d.device, d.cluster, d.shard_index, d.shard_count) for d in plan.devices] == [
        ("pi-a", "c-pi-a", 0, 3), ("pi-b", "c-pi-b", 1, 3), ("pi-c", "c-pi-c", 2, 3)]
    assert [(c.cluster, c.members) for c in plan.clusters] == [
        ("c-pi-a", ("pi-a",)), ("c-pi-b", ("pi-b",)), ("c-pi-c", ("pi-c",))]
    assert {d.batch_size for d in plan.devices} == {16}  # uniform until the adaptive policy
    assert (plan.version, plan.reason, plan.created) == (4, "join", 123.0)
    assert (plan.model_spec, plan.dataset, plan.partition, plan.partition_alpha, plan.seed) == (
        training.model_spec, training.dataset, "dirichlet", 0.3, 7)
    assert (plan.sync_policy, plan.staleness_bound) == ("adaptive", 3)
    assert wire.decode(wire.encode(plan), Plan) == plan


def test_layout_is_independent_of_input_order() -> None:
    training = TrainingConfig()
    devices = [info(f"d{i}") for i in range(6)]
    first = plan_data_parallel(devices, version=1, training=training, reason="start")
    second = plan_data_parallel(list(reversed(devices)), version=1, training=training, reason="start")
    assert first == second


def test_layout_of_no_devices_is_an_empty_plan() -> None:
    plan = plan_data_parallel([], version=9, training=TrainingConfig(), reason="leave")
    assert plan.devices == () and plan.clusters == () and plan.version == 9


def test_layout_refuses_a_device_twice() -> None:
    with pytest.raises(ValueError, match="twice"):
        plan_data_parallel([info("a"), info("a")], version=1, training=TrainingConfig(), reason="join")


def test_cluster_names_of_long_device_names_stay_valid_and_distinct() -> None:
    long_a, long_b = "a" * 63 + "x", "a" * 63 + "y"
    assert cluster_name(["pi-1"]) == "c-pi-1"
    names = {cluster_name([long_a]), cluster_name([long_b])}
    assert len(names) == 2 and all(len(n) <= 64 for n in names)
    plan = plan_data_parallel([info(long_a), info(long_b)], version=1, training=TrainingConfig(), reason="join")
    assert {d.cluster for d in plan.devices} == names


def test_device_info_from_hello() -> None:
    hello = DeviceHello(device="pi", incarnation=1, flops=2e9, memory_bytes=GIB, link_rate_bps=5e5)
    assert DeviceInfo.from_hello(hello) == DeviceInfo(device="pi", flops=2e9, memory_bytes=GIB, link_rate_bps=5e5)


def test_the_planner_does_not_import_torch() -> None:
    """The planner runs on small hosts without torch."""
    code = "import sys, edgemesh.services.planner.service; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=WAIT).returncode == 0


# --------------------------------------------------------------------------- helpers


def make_config(broker: BrokerProcess, **overrides: object) -> Config:
    return load_config(env={}, overrides={
        "broker.url": broker.url, "job": JOB, "metrics.address": "127.0.0.1:0",
        "planner.replan_debounce_s": DEBOUNCE, "broker.backoff_initial_s": 0.05, **overrides,
    })


@contextlib.asynccontextmanager
async def running(planner: Planner) -> AsyncIterator[Planner]:
    """The planner's ``run()`` as a task, once it is subscribed and has settled; stopped on exit."""
    task = asyncio.create_task(planner.run())
    try:
        async with asyncio.timeout(WAIT):
            await planner.ready.wait()
        yield planner
    finally:
        planner.stop.set()
        async with asyncio.timeout(WAIT):
            await task


class Inbox:
    """A test client's received messages: waits for one kind, keeping the others for later."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._kept: list[object] = []

    async def next(self, kind: type[T], predicate: Callable[[T], bool] = lambda _: True) -> T:
        """The oldest not yet taken message of ``kind`` that satisfies ``predicate``."""
        for i, msg in enumerate(self._kept):
            if isinstance(msg, kind) and predicate(msg):
                del self._kept[i]
                return msg
        async with asyncio.timeout(WAIT):
            while True:
                incoming = await self.bus.next_message(WAIT)
                msg = incoming.decode((Plan, ControlReply, Event))
                if isinstance(msg, kind) and predicate(msg):
                    return msg
                self._kept.append(msg)

    async def plan(self) -> Plan:
        return await self.next(Plan)

    async def reply(self, request_id: str = "") -> ControlReply:
        return await self.next(ControlReply, lambda r: not request_id or r.request_id == request_id)

    async def publish(self, topic: str, msg: object, *, retain: bool = False) -> None:
        await self.bus.publish(topic, msg, retain=retain)


@contextlib.asynccontextmanager
async def device_bus(config: Config) -> AsyncIterator[Inbox]:
    """A client playing devices and operator, subscribed to plans, events and control replies."""
    async with Bus(config.broker, client_id=f"test-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("test"),
                   subscriptions=[TOPICS.plan(), TOPICS.events(), TOPICS.control_reply("operator")]) as bus:
        await bus.wait_connected(WAIT)
        yield Inbox(bus)


def hello(name: str, incarnation: int = 1) -> DeviceHello:
    return DeviceHello(device=name, incarnation=incarnation, flops=1e9, memory_bytes=GIB)


async def join(bus: Inbox, name: str, incarnation: int = 1) -> None:
    """What a worker does on start: retained hello and ``online`` status."""
    await bus.publish(TOPICS.hello(name), hello(name, incarnation), retain=True)
    await bus.publish(TOPICS.status(name), DeviceStatus(device=name, state="online", incarnation=incarnation),
                      retain=True)


def names(plan: Plan) -> list[str]:
    return [d.device for d in plan.devices]


def replans(planner: Planner) -> float:
    return sum(planner.metrics.value("edgemesh_planner_replans_total", reason=r)
               for r in ("join", "leave", "control", "start"))


# a device in a child process that dies without DISCONNECT, so the broker publishes its will
WILL_DEVICE = """
import asyncio, sys
import aiomqtt

async def main():
    host, port, status_topic, will, hello_topic, hello, online = sys.argv[1:]
    async with aiomqtt.Client(host, int(port), protocol=aiomqtt.ProtocolVersion.V311,
                              will=aiomqtt.Will(status_topic, bytes.fromhex(will), qos=1, retain=True)) as client:
        await client.publish(hello_topic, bytes.fromhex(hello), qos=1, retain=True)
        await client.publish(status_topic, bytes.fromhex(online), qos=1, retain=True)
        print("ready", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


# --------------------------------------------------------------------------- service


async def test_two_joins_within_the_debounce_give_one_plan(broker: BrokerProcess) -> None:
    config = make_config(broker)
    async with device_bus(config) as bus, running(Planner(config)) as planner:
        await join(bus, "pi-b")
        await join(bus, "pi-a")
        plan = await bus.plan()
        event = await bus.next(Event, lambda e: e.kind == "replan")

        assert plan.version == 1
        assert [(d.device, d.shard_index, d.shard_count) for d in plan.devices] == [("pi-a", 0, 2), ("pi-b", 1, 2)]
        assert [c.cluster for c in plan.clusters] == ["c-pi-a", "c-pi-b"]
        assert event.data["version"] == 1 and event.data["joined"] == "pi-a,pi-b"
        assert replans(planner) == 1
        assert planner.metrics.value("edgemesh_planner_devices_live") == 2
        assert planner.metrics.value("edgemesh_planner_plan_version") == 1


async def test_a_will_drops_the_device_from_the_plan_and_the_last_leaving_empties_it(broker: BrokerProcess) -> None:
    config = make_config(broker)
    status = TOPICS.status("pi-b")
    args = [broker.host, str(broker.port), status,
            wire.encode(DeviceStatus(device="pi-b", state="offline", incarnation=1)).hex(),
            TOPICS.hello("pi-b"), wire.encode(hello("pi-b")).hex(),
            wire.encode(DeviceStatus(device="pi-b", state="online", incarnation=1)).hex()]
    async with device_bus(config) as bus, running(Planner(config)) as planner:
        await join(bus, "pi-a")
        device = await asyncio.create_subprocess_exec(sys.executable, "-c", WILL_DEVICE, *args,
                                                      stdout=asyncio.subprocess.PIPE)
        try:
            async with asyncio.timeout(WAIT):
                assert device.stdout is not None
                assert (await device.stdout.readline()).strip() == b"ready"
            plan = await bus.plan()
            while names(plan) != ["pi-a", "pi-b"]:  # pi-a alone may be planned first
                plan = await bus.plan()
        finally:
            device.kill()
            async with asyncio.timeout(WAIT):
                await device.wait()

        after = await bus.plan()
        assert names(after) == ["pi-a"] and after.version == plan.version + 1
        assert after.devices[0].shard_count == 1
        assert after.reason == "leave"
        assert planner.metrics.value("edgemesh_planner_replans_total", reason="leave") == 1
        assert planner.metrics.value("edgemesh_planner_devices_live") == 1

        # the last device leaves: the plan empties, so nobody waits for a device that is gone
        await bus.publish(TOPICS.status("pi-a"), DeviceStatus(device="pi-a", state="offline", incarnation=1),
                          retain=True)
        empty = await bus.plan()
        assert empty.devices == () and empty.clusters == () and empty.version == after.version + 1


async def test_a_restarted_planner_continues_the_plan_version(broker: BrokerProcess) -> None:
    config = make_config(broker)
    async with device_bus(config) as bus:
        async with running(Planner(config)):
            await join(bus, "pi-a")
            first = await bus.plan()
            assert (first.version, names(first)) == (1, ["pi-a"])

        async with running(Planner(config)) as second:
            await join(bus, "pi-b")
            plan = await bus.plan()  # the same live set as the retained plan is not re-planned
            assert (plan.version, names(plan)) == (2, ["pi-a", "pi-b"])
            assert second.version == 2


async def test_a_device_restart_with_a_new_incarnation_is_re_planned(broker: BrokerProcess) -> None:
    config = make_config(broker)
    async with device_bus(config) as bus, running(Planner(config)) as planner:
        await join(bus, "pi-a", incarnation=1)
        assert (await bus.plan()).version == 1
        await join(bus, "pi-a", incarnation=2)
        plan = await bus.plan()
        assert (plan.version, names(plan), plan.reason) == (2, ["pi-a"], "join")
        # the late will of the previous run does not take the device out
        await bus.publish(TOPICS.status("pi-a"), DeviceStatus(device="pi-a", state="offline", incarnation=1),
                          retain=True)
        await bus.publish(TOPICS.control("planner"), b'{"command": "status"}')
        reply = await bus.reply()
        assert reply.result["live"] == "pi-a" and planner.version == 2


async def test_malformed_payload_is_counted_and_planning_goes_on(broker: BrokerProcess) -> None:
    config = make_config(broker)
    async with device_bus(config) as bus, running(Planner(config)) as planner:
        await bus.publish(TOPICS.hello("pi-x"), b"\x00garbage")
        await join(bus, "pi-a")
        plan = await bus.plan()
        assert names(plan) == ["pi-a"]
        assert planner.metrics.value("edgemesh_planner_rejected_total", reason="malformed") == 1


async def test_a_hello_for_another_device_than_its_topic_is_rejected(broker: BrokerProcess) -> None:
    config = make_config(broker)
    async with device_bus(config) as bus, running(Planner(config)) as planner:
        await bus.publish(TOPICS.hello("pi-a"), hello("pi-imposter"), retain=True)
        await bus.publish(TOPICS.status("pi-a"), DeviceStatus(device="pi-a", state="online"), retain=True)
        await join(bus, "pi-c")
        plan = await bus.plan()
        assert names(plan) == ["pi-c"]
        assert planner.metrics.value("edgemesh_planner_rejected_total", reason="topic") == 1
        assert "pi-imposter" not in planner.hellos and "pi-a" not in planner.hellos


async def test_drain_device_by_json_command_excludes_it_until_undrained(broker: BrokerProcess) -> None:
    config = make_config(broker)
    control = TOPICS.control("planner")
    async with device_bus(config) as bus:
        async with running(Planner(config)) as planner:
            await join(bus, "pi-a")
            await join(bus, "pi-b")
            plan = await bus.plan()
            while names(plan) != ["pi-a", "pi-b"]:
                plan = await bus.plan()

            drain = {"command": "drain-device", "value": "pi-a", "request_id": "r1"}
            await bus.publish(control, json.dumps(drain).encode())
            reply = await bus.reply()
            assert (reply.request_id, reply.ok, reply.source) == ("r1", True, "planner")
            drained = await bus.plan()
            assert names(drained) == ["pi-b"] and drained.drained == ("pi-a",)
            assert drained.version == plan.version + 1 and drained.reason == "control"
            assert planner.metrics.value("edgemesh_planner_replans_total", reason="control") == 1
            assert planner.metrics.value("edgemesh_planner_devices_drained") == 1

        # the retained plan carries the drained list, so it survives a planner restart
        async with running(Planner(config)):
            await bus.publish(control, b'{"command": "status", "request_id": "r2"}')
            status = await bus.reply()
            assert status.result["live"] == "pi-a,pi-b" and status.result["drained"] == "pi-a"
            assert status.result["plan_version"] == drained.version

            await bus.publish(control, b'{"command": "undrain-device", "device": "pi-a", "request_id": "r3"}')
            assert (await bus.reply()).ok
            back = await bus.plan()
            assert names(back) == ["pi-a", "pi-b"] and back.drained == ()
            assert back.version == drained.version + 1


async def test_bad_and_expired_commands(broker: BrokerProcess) -> None:
    config = make_config(broker)
    control = TOPICS.control("planner")
    async with device_bus(config) as bus, running(Planner(config)) as planner:
        await bus.publish(control, b'{"command": "explode", "request_id": "bad"}')
        reply = await bus.reply()
        assert (reply.request_id, reply.ok) == ("bad", False) and "unknown command" in reply.message
        assert planner.metrics.value("edgemesh_planner_rejected_total", reason="bad_command") == 1

        expired = {"command": "drain-device", "value": "pi-a", "request_id": "old", "expires_at": time.time() - 5}
        await bus.publish(control, json.dumps(expired).encode())
        await bus.publish(control, b'{"command": "status", "request_id": "now"}')
        reply = await bus.reply()  # the expired command got no reply and changed nothing
        assert reply.request_id == "now" and reply.result["drained"] == ""
        assert planner.metrics.value("edgemesh_planner_rejected_total", reason="expired") == 1

        await join(bus, "pi-a")
        assert names(await bus.plan()) == ["pi-a"]
        await bus.publish(control, b'{"command": "replan", "request_id": "again"}')
        reply = await bus.reply()
        forced = await bus.plan()
        assert reply.ok and reply.result["plan_version"] == 2
        assert (forced.version, forced.reason, names(forced)) == (2, "control", ["pi-a"])

        await bus.publish(control, b'{"command": "stop"}')
        assert (await bus.reply()).ok
        async with asyncio.timeout(WAIT):
            await planner.stop.wait()


async def test_min_devices_holds_the_first_plan(broker: BrokerProcess) -> None:
    config = make_config(broker, **{"planner.min_devices": 2})
    async with device_bus(config) as bus, running(Planner(config)):
        await join(bus, "pi-a")
        await bus.publish(TOPICS.control("planner"), b'{"command": "replan"}')
        reply = await bus.reply()
        assert not reply.ok and "2 needed" in reply.message  # one device is not enough
        await join(bus, "pi-b")
        plan = await bus.plan()
        assert (plan.version, names(plan)) == (1, ["pi-a", "pi-b"])
