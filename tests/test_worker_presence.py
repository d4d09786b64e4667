"""A worker's presence (services/worker/presence.py) on a real broker: its will, status, hello, refusals and leaving."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
from helpers import WAIT_S, Inbox, inbox, make_config

from edgemesh.common import wire
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config, load_config
from edgemesh.common.messages import DeviceHello, DeviceStatus, Event
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.runtime import Events
from edgemesh.services.worker import profile as prof
from edgemesh.services.worker.board import EmulatedBoard
from edgemesh.services.worker.link import LinkMeter
from edgemesh.services.worker.presence import Presence

DEVICE = "pi-7"
INCARNATION = 3
VALIDATION_SAMPLES = 120
"""Samples of the device's validation share, as its status names them."""
LONG_OUTAGE_S = 60.0
"""An outage of the device's emulated link that outlasts the test: the connection is gone."""
LEAVE_TIMEOUT_S = 0.5
"""What the worker gives ``leave`` here (it passes ``broker.connect_timeout_s``)."""


def presence_config(broker: BrokerProcess, **settings: object) -> Config:
    """A worker emulating a Raspberry Pi 4 (its host speed given, not benchmarked), on the test's broker."""
    return make_config(broker, job=f"presence-{uuid.uuid4().hex[:6]}", **{
        "worker.emulate": "pi4", "worker.emulation_host_gflops": "50", **settings})


def new_presence(config: Config) -> tuple[Presence, EmulatedBoard, ServiceMetrics]:
    """The presence of ``DEVICE`` as the worker builds it, its profile measured by its (emulated) board."""
    metrics = ServiceMetrics("worker")
    link = LinkMeter(config.worker.link_rate_bps)
    board = EmulatedBoard(config.worker, DEVICE, link, metrics, config.broker)
    presence = Presence(device=DEVICE, incarnation=INCARNATION, topics=Topics(config.job), board=board, link=link,
                        can_encode=False, validation_samples=VALIDATION_SAMPLES, metrics=metrics)
    presence.profile = board.measure()
    return presence, board, metrics


@contextlib.asynccontextmanager
async def attached(config: Config, presence: Presence, board: EmulatedBoard) -> AsyncIterator[Bus]:
    """``presence`` attached to a connected bus carrying its will, through the board's emulated link (which the
    test can cut), as the worker's runtime attaches it."""
    async with contextlib.AsyncExitStack() as stack:
        broker = await board.connect(stack, config.broker)
        bus = await stack.enter_async_context(Bus(broker, client_id=f"{DEVICE}-{uuid.uuid4().hex[:6]}",
                                                  metrics=ServiceMetrics("worker"), will=presence.will()))
        presence.bus, presence.events = bus, Events(bus, presence.topics, f"device/{DEVICE}")
        yield bus


@contextlib.asynccontextmanager
async def watching(config: Config) -> AsyncIterator[Inbox]:
    """A planner's view of the devices: their statuses, hellos and events (retained ones on subscribing)."""
    topics = Topics(config.job)
    async with inbox(config, (topics.status_filter(), DeviceStatus), (topics.hello_filter(), DeviceHello),
                     (topics.events_filter(), Event), name="planner") as box:
        yield box


async def retained_status(config: Config) -> DeviceStatus:
    """The status the broker retains for ``DEVICE``: what a planner that starts now sees first."""
    async with watching(config) as later:
        return await later.next(DeviceStatus, lambda s: s.device == DEVICE)


def refused_shares(metrics: ServiceMetrics) -> float:
    return metrics.value("edgemesh_worker_refused_shares_total")


def load_config_without_broker() -> Config:
    """A worker's configuration that never connects (the will is built before the connection)."""
    return load_config(env={}, overrides={"job": "presence", "worker.emulate": "pi4",
                                          "worker.emulation_host_gflops": "50"})


@contextlib.asynccontextmanager
async def returns_within_wait() -> AsyncIterator[None]:
    """Fail the test, rather than hang it, if the block does not end within ``WAIT_S``."""
    try:
        async with asyncio.timeout(WAIT_S):
            yield
    except TimeoutError:
        pytest.fail(f"did not return within {WAIT_S:g}s")


# --------------------------------------------------------------------------- the will and announcing


def test_the_will_is_the_retained_offline_status_of_this_incarnation() -> None:
    presence, _, _ = new_presence(load_config_without_broker())
    topic, payload = presence.will()
    assert topic == Topics("presence").status(DEVICE)
    status = wire.decode(payload, DeviceStatus)
    assert (status.device, status.state, status.incarnation) == (DEVICE, "offline", INCARNATION)


async def test_announce_publishes_the_retained_online_status_then_the_hello_with_the_measured_profile(
        broker: BrokerProcess) -> None:
    config = presence_config(broker)
    presence, board, _ = new_presence(config)
    profile = presence.profile
    assert profile is not None
    async with watching(config) as planner, attached(config, presence, board):
        await presence.announce()
        status = await planner.next(DeviceStatus, lambda s: s.device == DEVICE)
        hello = await planner.next(DeviceHello, lambda h: h.device == DEVICE)
        kinds = [type(m) for _, m in planner.received if isinstance(m, (DeviceStatus, DeviceHello))]
        assert kinds == [DeviceStatus, DeviceHello]  # the planner knows the device is up before it plans it
        async with watching(config) as later:  # both retained: a planner that starts later sees the device
            assert (await later.next(DeviceStatus, lambda s: s.device == DEVICE)).state == "online"
            assert (await later.next(DeviceHello, lambda h: h.device == DEVICE)).flops == profile.flops
    assert (status.state, status.incarnation, status.refused_plan, status.reason) == ("online", INCARNATION, 0, "")
    assert status.validation_samples == VALIDATION_SAMPLES
    assert (hello.incarnation, hello.flops, hello.memory_bytes, hello.cores, hello.platform) == (
        INCARNATION, profile.flops, profile.memory_bytes, profile.cores, profile.platform)
    assert hello.platform == "emulated-pi4" and hello.software == prof.software() and hello.can_encode is False
    assert (hello.profile, hello.link_rate_bps, hello.downlink_rate_bps, hello.latency_s) == (
        "pi4", board.board.uplink_bps, board.board.downlink_bps, board.board.latency_s)
    assert hello.link_rate_bps > 0  # the emulated board declares its uplink


async def test_a_connection_lost_leaves_the_will_as_the_retained_status(broker: BrokerProcess) -> None:
    config = presence_config(broker)
    presence, board, _ = new_presence(config)
    async with watching(config) as planner, attached(config, presence, board):
        await presence.announce()
        await planner.next(DeviceStatus, lambda s: s.state == "online")
        assert board.emulated_link is not None
        await board.emulated_link.outage(LONG_OUTAGE_S)  # the device drops off the network
        offline = await planner.next(DeviceStatus, lambda s: s.device == DEVICE and s.state == "offline")
        assert offline.incarnation == INCARNATION
        assert (await retained_status(config)).state == "offline"


# --------------------------------------------------------------------------- refusing a share


async def test_a_refusal_names_the_plan_and_reason_in_the_retained_status_emits_an_event_and_is_counted(
        broker: BrokerProcess) -> None:
    config = presence_config(broker)
    presence, board, metrics = new_presence(config)
    reason = "its share needs 3.1 GiB, the device has 2.0 GiB"
    async with watching(config) as planner, attached(config, presence, board):
        await presence.announce()
        await planner.next(DeviceStatus, lambda s: s.state == "online")
        assert refused_shares(metrics) == 0
        await presence.refuse(7, reason)
        status = await planner.next(DeviceStatus, lambda s: s.refused_plan == 7)
        event = await planner.next(Event, lambda e: e.kind == "share_refused")
        assert (status.device, status.state, status.incarnation, status.reason) == (DEVICE, "online", INCARNATION,
                                                                                    reason)
        assert status.validation_samples == VALIDATION_SAMPLES
        assert event.source == f"device/{DEVICE}"
        assert event.data == {"device": DEVICE, "plan_version": 7}
        assert presence.refused == 7 and refused_shares(metrics) == 1
        assert (await retained_status(config)).refused_plan == 7  # a planner that starts later knows it too

        await presence.announce()  # a reconnect: the status still names the refusal
        again = await planner.next(DeviceStatus, lambda s: s.device == DEVICE)
        assert (again.refused_plan, again.reason) == (7, reason)

        await presence.refuse(9, "no room")  # a later plan's refusal replaces it
        latest = await planner.next(DeviceStatus, lambda s: s.refused_plan == 9)
        assert latest.reason == "no room" and refused_shares(metrics) == 2


async def test_a_refusal_without_a_connection_is_counted_and_does_not_raise(broker: BrokerProcess) -> None:
    config = presence_config(broker, **{"broker.publish_timeout_s": 0.5})
    presence, board, metrics = new_presence(config)
    async with attached(config, presence, board):
        assert board.emulated_link is not None
        await board.emulated_link.outage(LONG_OUTAGE_S)
        async with returns_within_wait():
            await presence.refuse(4, "no room")
        assert presence.refused == 4 and refused_shares(metrics) == 1


# --------------------------------------------------------------------------- leaving


async def test_leave_replaces_the_retained_status_with_offline(broker: BrokerProcess) -> None:
    config = presence_config(broker)
    presence, board, _ = new_presence(config)
    async with watching(config) as planner, attached(config, presence, board) as bus:
        await presence.announce()
        await planner.next(DeviceStatus, lambda s: s.state == "online")
        await presence.leave(LEAVE_TIMEOUT_S)
        offline = await planner.next(DeviceStatus, lambda s: s.device == DEVICE and s.state == "offline")
        assert offline.incarnation == INCARNATION and offline.time > 0  # stamped: the worker's, not the will
        assert bus.is_connected
        retained = await retained_status(config)
        assert (retained.state, retained.time) == ("offline", offline.time)


async def test_leave_does_not_raise_once_the_connection_is_gone(broker: BrokerProcess) -> None:
    config = presence_config(broker)
    presence, board, _ = new_presence(config)
    async with attached(config, presence, board):
        await presence.announce()
        assert board.emulated_link is not None
        await board.emulated_link.outage(LONG_OUTAGE_S)
        async with returns_within_wait():
            await presence.leave(LEAVE_TIMEOUT_S)


async def test_leave_gives_up_within_its_timeout_on_a_connection_that_moves_nothing(broker: BrokerProcess) -> None:
    """A stalled link keeps the connection open but no PUBACK comes: ``leave`` ends at its own timeout, well before
    the bus's publish timeout."""
    config = presence_config(broker, **{"broker.publish_timeout_s": 10 * WAIT_S})
    presence, board, _ = new_presence(config)
    async with attached(config, presence, board) as bus:
        await presence.announce()
        assert board.emulated_link is not None
        board.emulated_link.stall(LONG_OUTAGE_S)
        assert bus.is_connected
        async with returns_within_wait():
            await presence.leave(LEAVE_TIMEOUT_S)


async def test_leave_before_the_worker_was_attached_does_nothing() -> None:
    presence, _, _ = new_presence(load_config_without_broker())
    async with returns_within_wait():
        await presence.leave(LEAVE_TIMEOUT_S)
