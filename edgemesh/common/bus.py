"""The MQTT bus: one aiomqtt client per service, as an async context manager.

* Speaks MQTT 5 where the broker offers it and falls back to 3.1.1 (``protocol = "auto"``);
  every semantic lives in the envelope, so nothing depends on v5 properties.
* Reconnects in one place: an outer loop with capped, jittered exponential backoff that
  re-subscribes on every connect and then calls the service's ``on_connect`` hook
  (publish status, resend unacked updates).
* Splits large payloads into chunks (retained ones onto ``{topic}/chunk/{i}``) and joins
  them again on receipt with a bounded, timed buffer.
* Yields ``Incoming`` messages whose envelope already parsed; envelope-level failures
  (malformed, oversized, bad chunk) are counted on the service's ``rejected_total`` and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiomqtt

from edgemesh.common import wire
from edgemesh.common.config import BrokerConfig
from edgemesh.common.errors import BusError, WireError
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics, base_topic

logger = logging.getLogger(__name__)

T = TypeVar("T")

QOS_STATE = 1
"""QoS for everything that matters (updates, acks, plan, model); MQTT 3.1.1 and 5 both have it."""

REFUSED_IDS_KEPT = 256
"""Ids of refused chunked messages remembered, so their other chunks are dropped silently."""

INCOMING_QUEUE = 10_000
"""Messages buffered between the network and the service before back-pressure."""


@dataclass(frozen=True, slots=True)
class Incoming:
    """A received message: its topic (chunk suffix removed) and its parsed envelope."""

    topic: str
    retained: bool
    envelope: wire.Envelope

    @property
    def kind(self) -> str:
        return self.envelope.kind

    def decode(self, expected: type[T] | tuple[type, ...]) -> T:
        """The typed message; raises WireError with a reason."""
        return wire.decode_envelope(self.envelope, expected)


class Bus:
    """An MQTT connection that survives broker restarts."""

    def __init__(
        self,
        config: BrokerConfig,
        *,
        client_id: str,
        metrics: ServiceMetrics,
        subscriptions: Sequence[str] = (),
        will: tuple[str, bytes] | None = None,
        on_connect: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.config = config
        self.client_id = client_id
        self.metrics = metrics
        self._filters: list[str] = []
        for f in subscriptions:
            for expanded in Topics.with_chunks(f):
                if expanded not in self._filters:
                    self._filters.append(expanded)
        self._will = will
        self._on_connect = on_connect
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._queue: asyncio.Queue[Incoming] = asyncio.Queue(maxsize=INCOMING_QUEUE)
        self._reassembler = wire.Reassembler(
            max_bytes=config.reassembly_budget_bytes, timeout=config.reassembly_timeout_s
        )
        self._protocol = (
            aiomqtt.ProtocolVersion.V311 if config.protocol == "3.1.1" else aiomqtt.ProtocolVersion.V5
        )
        self._refused_ids: deque[str] = deque(maxlen=REFUSED_IDS_KEPT)
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.connections = 0

    # --- lifecycle ---------------------------------------------------------------------
    async def __aenter__(self) -> Bus:
        self._task = asyncio.create_task(self._run(), name=f"bus-{self.client_id}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True
        client = self._client
        if client is not None and self._connected.is_set():
            with contextlib.suppress(aiomqtt.MqttError, TimeoutError):
                async with asyncio.timeout(self.config.connect_timeout_s):
                    await client.__aexit__(None, None, None)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def is_connected(self) -> bool:
        return self._connected.is_set()

    @property
    def protocol(self) -> str:
        return "5" if self._protocol == aiomqtt.ProtocolVersion.V5 else "3.1.1"

    async def wait_connected(self, timeout_s: float | None = None) -> None:
        async with asyncio.timeout(timeout_s if timeout_s is not None else self.config.connect_timeout_s):
            await self._connected.wait()

    def _make_client(self, protocol: aiomqtt.ProtocolVersion) -> aiomqtt.Client:
        will = None
        if self._will is not None:
            will = aiomqtt.Will(topic=self._will[0], payload=self._will[1], qos=QOS_STATE, retain=True)
        tls = None
        if self.config.tls:
            tls = ssl.create_default_context(cafile=self.config.ca_file or None)
            if self.config.cert_file:
                tls.load_cert_chain(self.config.cert_file, self.config.key_file)
        return aiomqtt.Client(
            self.config.host,
            self.config.port,
            identifier=self.client_id,
            username=self.config.username or None,
            password=self.config.password or None,
            protocol=protocol,
            will=will,
            keepalive=self.config.keepalive_s,
            timeout=self.config.connect_timeout_s,
            tls_context=tls,
            # small QoS 1 packets (acks, updates) must not wait on Nagle + delayed ACK (~40 ms)
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            clean_session=True if protocol != aiomqtt.ProtocolVersion.V5 else None,
        )

    async def _connect(self) -> aiomqtt.Client:
        """Connect once; in ``auto`` mode a v5 attempt that is refused or unanswered is retried with 3.1.1.

        Some 3.1.1-only brokers refuse a v5 CONNECT (amqtt: code 132), others never answer it
        (amqtt again, when the CONNECT carries a will), so the v5 attempt has a short deadline.
        """
        probing = self.config.protocol == "auto" and self._protocol == aiomqtt.ProtocolVersion.V5
        client = self._make_client(self._protocol)
        if probing:
            client.timeout = min(self.config.connect_timeout_s, V5_PROBE_TIMEOUT_S)
        try:
            await client.__aenter__()
        except aiomqtt.MqttError as exc:
            if not probing or not (_refused_protocol(exc) or _unanswered(exc)):
                raise
            logger.info("%s: broker did not take MQTT 5 (%s); trying MQTT 3.1.1", self.client_id, exc)
            fallback = self._make_client(aiomqtt.ProtocolVersion.V311)
            await fallback.__aenter__()
            self._protocol = aiomqtt.ProtocolVersion.V311
            fallback.timeout = self.config.operation_timeout_s
            return fallback
        client.timeout = self.config.operation_timeout_s  # connected: answers may queue behind retained data
        return client

    async def _run(self) -> None:
        delay = self.config.backoff_initial_s
        while not self._closing:
            try:
                client = await self._connect()
            except aiomqtt.MqttError as exc:
                logger.warning("%s: cannot connect to %s: %s; retry in %.1fs",
                               self.client_id, self.config.url, exc, delay)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # noqa: S311 - jitter
                delay = min(delay * 2, self.config.backoff_max_s)
                continue
            self._client = client
            try:
                for f in self._filters:
                    await client.subscribe(f, qos=QOS_STATE)
                self.connections += 1
                self.metrics.connects.inc()
                self.metrics.connected.set(1)
                self._connected.set()
                delay = self.config.backoff_initial_s
                logger.info("%s: connected to %s (MQTT %s)", self.client_id, self.config.url, self.protocol)
                if self._on_connect is not None:
                    await self._on_connect()
                async for msg in client.messages:
                    await self._receive(msg)
                # the iterator ends only when the client disconnects
            except aiomqtt.MqttError as exc:
                if not self._closing:
                    logger.warning("%s: connection to %s lost: %s", self.client_id, self.config.url, exc)
            finally:
                self._connected.clear()
                self.metrics.connected.set(0)
                self._client = None
            if not self._closing:
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # noqa: S311 - jitter
                delay = min(delay * 2, self.config.backoff_max_s)

    async def subscribe(self, filters: Sequence[str]) -> None:
        """Add subscriptions, now if connected and on every reconnect."""
        new = [e for f in filters for e in Topics.with_chunks(f) if e not in self._filters]
        self._filters.extend(new)
        client = self._client
        if client is not None and self._connected.is_set():
            for f in new:
                with contextlib.suppress(aiomqtt.MqttError):  # a lost connection re-subscribes all
                    await client.subscribe(f, qos=QOS_STATE)

    async def unsubscribe(self, filters: Sequence[str]) -> None:
        """Drop subscriptions added with :meth:`subscribe`."""
        gone = [e for f in filters for e in Topics.with_chunks(f) if e in self._filters]
        self._filters = [f for f in self._filters if f not in gone]
        client = self._client
        if client is not None and self._connected.is_set():
            for f in gone:
                with contextlib.suppress(aiomqtt.MqttError):
                    await client.unsubscribe(f)

    # --- receiving -------------------------------------------------------------------------
    async def _receive(self, msg: aiomqtt.Message) -> None:
        topic = msg.topic.value
        payload = msg.payload
        if not isinstance(payload, (bytes, bytearray)):
            payload = b"" if payload is None else str(payload).encode()
        if not payload and msg.retain:
            return  # a cleared retained topic
        self.metrics.received_bytes.inc(len(payload))
        try:
            envelope = self._unpack(topic, bytes(payload))
        except WireError as exc:
            self.metrics.reject(exc.reason, topic, f"{exc} payload={wire.truncate(bytes(payload))}")
            return
        if envelope is None:
            return  # more chunks to come
        await self._queue.put(Incoming(topic=base_topic(topic), retained=msg.retain, envelope=envelope))

    def _unpack(self, topic: str, payload: bytes) -> wire.Envelope | None:
        try:
            envelope = wire.unpack(payload, max_bytes=self.config.max_message_bytes)
        except WireError as exc:
            if exc.reason != "malformed" or "/control/" not in topic:
                raise
            return wire.unpack_json(payload, "control", max_bytes=self.config.max_message_bytes)
        if envelope.kind != wire.CHUNK_KIND:
            return envelope
        chunk = wire.decode_envelope(envelope, wire.Chunk)
        if chunk.id in self._refused_ids:
            return None  # the rest of a message already counted as rejected
        if chunk.size > self.config.max_message_bytes:
            self._refused_ids.append(chunk.id)
            raise WireError(f"chunked message of {chunk.size} bytes exceeds the limit", "oversized")
        before = dict(self._reassembler.dropped)
        whole = self._reassembler.add(base_topic(topic), chunk)
        for reason, n in self._reassembler.dropped.items():
            if n > before.get(reason, 0):
                self.metrics.reject(reason, topic, "partial chunked message dropped")
        if whole is None:
            return None
        inner = wire.unpack(whole, max_bytes=self.config.max_message_bytes)
        if inner.kind == wire.CHUNK_KIND:
            raise WireError("a chunk inside a chunk", "chunk")
        return inner

    async def messages(self) -> AsyncIterator[Incoming]:
        """Received messages, across reconnects, until the bus closes."""
        while True:
            yield await self._queue.get()

    async def next_message(self, timeout_s: float) -> Incoming:
        async with asyncio.timeout(timeout_s):
            return await self._queue.get()

    # --- publishing ----------------------------------------------------------------------
    async def publish(
        self, topic: str, msg: Any, *, retain: bool = False, qos: int = QOS_STATE, kind: str = ""
    ) -> int:
        """Publish a message (or ready envelope bytes); returns bytes sent. Chunks large payloads.

        Waits up to ``publish_timeout_s`` for a connection; raises BusError after that.
        """
        payload = msg if isinstance(msg, (bytes, bytearray)) else wire.encode(msg)
        kind = kind or ("raw" if isinstance(msg, (bytes, bytearray)) else wire.kind_of(msg))
        pieces = wire.split(bytes(payload), self.config.chunk_bytes)
        if len(pieces) == 1:
            targets = [topic]
        elif retain:
            targets = [Topics.chunk(topic, i) for i in range(len(pieces))]
        else:
            targets = [topic] * len(pieces)
        sent = 0
        for target, piece in zip(targets, pieces, strict=True):
            await self._publish_raw(target, piece, retain=retain, qos=qos)
            sent += len(piece)
        self.metrics.published_messages.labels(kind=kind).inc()
        self.metrics.published_bytes.inc(sent)
        return sent

    async def _publish_raw(self, topic: str, payload: bytes, *, retain: bool, qos: int) -> None:
        try:
            async with asyncio.timeout(self.config.publish_timeout_s):
                while True:
                    await self._connected.wait()
                    client = self._client
                    if client is None:
                        await asyncio.sleep(0)
                        continue
                    try:
                        await client.publish(topic, payload, qos=qos, retain=retain)
                        return
                    except aiomqtt.MqttError as exc:
                        logger.debug("%s: publish on %s failed (%s); retrying", self.client_id, topic, exc)
                        await asyncio.sleep(self.config.backoff_initial_s)
        except TimeoutError:
            raise BusError(f"could not publish on {topic} within {self.config.publish_timeout_s}s") from None

    async def clear_retained(self, topic: str) -> None:
        await self._publish_raw(topic, b"", retain=True, qos=QOS_STATE)


V5_PROBE_TIMEOUT_S = 3.0
"""How long an ``auto`` connection waits for a v5 CONNACK before trying 3.1.1."""

UNSUPPORTED_PROTOCOL_CODES = (1, 132)
"""CONNACK codes for "unsupported protocol version": 3.1.1's 1, which paho maps to v5's 0x84."""


def _refused_protocol(exc: aiomqtt.MqttError) -> bool:
    """True when the broker answered but refused the MQTT version (amqtt does for v5)."""
    rc = getattr(exc, "rc", None)
    value = getattr(rc, "value", rc)
    return isinstance(exc, aiomqtt.MqttCodeError) and value in UNSUPPORTED_PROTOCOL_CODES


def _unanswered(exc: aiomqtt.MqttError) -> bool:
    """True when the TCP connection opened but no CONNACK came (aiomqtt reports a timeout)."""
    return not isinstance(exc, aiomqtt.MqttCodeError) and "timed out" in str(exc).lower()
