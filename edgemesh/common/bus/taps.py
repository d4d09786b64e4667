"""What the bus reads from the paho client under aiomqtt, which aiomqtt does not pass on (``client.Bus``).

* **Refused publishes.** aiomqtt completes a publish on any PUBACK and drops its reason code, so a publish an
  MQTT 5 broker's ACL denies (0x87, not authorized) would look sent. paho's publish is wrapped to remember each
  QoS 1 message's topic until its PUBACK, whose code is checked. (Under MQTT 3.1.1 a broker drops a denied
  publish without a word: nothing can tell.)
* **Handed publishes.** The same wrapper sets the ``handing`` event of the publish being handed over (the bus
  sets it just before it calls aiomqtt's publish): what ``Bus.publish(handed=...)`` waits for.
* **Arrival times.** aiomqtt queues every message it parses for the connection loop, which takes them out
  whenever the event loop gets round to it: that is not when they arrived.
  paho's message callback, called as each message is parsed, notes the time and the payload bytes read so far
  (a ``chunks.Arrival``), in the order aiomqtt queues the messages; and paho's socket reads, when a packet's
  first byte was read (``Arrival.began``): a large message is a downlink sample even when it came whole.
* **Answers that will not come.** aiomqtt waits ``operation_timeout_s`` for a PUBACK or SUBACK even when the
  connection that would carry it is gone (a broker that crashed with a gradient in flight). ``Answers`` ends
  those waits with an MqttError when the bus loses the connection, so the publish is retried on the next one.
* **The broker's packet limit.** An MQTT 5 broker's CONNACK may say the largest packet it takes (Maximum Packet
  Size, which Mosquitto sends when ``max_packet_size`` is set): ``max_packet`` (0 when it said nothing).
"""

from __future__ import annotations

import asyncio
import time
import typing
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiomqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.reasoncodes import ReasonCode

from edgemesh.common.wire import chunks

T = TypeVar("T")

Refused = Callable[[str, str, int | ReasonCode], None]
"""``(operation, topic, code)``: a publish or subscription the broker refused."""


class Taps:
    """The wrappers of one bus's paho clients (a new one on every connect)."""

    def __init__(self, refused: Refused) -> None:
        self.refused = refused
        self.handing: asyncio.Event | None = None
        """The ``handed`` event of the publish being handed to the client right now."""
        self._arrivals: deque[tuple[str, chunks.Arrival]] = deque()
        """When the messages the current client parsed were read, in the order it queues them."""
        self._clients = 0
        self.max_packet = 0
        """The largest packet the broker of the current connection takes, by its CONNACK; 0 if it did not say."""

    def attach(self, client: aiomqtt.Client) -> None:
        """Wrap ``client``'s paho client (before it connects)."""
        self._watch_publishes(client)
        self._stamp_arrivals(client)
        self._read_connack(client)

    def arrival(self, topic: str) -> chunks.Arrival | None:
        """When the message on ``topic`` the connection loop took out was read (None if that is not known)."""
        while self._arrivals:
            seen, arrival = self._arrivals.popleft()
            if seen == topic:
                return arrival
        return None

    def _watch_publishes(self, client: aiomqtt.Client) -> None:
        paho = client._client  # noqa: SLF001 - the reason code is only seen here
        in_flight: dict[int, str] = {}
        publish, on_publish = paho.publish, typing.cast(Callable[..., None], paho.on_publish)

        def publishing(topic: str, payload: Any = None, qos: int = 0, retain: bool = False,
                       properties: Any = None) -> Any:
            info = publish(topic, payload, qos, retain, properties)
            if qos:
                in_flight[info.mid] = topic  # its PUBACK is read by the event loop, after this returns
            handing, self.handing = self.handing, None
            if handing is not None and info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS:  # else retried: handed again
                handing.set()
            return info

        def acked(c: Any, userdata: Any, mid: int, reason_code: ReasonCode, properties: Any) -> None:
            topic = in_flight.pop(mid, "")
            if reason_code.is_failure:
                self.refused("publish", topic, reason_code)
            on_publish(c, userdata, mid, reason_code, properties)

        paho.publish = publishing  # type: ignore[method-assign]
        paho.on_publish = acked

    def _stamp_arrivals(self, client: aiomqtt.Client) -> None:
        paho = client._client  # noqa: SLF001 - the time of parsing is only seen here
        on_message = typing.cast(Callable[..., None], paho.on_message)
        arrivals: deque[tuple[str, chunks.Arrival]] = deque()
        self._arrivals, self._clients = arrivals, self._clients + 1
        connection, received, began = self._clients, 0, 0.0
        sock_recv = paho._sock_recv  # noqa: SLF001 - a packet's first read is only seen here

        def reading(bufsize: int) -> bytes:
            nonlocal began
            if paho._in_packet["command"] == 0:  # noqa: SLF001 - paho is reading a packet's first byte
                began = time.monotonic()
            return sock_recv(bufsize)

        def stamped(c: Any, userdata: Any, message: Any) -> None:
            nonlocal received
            received += len(message.payload)
            arrivals.append((message.topic, chunks.Arrival(time.monotonic(), received, connection, began)))
            on_message(c, userdata, message)

        paho._sock_recv = reading  # type: ignore[method-assign]  # noqa: SLF001
        paho.on_message = stamped

    def _read_connack(self, client: aiomqtt.Client) -> None:
        paho = client._client  # noqa: SLF001 - the CONNACK's properties are only seen here
        on_connect = typing.cast(Callable[..., None], paho.on_connect)
        self.max_packet = 0

        def connected(c: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any = None) -> None:
            self.max_packet = int(getattr(properties, "MaximumPacketSize", 0) or 0)
            on_connect(c, userdata, flags, reason_code, properties)

        paho.on_connect = connected


class Answers:
    """The broker's answers (PUBACK, SUBACK, UNSUBACK) awaited on the current connection."""

    def __init__(self) -> None:
        self._waits: set[asyncio.Timeout] = set()

    async def of(self, call: Awaitable[T]) -> T:
        """Await ``call``, a request to the broker; MqttError at once if the connection is lost first."""
        try:
            async with asyncio.timeout(None) as wait:
                self._waits.add(wait)
                try:
                    return await call
                finally:
                    self._waits.discard(wait)
        except TimeoutError:
            if wait.expired():
                raise aiomqtt.MqttError("the connection was lost before the broker answered") from None
            raise

    def lost(self) -> None:
        """The connection is gone: every wait ends now."""
        now = asyncio.get_running_loop().time()
        for wait in self._waits:
            wait.reschedule(now)
