"""The compressor: the codec policy (pure) and the service on real brokers.

Service tests run the compressor in-process against each broker of the ``broker`` fixture and
drive it with a test ``Bus`` that plays the devices and the operator. Every wait is bounded
by :data:`WAIT`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import pytest

from edgemesh.common.broker import BrokerProcess
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import available_codecs
from edgemesh.common.config import Config, load_config
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import CodecPolicy, ControlReply, DeviceHello, DeviceStats
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.compressor.policy import choose_policy
from edgemesh.services.compressor.service import Compressor

WAIT = 10.0
"""Seconds any single expected event may take."""
JOB = "t-compressor"
TOPICS = Topics(JOB)
T = TypeVar("T")


# --------------------------------------------------------------------------- policy (pure)


def test_a_new_device_gets_the_default_codec_at_version_1() -> None:
    policy = choose_policy("pi-1", default_codec="fp16", overrides={}, previous=None)
    assert (policy.device, policy.codec, policy.density, policy.version, policy.gateway) == (
        "pi-1", "fp16", 1.0, 1, False)
    assert policy.reason == "default"


def test_a_config_override_beats_the_default_and_an_operator_beats_both() -> None:
    overrides = {"pi-1": "none"}
    assert choose_policy("pi-1", default_codec="fp16", overrides=overrides, previous=None).codec == "none"
    assert choose_policy("pi-2", default_codec="fp16", overrides=overrides, previous=None).codec == "fp16"
    chosen = choose_policy("pi-1", default_codec="fp16", overrides=overrides, previous=None,
                           operator={"pi-1": "fp16"})
    assert (chosen.codec, chosen.reason) == ("fp16", "operator")


def test_the_version_moves_only_when_the_codec_changes() -> None:
    first = choose_policy("pi-1", default_codec="fp16", overrides={}, previous=None)
    same = choose_policy("pi-1", default_codec="fp16", overrides={}, previous=first)
    assert same is first
    changed = choose_policy("pi-1", default_codec="fp16", overrides={"pi-1": "none"}, previous=same)
    assert (changed.codec, changed.version) == ("none", 2)
    back = choose_policy("pi-1", default_codec="fp16", overrides={}, previous=changed)
    assert (back.codec, back.version) == ("fp16", 3)


def test_the_same_codec_for_another_reason_keeps_the_version() -> None:
    first = choose_policy("pi-1", default_codec="fp16", overrides={}, previous=None)
    pinned = choose_policy("pi-1", default_codec="fp16", overrides={}, previous=first, operator={"pi-1": "fp16"})
    assert (pinned.codec, pinned.version, pinned.reason) == ("fp16", 1, "operator")


def test_static_mode_ignores_stats() -> None:
    """Without adaptive settings (``compressor.mode = "static"``) the codec comes from config alone."""
    slow = DeviceStats(device="pi-1", link_rate_bps=1e3, delay_index=40.0, step_time_s=0.1, comm_time_s=9.0,
                       gradient_bytes=1 << 20)
    first = choose_policy("pi-1", default_codec="fp16", overrides={}, previous=None)
    assert choose_policy("pi-1", default_codec="fp16", overrides={}, previous=first, stats=slow) is first


@pytest.fixture
def unimplemented_codec(monkeypatch: pytest.MonkeyPatch) -> str:
    """A codec the config names but this build lacks: ``qsgd``, hidden from the compressor."""
    import edgemesh.services.compressor.service as service

    hidden = "qsgd"
    monkeypatch.setattr(service, "available_codecs", lambda: tuple(c for c in available_codecs() if c != hidden))
    return hidden


def test_the_service_refuses_a_configured_codec_it_cannot_run(unimplemented_codec: str) -> None:
    missing = unimplemented_codec
    with pytest.raises(ConfigError, match="not implemented"):
        Compressor(load_config(env={}, overrides={"compressor.default_codec": missing}))
    with pytest.raises(ConfigError, match="pi-1"):
        Compressor(load_config(env={}, overrides={"compressor.overrides": {"pi-1": missing}}))


def test_the_compressor_does_not_import_torch() -> None:
    """The compressor runs on small hosts without torch."""
    code = "import sys, edgemesh.services.compressor.service; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=WAIT).returncode == 0


# --------------------------------------------------------------------------- helpers


def make_config(broker: BrokerProcess, **overrides: object) -> Config:
    return load_config(env={}, overrides={
        "broker.url": broker.url, "job": JOB, "metrics.address": "127.0.0.1:0",
        "broker.backoff_initial_s": 0.05, **overrides,
    })


@contextlib.asynccontextmanager
async def running(compressor: Compressor) -> AsyncIterator[Compressor]:
    """The compressor's ``run()`` as a task, once it is subscribed and has settled; stopped on exit."""
    task = asyncio.create_task(compressor.run())
    try:
        async with asyncio.timeout(WAIT):
            await compressor.ready.wait()
        yield compressor
    finally:
        compressor.stop.set()
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
                msg = incoming.decode((CodecPolicy, ControlReply))
                if isinstance(msg, kind) and predicate(msg):
                    return msg
                self._kept.append(msg)

    async def policy(self, device: str) -> CodecPolicy:
        return await self.next(CodecPolicy, lambda p: p.device == device)

    async def reply(self) -> ControlReply:
        return await self.next(ControlReply)

    async def publish(self, topic: str, msg: object, *, retain: bool = False) -> None:
        await self.bus.publish(topic, msg, retain=retain)


@contextlib.asynccontextmanager
async def device_bus(config: Config) -> AsyncIterator[Inbox]:
    """A client playing devices and operator, subscribed to codec policies and control replies."""
    async with Bus(config.broker, client_id=f"test-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("test"),
                   subscriptions=[TOPICS.all_codec(), TOPICS.control_reply("operator")]) as bus:
        await bus.wait_connected(WAIT)
        yield Inbox(bus)


async def say_hello(bus: Inbox, name: str, incarnation: int = 1) -> None:
    await bus.publish(TOPICS.hello(name), DeviceHello(device=name, incarnation=incarnation, flops=1e9,
                                                      memory_bytes=1 << 30), retain=True)


async def retained_policy(config: Config, device: str) -> CodecPolicy:
    """What a device starting now would get: the retained policy on its codec topic."""
    async with Bus(config.broker, client_id=f"late-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("late"),
                   subscriptions=[TOPICS.codec(device)]) as late:
        msg = await late.next_message(WAIT)
        assert msg.retained
        return msg.decode(CodecPolicy)


def control(command: str, **fields: object) -> bytes:
    """A control command as an operator types it for ``mosquitto_pub``."""
    return json.dumps({"command": command, **fields}).encode()


# --------------------------------------------------------------------------- service


async def test_a_hello_gets_a_retained_policy_with_the_default_codec(broker: BrokerProcess) -> None:
    config = make_config(broker, **{"compressor.default_codec": "none"})
    async with device_bus(config) as bus, running(Compressor(config)) as compressor:
        await say_hello(bus, "pi-1")
        policy = await bus.policy("pi-1")
        assert (policy.codec, policy.version, policy.density) == ("none", 1, 1.0)
        assert await retained_policy(config, "pi-1") == policy
        assert compressor.metrics.value("edgemesh_compressor_policies_published_total", codec="none") == 1
        assert compressor.metrics.value("edgemesh_compressor_devices") == 1

        # the same hello again (a broker re-delivering retained state) publishes nothing new;
        # a restart (new incarnation) re-announces the same policy
        await say_hello(bus, "pi-1")
        await say_hello(bus, "pi-1", incarnation=2)
        again = await bus.policy("pi-1")
        assert again == policy
        assert compressor.metrics.value("edgemesh_compressor_policies_published_total", codec="none") == 2


async def test_a_config_override_applies_to_its_device_only(broker: BrokerProcess) -> None:
    config = make_config(broker, **{"compressor.default_codec": "fp16", "compressor.overrides": {"pi-2": "none"}})
    async with device_bus(config) as bus, running(Compressor(config)):
        await say_hello(bus, "pi-1")
        await say_hello(bus, "pi-2")
        assert (await bus.policy("pi-1")).codec == "fp16"
        override = await bus.policy("pi-2")
        assert (override.codec, override.reason) == ("none", "override")


async def test_set_codec_changes_the_retained_policy_and_survives_a_restart(broker: BrokerProcess) -> None:
    config = make_config(broker, **{"compressor.default_codec": "fp16"})
    command = TOPICS.control("compressor")
    async with device_bus(config) as bus:
        async with running(Compressor(config)):
            await say_hello(bus, "pi-1")
            first = await bus.policy("pi-1")
            assert (first.codec, first.version) == ("fp16", 1)

            await bus.publish(command, control("set-codec", device="pi-1", value="none", request_id="r1"))
            reply = await bus.reply()
            assert (reply.request_id, reply.ok, reply.result["version"]) == ("r1", True, 2)
            changed = await bus.policy("pi-1")
            assert (changed.codec, changed.version, changed.reason) == ("none", 2, "operator")
            assert await retained_policy(config, "pi-1") == changed

        # a new compressor keeps the operator's choice and the version clock
        async with running(Compressor(config)) as second:
            await say_hello(bus, "pi-1", incarnation=2)
            assert await bus.policy("pi-1") == changed
            await bus.publish(command, control("set-codec", device="pi-1", value="default"))
            assert (await bus.reply()).ok
            back = await bus.policy("pi-1")
            assert (back.codec, back.version, back.reason) == ("fp16", 3, "default")
            assert second.operator == {}


async def test_set_codec_refuses_codecs_it_cannot_run(broker: BrokerProcess, unimplemented_codec: str) -> None:
    config = make_config(broker)
    command = TOPICS.control("compressor")
    unimplemented = unimplemented_codec
    async with device_bus(config) as bus, running(Compressor(config)) as compressor:
        await say_hello(bus, "pi-1")
        first = await bus.policy("pi-1")

        await bus.publish(command, control("set-codec", device="pi-1", value=unimplemented))
        reply = await bus.reply()
        assert not reply.ok and "not implemented" in reply.message and unimplemented in reply.message
        await bus.publish(command, control("set-codec", device="pi-1", value="zip"))
        reply = await bus.reply()
        assert not reply.ok and "unknown codec" in reply.message
        await bus.publish(command, control("set-codec", value="none"))
        assert not (await bus.reply()).ok  # no device
        await bus.publish(command, control("shrink"))
        assert not (await bus.reply()).ok

        assert compressor.metrics.value("edgemesh_compressor_rejected_total", reason="bad_command") == 4
        assert compressor.policies["pi-1"] == first
        await bus.publish(command, control("status"))
        status = await bus.reply()
        assert status.ok and status.result["policies"] == f"pi-1={first.codec}@1"

        await bus.publish(command, control("stop"))
        assert (await bus.reply()).ok
        async with asyncio.timeout(WAIT):
            await compressor.stop.wait()


async def test_malformed_and_misaddressed_payloads_are_counted_and_work_goes_on(broker: BrokerProcess) -> None:
    config = make_config(broker)
    async with device_bus(config) as bus, running(Compressor(config)) as compressor:
        await bus.publish(TOPICS.hello("pi-1"), b"\x00garbage")
        await bus.publish(TOPICS.stats("pi-1"), b"\x00garbage")
        await say_hello(bus, "pi-imposter")
        await bus.publish(TOPICS.hello("pi-3"), DeviceHello(device="pi-4", incarnation=1, flops=1.0,
                                                            memory_bytes=1))
        await say_hello(bus, "pi-2")
        await bus.publish(TOPICS.stats("pi-2"), DeviceStats(device="pi-2", link_rate_bps=1e3))
        assert (await bus.policy("pi-imposter")).version == 1
        assert (await bus.policy("pi-2")).version == 1
        await bus.publish(TOPICS.control("compressor"), control("status"))
        status = await bus.reply()  # handled after everything above
        assert status.result["devices"] == 2
        assert compressor.metrics.value("edgemesh_compressor_rejected_total", reason="malformed") == 2
        assert compressor.metrics.value("edgemesh_compressor_rejected_total", reason="topic") == 1
