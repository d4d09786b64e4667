"""paho's packet reading, PUBLISH decoding and packet sending, with a payload copied by the kernel alone: opt-in, and
only on the paho-mqtt releases it was written for.

paho-mqtt 2.x reads a packet's body with ``sock.recv(remaining)`` calls, each into a new ``bytes``, appended to a
growing ``bytearray``; then it splits the PUBLISH with ``struct.unpack(f"!H{n}s", packet)`` three times (the
topic's length, the topic, the packet id), slices off the MQTT 5 properties, and ``Properties.unpack`` slices its
buffer again for every field: each step copies the rest of the packet, payload included, with the GIL held. For
a gradient of megabytes that is four to six copies.

This module replaces paho's private reader, writer and PUBLISH decoder, so it is pinned: ``enable(client)`` is the
one way in, called for the clients of a bus built with ``zero_copy=True`` (the services' runtime builds theirs so)
and by ``bench transport``. On a paho-mqtt outside ``PAHO_VERSIONS`` it logs one warning and leaves paho as it is;
a test fails when the installed paho is outside them, so that a new paho is read before the range is widened.

* ``read_into_buffers(client)`` gives one paho client a packet reader that reads each packet's body with
  ``recv_into`` straight into a buffer of its size (a ``Body``; the GIL is released while the kernel copies).
  It reads the fixed header as paho does, through ``_sock_recv`` (what ``taps`` wraps to note when a packet's
  first byte was read), and answers as paho's ``_packet_read`` does (``MQTT_ERR_AGAIN`` while a packet is
  incomplete, ``MQTT_ERR_CONN_LOST`` on a closed or failed socket).
* ``write_from_buffers(client)`` makes the packets one paho client queues of ``UNSLICED_FROM`` bytes and more
  hand out views of themselves: paho sends ``packet[pos:]`` of a queued packet, a copy of what is left of it at
  every send (the whole packet at least once), where a view costs nothing. A PUBLISH whose payload is that long
  is not even joined: paho builds it by appending the payload to its header (a copy of the payload), where it is
  queued here as the two (``Pieces``), sent one after the other.
* ``decode_publish`` reads the PUBLISH fields from a memoryview; the payload of a ``Body`` is that buffer itself,
  its header dropped from the front in place (O(1) for a ``bytearray``), so a payload costs no copy at all; any
  other buffer's payload is copied once. It returns what paho's does and raises ``MalformedPacket`` where
  paho's does (paho's own ``convert_exception`` wraps it). paho calls its decoder through a module of its own,
  so ``install`` puts ``dispatch`` in its place for the process (once): a ``Body`` goes to ``decode_publish``, any
  other packet (a client that did not opt in, reading with paho's own reader) to paho's own decoder, untouched.
"""

from __future__ import annotations

import logging
import socket
import ssl
import types
from typing import Any, cast

import paho.mqtt
from paho.mqtt import client as paho_client
from paho.mqtt.enums import MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties, VariableByteIntegers

try:  # paho's private decoders: paho-mqtt 2.1 has no such module (outside PAHO_VERSIONS, never used)
    from paho.mqtt import _packet
except ImportError:
    _packet = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

PAHO_VERSIONS = ((2, 2), (2, 3))
"""The paho-mqtt releases this module was written and tested against: from the first (2.2.0) up to, not including,
the second. What it relies on: ``Client._packet_read``, ``_in_packet``, ``_sock_recv``, ``_packet_handle``,
``_packet_queue``, ``_send_publish``, ``_pack_remaining_length``, ``_pack_str16`` and ``_packet.decode_publish``."""
PAHO_VERSION: str = paho.mqtt.__version__
"""The paho-mqtt of this process."""

_VBI_MAX = 4
"""A Variable Byte Integer is at most four bytes long."""
PAHO_DECODE = getattr(_packet, "decode_publish", None)
"""paho's own, as this module found it."""
READS_PER_CALL = 100
"""Socket reads one call may make before it lets the event loop run again, as paho's own reader."""
UNSLICED_FROM = 64 * 1024
"""Packets this long and longer are sent from views of themselves (``write_from_buffers``)."""


class Body(bytearray):
    """A packet's body as ``read_into_buffers`` read it: a PUBLISH's payload is this buffer itself."""


class Unsliced:
    """A queued packet whose slices are views of it, not copies (``write_from_buffers``)."""

    __slots__ = ("_view",)

    def __init__(self, packet: bytes | bytearray) -> None:
        self._view = memoryview(packet)

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, key: slice) -> memoryview:
        return self._view[key]


class Pieces:
    """A PUBLISH queued as its header and its payload, never joined (``write_from_buffers``): ``packet[pos:]`` is a
    view of what is left of the piece ``pos`` falls in, so one send takes at most the rest of that piece."""

    __slots__ = ("_body", "_head")

    def __init__(self, head: bytes, body: bytes | bytearray) -> None:
        self._head, self._body = memoryview(head), memoryview(body)

    def __len__(self) -> int:
        return len(self._head) + len(self._body)

    def __getitem__(self, key: slice) -> memoryview:
        start = key.start or 0
        if start < len(self._head):
            return self._head[start:]
        return self._body[start - len(self._head):]


def decode_publish(header: int, packet: bytes | bytearray, protocol: MQTTProtocolVersion) -> _packet.PublishPacket:
    """A PUBLISH packet after its fixed header, as paho's ``_packet.decode_publish`` decodes it; the payload of a
    ``Body`` is the body itself, its header dropped."""
    dup = ((header & 0x08) >> 3) != 0
    qos = (header & 0x06) >> 1
    retain = (header & 0x01) != 0
    with memoryview(packet) as view:
        size = len(view)
        if size < 2:
            raise MalformedPacket("PUBLISH shorter than its topic length")
        pos = 2 + ((view[0] << 8) | view[1])
        if pos > size:
            raise MalformedPacket("PUBLISH topic runs past the packet")
        topic = bytes(view[2:pos])
        if protocol != MQTTProtocolVersion.MQTTv5 and len(topic) == 0:
            raise MalformedPacket("topic can't be empty in MQTTv3")
        mid = 0
        if qos > 0:
            if pos + 2 > size:
                raise MalformedPacket("PUBLISH packet id runs past the packet")
            mid = (view[pos] << 8) | view[pos + 1]
            pos += 2
        properties = None
        if protocol == MQTTProtocolVersion.MQTTv5:
            properties = Properties(PacketTypes.PUBLISH)
            length, width = VariableByteIntegers.decode(bytes(view[pos:pos + _VBI_MAX]))
            _, used = properties.unpack(bytes(view[pos:pos + width + length]))  # the properties alone
            pos += used
        payload: bytes | bytearray = b"" if isinstance(packet, Body) else bytes(view[pos:])
    if isinstance(packet, Body):  # the view released: the header goes from the front, the rest is not moved
        del packet[:pos]
        payload = packet
    return _packet.PublishPacket(dup=dup, qos=qos, retain=retain, topic=topic, mid=mid, properties=properties,
                                 payload=payload)


def written_for(version: str) -> bool:
    """Whether paho-mqtt ``version`` is one of ``PAHO_VERSIONS``."""
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return PAHO_VERSIONS[0] <= release < PAHO_VERSIONS[1]


_installed = False
_warned = False
_decode_body = _packet.convert_exception(decode_publish) if _packet is not None else decode_publish
"""``decode_publish`` raising paho's ``MalformedPacket`` for what it cannot decode, as paho's own does."""


def enable(client: paho_client.Client) -> bool:
    """Read and write ``client``'s packets with this module (before it connects), and decode every PUBLISH of the
    process with it (``install``): True. On a paho-mqtt this module was not written for, paho stays as it is and a
    warning is logged (once per process): False."""
    global _warned  # noqa: PLW0603 - one warning per process
    if not written_for(PAHO_VERSION) or PAHO_DECODE is None:
        if not _warned:
            logger.warning("paho-mqtt %s is not one this process's zero-copy paho layer was written for (%s.%s up "
                           "to %s.%s): received payloads are copied as paho copies them", PAHO_VERSION,
                           *PAHO_VERSIONS[0], *PAHO_VERSIONS[1])
            _warned = True
        return False
    install()
    read_into_buffers(client)
    write_from_buffers(client)
    return True


def install() -> None:
    """Put ``dispatch`` in paho's place as its PUBLISH decoder (once; ``enable`` calls it)."""
    global _installed  # noqa: PLW0603 - one swap per process
    if not _installed:
        _packet.decode_publish = dispatch
        _installed = True


def dispatch(header: int, packet: bytes | bytearray, protocol: MQTTProtocolVersion) -> _packet.PublishPacket:
    """The PUBLISH decoder paho calls for every client of the process: a ``Body`` (read by ``read_packet``, so by a
    client ``enable`` made this module's) with ``decode_publish``, any other packet with paho's own, untouched:
    a client that did not opt in decodes as stock paho does."""
    if isinstance(packet, Body):
        return _decode_body(header, packet, protocol)
    return PAHO_DECODE(header, packet, protocol)  # type: ignore[misc]


def write_from_buffers(client: paho_client.Client) -> None:
    """Queue ``client``'s long packets as ``Unsliced``, and its PUBLISHes of long payloads as ``Pieces`` (before it
    connects)."""
    queue, send_publish = client._packet_queue, client._send_publish  # noqa: SLF001 - where paho queues packets

    def queued(command: int, packet: bytes | bytearray, mid: int, qos: int, info: Any = None) -> MQTTErrorCode:
        long = len(packet) >= UNSLICED_FROM and not isinstance(packet, Pieces)
        return queue(command, Unsliced(packet) if long else packet, mid, qos, info)  # type: ignore[arg-type]

    def publish(mid: int, topic: bytes, payload: bytes | bytearray = b"", qos: int = 0, retain: bool = False,
                dup: bool = False, info: Any = None, properties: Properties | None = None) -> MQTTErrorCode:
        """paho's ``_send_publish``, the header built as paho builds it and the payload queued beside it."""
        if len(payload) < UNSLICED_FROM or not isinstance(topic, bytes) or \
                not isinstance(payload, (bytes, bytearray)) or client._sock is None:  # noqa: SLF001
            return send_publish(mid, topic, payload, qos, retain, dup, info, properties)  # paho's answer
        v5 = client._protocol == MQTTProtocolVersion.MQTTv5  # noqa: SLF001
        packed = (b"\x00" if properties is None else properties.pack()) if v5 else b""
        head = bytearray([paho_client.PUBLISH | ((dup & 0x1) << 3) | (qos << 1) | retain])
        remaining = 2 + len(topic) + (2 if qos > 0 else 0) + len(packed) + len(payload)
        client._pack_remaining_length(head, remaining)  # noqa: SLF001
        client._pack_str16(head, topic)  # noqa: SLF001
        if qos > 0:
            head += mid.to_bytes(2, "big")
        head += packed
        pieces = Pieces(bytes(head), payload)
        return client._packet_queue(paho_client.PUBLISH, pieces, mid, qos, info)  # type: ignore[arg-type]  # noqa: SLF001

    client._packet_queue = queued  # type: ignore[method-assign]  # noqa: SLF001
    client._send_publish = publish  # type: ignore[method-assign]  # noqa: SLF001


def read_into_buffers(client: paho_client.Client) -> None:
    """Read ``client``'s packets with ``read_packet`` (before it connects)."""
    client._packet_read = types.MethodType(read_packet, client)  # type: ignore[method-assign]  # noqa: SLF001


def read_packet(self: paho_client.Client) -> MQTTErrorCode:
    """paho's ``Client._packet_read``, the body read into a ``Body`` of its size: read what the socket has of
    the packet under way; once it is whole, hand it to paho's ``_packet_handle`` and start the next."""
    packet = cast(dict[str, Any], self._in_packet)  # noqa: SLF001 - paho's reading state, kept in paho's shape
    if packet["command"] == 0 or packet["have_remaining"] == 0:
        rc = _read_header(self, packet)
        if rc is not None:
            return rc
        packet["packet"], packet["filled"] = Body(packet["remaining_length"]), 0
    rc = _read_body(self, packet)
    if rc is not None:
        return rc
    return _handle(self, packet)


def _read_body(self: paho_client.Client, packet: dict[str, Any]) -> MQTTErrorCode | None:
    """What the socket has of the body, into its ``Body`` (None once the body is whole), at most
    ``READS_PER_CALL`` reads."""
    body: Body = packet["packet"]
    for _ in range(READS_PER_CALL):
        if packet["to_process"] <= 0:
            return None
        sock = cast(socket.socket | None, self._sock)  # noqa: SLF001 - TCP or TLS: both read into a buffer
        if sock is None:
            return MQTTErrorCode.MQTT_ERR_CONN_LOST
        try:
            with memoryview(body) as view:
                n = sock.recv_into(view[packet["filled"]:])
        except (BlockingIOError, ssl.SSLWantReadError):
            return MQTTErrorCode.MQTT_ERR_AGAIN
        except ssl.SSLWantWriteError:
            self._call_socket_register_write()  # noqa: SLF001
            return MQTTErrorCode.MQTT_ERR_AGAIN
        except OSError as exc:
            self._easy_log(paho_client.MQTT_LOG_ERR, "failed to receive on socket: %s", exc)  # noqa: SLF001
            return MQTTErrorCode.MQTT_ERR_CONN_LOST
        if n == 0:
            return MQTTErrorCode.MQTT_ERR_CONN_LOST
        packet["filled"] += n
        packet["to_process"] -= n
        _received(self)
    return None if packet["to_process"] <= 0 else MQTTErrorCode.MQTT_ERR_AGAIN


def _handle(self: paho_client.Client, packet: dict[str, Any]) -> MQTTErrorCode:
    """The whole packet to paho's ``_packet_handle``; paho's reading state made ready for the next."""
    packet["pos"] = 0
    try:
        rc = self._packet_handle()  # noqa: SLF001
    except MalformedPacket as exc:
        self._easy_log(paho_client.MQTT_LOG_DEBUG, "Received malformed packet: %s", exc)  # noqa: SLF001
        rc = MQTTErrorCode.MQTT_ERR_PROTOCOL
    self._in_packet = {"command": 0, "have_remaining": 0, "remaining_count": [], "remaining_mult": 1,  # noqa: SLF001
                       "remaining_length": 0, "packet": bytearray(b""), "to_process": 0, "pos": 0}
    _received(self)
    return rc


def _read_header(self: paho_client.Client, packet: dict[str, Any]) -> MQTTErrorCode | None:
    """The command byte and the remaining length, a byte at a time as paho reads them (None once both are in)."""
    try:
        if packet["command"] == 0:
            command = self._sock_recv(1)  # noqa: SLF001
            if not command:
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            packet["command"] = command[0]
        while True:
            byte = self._sock_recv(1)  # noqa: SLF001
            if not byte:
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            packet["remaining_count"].append(byte[0])
            if len(packet["remaining_count"]) > _VBI_MAX:  # a broken or hostile peer
                return MQTTErrorCode.MQTT_ERR_PROTOCOL
            packet["remaining_length"] += (byte[0] & 127) * packet["remaining_mult"]
            packet["remaining_mult"] *= 128
            if byte[0] & 128 == 0:
                break
    except BlockingIOError:
        return MQTTErrorCode.MQTT_ERR_AGAIN
    except OSError as exc:  # paho's _sock_recv raises ConnectionError when the socket is gone
        self._easy_log(paho_client.MQTT_LOG_ERR, "failed to receive on socket: %s", exc)  # noqa: SLF001
        return MQTTErrorCode.MQTT_ERR_CONN_LOST
    packet["have_remaining"] = 1
    packet["to_process"] = packet["remaining_length"]
    return None


def _received(self: paho_client.Client) -> None:
    with self._msgtime_mutex:  # noqa: SLF001 - what paho's keepalive reads
        self._last_bytes_received = paho_client.time_func()  # noqa: SLF001
