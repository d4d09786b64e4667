"""The emulated link's sockets: a reset that drops nothing sent before it, and streams that keep a peer's last
words when its reset is reported by a failed write (asyncio's own streams lose them)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
from collections.abc import Callable

READ_BYTES = 16 * 1024
"""Most bytes read at once from a socket being closed."""
FLUSH_TIMEOUT_S = 2.0
"""Seconds a reset waits for the bytes before it to leave this host (a far end that reads nothing holds them)."""
FLUSH_POLL_S = 0.005
"""Seconds between looks at a socket's unsent bytes while a reset waits for them."""
LINGER_RESET = struct.pack("ii", 1, 0)
"""``SO_LINGER`` on with a zero timeout: closing the socket sends a TCP RST and drops unsent bytes."""


def reset(transport: asyncio.WriteTransport | None) -> None:
    """Close ``transport`` at once with a TCP RST: its unsent bytes are dropped, no FIN is sent."""
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
    transport.abort()


def unread(sock: socket.socket) -> bytes:
    """What ``sock`` (an asyncio transport's, not yet closed) still holds to be read, taken without blocking."""
    try:
        dup = socket.fromfd(sock.fileno(), sock.family, sock.type)  # a dup: closing it leaves the transport's
    except OSError:
        return b""
    pieces = []
    with dup:
        dup.setblocking(False)
        while True:
            try:
                data = dup.recv(READ_BYTES)
            except OSError:  # nothing more for now, or the peer's reset after its bytes
                break
            if not data:
                break
            pieces.append(data)
    return b"".join(pieces)


async def read(source: asyncio.StreamReader, n: int) -> bytes | None:
    """Up to ``n`` bytes from ``source``: ``b""`` at its end, None at its reset, after every byte that came before
    it (``StreamReader.read`` raises a reset ahead of the bytes it holds)."""
    try:
        return await source.read(n)
    except OSError:
        buffered: bytearray = getattr(source, "_buffer", bytearray())
        if not buffered:
            return None
        ahead = bytes(buffered[:n])
        del buffered[:n]
        return ahead


class LastWords(asyncio.StreamReaderProtocol):
    """A stream that keeps a peer's last words. When a write fails on the peer's reset, asyncio closes the socket
    without reading what the peer sent before it (read late: the loop was busy, or reading was paused under
    back-pressure); this reads it first, so the reader gets those bytes ahead of the error, as TCP delivers them."""

    def __init__(self, reader: asyncio.StreamReader,
                 connected: Callable[[asyncio.StreamReader, asyncio.StreamWriter], None] | None = None) -> None:
        super().__init__(reader, connected)
        self._reader = reader
        self._socket: socket.socket | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._socket = transport.get_extra_info("socket")
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and self._socket is not None and (data := unread(self._socket)):
            self._reader.feed_data(data)
        super().connection_lost(exc)


async def open_connection(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """``asyncio.open_connection`` with :class:`LastWords`."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    protocol = LastWords(reader)
    transport, _ = await loop.create_connection(lambda: protocol, host, port)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


async def flush(sink: asyncio.StreamWriter) -> None:
    """Wait up to :data:`FLUSH_TIMEOUT_S` until what was written to ``sink`` has left this host (asyncio's buffer
    and the kernel's send queue are empty): a reset after it must not drop the bytes sent before it."""
    sock = sink.get_extra_info("socket")
    sink.transport.set_write_buffer_limits(0)
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(FLUSH_TIMEOUT_S):
            await sink.drain()
            while sock is not None and unsent(sock):  # noqa: ASYNC110 - the kernel's queue: no event to await
                await asyncio.sleep(FLUSH_POLL_S)


def unsent(sock: socket.socket) -> int:
    """Bytes in ``sock``'s kernel send queue: not sent yet, or not yet acked by the far end."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0])
