"""What the bus reads from the paho client under aiomqtt, which aiomqtt does not pass on (``bus.Bus``).

* **Refused publishes.** aiomqtt completes a publish on any PUBACK and drops its reason code, so a publish an
  MQTT 5 broker's ACL denies (0x87, not authorized) would look sent. paho's publish is wrapped to remember each
  QoS 1 message's topic until its PUBACK, whose code is checked. (Under MQTT 3.1.1 a broker drops a denied
  publish without a word: nothing can tell.)
* **Handed publishes.** The same wrapper sets the ``handing`` event of the publish being handed over (the bus
  sets it just before it calls aiomqtt's publish): what ``Bus.publish(handed=...)`` waits for.
* **Arrival times.** aiomqtt queues every message it parses for the connection loop, which takes them out only
  after the ``on_connect`` hooks and whenever the event loop gets round to it: that is not when they arrived.
  paho's message callback, called as each message is parsed, notes the time and the payload bytes read so far
  (a ``chunks.Arrival``), in the order aiomqtt queues the messages.
"""

from __future__ import annotations

import asyncio
import time
import typing
from collections import deque
from collections.abc import Callable
from typing import Any

import aiomqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.reasoncodes import ReasonCode

from edgemesh.common import chunks

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

    def attach(self, client: aiomqtt.Client) -> None:
        """Wrap ``client``'s paho client (before it connects)."""
        self._watch_publishes(client)
        self._stamp_arrivals(client)

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
        connection, received = self._clients, 0

        def stamped(c: Any, userdata: Any, message: Any) -> None:
            nonlocal received
            received += len(message.payload)
            arrivals.append((message.topic, chunks.Arrival(time.monotonic(), received, connection)))
            on_message(c, userdata, message)

        paho.on_message = stamped
