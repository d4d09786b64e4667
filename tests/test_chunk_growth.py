"""Chunks that follow the link and the broker: on a fast link to a broker that says its packet limit (MQTT 5's
Maximum Packet Size), a large message goes in as few packets as the limit allows; on a slow link, on a broker
that says nothing, and for retained messages, chunks keep ``broker.chunk_bytes``. A large message that comes
whole is still a downlink sample."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import aiomqtt
import numpy as np
import pytest
from helpers import require_binary, until

from edgemesh.common.bus import Bus
from edgemesh.common.config import Config, load_config
from edgemesh.common.emulation.link import EmulatedLink
from edgemesh.common.emulation.shape import LinkShape
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import GradientUpdate, ShardUpdate
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.common.wire.chunks import CHUNK_HEADROOM
from edgemesh.local.broker import MAX_PACKET_SIZE, BrokerProcess

T = Topics("chunks")
SMALL = 64 * 1024
"""``broker.chunk_bytes`` here: a 2.4 MB update is 37 chunks of it."""


@pytest.fixture
def limited() -> Iterator[BrokerProcess]:
    """Mosquitto set as ``production.conf`` is (and the broker of a local cluster): packets up to 1 MiB, said
    in every MQTT 5 CONNACK."""
    require_binary("mosquitto")
    with BrokerProcess.mosquitto(max_packet_size=MAX_PACKET_SIZE) as broker:
        yield broker


def config(url: str, **settings: str) -> Config:
    # chunk_seconds 1: any link faster than the broker's limit per second grows the chunks, however loaded the host
    return load_config(env={}, overrides={"broker.url": url, "job": "chunks", "broker.chunk_bytes": str(SMALL),
                                          "broker.chunk_seconds": "1", **settings})


def update(seq: int, nbytes: int) -> GradientUpdate:
    values = np.random.default_rng(seq).standard_normal(nbytes // 4).astype(np.float32)
    return GradientUpdate(device="pi-1", cluster="c-pi-1", incarnation=1, seq=seq, base_version=0, samples=8,
                          shards=(ShardUpdate(param="w", start=0, stop=values.size, codec="none",
                                              data=values.tobytes()),))


class Received:
    """Updates and downlink samples a bus heard."""

    def __init__(self) -> None:
        self.updates: list[GradientUpdate] = []
        self.samples: list[tuple[str, int, float]] = []

    async def __call__(self, msg: GradientUpdate, match: TopicMatch) -> None:
        self.updates.append(msg)


@contextlib.asynccontextmanager
async def pair(cfg: Config) -> AsyncIterator[tuple[Bus, Received]]:
    """A sending bus and a receiving one, both running."""
    got = Received()
    sender = Bus(cfg.broker, client_id=f"send-{uuid.uuid4().hex[:6]}", metrics=ServiceMetrics("sender"))
    receiver = Bus(cfg.broker, client_id=f"recv-{uuid.uuid4().hex[:6]}", metrics=ServiceMetrics("receiver"))
    receiver.route(T.grad_filter(), GradientUpdate, got)
    receiver.on_joined(lambda topic, nbytes, seconds: got.samples.append((topic, nbytes, seconds)))
    async with receiver, sender:
        yield sender, got


async def test_chunks_grow_to_the_brokers_limit_on_a_fast_link_and_messages_arrive_whole(
        limited: BrokerProcess) -> None:
    limit = MAX_PACKET_SIZE - CHUNK_HEADROOM
    async with pair(config(limited.url)) as (sender, got):
        assert sender.chunk_bytes == SMALL  # nothing measured yet
        sent = [update(seq, 2_400_000) for seq in range(4)]
        for u in sent:
            await sender.publish(T.grad("c-pi-1", "pi-1"), u)
        assert sender.chunk_bytes == limit, "loopback carries more than the broker's limit in a second"
        assert sender.metrics.value("edgemesh_sender_chunk_bytes") == limit
        # under the limit, a large message now goes whole, and is still a downlink sample
        whole = update(9, 800_000)
        await sender.publish(T.grad("c-pi-1", "pi-1"), whole)
        await until("every update", lambda: len(got.updates) == 5)
        assert [u.shards[0].data for u in got.updates] == [u.shards[0].data for u in [*sent, whole]]
        assert any(n >= 800_000 and n < limit for _, n, _ in got.samples), got.samples


async def test_chunks_keep_chunk_bytes_on_a_slow_link_and_up_to_chunk_max_bytes(limited: BrokerProcess) -> None:
    slow = LinkShape(uplink_bps=400_000)  # 400 kB/s: 20 kB in chunk_seconds 0.05, under chunk_bytes
    async with EmulatedLink(slow, upstream_host=limited.host, upstream_port=limited.port) as link:
        cfg = config(f"mqtt://{link.host}:{link.port}", **{"broker.chunk_seconds": "0.05"})
        async with pair(cfg) as (sender, got):
            for seq in range(2):
                await sender.publish(T.grad("c-pi-1", "pi-1"), update(seq, 300_000))
            await until("both updates", lambda: len(got.updates) == 2)
            assert sender.chunk_bytes == SMALL
    capped = config(limited.url, **{"broker.chunk_max_bytes": str(2 * SMALL)})
    async with pair(capped) as (sender, got):
        for seq in range(3):
            await sender.publish(T.grad("c-pi-1", "pi-1"), update(seq, 1_000_000))
        assert sender.chunk_bytes == 2 * SMALL


async def test_chunks_keep_chunk_bytes_on_a_broker_that_says_no_limit(broker: BrokerProcess) -> None:
    """Mosquitto's default takes any size and says no limit; amqtt speaks MQTT 3.1.1, which cannot say."""
    async with pair(config(broker.url)) as (sender, got):
        for seq in range(3):
            await sender.publish(T.grad("c-pi-1", "pi-1"), update(seq, 1_000_000))
        await until("every update", lambda: len(got.updates) == 3)
        assert sender.chunk_bytes == SMALL


async def test_a_retained_message_keeps_chunk_bytes_whatever_the_link(limited: BrokerProcess) -> None:
    """A later retained message in other chunks would leave the earlier's last ones behind on the broker."""
    retained = T.grad("c-pi-1", "pi-2")
    async with pair(config(limited.url)) as (sender, _):
        for seq in range(3):
            await sender.publish(T.grad("c-pi-1", "pi-1"), update(seq, 1_000_000))
        assert sender.chunk_bytes > SMALL
        await sender.publish(retained, update(7, 1_000_000), retain=True)
    pieces = -(-1_000_000 // SMALL)  # the envelope's few bytes make no 17th
    topics: set[str] = set()
    async with aiomqtt.Client(limited.host, limited.port) as client, asyncio.timeout(10.0):
        await client.subscribe(f"{retained}/chunk/+", qos=1)
        async for msg in client.messages:  # the broker sends what it retains at once
            topics.add(msg.topic.value)
            if len(topics) == pieces:
                break
        await client.publish(f"{retained}/chunk/0", b"", retain=True)
    assert topics == {f"{retained}/chunk/{i}" for i in range(pieces)}


def test_chunk_max_bytes_below_chunk_bytes_is_refused() -> None:
    with pytest.raises(ConfigError, match="chunk_max_bytes"):
        load_config(env={}, overrides={"broker.chunk_bytes": "1048576", "broker.chunk_max_bytes": "65536"})
    with pytest.raises(ConfigError, match="chunk_seconds"):
        load_config(env={}, overrides={"broker.chunk_seconds": "0"})


@pytest.mark.requires_binary("mosquitto")
async def test_a_broker_whose_limit_is_below_chunk_bytes_is_named_at_connect(
        caplog: pytest.LogCaptureFixture) -> None:
    with BrokerProcess.mosquitto(max_packet_size=100 * 1024) as broker:
        bus = Bus(config(broker.url).broker, client_id="small-limit", metrics=ServiceMetrics("sender"))
        with caplog.at_level("WARNING", logger="edgemesh.common.bus"):
            async with bus:
                pass
    assert any("takes packets of at most 102400 bytes" in r.getMessage() and "lower broker.chunk_bytes below 36864"
               in r.getMessage() for r in caplog.records), caplog.text
