"""``edgemesh.common.paho_decode``: the PUBLISH decoding the bus puts in paho's place decodes what paho's own does,
and refuses what it refuses; its packet reader reads a packet in pieces into one buffer and ends as paho's does; its
writer sends a long packet from views of it; a real broker's messages come through them."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

import aiomqtt
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgemesh.common import paho_decode
from edgemesh.local.broker import BrokerProcess

OURS = _packet.convert_exception(paho_decode.decode_publish)
PAHO = paho_decode.PAHO_DECODE
V5, V311 = MQTTProtocolVersion.MQTTv5, MQTTProtocolVersion.MQTTv311


def _properties(expiry: int | None, content: str | None, user: list[tuple[str, str]]) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    if expiry is not None:
        props.MessageExpiryInterval = expiry
    if content is not None:
        props.ContentType = content
    if user:
        props.UserProperty = user
    return props


def _packet_bytes(topic: bytes, qos: int, mid: int, props: Properties | None, payload: bytes) -> bytearray:
    body = struct.pack("!H", len(topic)) + topic + (struct.pack("!H", mid) if qos else b"")
    return bytearray(body + (props.pack() if props is not None else b"") + payload)


def _decoded(decoder: object, header: int, packet: bytearray, protocol: MQTTProtocolVersion) -> object:
    try:
        out = decoder(header, bytearray(packet), protocol)  # type: ignore[operator]
    except MalformedPacket:
        return MalformedPacket
    props = None if out.properties is None else sorted(out.properties.json().items())
    return out.dup, out.qos, out.retain, bytes(out.topic), out.mid, props, bytes(out.payload)


@settings(max_examples=300, deadline=None)
@given(header=st.integers(0, 15), topic=st.binary(max_size=40), mid=st.integers(0, 0xFFFF),
       v5=st.booleans(), expiry=st.none() | st.integers(0, 2**32 - 1), content=st.none() | st.text(max_size=12),
       user=st.lists(st.tuples(st.text(max_size=6), st.text(max_size=6)), max_size=3),
       payload=st.binary(max_size=300), cut=st.none() | st.integers(0, 400))
def test_it_decodes_what_paho_decodes_and_refuses_what_paho_refuses(
        header: int, topic: bytes, mid: int, v5: bool, expiry: int | None, content: str | None,
        user: list[tuple[str, str]], payload: bytes, cut: int | None) -> None:
    qos = (header & 0x06) >> 1
    protocol = V5 if v5 else V311
    packet = _packet_bytes(topic, qos, mid, _properties(expiry, content, user) if v5 else None, payload)
    if cut is not None:  # truncated anywhere, header fields included
        packet = packet[:cut]
    assert _decoded(OURS, 0x30 | header, packet, protocol) == _decoded(PAHO, 0x30 | header, packet, protocol)


def test_a_chunk_sized_payload_is_decoded_whole() -> None:
    payload = bytes(range(256)) * 1024
    packet = _packet_bytes(b"edgemesh/v1/j/grad/c/d", 1, 7, Properties(PacketTypes.PUBLISH), payload)
    out = paho_decode.decode_publish(0x32, packet, V5)
    assert (out.topic, out.mid, out.qos, out.payload) == (b"edgemesh/v1/j/grad/c/d", 7, 1, payload)
    packet += b"x"  # no view of paho's buffer is left behind (a resize would raise BufferError)


async def test_messages_from_a_real_broker_come_through_it(broker: BrokerProcess) -> None:
    paho_decode.install()
    assert _packet.decode_publish is not PAHO
    payload = bytes(range(256)) * 2048  # 512 KiB, in several reads off the socket
    # amqtt refuses an MQTT 5 CONNECT (the bus falls back to 3.1.1 there)
    v311, v5 = aiomqtt.ProtocolVersion.V311, aiomqtt.ProtocolVersion.V5
    protocols = [v311] if broker.kind == "amqtt" else [v311, v5]
    for protocol in protocols:
        async with aiomqtt.Client(broker.host, broker.port, protocol=protocol) as client:
            await client.subscribe("edgemesh/v1/paho-decode/#", qos=1)
            await client.publish("edgemesh/v1/paho-decode/a", payload, qos=1, retain=False)
            await client.publish("edgemesh/v1/paho-decode/b", b"", qos=1)
            got = []
            async for msg in client.messages:
                got.append((str(msg.topic), msg.payload, msg.qos))
                if len(got) == 2:
                    break
        assert got == [("edgemesh/v1/paho-decode/a", payload, 1), ("edgemesh/v1/paho-decode/b", b"", 1)], protocol


# --------------------------------------------------------------------------- reading into buffers


def _publish_packet(topic: bytes, payload: bytes, *, v5: bool) -> bytes:
    """A whole QoS 0 PUBLISH packet, fixed header included."""
    body = struct.pack("!H", len(topic)) + topic + (b"\x00" if v5 else b"") + payload  # v5: no properties
    length, encoded = len(body), bytearray()
    while True:
        byte, length = length % 128, length // 128
        encoded.append(byte | (0x80 if length else 0))
        if not length:
            break
    return bytes([0x30]) + bytes(encoded) + body


def _reading_client(v5: bool) -> tuple[mqtt.Client, socket.socket, list[mqtt.MQTTMessage]]:
    """A paho client reading with ``read_packet`` from one end of a socket pair; the test writes the other."""
    paho_decode.install()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    client._sock = ours  # noqa: SLF001 - as if connected
    paho_decode.read_into_buffers(client)
    got: list[mqtt.MQTTMessage] = []
    client.on_message = lambda _c, _u, message: got.append(message)
    return client, theirs, got


@pytest.mark.parametrize("v5", [False, True])
def test_a_packet_read_in_pieces_is_handled_once_whole_its_payload_the_buffer_read_into(v5: bool) -> None:
    client, theirs, got = _reading_client(v5)
    payload = bytes(range(256)) * 600  # 150 KiB: a three-byte remaining length; it fits the pair's buffers
    packet = _publish_packet(b"edgemesh/v1/j/grad/c/d", payload, v5=v5)
    try:
        sent = 0
        for cut in (1, 3, 100, 70_000, len(packet)):  # the command byte alone, the length cut, the body cut
            theirs.sendall(packet[sent:cut])
            sent = cut
            rc = client._packet_read()  # noqa: SLF001 - what one readable event reads, as paho's loop_read calls it
            if cut < len(packet):
                assert (rc, got) == (mqtt.MQTT_ERR_AGAIN, []), cut
        assert rc == mqtt.MQTT_ERR_SUCCESS and len(got) == 1
        message = got[0]
        assert (message.topic, message.payload) == ("edgemesh/v1/j/grad/c/d", payload)
        assert isinstance(message.payload, paho_decode.Body)  # no copy: the buffer the kernel wrote
        assert client._in_packet["command"] == 0  # noqa: SLF001 - ready for the next packet
    finally:
        theirs.close()
        client._sock.close()  # type: ignore[union-attr]  # noqa: SLF001


def test_a_closed_socket_or_an_overlong_length_ends_the_read_as_paho_does() -> None:
    client, theirs, _ = _reading_client(True)
    theirs.sendall(b"\x30\xff\xff\xff\xff\x01")  # a remaining length of five bytes
    assert client._packet_read() == mqtt.MQTT_ERR_PROTOCOL  # noqa: SLF001
    client, theirs, _ = _reading_client(True)
    theirs.sendall(_publish_packet(b"t", b"x" * 1000, v5=True)[:500])
    assert client._packet_read() == mqtt.MQTT_ERR_AGAIN  # noqa: SLF001
    theirs.close()  # the peer went away mid-packet
    assert client._packet_read() == mqtt.MQTT_ERR_CONN_LOST  # noqa: SLF001
    client._sock.close()  # type: ignore[union-attr]  # noqa: SLF001


def test_a_long_packet_is_sent_from_views_of_itself_whole_through_partial_sends() -> None:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # the packet goes in many sends
    ours.setblocking(False)
    client._sock = ours  # noqa: SLF001 - as if connected
    paho_decode.write_from_buffers(client)
    packet = bytearray(_publish_packet(b"edgemesh/v1/j/model/delta", np.random.default_rng(1).bytes(400_000), v5=True))
    got = bytearray()
    try:
        client._packet_queue(mqtt.PUBLISH, packet, 0, 1)  # noqa: SLF001 - as _send_publish queues it (QoS 1)
        queued = client._out_packet[0]["packet"]  # noqa: SLF001
        assert isinstance(queued, paho_decode.Unsliced) and isinstance(queued[10:], memoryview)
        while len(got) < len(packet):
            client.loop_write()
            got += theirs.recv(1 << 20)
        assert got == packet and not client._out_packet  # noqa: SLF001
        client._packet_queue(mqtt.PUBLISH, bytearray(b"\x30\x03\x00\x01t"), 0, 1)  # noqa: SLF001 - a short one: as it was
        assert theirs.recv(100) == b"\x30\x03\x00\x01t"
    finally:
        theirs.close()
        ours.close()


@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5])
@pytest.mark.parametrize("qos", [0, 1])
def test_a_long_publish_goes_as_its_header_and_its_payload_the_bytes_paho_would_send(protocol: int, qos: int) -> None:
    payload = np.random.default_rng(2).bytes(300_000)
    sent = {}
    for ours_too in (False, True):
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=protocol)
        mine, theirs = socket.socketpair()
        mine.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # many sends, one across the header's end
        mine.setblocking(False)
        client._sock = mine  # noqa: SLF001 - as if connected
        if ours_too:
            paho_decode.write_from_buffers(client)
        got = bytearray()
        try:
            info = mqtt.MQTTMessageInfo(7)
            client._send_publish(7, b"edgemesh/v1/j/grad/c/d", payload, qos, False, False, info, None)  # noqa: SLF001
            if ours_too:
                assert isinstance(client._out_packet[0]["packet"], paho_decode.Pieces)  # noqa: SLF001 - not joined
            while client._out_packet or not got:  # noqa: SLF001
                client.loop_write()
                with contextlib.suppress(BlockingIOError):
                    got += theirs.recv(1 << 20, socket.MSG_DONTWAIT)
            while True:
                try:
                    got += theirs.recv(1 << 20, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
        finally:
            theirs.close()
            mine.close()
        sent[ours_too] = bytes(got)
    assert sent[True] == sent[False] and sent[True].endswith(payload)


async def test_a_bus_client_reads_large_and_small_messages_from_a_real_broker(broker: BrokerProcess) -> None:
    payload = np.random.default_rng(0).bytes(3_000_000)  # many reads off the socket into one buffer
    v311, v5 = aiomqtt.ProtocolVersion.V311, aiomqtt.ProtocolVersion.V5
    for protocol in [v311] if broker.kind == "amqtt" else [v311, v5]:
        client = aiomqtt.Client(broker.host, broker.port, protocol=protocol)
        paho_decode.read_into_buffers(client._client)  # noqa: SLF001 - as the bus does
        paho_decode.write_from_buffers(client._client)  # noqa: SLF001 - its 3 MB publish sent from views
        async with client:
            await client.subscribe("edgemesh/v1/paho-read/#", qos=1)
            for topic, body in (("a", payload), ("b", b""), ("c", b"ok")):
                await client.publish(f"edgemesh/v1/paho-read/{topic}", body, qos=1)
            got = []
            async with asyncio.timeout(20):
                async for msg in client.messages:
                    got.append((str(msg.topic), bytes(msg.payload)))  # type: ignore[arg-type]
                    if len(got) == 3:
                        break
        assert got == [("edgemesh/v1/paho-read/a", payload), ("edgemesh/v1/paho-read/b", b""),
                       ("edgemesh/v1/paho-read/c", b"ok")], protocol
