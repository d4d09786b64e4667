"""``edgemesh.common.bus.paho_layer``: the PUBLISH decoding a zero-copy bus puts in paho's place decodes what paho's
own does, and refuses what it refuses; its packet reader reads a packet in pieces into one buffer and ends as paho's
does; its writer sends a long packet from views of it; a real broker's messages come through them. It is put in place
only for a bus that asks, and only on the paho it was written for: elsewhere paho stays as it is."""

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

from edgemesh.common.bus import Bus, paho_layer
from edgemesh.common.config import BrokerConfig
from edgemesh.common.messages import DeviceHello
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.broker import BrokerProcess

OURS = _packet.convert_exception(paho_layer.decode_publish)
PAHO = paho_layer.PAHO_DECODE
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
    out = paho_layer.decode_publish(0x32, packet, V5)
    assert (out.topic, out.mid, out.qos, out.payload) == (b"edgemesh/v1/j/grad/c/d", 7, 1, payload)
    packet += b"x"  # no view of paho's buffer is left behind (a resize would raise BufferError)


def test_installed_it_decodes_only_what_its_reader_read_and_leaves_other_clients_to_paho() -> None:
    """paho calls one decoder for every client of the process: a body ``read_packet`` read (a client that opted in)
    is decoded by the layer, its payload that very buffer; any other packet by paho's own, as stock paho would."""
    paho_layer.install()
    assert _packet.decode_publish is paho_layer.dispatch
    packet = _packet_bytes(b"edgemesh/v1/j/grad/c/d", 1, 7, Properties(PacketTypes.PUBLISH), b"payload")
    body = paho_layer.Body(packet)
    ours = paho_layer.dispatch(0x32, body, V5)
    assert ours.payload == b"payload" and ours.payload is body  # the buffer read into, its header dropped
    theirs = paho_layer.dispatch(0x32, bytearray(packet), V5)
    assert theirs.payload == b"payload" and type(theirs.payload) is bytes  # paho's own copy
    with pytest.raises(MalformedPacket):
        paho_layer.dispatch(0x32, paho_layer.Body(b"\x00"), V5)


async def test_messages_from_a_real_broker_reach_a_client_that_did_not_opt_in(broker: BrokerProcess) -> None:
    paho_layer.install()
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
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    client._sock = ours  # noqa: SLF001 - as if connected
    assert paho_layer.enable(client)
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
        assert isinstance(message.payload, paho_layer.Body)  # no copy: the buffer the kernel wrote
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
    paho_layer.write_from_buffers(client)
    packet = bytearray(_publish_packet(b"edgemesh/v1/j/model/delta", np.random.default_rng(1).bytes(400_000), v5=True))
    got = bytearray()
    try:
        client._packet_queue(mqtt.PUBLISH, packet, 0, 1)  # noqa: SLF001 - as _send_publish queues it (QoS 1)
        queued = client._out_packet[0]["packet"]  # noqa: SLF001
        assert isinstance(queued, paho_layer.Unsliced) and isinstance(queued[10:], memoryview)
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
            paho_layer.write_from_buffers(client)
        got = bytearray()
        try:
            info = mqtt.MQTTMessageInfo(7)
            client._send_publish(7, b"edgemesh/v1/j/grad/c/d", payload, qos, False, False, info, None)  # noqa: SLF001
            if ours_too:
                assert isinstance(client._out_packet[0]["packet"], paho_layer.Pieces)  # noqa: SLF001 - not joined
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
        assert paho_layer.enable(client._client)  # noqa: SLF001 - as a zero-copy bus does: its 3 MB publish sent from views
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


# --------------------------------------------------------------------------- opt-in, on the paho it was written for


def test_the_installed_paho_is_one_the_layer_was_written_for() -> None:
    """Fails when paho-mqtt changes: read the new paho's reader, writer and decoder against this module's before
    widening ``PAHO_VERSIONS`` (outside them a zero-copy bus copies as paho does)."""
    assert paho_layer.written_for(paho_layer.PAHO_VERSION), paho_layer.PAHO_VERSION
    assert [paho_layer.written_for(v) for v in ("2.1.0", "2.2.0", "2.2.7", "2.3.0", "3.0", "", "2.x")] == [
        False, True, True, False, False, False, False]


def test_on_a_paho_it_was_not_written_for_the_layer_stays_off_and_says_so_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(paho_layer, "PAHO_VERSION", "2.3.0")
    monkeypatch.setattr(paho_layer, "_warned", False)
    clients = [mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5) for _ in range(2)]
    with caplog.at_level("WARNING", logger="edgemesh.common.bus.paho_layer"):
        assert [paho_layer.enable(c) for c in clients] == [False, False]
    for client in clients:  # paho's own reader and writer
        assert client._packet_read.__func__ is mqtt.Client._packet_read  # type: ignore[attr-defined]  # noqa: SLF001
        assert client._send_publish.__func__ is mqtt.Client._send_publish  # type: ignore[attr-defined]  # noqa: SLF001
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "2.3.0" in caplog.records[0].getMessage()


@pytest.mark.parametrize("zero_copy,version,layered", [(False, None, False), (True, None, True),
                                                       (True, "9.0.0", False)])
async def test_a_bus_reads_with_the_layer_only_when_it_asks_and_paho_is_the_one_it_was_written_for(
        broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch, zero_copy: bool, version: str | None,
        layered: bool) -> None:
    """Only a bus built with ``zero_copy`` puts the layer in paho's place, and on an unknown paho it does not: its
    messages come through paho's own reader all the same."""
    if version is not None:
        monkeypatch.setattr(paho_layer, "PAHO_VERSION", version)
        monkeypatch.setattr(paho_layer, "_warned", False)
    readers: list[object] = []
    read_into_buffers = paho_layer.read_into_buffers
    monkeypatch.setattr(paho_layer, "read_into_buffers", lambda client: (readers.append(client),
                                                                         read_into_buffers(client)))
    topics = Topics("paho-layer")
    got: list[DeviceHello] = []
    arrived = asyncio.Event()

    async def keep(msg: DeviceHello, _: TopicMatch) -> None:
        got.append(msg)
        arrived.set()

    cfg = BrokerConfig(url=broker.url)
    bus = Bus(cfg, client_id=f"layer-{zero_copy}-{version}", metrics=ServiceMetrics("test"), zero_copy=zero_copy)
    bus.route(topics.hello_filter(), DeviceHello, keep)
    hello = DeviceHello(device="pi-1", incarnation=1, flops=1e9, memory_bytes=1 << 30)
    sender = Bus(cfg, client_id=f"layer-sender-{zero_copy}-{version}", metrics=ServiceMetrics("sender"))
    async with bus, sender:
        await sender.publish(topics.hello("pi-1"), hello)
        async with asyncio.timeout(20):
            await arrived.wait()
    assert got == [hello]
    assert bool(readers) == layered
