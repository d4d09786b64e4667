"""The emulated link: a relay that shapes a device's byte stream like a slow, lossy Wi-Fi link.

Byte-level tests run plain asyncio servers of their own behind the link; the outage test
runs a real MQTT client through it against each broker (started by the test). Timing
assertions are lower bounds only: shaping must delay by at least the modeled amount.
Every wait is bounded by :data:`WAIT`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
import statistics
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import aiomqtt
import pytest

from edgemesh.common.emulation import streams
from edgemesh.common.emulation.link import EmulatedLink, _ChunkQueue
from edgemesh.common.emulation.shape import LinkClock, LinkShape, outage_schedule
from edgemesh.local.broker import BrokerProcess, free_port

WAIT = 10.0
"""Seconds any single expected event may take."""
SLACK = 0.85
"""Shaping must delay by at least this share of the modeled time (timer and clock granularity)."""
WRITE_CHUNK = 64 * 1024
"""Bytes the test clients write at once."""

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


# --- helpers ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def tcp_server(handler: Handler) -> AsyncIterator[int]:
    """A plain TCP server on 127.0.0.1 running ``handler`` per connection; yields its port."""
    tasks: set[asyncio.Task[None]] = set()

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(serve(reader, writer))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except OSError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=WAIT)
        await server.wait_closed()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send back everything received; half-close at the end of the stream."""
    while data := await reader.read(WRITE_CHUNK):
        writer.write(data)
        await writer.drain()
    writer.write_eof()


async def send_all(writer: asyncio.StreamWriter, payload: bytes, *, eof: bool = True) -> None:
    """Write ``payload`` in chunks, honouring back-pressure, then half-close."""
    for start in range(0, len(payload), WRITE_CHUNK):
        writer.write(payload[start : start + WRITE_CHUNK])
        await writer.drain()
    if eof:
        writer.write_eof()


async def exchange(host: str, port: int, payload: bytes) -> bytes:
    """Send ``payload`` to ``host:port`` while reading its answer until the end of the stream."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        async with asyncio.TaskGroup() as group:
            group.create_task(send_all(writer, payload))
            answer = group.create_task(reader.read())
    finally:
        writer.close()
    return answer.result()


async def wait_cut(reader: asyncio.StreamReader) -> None:
    """Return when the connection of ``reader`` is reset or closed by the other end."""
    with contextlib.suppress(ConnectionResetError):
        while await reader.read(WRITE_CHUNK):
            pass


def mqtt_client(host: str, port: int, **kwargs: object) -> aiomqtt.Client:
    """An MQTT 3.1.1 client of ``host:port`` (both brokers speak it)."""
    return aiomqtt.Client(host, port, timeout=WAIT, **kwargs)  # type: ignore[arg-type]


async def next_message(client: aiomqtt.Client) -> aiomqtt.Message:
    """The next message delivered to ``client``; TimeoutError if none comes in time."""
    async with asyncio.timeout(WAIT):
        async for message in client.messages:
            return message
    raise AssertionError("message iterator ended")  # pragma: no cover


# --- LinkShape ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("uplink_bps", -1.0),
        ("downlink_bps", math.inf),
        ("latency_s", math.nan),
        ("disconnects_per_hour", -0.5),
        ("outage_s", "5"),
    ],
)
def test_shape_rejects_negative_or_non_finite_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        LinkShape(**{field: value})  # type: ignore[arg-type]


def test_shape_requires_an_outage_length_when_drops_are_on() -> None:
    with pytest.raises(ValueError, match="^outage_s:"):
        LinkShape(disconnects_per_hour=2.0)
    LinkShape(disconnects_per_hour=2.0, outage_s=1.0)  # valid


def test_shape_is_off_only_when_it_shapes_nothing() -> None:
    assert LinkShape().off
    assert LinkShape(outage_s=3.0).off  # a drop length without drops shapes nothing
    for shaped in (
        LinkShape(uplink_bps=1e6),
        LinkShape(downlink_bps=1e6),
        LinkShape(latency_s=0.01),
        LinkShape(disconnects_per_hour=1.0, outage_s=1.0),
    ):
        assert not shaped.off, shaped


# --- pacing model ---------------------------------------------------------------------------


def test_clock_queues_chunks_behind_each_other_then_adds_latency() -> None:
    clock = LinkClock(rate_bps=1000.0, latency_s=0.5)
    assert clock.deliver_at(100, now=10.0) == pytest.approx(10.6)  # 0.1 s on the air + 0.5 s
    assert clock.deliver_at(200, now=10.0) == pytest.approx(10.8)  # waits for the first chunk
    assert clock.deliver_at(100, now=20.0) == pytest.approx(20.6)  # an idle radio starts at once
    clock.deliver_at(1000, now=30.0)
    clock.reset()  # the chunk in flight was dropped: the radio is free again
    assert clock.deliver_at(0, now=30.0) == pytest.approx(30.5)


def test_clock_without_a_rate_adds_only_latency() -> None:
    clock = LinkClock(rate_bps=0.0, latency_s=0.0)
    assert clock.deliver_at(10**9, now=5.0) == 5.0
    assert clock.deliver_at(10**9, now=5.0) == 5.0


async def test_the_relay_stops_reading_while_its_queue_is_full() -> None:
    queue = _ChunkQueue(max_bytes=100)
    await queue.wait_room()  # empty: room at once
    await queue.put(1.0, bytes(60))
    await queue.wait_room()  # 60 < 100: still room
    await queue.put(2.0, bytes(60))
    room = asyncio.create_task(queue.wait_room())
    await asyncio.sleep(0)  # let it run: it must now be blocked on the full queue
    assert not room.done()
    assert await queue.get() == (1.0, bytes(60))  # taking one chunk out makes room
    async with asyncio.timeout(WAIT):
        await room
    assert await queue.get() == (2.0, bytes(60))


# --- relaying ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [LinkShape(), LinkShape(uplink_bps=20e6, downlink_bps=20e6, latency_s=0.005)],
    ids=["off", "shaped"],
)
async def test_bytes_cross_intact_and_in_order_both_ways(shape: LinkShape) -> None:
    payload = random.Random(1).randbytes(3 << 20)
    async with tcp_server(echo) as port, EmulatedLink(shape, upstream_host="127.0.0.1", upstream_port=port) as link:
        async with asyncio.timeout(WAIT):
            answer = await exchange(link.host, link.port, payload)
        assert answer == payload  # the stream also ended: half-closes were relayed both ways
        assert (link.bytes_up, link.bytes_down) == (len(payload), len(payload))
        assert link.connections == 1


@pytest.mark.parametrize("direction", ["up", "down"])
async def test_moving_n_bytes_takes_at_least_n_over_the_rate(direction: str) -> None:
    size, rate = 200_000, 200_000.0
    payload = bytes(size)
    shape = LinkShape(uplink_bps=rate) if direction == "up" else LinkShape(downlink_bps=rate)
    received = asyncio.get_running_loop().create_future()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.set_result(len(await reader.read()))

    async def source(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await send_all(writer, payload)

    loop = asyncio.get_running_loop()
    server = tcp_server(sink if direction == "up" else source)
    async with server as port, EmulatedLink(shape, upstream_host="127.0.0.1", upstream_port=port) as link:
        async with asyncio.timeout(WAIT):
            start = loop.time()
            reader, writer = await asyncio.open_connection(link.host, link.port)
            if direction == "up":
                await send_all(writer, payload)
                assert await received == size
            else:
                assert len(await reader.read()) == size
            elapsed = loop.time() - start
            writer.close()
    assert elapsed >= SLACK * size / rate


async def test_a_slow_uplink_does_not_slow_the_downlink() -> None:
    up_size, up_rate = 80_000, 40_000.0  # >= 2 s
    down_size, down_rate = 200_000, 400_000.0  # >= 0.5 s
    shape = LinkShape(uplink_bps=up_rate, downlink_bps=down_rate)
    loop = asyncio.get_running_loop()
    uploaded = loop.create_future()

    async def both_ways(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(send_all(writer, bytes(down_size)))
            upload = group.create_task(reader.readexactly(up_size))
        await upload
        uploaded.set_result(loop.time())

    async with tcp_server(both_ways) as port, EmulatedLink(
        shape, upstream_host="127.0.0.1", upstream_port=port
    ) as link:
        async with asyncio.timeout(WAIT):
            start = loop.time()
            reader, writer = await asyncio.open_connection(link.host, link.port)
            upload = asyncio.create_task(send_all(writer, bytes(up_size), eof=False))
            await reader.readexactly(down_size)
            downloaded = loop.time()
            assert not uploaded.done()  # the download finished while the upload was still going
            up_done = await uploaded
            await upload
            writer.close()
    assert downloaded - start >= SLACK * down_size / down_rate
    assert up_done - start >= SLACK * up_size / up_rate
    assert downloaded < up_done


async def test_connections_of_one_link_share_its_rate() -> None:
    size, rate = 100_000, 200_000.0  # two connections: >= 1 s together
    loop = asyncio.get_running_loop()
    done: list[float] = []
    both_done = asyncio.Event()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(size)
        done.append(loop.time())
        if len(done) == 2:
            both_done.set()

    async def upload(host: str, port: int) -> None:
        _, writer = await asyncio.open_connection(host, port)
        await send_all(writer, bytes(size))
        writer.close()

    async with tcp_server(sink) as port, EmulatedLink(
        LinkShape(uplink_bps=rate), upstream_host="127.0.0.1", upstream_port=port
    ) as link:
        async with asyncio.timeout(WAIT):
            start = loop.time()
            await asyncio.gather(upload(link.host, link.port), upload(link.host, link.port))
            await both_done.wait()
    assert max(done) - start >= SLACK * 2 * size / rate


async def test_a_round_trip_takes_at_least_twice_the_latency() -> None:
    latency = 0.2
    loop = asyncio.get_running_loop()
    async with tcp_server(echo) as port, EmulatedLink(
        LinkShape(latency_s=latency), upstream_host="127.0.0.1", upstream_port=port
    ) as link:
        async with asyncio.timeout(WAIT):
            reader, writer = await asyncio.open_connection(link.host, link.port)
            start = loop.time()
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            elapsed = loop.time() - start
            writer.close()
    assert elapsed >= SLACK * 2 * latency


async def until_the_end(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    """Everything ``reader`` receives, and how its stream ended: ``"eof"`` or ``"reset"``."""
    received = bytearray()
    try:
        while data := await reader.read(WRITE_CHUNK):
            received += data
    except ConnectionResetError:
        return "reset", bytes(received)
    return "eof", bytes(received)


@pytest.mark.parametrize("how", ["eof", "reset"])
async def test_a_peer_s_end_arrives_after_the_bytes_it_sent_before_it(how: str) -> None:
    # A device's last words (an MQTT DISCONNECT, say) are still in flight when it ends its
    # stream or resets its socket, while the far end keeps sending to it: the far end must
    # get the last words first, then the end of stream or the reset, as over a real link.
    last_words = bytes(range(256)) * 80  # 20 KiB: 0.2 s on the air at 100 kB/s
    loop = asyncio.get_running_loop()
    ending = loop.create_future()

    async def chatty(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = asyncio.create_task(send_all(writer, bytes(1 << 20)))
        ending.set_result(await until_the_end(reader))
        stream.cancel()
        await asyncio.wait([stream])

    shape = LinkShape(uplink_bps=100_000, latency_s=0.05)
    async with tcp_server(chatty) as port, EmulatedLink(shape, upstream_host="127.0.0.1", upstream_port=port) as link:
        async with asyncio.timeout(WAIT):
            reader, writer = await asyncio.open_connection(link.host, link.port)
            await reader.readexactly(1)  # the far end is sending
            writer.write(last_words)
            await writer.drain()
            if how == "reset":  # closing with unread bytes resets too; this does it for sure
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:
                writer.write_eof()
            assert await ending == (how, last_words)
            writer.close()


async def test_a_reset_a_write_runs_into_still_gives_the_bytes_sent_before_it() -> None:
    # The relay's end of a connection whose peer sent its last words and reset while the relay was not reading
    # (a busy loop, or reading paused under back-pressure): the relay's next write fails on the reset. asyncio
    # would then close the socket unread; the relay must still read the last words, then the reset.
    last_words = bytes(range(256)) * 80
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = loop.create_future()
    server = await loop.create_server(
        lambda: streams.LastWords(asyncio.StreamReader(), lambda r, w: accepted.set_result((r, w))), "127.0.0.1", 0)
    async with server, asyncio.timeout(WAIT):
        _, peer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        reader, writer = await accepted
        writer.transport.pause_reading()
        peer.write(last_words)
        await streams.flush(peer)  # in the relay's kernel, unread
        streams.reset(peer.transport)
        await peer.wait_closed()
        while not writer.transport.is_closing():  # the reset reaches the relay's kernel: a write runs into it
            writer.write(b"x")
            await asyncio.sleep(0.01)
        received = bytearray()
        while data := await streams.read(reader, WRITE_CHUNK):
            received += data
        assert (bytes(received), data) == (last_words, None)  # every byte, then the reset
        writer.close()


async def test_an_unreachable_upstream_closes_the_device_side() -> None:
    async with EmulatedLink(LinkShape(), upstream_host="127.0.0.1", upstream_port=free_port()) as link:
        async with asyncio.timeout(WAIT):
            reader, writer = await asyncio.open_connection(link.host, link.port)
            await wait_cut(reader)
            writer.close()
        assert link.connections == 1


async def test_closing_the_link_closes_its_connections_and_tasks() -> None:
    async with tcp_server(echo) as port:
        async with EmulatedLink(LinkShape(latency_s=0.05), upstream_host="127.0.0.1", upstream_port=port,
                                name="closing-link") as link:
            reader, writer = await asyncio.open_connection(link.host, link.port)
            writer.write(b"hello")
            async with asyncio.timeout(WAIT):
                assert await reader.readexactly(5) == b"hello"
        async with asyncio.timeout(WAIT):
            await wait_cut(reader)
        writer.close()
        leftover = [task for task in asyncio.all_tasks() if task.get_name().startswith("closing-link")]
        assert leftover == []


# --- outages -------------------------------------------------------------------------------


async def test_a_cut_resets_both_sides_and_drops_queued_bytes() -> None:
    size = 200_000
    loop = asyncio.get_running_loop()
    first_bytes = asyncio.Event()
    ending = loop.create_future()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        total = 0
        try:
            while data := await reader.read(WRITE_CHUNK):
                total += len(data)
                first_bytes.set()
        except ConnectionResetError:
            ending.set_result(("reset", total))
        else:
            ending.set_result(("eof", total))

    async with tcp_server(sink) as port, EmulatedLink(
        LinkShape(uplink_bps=50_000), upstream_host="127.0.0.1", upstream_port=port
    ) as link:
        async with asyncio.timeout(WAIT):
            reader, writer = await asyncio.open_connection(link.host, link.port)
            writer.write(bytes(size))  # 4 s on the air: most of it still queued at the cut
            await first_bytes.wait()
            await link.outage(0.2)
            how, received = await ending
            with pytest.raises(ConnectionResetError):  # the device sees a reset too
                await reader.read()
            writer.close()
    assert how == "reset"  # the upstream sees a dead peer, not an orderly close
    assert 0 < received < size
    assert link.bytes_up == received
    assert link.disconnects == 1


async def test_connections_are_refused_while_down_and_an_outage_extends_to_the_later_end() -> None:
    loop = asyncio.get_running_loop()
    async with tcp_server(echo) as port, EmulatedLink(
        LinkShape(), upstream_host="127.0.0.1", upstream_port=port
    ) as link:
        async with asyncio.timeout(WAIT):
            reader, writer = await asyncio.open_connection(link.host, link.port)
            writer.write(b"x")
            assert await reader.readexactly(1) == b"x"

            before = loop.time()
            await link.outage(0.4)
            await link.outage(0.8)  # extends: down until 0.8 s from now
            await link.outage(0.1)  # ends earlier: changes nothing
            after = loop.time()
            await wait_cut(reader)
            writer.close()

            assert link.is_down
            refused_reader, refused_writer = await asyncio.open_connection(link.host, link.port)
            await wait_cut(refused_reader)  # accepted, then reset at once
            refused_writer.close()
            assert link.refused == 1

            await link.wait_up()
            up_at = loop.time()
            assert not link.is_down
            assert await exchange(link.host, link.port, b"back") == b"back"
    assert up_at - before >= 0.8
    assert link.outages == 1
    assert link.disconnects == 1  # only the first call found an open connection
    assert 0.8 <= link.down_seconds <= 0.8 + (after - before)
    assert link.connections == 2


async def test_a_forced_outage_fires_the_will_and_refuses_reconnects_until_it_ends(broker: BrokerProcess) -> None:
    outage = 3.0
    status = "edgemesh/v1/t/device/emulated-1/status"
    will = aiomqtt.Will(status, b"offline", qos=1)
    loop = asyncio.get_running_loop()
    async with EmulatedLink(
        LinkShape(latency_s=0.01), upstream_host=broker.host, upstream_port=broker.port
    ) as link, mqtt_client(broker.host, broker.port) as watcher:
        await watcher.subscribe(status, qos=1)
        async with mqtt_client(link.host, link.port, identifier="emulated-1", will=will) as device:
            await device.subscribe("edgemesh/v1/t/plan", qos=1)
            await device.publish(status, b"online", qos=1)
            assert (await next_message(watcher)).payload == b"online"

            start = loop.time()
            await link.outage(outage)
            with pytest.raises(aiomqtt.MqttError):
                await next_message(device)  # the device sees its connection drop
        assert (await next_message(watcher)).payload == b"offline"  # the broker saw a dead device

        assert link.is_down
        with pytest.raises(aiomqtt.MqttError):  # entering the client is the attempt
            async with aiomqtt.Client(link.host, link.port, identifier="emulated-1", timeout=1.0):
                pass
        assert link.refused >= 1

        async with asyncio.timeout(WAIT):
            await link.wait_up()
        assert loop.time() - start >= outage
        async with mqtt_client(link.host, link.port, identifier="emulated-1", will=will) as device:
            await device.publish(status, b"online again", qos=1)
            assert (await next_message(watcher)).payload == b"online again"

    assert link.outages == 1
    assert link.disconnects == 1
    assert link.down_seconds == pytest.approx(outage)
    assert link.connections == 2


# --- spontaneous drops ---------------------------------------------------------------------


def test_the_drop_schedule_depends_only_on_the_seed() -> None:
    shape = LinkShape(disconnects_per_hour=60.0, outage_s=5.0)
    first = list(outage_schedule(shape, seed=7, count=50))
    assert len(first) == 50
    assert first == list(outage_schedule(shape, seed=7, count=50))
    assert first != list(outage_schedule(shape, seed=8, count=50))
    assert list(outage_schedule(LinkShape(), seed=7, count=50)) == []  # no drops


def test_the_drop_schedule_follows_its_rate_and_mean_length() -> None:
    shape = LinkShape(disconnects_per_hour=120.0, outage_s=4.0)  # one drop every 30 s on average
    waits, lengths = zip(*outage_schedule(shape, seed=3, count=20_000), strict=True)
    assert statistics.fmean(waits) == pytest.approx(30.0, rel=0.05)
    assert statistics.fmean(lengths) == pytest.approx(4.0, rel=0.05)
    capped = [length for _, length in outage_schedule(shape, seed=3, count=20_000, max_outage_s=2.0)]
    assert max(capped) == 2.0
    assert capped == [min(length, 2.0) for length in lengths]


async def test_spontaneous_drops_cut_connections_on_the_seeded_schedule() -> None:
    shape = LinkShape(disconnects_per_hour=36_000.0, outage_s=0.05)  # a drop every 0.1 s on average
    seed = 11
    async with tcp_server(echo) as port, EmulatedLink(
        shape, upstream_host="127.0.0.1", upstream_port=port, seed=seed
    ) as link:
        async with asyncio.timeout(WAIT):
            while link.disconnects < 3:
                await link.wait_up()
                reader, writer = await asyncio.open_connection(link.host, link.port)
                await wait_cut(reader)  # the echo server sends nothing: only a drop ends this
                writer.close()
        # read together, in one step of the loop: one consistent state
        outages, disconnects, down_seconds = link.outages, link.disconnects, link.down_seconds
    assert outages >= disconnects >= 3
    lengths = [length for _, length in outage_schedule(shape, seed, count=outages)]
    assert down_seconds == pytest.approx(sum(lengths))  # the link took the seed's outages, in order
