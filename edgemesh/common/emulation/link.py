"""The emulated link between one device and the broker: a shaping TCP relay.

An emulated device's MQTT client connects to an :class:`EmulatedLink` instead of the
broker. The link relays bytes (it knows nothing of MQTT) and shapes them like a slow,
lossy Wi-Fi link, per direction:

* **bandwidth** - chunks leave one after another at ``rate`` bytes/s; the rate and the
  clock of when the radio is next free (:class:`LinkClock`) are shared by every
  connection of the link, as one radio is; a chunk arrives in pieces of at most
  :data:`PIECE_S` of air time, as a real link's frames do, not as the relay read it;
* **propagation delay** - each chunk arrives ``latency_s`` after it has been sent;
* **back-pressure** - at most :data:`QUEUE_BYTES` wait per direction and connection;
  while that is full the relay stops reading, so the sender's TCP window closes;
* **ends in order** - when a peer closes or resets its socket, the other peer gets the
  end of stream or the reset after the bytes sent before it, not ahead of them;
* **disconnects** - :meth:`EmulatedLink.outage` (forced) or a seeded Poisson process
  (spontaneous, :func:`outage_schedule`) cuts every connection with a TCP reset and
  refuses new ones until the outage ends;
* **stalls and rate changes** - :meth:`EmulatedLink.stall` holds every byte for a while with the
  connections kept (the broker notices nothing); :meth:`EmulatedLink.set_rates` scales both rates
  (a scenario's timeline drives both: ``dynamics``).

The link's shape, its clock and its drops are in ``shape``.

A cut looks to the broker like a device that died, not one that left: queued bytes are
dropped, no MQTT DISCONNECT gets through, the broker sees its socket reset and publishes
the client's will. While down, a connection is accepted and reset at once; note that
aiomqtt 2.x ignores a disconnect that comes before the CONNACK and reports the failed
attempt only at its own ``timeout``. Everything runs on the event loop; nothing blocks it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
from types import TracebackType
from typing import Self

from edgemesh.common.emulation import streams
from edgemesh.common.emulation.shape import LinkClock, LinkShape, outage_schedule

logger = logging.getLogger(__name__)

CHUNK_SIZE = 16 * 1024
"""Most bytes read from a socket at once."""
PIECE_S = 0.002
"""Most air time of one delivered piece: a chunk is paced and delivered in pieces this long (or one segment,
``SEGMENT_BYTES``, if that is longer), so that a receiver timing its bytes sees the link's rate. Delivered as
read, a 36 kB message on a 0.8 MB/s link seemed 1.8 times faster: its first 16 KiB came in one go."""
SEGMENT_BYTES = 1448
"""A TCP segment's payload under a 1500-byte MTU: the least a link delivers at once."""
QUEUE_BYTES = 1 << 20
"""Bytes that may wait for delivery per direction and connection before the relay stops reading."""
UPSTREAM_CONNECT_TIMEOUT_S = 10.0
"""Seconds to open the upstream connection of an accepted connection before giving up on it."""
CLOSE_TIMEOUT_S = 5.0
"""Seconds to wait for the relay tasks of cut or closed connections to finish."""


class _Direction:
    """One direction of the link: its clock, shared by every connection, and its byte counter."""

    __slots__ = ("name", "clock", "delivered")

    def __init__(self, name: str, rate_bps: float, latency_s: float) -> None:
        self.name = name
        self.clock = LinkClock(rate_bps, latency_s)
        self.delivered = 0


class _ChunkQueue:
    """Chunks of one connection and direction waiting for their delivery time, bounded in bytes."""

    __slots__ = ("_chunks", "_bytes", "_max_bytes", "_changed")

    def __init__(self, max_bytes: int) -> None:
        self._chunks: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._changed = asyncio.Condition()

    async def wait_room(self) -> None:
        """Return once fewer than ``max_bytes`` are queued."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._bytes < self._max_bytes)

    async def put(self, deliver_at: float, data: bytes | None) -> None:
        """Queue ``data`` for delivery at ``deliver_at`` (``b""``: end of stream, ``None``: reset)."""
        async with self._changed:
            self._chunks.append((deliver_at, data))
            self._bytes += len(data or b"")
            self._changed.notify_all()

    async def get(self) -> tuple[float, bytes | None]:
        """The oldest chunk and its delivery time, once there is one."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._chunks))
            deliver_at, data = self._chunks.popleft()
            self._bytes -= len(data or b"")
            self._changed.notify_all()
            return deliver_at, data


class _Connection:
    """One relayed connection: the device's transport, the upstream one once open, its relay task."""

    __slots__ = ("number", "client", "upstream", "task")

    def __init__(self, number: int, client: asyncio.WriteTransport) -> None:
        self.number = number
        self.client = client
        self.upstream: asyncio.WriteTransport | None = None
        self.task: asyncio.Task[None] | None = None

    def reset(self) -> None:
        """Reset both sockets now, dropping whatever they still had to send."""
        streams.reset(self.client)
        streams.reset(self.upstream)


class EmulatedLink:
    """A shaping relay on ``listen_host``:<free port> in front of ``upstream_host``:``upstream_port``.

    Async context manager; :attr:`host` and :attr:`port` (where the device connects)
    are valid once entered. The counters are plain numbers for the caller to export:
    ``bytes_up`` and ``bytes_down`` (bytes delivered each way), ``connections``
    (accepted and relayed), ``refused`` (accepted and reset while down),
    ``disconnects`` (cuts that hit at least one open connection), ``outages`` (times
    the link went down; extending an outage is not a new one), ``down_seconds``, ``stalls`` and
    ``stalled_seconds``.
    ``listen_host`` should be an IP address, so that the link listens on one socket.
    """

    def __init__(
        self,
        shape: LinkShape,
        *,
        upstream_host: str,
        upstream_port: int,
        seed: int = 0,
        listen_host: str = "127.0.0.1",
        name: str = "link",
        max_outage_s: float | None = None,
    ) -> None:
        if max_outage_s is not None and not (math.isfinite(max_outage_s) and max_outage_s > 0):
            raise ValueError(f"max_outage_s: expected a finite number > 0 or None (no cap), got {max_outage_s!r}")
        self.shape = shape
        self.seed = seed
        self.name = name
        self.max_outage_s = max_outage_s
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.host = listen_host
        """Where the device connects (valid once entered)."""
        self.port = 0
        """Where the device connects (valid once entered)."""
        self.connections = 0
        self.refused = 0
        self.disconnects = 0
        self.outages = 0
        self.down_seconds = 0.0
        self.stalls = 0
        self.stalled_seconds = 0.0
        self._uplink = _Direction("up", shape.uplink_bps, shape.latency_s)
        self._downlink = _Direction("down", shape.downlink_bps, shape.latency_s)
        self._open: set[_Connection] = set()
        self._up = asyncio.Event()
        self._up.set()
        self._down_until = -math.inf
        self._come_up_handle: asyncio.TimerHandle | None = None
        self._server: asyncio.Server | None = None
        self._dropper: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def busy_s(self) -> tuple[float, float]:
        """Seconds the uplink and the downlink have been busy sending so far."""
        return self._uplink.clock.busy_s, self._downlink.clock.busy_s

    @property
    def bytes_up(self) -> int:
        """Bytes delivered from the device to the broker."""
        return self._uplink.delivered

    @property
    def bytes_down(self) -> int:
        """Bytes delivered from the broker to the device."""
        return self._downlink.delivered

    @property
    def is_down(self) -> bool:
        """Whether the link is in an outage (connections are refused)."""
        return not self._up.is_set()

    async def wait_up(self) -> None:
        """Return when the link is up."""
        await self._up.wait()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.get_running_loop().create_server(
            lambda: streams.LastWords(asyncio.StreamReader(), self._accept), self.host, 0)
        self.host, self.port = self._server.sockets[0].getsockname()[:2]
        if self.shape.disconnects_per_hour > 0:
            self._dropper = asyncio.create_task(self._drop_spontaneously(), name=f"{self.name}:drops")
        logger.info(
            "%s: relaying %s:%d -> %s:%d (%s)", self.name, self.host, self.port,
            self.upstream_host, self.upstream_port, self.shape,
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closing = True
        if self._dropper is not None:
            self._dropper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dropper
        if self._server is not None:
            self._server.close()
        await self._cut_all()
        if self._come_up_handle is not None:
            self._come_up_handle.cancel()
        self._up.set()  # nobody waits for a closed link forever
        if self._server is not None:
            await self._server.wait_closed()
        logger.info(
            "%s: closed after %d connection(s), %d byte(s) up, %d down, %d outage(s), %.1f s down",
            self.name, self.connections, self.bytes_up, self.bytes_down, self.outages, self.down_seconds,
        )

    async def outage(self, seconds: float) -> None:
        """Cut every open connection now and refuse new ones for ``seconds``.

        Returns right after the cut. Called while down, extends the outage to the
        later of the two ends.
        """
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds: expected a finite number >= 0, got {seconds!r}")
        await self._go_down(seconds, "forced")

    def stall(self, seconds: float) -> None:
        """Move nothing either way for ``seconds`` from now, connections kept (a Wi-Fi stall: the broker does
        not notice, the bytes wait and arrive after it). Called during a stall, extends it to the later end."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds: expected a finite number >= 0, got {seconds!r}")
        until = asyncio.get_running_loop().time() + seconds
        for direction in (self._uplink, self._downlink):
            direction.clock.stalled_until = max(direction.clock.stalled_until, until)
        self.stalls += 1
        self.stalled_seconds += seconds
        logger.info("%s: link stalled for %.2f s", self.name, seconds)

    def set_rates(self, factor: float) -> None:
        """Both directions at ``factor`` times the shape's rates from now on (a varying Wi-Fi rate)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor: expected a finite number > 0, got {factor!r}")
        self._uplink.clock.rate_bps = self.shape.uplink_bps * factor
        self._downlink.clock.rate_bps = self.shape.downlink_bps * factor

    async def _go_down(self, seconds: float, cause: str) -> None:
        """Take the link down for ``seconds`` (or extend the outage), cutting every open connection."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        if self.is_down:
            extended = max(0.0, end - self._down_until)
            self.down_seconds += extended
            logger.info("%s: outage extended by %.2f s (%s, %.2f s from now)", self.name, extended, cause, seconds)
        else:
            self.outages += 1
            self.down_seconds += seconds
            self._up.clear()
            self._uplink.clock.reset()
            self._downlink.clock.reset()
            logger.info(
                "%s: link down for %.2f s (%s), %d connection(s) cut", self.name, seconds, cause, len(self._open)
            )
        if end > self._down_until:
            self._down_until = end
            if self._come_up_handle is not None:
                self._come_up_handle.cancel()
            self._come_up_handle = loop.call_at(end, self._come_up)
        if self._open:
            self.disconnects += 1
        await self._cut_all()

    def _come_up(self) -> None:
        """End the outage (a timer callback)."""
        self._come_up_handle = None
        self._up.set()
        logger.info("%s: link up", self.name)

    async def _cut_all(self) -> None:
        """Reset every open connection and wait for its relay task to finish."""
        tasks = []
        for conn in self._open:
            conn.reset()
            if conn.task is not None:
                conn.task.cancel()
                tasks.append(conn.task)
        self._open.clear()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT_S)

    async def _drop_spontaneously(self) -> None:
        """Take the link down on the seeded schedule of :func:`outage_schedule`, until cancelled."""
        for wait_s, length_s in outage_schedule(self.shape, self.seed, max_outage_s=self.max_outage_s):
            await self.wait_up()
            await asyncio.sleep(wait_s)
            await self._go_down(length_s, "spontaneous")

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A device connected: reset it while down, else start relaying it (called by the server)."""
        if self._closing or self.is_down:
            self.refused += 1
            streams.reset(writer.transport)
            logger.debug("%s: connection refused while down", self.name)
            return
        self.connections += 1
        conn = _Connection(self.connections, writer.transport)
        conn.task = asyncio.create_task(self._relay(conn, reader, writer), name=f"{self.name}:conn-{conn.number}")
        conn.task.add_done_callback(lambda task: self._relay_done(conn, task))
        self._open.add(conn)

    def _relay_done(self, conn: _Connection, task: asyncio.Task[None]) -> None:
        """Forget a finished connection; log a relay that failed (a bug: peers' errors are handled)."""
        self._open.discard(conn)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error("%s: relay of connection %d failed", self.name, conn.number, exc_info=error)

    async def _relay(self, conn: _Connection, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
        """Relay one connection both ways until each direction has delivered its end; reset it if interrupted."""
        finished = False
        try:
            try:
                async with asyncio.timeout(UPSTREAM_CONNECT_TIMEOUT_S):
                    upstream_reader, upstream_writer = await streams.open_connection(
                        self.upstream_host, self.upstream_port
                    )
            except (OSError, TimeoutError) as exc:
                logger.warning(
                    "%s: upstream %s:%d unreachable (%r); resetting connection %d",
                    self.name, self.upstream_host, self.upstream_port, exc, conn.number,
                )
                return
            conn.upstream = upstream_writer.transport
            async with asyncio.TaskGroup() as group:
                up = group.create_task(self._pipe(client_reader, upstream_writer, self._uplink))
                down = group.create_task(self._pipe(upstream_reader, client_writer, self._downlink))
            logger.debug("%s: connection %d ended (up: %s, down: %s)", self.name, conn.number, up.result(),
                         down.result())
            client_writer.close()
            upstream_writer.close()
            finished = True
        finally:
            if not finished:
                conn.reset()

    @classmethod
    async def _pipe(cls, source: asyncio.StreamReader, sink: asyncio.StreamWriter, direction: _Direction) -> str:
        """Relay one direction of a connection until its end is delivered; return how it ended.

        ``"eof"``: the source closed and the sink was half-closed after the last byte;
        ``"reset"``: the source was reset and the sink reset after the last byte;
        ``"lost"``: the sink is gone (what was still queued for it is dropped).
        """
        queue = _ChunkQueue(QUEUE_BYTES)
        reading = asyncio.create_task(cls._read(source, queue, direction))
        try:
            return await cls._deliver(queue, sink, direction)
        finally:
            reading.cancel()
            await asyncio.wait([reading])

    @staticmethod
    async def _read(source: asyncio.StreamReader, queue: _ChunkQueue, direction: _Direction) -> None:
        """Read chunks from ``source`` while ``queue`` has room, each timestamped with its delivery time.

        The source's end travels in order behind its bytes: ``b""`` when it closed,
        ``None`` when it was reset.
        """
        loop = asyncio.get_running_loop()
        while True:
            await queue.wait_room()
            data = await streams.read(source, CHUNK_SIZE)
            for piece in _pieces(data, direction.clock.rate_bps):
                await queue.put(direction.clock.deliver_at(len(piece or b""), loop.time()), piece)
            if not data:
                return

    @staticmethod
    async def _deliver(queue: _ChunkQueue, sink: asyncio.StreamWriter, direction: _Direction) -> str:
        """Write each queued chunk to ``sink`` at its delivery time, then its end; see :meth:`_pipe`."""
        loop = asyncio.get_running_loop()
        while True:
            deliver_at, data = await queue.get()
            delay = deliver_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if (stalled := direction.clock.stalled_until - loop.time()) > 0:
                await asyncio.sleep(stalled)  # a stall that began after the chunk was timed holds it too
            if data is None:
                await streams.flush(sink)
                streams.reset(sink.transport)
                return "reset"
            try:
                if not data:
                    if sink.can_write_eof():
                        sink.write_eof()
                    return "eof"
                sink.write(data)
                await sink.drain()
            except OSError:
                return "lost"
            direction.delivered += len(data)


def _pieces(data: bytes | None, rate_bps: float) -> list[bytes | None]:
    """``data`` as the pieces it is delivered in (see ``PIECE_S``); an end (``b""``, None) or an unlimited link's
    chunk as it is."""
    size = max(SEGMENT_BYTES, int(rate_bps * PIECE_S))
    if not data or rate_bps <= 0 or len(data) <= size:
        return [data]
    return [data[i:i + size] for i in range(0, len(data), size)]
