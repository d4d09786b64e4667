"""The worker's link meters (``services/worker/link.py``): the uplink, downlink and latency a device reports in
its stats, alone and over a real broker, straight and through an emulated link."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import numpy as np
from helpers import WAIT_S

from edgemesh.common.bus import Bus
from edgemesh.common.config import BrokerConfig
from edgemesh.common.emulation.link import EmulatedLink
from edgemesh.common.emulation.shape import LinkShape
from edgemesh.common.messages import LinkProbe, ModelSnapshot
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.common.wire.tensors import Tensor
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.worker.link import DownlinkMeter, LatencyMeter, LinkMeter, probe_round_trip


def test_the_link_meter_averages_publishes_and_a_declared_rate_wins() -> None:
    meter = LinkMeter()
    assert meter.rate_bps == 0.0
    meter.observe(1000, 0.0)  # no duration: no sample
    assert meter.rate_bps == 0.0
    meter.observe(1000, 1.0)
    assert meter.rate_bps == 1000.0
    meter.observe(2000, 1.0)
    assert 1000.0 < meter.rate_bps < 2000.0  # a moving average, not the last sample
    meter.declare(5e6)
    assert meter.rate_bps == 5e6
    meter.declare(0.0)
    assert 1000.0 < meter.rate_bps < 2000.0


def test_the_downlink_meter_weighs_chunked_messages_by_how_long_they_took() -> None:
    meter = DownlinkMeter()
    assert meter.rate_bps == 0.0
    meter.observe(1000, 0.0)  # all chunks read at once: no sample
    meter.observe(0, 1.0)
    assert meter.rate_bps == 0.0 and meter.samples == 0
    meter.observe(1_000_000, 1.0)
    assert meter.rate_bps == 1e6
    meter.observe(4_000_000, 1.0)
    assert 1e6 < meter.rate_bps < 4e6  # a moving average: one fast message moves it only part of the way
    for _ in range(30):
        meter.observe(4_000_000, 1.0)
    assert abs(meter.rate_bps - 4e6) < 0.001 * 4e6  # it follows a change
    # chunks read in one go after the event loop was busy: a burst, which weighs by its few milliseconds
    meter.observe(1_000_000, 0.001)
    assert meter.rate_bps < 1.3 * 4e6


def test_the_latency_is_half_the_shortest_recent_round_trip() -> None:
    meter = LatencyMeter(window=3)
    assert meter.latency_s == 0.0
    meter.observe(0.0)  # no sample
    meter.observe(0.020)
    meter.observe(0.500)  # queued behind an update: not the link
    assert meter.latency_s == 0.010
    meter.observe(0.018)
    assert meter.latency_s == 0.009
    # the link got slower: it shows once the shorter round trips have left the window
    meter.observe(0.060)
    assert meter.latency_s == 0.009
    meter.observe(0.064)
    meter.observe(0.062)
    assert meter.latency_s == 0.030 and meter.round_trip_s == 0.060


async def test_a_device_measures_its_downlink_and_latency_through_an_emulated_link(broker: BrokerProcess) -> None:
    """Through a link of 1 MB/s down with 20 ms each way, the chunks of a retained model arrive at about 1 MB/s
    and a probe comes back after at least 40 ms; straight to the broker both are far faster."""
    topics = Topics("links")
    snapshot = ModelSnapshot(version=1, model_spec="digits-cnn",
                             tensors={"w": Tensor.from_numpy(np.ones(100_000, np.float32))})  # 400 kB
    # the connect is not what is measured: it may take as long as any event here (CI, once, on amqtt at the end of
    # a full run: the last connect took over the default 10 s)
    config = BrokerConfig(url=broker.url, chunk_bytes=16 * 1024, connect_timeout_s=WAIT_S)
    async with Bus(config, client_id="ps", metrics=ServiceMetrics("ps")) as ps:
        await ps.publish(topics.model(), snapshot, retain=True)
    shape = LinkShape(uplink_bps=1e6, downlink_bps=1e6, latency_s=0.02)
    async with EmulatedLink(shape, upstream_host=broker.host, upstream_port=broker.port) as link:
        slow = await _measure(replace(config, url=f"mqtt://{link.host}:{link.port}"), topics)
    fast = await _measure(config, topics)
    downlink, latency = slow
    assert 0.6e6 < downlink < 1.2e6, slow
    assert 0.02 <= latency < 0.1, slow
    assert fast[0] > 5 * downlink and fast[1] < latency / 5, (fast, slow)


async def test_a_message_of_three_chunks_measures_the_link_not_the_relays_reads(broker: BrokerProcess) -> None:
    """A delta of three 16 KiB chunks (36 kB) on a 0.8 MB/s link measures about 0.8 MB/s: the link delivers its
    bytes as a real one does, a few milliseconds of air time at once (delivered as the relay read them, 16 KiB at
    once, the meter read 1.8 times the link's rate)."""
    topics = Topics("threechunks")
    snapshot = ModelSnapshot(version=1, model_spec="digits-cnn",
                             tensors={"w": Tensor.from_numpy(np.ones(9_000, np.float32))})
    config = BrokerConfig(url=broker.url, chunk_bytes=16 * 1024, connect_timeout_s=WAIT_S)
    async with Bus(config, client_id="ps", metrics=ServiceMetrics("ps")) as ps:
        await ps.publish(topics.model(), snapshot, retain=True)
    shape = LinkShape(uplink_bps=0.8e6, downlink_bps=0.8e6, latency_s=0.005)
    async with EmulatedLink(shape, upstream_host=broker.host, upstream_port=broker.port) as link:
        downlink, _ = await _measure(replace(config, url=f"mqtt://{link.host}:{link.port}"), topics)
    assert 0.6e6 < downlink < 1.0e6, downlink


async def _measure(config: BrokerConfig, topics: Topics) -> tuple[float, float]:
    """(downlink bytes/s, one-way latency s) a bus on ``config`` measures: the retained model's chunks, and
    five probes."""
    downlink, latency = DownlinkMeter(), LatencyMeter()
    device = f"pi-{uuid.uuid4().hex[:6]}"
    bus = Bus(config, client_id=device, metrics=ServiceMetrics("worker"))
    got = asyncio.Event()

    async def keep(_: ModelSnapshot, __: TopicMatch) -> None:
        got.set()

    bus.route(topics.model_filter(), ModelSnapshot, keep)
    bus.on_joined(lambda _, nbytes, seconds: downlink.observe(nbytes, seconds))
    async with bus:
        await asyncio.wait_for(got.wait(), WAIT_S)
        for _ in range(5):
            round_trip = await probe_round_trip(bus, topics.probe(device), LinkProbe(device=device))
            assert round_trip is not None
            latency.observe(round_trip)
    assert downlink.samples >= 1 and latency.samples == 5  # amqtt may send a retained message twice
    return downlink.rate_bps, latency.latency_s
