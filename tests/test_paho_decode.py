"""``edgemesh.common.paho_decode``: the PUBLISH decoding the bus puts in paho's place decodes what paho's own does,
and refuses what it refuses; a real broker's messages come through it."""

from __future__ import annotations

import struct

import aiomqtt
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
