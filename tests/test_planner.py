"""The planner: the data-parallel layout (pure) and the service on real brokers.

Service tests run the planner in-process against each broker of the ``broker`` fixture and
drive it with a test client that plays the devices and the operator (``planner_devices``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
from helpers import (
    GIB,
    WAIT_S,
    Inbox,
    device_hello,
    device_names,
    join,
    planner_config,
    planner_devices,
    running,
)

from edgemesh.common import wire
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config, TrainingConfig
from edgemesh.common.messages import ControlReply, DeviceHello, DeviceStatus, Event, Plan
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.planner.layout import plan_data_parallel
from edgemesh.services.planner.mesh import DeviceInfo, cluster_name
from edgemesh.services.planner.service import Planner

JOB = "t-planner"
TOPICS = Topics(JOB)


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
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=WAIT_S).returncode == 0


# --------------------------------------------------------------------------- helpers


async def next_plan(bus: Inbox) -> Plan:
    """The oldest plan not taken yet."""
    return await bus.next(Plan)


async def next_reply(bus: Inbox, request_id: str = "") -> ControlReply:
    """The oldest control reply not taken yet (of ``request_id`` if given)."""
    return await bus.next(ControlReply, lambda r: not request_id or r.request_id == request_id)


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
    config = planner_config(broker, job=JOB)
    planner = Planner(config)
    async with planner_devices(config) as bus, running(planner):
        await join(bus, "pi-b")
        await join(bus, "pi-a")
        plan = await next_plan(bus)
        event = await bus.next(Event, lambda e: e.kind == "replan")

        assert plan.version == 1
        assert [(d.device, d.shard_index, d.shard_count) for d in plan.devices] == [("pi-a", 0, 2), ("pi-b", 1, 2)]
        assert [c.cluster for c in plan.clusters] == ["c-pi-a", "c-pi-b"]
        assert event.data["version"] == 1 and event.data["joined"] == "pi-a,pi-b"
        assert replans(planner) == 1
        assert planner.metrics.value("edgemesh_planner_devices_live") == 2
        assert planner.metrics.value("edgemesh_planner_plan_version") == 1


async def test_a_will_drops_the_device_from_the_plan_and_the_last_leaving_empties_it(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB)
    status = TOPICS.status("pi-b")
    args = [broker.host, str(broker.port), status,
            wire.encode(DeviceStatus(device="pi-b", state="offline", incarnation=1)).hex(),
            TOPICS.hello("pi-b"), wire.encode(device_hello("pi-b")).hex(),
            wire.encode(DeviceStatus(device="pi-b", state="online", incarnation=1)).hex()]
    planner = Planner(config)
    async with planner_devices(config) as bus, running(planner):
        await join(bus, "pi-a")
        device = await asyncio.create_subprocess_exec(sys.executable, "-c", WILL_DEVICE, *args,
                                                      stdout=asyncio.subprocess.PIPE)
        try:
            async with asyncio.timeout(WAIT_S):
                assert device.stdout is not None
                assert (await device.stdout.readline()).strip() == b"ready"
            plan = await next_plan(bus)
            while device_names(plan) != ["pi-a", "pi-b"]:  # pi-a alone may be planned first
                plan = await next_plan(bus)
        finally:
            device.kill()
            async with asyncio.timeout(WAIT_S):
                await device.wait()

        after = await next_plan(bus)
        assert device_names(after) == ["pi-a"] and after.version == plan.version + 1
        assert after.devices[0].shard_count == 1
        assert after.reason == "leave"
        assert planner.metrics.value("edgemesh_planner_replans_total", reason="leave") == 1
        assert planner.metrics.value("edgemesh_planner_devices_live") == 1

        # the last device leaves: the plan empties, so nobody waits for a device that is gone
        await bus.publish(TOPICS.status("pi-a"), DeviceStatus(device="pi-a", state="offline", incarnation=1),
                          retain=True)
        empty = await next_plan(bus)
        assert empty.devices == () and empty.clusters == () and empty.version == after.version + 1


async def test_min_devices_holds_only_the_first_plan_not_a_return_after_everyone_left(
        broker: BrokerProcess) -> None:
    """A stopping broker sends every device's will: with min_devices held again after the empty plan, training
    stayed stopped for good when fewer devices than that came back (the fault-injection run did this)."""
    config = planner_config(broker, job=JOB, **{"planner.min_devices": 2})
    async with planner_devices(config) as bus, running(Planner(config)):
        await join(bus, "pi-a")
        await join(bus, "pi-b")
        assert device_names(await next_plan(bus)) == ["pi-a", "pi-b"]
        for name in ("pi-a", "pi-b"):
            await bus.publish(TOPICS.status(name), DeviceStatus(device=name, state="offline", incarnation=1),
                              retain=True)
        empty = await bus.next(Plan, lambda p: not p.devices)  # one will at a time, or both at once
        await join(bus, "pi-a")
        back = await bus.next(Plan, lambda p: p.version > empty.version)
        assert (device_names(back), back.reason) == (["pi-a"], "join")


async def test_wills_a_stopping_broker_sends_do_not_empty_the_plan_when_the_devices_come_back(
        mosquitto_broker: BrokerProcess) -> None:
    """Mosquitto sends every connected client's will when it is stopped; the devices announce themselves again
    on the restarted broker, within the longest backoff, and the planner waits that long after its own reconnect
    before it plans. Here the devices come back after the planner's debounce: it used to plan without them."""
    config = planner_config(mosquitto_broker, job=JOB, **{"broker.backoff_max_s": 5.0})
    slow = dataclasses.replace(config, broker=dataclasses.replace(config.broker, backoff_initial_s=1.0))
    async with planner_devices(config) as bus, running(Planner(config)), device("pi-a", slow), \
            device("pi-b", slow):
        # pi-b may come a debounce after pi-a on a busy host
        first = await bus.next(Plan, lambda p: device_names(p) == ["pi-a", "pi-b"])
        mosquitto_broker.stop()
        mosquitto_broker.start()
        await join(bus, "pi-c")  # a plan is due now: it must not take pi-a and pi-b out
        # past the plan the planner restores, retained, on the restarted broker
        plan = await bus.next(Plan, lambda p: p.version > first.version)
        assert (plan.version, device_names(plan), plan.reason) == (first.version + 1, ["pi-a", "pi-b", "pi-c"], "join")


@contextlib.asynccontextmanager
async def device(name: str, config: Config) -> AsyncIterator[Bus]:
    """A device as a worker is one on the bus: an ``offline`` will, and on every connect its ``online`` status
    and hello (retained)."""
    will = wire.encode(DeviceStatus(device=name, state="offline", incarnation=1))
    dev = Bus(config.broker, client_id=f"device-{name}", metrics=ServiceMetrics("device"),
              will=(TOPICS.status(name), will))

    async def announce() -> None:
        await dev.publish(TOPICS.status(name), DeviceStatus(device=name, state="online", incarnation=1), retain=True)
        await dev.publish(TOPICS.hello(name), device_hello(name), retain=True)

    dev.on_connect(announce)
    async with dev:
        yield dev


async def test_a_restarted_planner_continues_the_plan_version(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB)
    async with planner_devices(config) as bus:
        async with running(Planner(config)):
            await join(bus, "pi-a")
            first = await next_plan(bus)
            assert (first.version, device_names(first)) == (1, ["pi-a"])

        second = Planner(config)
        async with running(second):
            await join(bus, "pi-b")
            plan = await next_plan(bus)  # the same live set as the retained plan is not re-planned
            assert (plan.version, device_names(plan)) == (2, ["pi-a", "pi-b"])
            assert second.version == 2


async def test_a_device_restart_with_a_new_incarnation_is_re_planned(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB)
    planner = Planner(config)
    async with planner_devices(config) as bus, running(planner):
        await join(bus, "pi-a", incarnation=1)
        assert (await next_plan(bus)).version == 1
        await join(bus, "pi-a", incarnation=2)
        plan = await next_plan(bus)
        assert (plan.version, device_names(plan), plan.reason) == (2, ["pi-a"], "join")
        # the late will of the previous run does not take the device out
        await bus.publish(TOPICS.status("pi-a"), DeviceStatus(device="pi-a", state="offline", incarnation=1),
                          retain=True)
        await bus.publish(TOPICS.control("planner"), b'{"command": "status"}')
        reply = await next_reply(bus)
        assert reply.result["live"] == "pi-a" and planner.version == 2


async def test_malformed_payload_is_counted_and_planning_goes_on(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB)
    planner = Planner(config)
    async with planner_devices(config) as bus, running(planner):
        await bus.publish(TOPICS.hello("pi-x"), b"\x00garbage")
        await join(bus, "pi-a")
        plan = await next_plan(bus)
        assert device_names(plan) == ["pi-a"]
        assert planner.metrics.value("edgemesh_planner_rejected_total", reason="malformed") == 1


async def test_a_hello_for_another_device_than_its_topic_is_rejected(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB)
    planner = Planner(config)
    async with planner_devices(config) as bus, running(planner):
        await bus.publish(TOPICS.hello("pi-a"), device_hello("pi-imposter"), retain=True)
        await bus.publish(TOPICS.status("pi-a"), DeviceStatus(device="pi-a", state="online"), retain=True)
        await join(bus, "pi-c")
        plan = await next_plan(bus)
        assert device_names(plan) == ["pi-c"]
        assert planner.metrics.value("edgemesh_planner_rejected_total", reason="topic") == 1
        assert "pi-imposter" not in planner.registry.hellos and "pi-a" not in planner.registry.hellos


async def test_drain_device_by_json_command_excludes_it_until_undrained(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB)
    control = TOPICS.control("planner")
    async with planner_devices(config) as bus:
        planner = Planner(config)
        async with running(planner):
            await join(bus, "pi-a")
            await join(bus, "pi-b")
            plan = await next_plan(bus)
            while device_names(plan) != ["pi-a", "pi-b"]:
                plan = await next_plan(bus)

            drain = {"command": "drain-device", "value": "pi-a", "request_id": "r1"}
            await bus.publish(control, json.dumps(drain).encode())
            reply = await next_reply(bus)
            assert (reply.request_id, reply.ok, reply.source) == ("r1", True, "planner")
            drained = await next_plan(bus)
            assert device_names(drained) == ["pi-b"] and drained.drained == ("pi-a",)
            assert drained.version == plan.version + 1 and drained.reason == "control"
            assert planner.metrics.value("edgemesh_planner_replans_total", reason="control") == 1
            assert planner.metrics.value("edgemesh_planner_devices_drained") == 1

        # the retained plan carries the drained list, so it survives a planner restart
        async with running(Planner(config)):
            await bus.publish(control, b'{"command": "status", "request_id": "r2"}')
            status = await next_reply(bus)
            assert status.result["live"] == "pi-a,pi-b" and status.result["drained"] == "pi-a"
            assert status.result["plan_version"] == drained.version

            await bus.publish(control, b'{"command": "undrain-device", "device": "pi-a", "request_id": "r3"}')
            assert (await next_reply(bus)).ok
            back = await next_plan(bus)
            assert device_names(back) == ["pi-a", "pi-b"] and back.drained == ()
            assert back.version == drained.version + 1


async def test_bad_and_expired_commands(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB)
    control = TOPICS.control("planner")
    planner = Planner(config)
    async with planner_devices(config) as bus, running(planner):
        await bus.publish(control, b'{"command": "explode", "request_id": "bad"}')
        reply = await next_reply(bus)
        assert (reply.request_id, reply.ok) == ("bad", False) and "unknown command" in reply.message
        assert planner.metrics.value("edgemesh_planner_rejected_total", reason="bad_command") == 1

        expired = {"command": "drain-device", "value": "pi-a", "request_id": "old", "expires_at": time.time() - 5}
        await bus.publish(control, json.dumps(expired).encode())
        await bus.publish(control, b'{"command": "status", "request_id": "now"}')
        reply = await next_reply(bus)  # the expired command got no reply and changed nothing
        assert reply.request_id == "now" and reply.result["drained"] == ""
        assert planner.metrics.value("edgemesh_planner_rejected_total", reason="expired") == 1

        await join(bus, "pi-a")
        assert device_names(await next_plan(bus)) == ["pi-a"]
        await bus.publish(control, b'{"command": "replan", "request_id": "again"}')
        reply = await next_reply(bus)
        forced = await next_plan(bus)
        assert reply.ok and reply.result["plan_version"] == 2
        assert (forced.version, forced.reason, device_names(forced)) == (2, "control", ["pi-a"])

        await bus.publish(control, b'{"command": "stop"}')
        assert (await next_reply(bus)).ok
        async with asyncio.timeout(WAIT_S):
            await planner.stop.wait()


async def test_min_devices_holds_the_first_plan(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB, **{"planner.min_devices": 2})
    async with planner_devices(config) as bus, running(Planner(config)):
        await join(bus, "pi-a")
        await bus.publish(TOPICS.control("planner"), b'{"command": "replan"}')
        reply = await next_reply(bus)
        assert not reply.ok and "2 needed" in reply.message  # one device is not enough
        await join(bus, "pi-b")
        plan = await next_plan(bus)
        assert (plan.version, device_names(plan)) == (1, ["pi-a", "pi-b"])
