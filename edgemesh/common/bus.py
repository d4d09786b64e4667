"""The MQTT bus: one aiomqtt connection per service, and the router every service consumes through.

* **Routes.** A service declares what it consumes: ``bus.route(topics.grad_filter(), GradientUpdate,
  self.on_gradient)``. Every route's filter goes out in one SUBSCRIBE, on every connect. For each
  message the router finds its route, parses the topic once (``topics.parse``), unpacks the envelope
  (joining chunks), decodes the body to the route's type, checks it against the topic (the device a
  topic names is the device in the body) and awaits ``handler(message, match)``. A failure at any
  step, and any exception a handler raises, is counted on ``rejected_total{route,reason}`` and logged
  (the first time per reason, then sparsely); the loop goes on. The router also counts
  ``received_messages_total{route}`` and times ``handler_seconds{route}``, so no service counts
  what it receives. A route dropped by ``unsubscribe`` still takes, for a grace period, what the broker
  sent on it before it took the UNSUBSCRIBE (``bus_routes``).
* **Unsolicited messages.** The routes are the subscriptions: a message no route takes is on a topic no
  subscription of this client covers, which a broker should never send. One does: amqtt (the embedded broker)
  sends every client that connects the retained messages of every filter any client holds (the job files
  under the job hosts' ``edgemesh/v1/+/job``, to an ``edgemesh job status`` that asked for one job's state).
  Such a message is not a peer's bad message: it is dropped before it is decoded and counted on
  ``unsolicited_messages_total``, never as a rejection.
* **Connection.** ``run()``, a task of the service's TaskGroup, connects (MQTT 5 where the broker
  offers it, else 3.1.1: every semantic lives in the envelope), then reads and dispatches. It
  reconnects in one place, with capped, jittered exponential backoff, re-subscribes and calls the
  ``on_connect`` hooks. A login the broker refuses (bad credentials, not authorized) ends ``run()``
  with a BusError instead of retrying forever.
* **Publishing** splits large payloads into chunks (retained ones onto ``{topic}/chunk/{i}``), and
  waits up to ``publish_timeout_s`` for a connection.
* **Downlink samples.** Every payload is stamped as the MQTT client parses it off the connection, before it
  waits for the connection loop and the router, so neither the ``on_connect`` hooks (a retained model arrives
  while they publish) nor a handler that takes its time bunches the chunks behind them; ``on_joined`` hooks hear
  of each message joined from several chunks (``chunks.Joined``): what a device measures its downlink by.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiomqtt
from paho.mqtt.reasoncodes import ReasonCode

from edgemesh.common import chunks, paho_decode, wire
from edgemesh.common.bus_hooks import ConnectHooks
from edgemesh.common.bus_routes import Handler, Route, Routes
from edgemesh.common.bus_taps import Answers, Taps
from edgemesh.common.config import BrokerConfig
from edgemesh.common.errors import BusError, WireError
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.tasks import cancel_all
from edgemesh.common.topics import CHUNK_SEGMENT, Filter, TopicError

logger = logging.getLogger(__name__)

M = TypeVar("M")

QOS_STATE = 1
"""QoS for everything that matters (updates, acks, plan, model); MQTT 3.1.1 and 5 both have it."""
INBOX_MESSAGES = 10_000
"""Messages buffered between the network and the router before back-pressure."""
UNROUTED = "none"
"""Route label of a message whose topic no route could be found for (a topic that is not EdgeMesh's)."""
V5_PROBE_TIMEOUT_S = 3.0
"""How long an ``auto`` connection waits for a v5 CONNACK before trying 3.1.1."""
_SPEAK_3_1_1: set[str] = set()
"""Broker URLs an ``auto`` bus of this process found speaking MQTT 3.1.1 only: later buses start there."""
UNSUPPORTED_PROTOCOL_CODES = (1, 132)
"""CONNACK codes for "unsupported protocol version": 3.1.1's 1, which paho maps to v5's 0x84."""
REFUSED_LOGIN_CODES = (2, 4, 5, 133, 134, 135, 138, 140)
"""CONNACK codes that a retry cannot change: identifier rejected, bad user name or password, not
authorized, banned, bad authentication method (3.1.1's 2, 4, 5 and their v5 equivalents)."""
REFUSALS_LOGGED = 1000
"""Distinct refused topics logged at ERROR (later ones, and repeats, at DEBUG; all are counted)."""
PENDING_CALLS_WARNING = 1024
"""aiomqtt warns past this many calls waiting on the broker (its 10 is less than a window of chunks and acks)."""
SUBSCRIBE_FAILURE = 0x80
"""A SUBACK code at or above this refuses the subscription (3.1.1's 0x80 and v5's reason codes)."""


class Bus:
    """An MQTT connection that survives broker restarts, with its routes."""

    def __init__(self, config: BrokerConfig, *, client_id: str, metrics: ServiceMetrics,
                 will: tuple[str, bytes] | None = None) -> None:
        self.config = config
        self.client_id = client_id
        self.metrics = metrics
        self._prefix = config.topic_prefix
        """Before every topic on the wire (``broker.topic_prefix``), never in a route's or a caller's."""
        self._routes = Routes()
        self._will = will
        self._hooks = ConnectHooks(client_id)
        self._joined_hooks: list[chunks.Joined] = []
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._answers = Answers()
        self._inbox: asyncio.Queue[tuple[str, bytes, chunks.Arrival | None]] = asyncio.Queue(maxsize=INBOX_MESSAGES)
        metrics.inbox.set_function(self._inbox.qsize)
        self._receiver = chunks.Receiver(max_bytes=config.max_message_bytes,
                                         budget_bytes=config.reassembly_budget_bytes,
                                         timeout_s=config.reassembly_timeout_s, on_drop=self._partial_dropped,
                                         on_joined=self._joined, sample_bytes=config.chunk_bytes)
        self._chunk_size = chunks.ChunkSize(config.chunk_bytes, config.chunk_max_bytes, config.chunk_seconds)
        metrics.chunk_bytes.set_function(lambda: self.chunk_bytes)
        self._taps = Taps(self._refused)
        """What the paho client under aiomqtt tells: PUBACK codes, publishes handed over, arrival times."""
        v311 = config.protocol == "3.1.1" or (config.protocol == "auto" and config.url in _SPEAK_3_1_1)
        self._protocol = aiomqtt.ProtocolVersion.V311 if v311 else aiomqtt.ProtocolVersion.V5
        self._closing = False
        self._refusals_logged: set[tuple[str, str]] = set()
        self._unsolicited_logged = False
        self.connections = 0

    # --- declaring -------------------------------------------------------------------------
    def route(self, filter_: Filter, message: type[M] | tuple[type, ...], handler: Handler[M], *,
              name: str = "", json_body: bool = False) -> Route[M]:
        """Consume ``filter_`` from the next connect on (declare routes before ``run``)."""
        route = Route(filter_, message, handler, name, json_body)
        self._routes.held.append(route)
        return route

    async def subscribe(self, *routes: Route[Any]) -> None:
        """Add routes now: subscribed at once if connected, and on every reconnect. A route already held is
        subscribed again, in place: the broker sends its retained messages anew, and none finds it gone."""
        self._routes.add(routes)
        await self._subscribe_now([p for r in routes for p in r.filter.patterns])

    async def unsubscribe(self, *filters: Filter) -> None:
        """Drop the routes of ``filters`` (what the broker sent on them before it took the UNSUBSCRIBE still goes to
        them, for ``bus_routes.UNSUBSCRIBED_GRACE_S``)."""
        gone = self._routes.drop(filters)
        client = self._client
        patterns = [p for r in gone for p in r.filter.patterns]
        if client is not None and self._connected.is_set() and patterns:
            with contextlib.suppress(aiomqtt.MqttError):  # a lost connection re-subscribes what is left
                await self._answers.of(client.unsubscribe([self._prefix + p for p in patterns]))

    @property
    def filters(self) -> tuple[Filter, ...]:
        """What this bus consumes: its routes' filters, in the order they are matched."""
        return tuple(r.filter for r in self._routes.held)

    def on_connect(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Await ``hook()`` after every (re)connect, once the subscriptions are in place, while messages are read
        (a task cancelled if the connection is lost meanwhile). A hook that raises is logged, not fatal."""
        self._hooks.add(hook)

    def on_joined(self, hook: chunks.Joined) -> None:
        """Call ``hook(topic, bytes, seconds)`` for every message received in several chunks: the payload bytes
        read after its first chunk up to its last, and the seconds between the two (a downlink sample)."""
        self._joined_hooks.append(hook)

    # --- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True

    @property
    def is_connected(self) -> bool:
        return self._connected.is_set()

    @property
    def protocol(self) -> str:
        return "5" if self._protocol == aiomqtt.ProtocolVersion.V5 else "3.1.1"

    @property
    def chunk_bytes(self) -> int:
        """The chunk size of the next large message published that is not retained (``chunks.ChunkSize``)."""
        return self._chunk_size.now(self._taps.max_packet if self._protocol == aiomqtt.ProtocolVersion.V5 else 0)

    async def wait_connected(self, timeout_s: float | None = None) -> None:
        async with asyncio.timeout(timeout_s if timeout_s is not None else self.config.connect_timeout_s):
            await self._connected.wait()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Bus]:
        """``run()`` for the duration of the block (operator tools and tests), connected on entry."""
        task = asyncio.create_task(self.run(), name=f"bus-{self.client_id}")
        waiter = asyncio.create_task(self._connected.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, timeout=self.config.connect_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                task.result()  # the login was refused: raise its BusError
            if waiter not in done:
                raise BusError(f"{self.client_id}: no connection to {self.config.url} "
                               f"within {self.config.connect_timeout_s:g}s")
            yield self
        finally:
            await cancel_all([waiter, task])
            if not task.cancelled():
                task.result()  # it failed on its own (a refused login): raise its error

    async def run(self) -> None:
        """Connect, read and dispatch until cancelled; BusError when the broker refuses the login. Not in a
        TaskGroup, which cancels the router once: a handler's publish can drop that cancel (``tasks``)."""
        tasks = [asyncio.create_task(self._connection_loop(), name=f"connection-{self.client_id}"),
                 asyncio.create_task(self._dispatch_loop(), name=f"router-{self.client_id}")]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_all(tasks)
        for task in (t for t in tasks if not t.cancelled()):
            task.result()  # raises the refused login's BusError, or a router's bug

    # --- connecting --------------------------------------------------------------------------
    def _make_client(self, protocol: aiomqtt.ProtocolVersion) -> aiomqtt.Client:
        will = None
        if self._will is not None:
            will = aiomqtt.Will(topic=self._prefix + self._will[0], payload=self._will[1], qos=QOS_STATE, retain=True)
        tls = None
        if self.config.tls:
            tls = ssl.create_default_context(cafile=self.config.ca_file or None)
            if self.config.cert_file:
                tls.load_cert_chain(self.config.cert_file, self.config.key_file)
        client = aiomqtt.Client(
            self.config.host, self.config.port, identifier=self.client_id,
            username=self.config.username or None, password=self.config.password or None,
            protocol=protocol, will=will, keepalive=self.config.keepalive_s,
            timeout=self.config.connect_timeout_s, tls_context=tls,
            # small QoS 1 packets (acks, updates) must not wait on Nagle + delayed ACK (~40 ms)
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            clean_session=True if protocol != aiomqtt.ProtocolVersion.V5 else None,
        )
        # chunks in flight, and the PS's acks to a batch of devices, are many publishes at once by design
        client.pending_calls_threshold = PENDING_CALLS_WARNING
        paho_decode.install()  # a received payload read into its buffer by the kernel, then not copied again
        paho_decode.read_into_buffers(client._client)  # noqa: SLF001 - paho's reader and writer, under aiomqtt
        paho_decode.write_from_buffers(client._client)  # noqa: SLF001
        self._taps.attach(client)
        return client

    def _refused(self, operation: str, topic: str, code: int | ReasonCode) -> None:
        """A publish or subscription the broker refused: counted always, logged once per topic at ERROR."""
        self.metrics.refused.labels(operation=operation).inc()
        key = (operation, topic)
        first = key not in self._refusals_logged
        if first and len(self._refusals_logged) < REFUSALS_LOGGED:
            self._refusals_logged.add(key)
        logger.log(logging.ERROR if first else logging.DEBUG, "%s: the broker refused the %s %s %s (%s)%s",
                   self.client_id, operation, "on" if operation == "publish" else "of", topic or "?", code,
                   "; check the broker's ACL for this user" if first else "")

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
            if not probing or not (_code_in(exc, UNSUPPORTED_PROTOCOL_CODES) or _unanswered(exc)):
                raise
            logger.info("%s: broker did not take MQTT 5 (%s); trying MQTT 3.1.1", self.client_id, exc)
            client = self._make_client(aiomqtt.ProtocolVersion.V311)
            await client.__aenter__()
            self._protocol = aiomqtt.ProtocolVersion.V311
            _SPEAK_3_1_1.add(self.config.url)  # this process's later buses (a job host's jobs) skip the probe
        client.timeout = self.config.operation_timeout_s  # connected: answers may queue behind retained data
        return client

    async def _connection_loop(self) -> None:
        delay = self.config.backoff_initial_s
        while not self._closing:
            try:
                client = await self._connect()
            except aiomqtt.MqttError as exc:
                if _code_in(exc, REFUSED_LOGIN_CODES):
                    who = f"user {self.config.username!r}" if self.config.username else "an anonymous client"
                    raise BusError(f"{self.config.url} refused the login of {who} ({self.client_id}): {exc}") from None
                logger.warning("%s: cannot connect to %s: %s; retry in %.1fs", self.client_id, self.config.url,
                               exc, delay)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # noqa: S311 - jitter
                delay = min(delay * 2, self.config.backoff_max_s)
                continue
            self._client = client
            hooks: asyncio.Task[None] | None = None
            try:
                await self._subscribe_now([p for r in self._routes.held for p in r.filter.patterns])
                self.connections += 1
                self.metrics.connects.inc()
                self.metrics.connected.set(1)
                self._connected.set()
                delay = self.config.backoff_initial_s
                logger.info("%s: connected to %s (MQTT %s)", self.client_id, self.config.url, self.protocol)
                if 0 < self._taps.max_packet < self.config.chunk_bytes + chunks.CHUNK_HEADROOM:
                    logger.warning("%s: %s takes packets of at most %d bytes, less than broker.chunk_bytes (%d) and "
                                   "its envelope: it will refuse every chunk; lower broker.chunk_bytes below %d",
                                   self.client_id, self.config.url, self._taps.max_packet, self.config.chunk_bytes,
                                   self._taps.max_packet - chunks.CHUNK_HEADROOM)
                hooks = asyncio.create_task(self._hooks.run(), name=f"hooks-{self.client_id}")
                await asyncio.sleep(0)  # the hooks begin before the first message of this connection is routed
                async for msg in client.messages:  # ends only when the client disconnects
                    arrival = self._taps.arrival(msg.topic.value)
                    payload = msg.payload if isinstance(msg.payload, (bytes, bytearray)) else \
                        b"" if msg.payload is None else str(msg.payload).encode()
                    if not payload and msg.retain:
                        continue  # a cleared retained topic
                    self.metrics.received_bytes.inc(len(payload))
                    topic = msg.topic.value.removeprefix(self._prefix)  # every subscription has the prefix
                    await self._inbox.put((topic, payload, arrival))  # a bytearray stays one: no copy
            except aiomqtt.MqttError as exc:
                if not self._closing:
                    logger.warning("%s: connection to %s lost: %s", self.client_id, self.config.url, exc)
            except asyncio.CancelledError:
                await self._disconnect(client)
                raise
            finally:
                self._connected.clear()
                self.metrics.connected.set(0)
                self._client = None
                self._answers.lost()  # what waits for the old broker's answer is retried on the next connection
                if hooks is not None:
                    await cancel_all([hooks])  # a hook cut short runs again, whole, on the next connection
            if not self._closing:
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # noqa: S311 - jitter
                delay = min(delay * 2, self.config.backoff_max_s)

    async def _disconnect(self, client: aiomqtt.Client) -> None:
        """Leave cleanly (a DISCONNECT: the broker does not publish the will)."""
        self._closing = True
        with contextlib.suppress(aiomqtt.MqttError, TimeoutError):
            async with asyncio.timeout(self.config.connect_timeout_s):
                await client.__aexit__(None, None, None)

    async def _subscribe_now(self, patterns: list[str]) -> None:
        """One SUBSCRIBE for ``patterns`` if connected; refusals are counted and logged."""
        client = self._client
        if client is None or not patterns:
            return
        try:
            granted = await self._answers.of(client.subscribe([(self._prefix + p, QOS_STATE) for p in patterns]))
        except aiomqtt.MqttError:
            if self._connected.is_set() or client is not self._client:
                return  # the connection is going or gone: the next connect subscribes everything again
            raise
        codes: list[int | ReasonCode] = list(granted)
        for pattern, code in zip(patterns, codes, strict=False):
            if (code.value if isinstance(code, ReasonCode) else code) >= SUBSCRIBE_FAILURE:
                self._refused("subscribe", pattern, code)

    # --- routing -------------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            try:  # while partial chunked messages are held, an idle bus still lets them time out
                async with asyncio.timeout(self.config.reassembly_timeout_s if self._receiver.partials else None):
                    topic, payload, arrival = await self._inbox.get()
            except TimeoutError:
                if (task := asyncio.current_task()) is not None and task.cancelling():
                    raise asyncio.CancelledError from None  # a cancel as the timeout expired (Python 3.11 drops it)
                self._receiver.expire()
                continue
            await self._dispatch(topic, payload, arrival)

    def _partial_dropped(self, topic: str, reason: str) -> None:
        """A partial chunked message let go (timed out, evicted, contradicted): counted on its own route."""
        found = self._routes.find(topic)
        label = found[0].label if found is not None else UNROUTED
        self.metrics.reject(reason, topic, "partial chunked message dropped", route=label)

    def _unsolicited(self, topic: str) -> None:
        """A message on a topic no subscription of this bus covers (now, or within the grace of an unsubscribe): the
        broker's, not a peer's doing. Counted, logged once at INFO, dropped."""
        self.metrics.unsolicited.inc()
        first, self._unsolicited_logged = not self._unsolicited_logged, True
        logger.log(logging.INFO if first else logging.DEBUG, "%s: the broker sent a message on %s, which no "
                   "subscription of this client covers; dropped%s", self.client_id, topic,
                   " (counted on unsolicited_messages_total; amqtt sends a new client the retained messages of "
                   "every client's filters)" if first else "")

    def _joined(self, topic: str, nbytes: int, seconds: float) -> None:
        for hook in self._joined_hooks:
            hook(topic, nbytes, seconds)

    async def _dispatch(self, topic: str, payload: bytes, arrival: chunks.Arrival | None = None) -> None:
        """Route one received payload (read as ``arrival`` says): match and parse its topic, decode and check its
        body, hand it to its route's handler. Every failure is counted, with the route's label."""
        label = UNROUTED
        try:
            found = self._routes.find(topic)
            if found is None:
                self._unsolicited(topic)
                return
            route, where = found
            label = route.label
            message = self._receiver.take(where.topic, payload, route.message,
                                          json_kind="control" if route.json_body else "", arrival=arrival)
            if message is None:
                return  # more chunks to come
            why = where.disagreement(message)
            if why is not None:
                raise WireError(why, "topic")
        except TopicError as exc:
            self.metrics.reject("topic", topic, exc, route=label)
            return
        except WireError as exc:
            self.metrics.reject(exc.reason, topic, f"{exc} payload={wire.truncate(payload)}", route=label)
            return
        self.metrics.received_messages.labels(route=label).inc()
        started = time.perf_counter()
        try:
            await route.handler(message, where)
        except WireError as exc:
            self.metrics.reject(exc.reason, topic, exc, route=label)
        except Exception as exc:  # a handler's bug or a lost connection must not end the router
            self.metrics.reject("handler", topic, f"{type(exc).__name__}: {exc}", route=label, error=exc)
        finally:
            self.metrics.handler_seconds.labels(route=label).observe(time.perf_counter() - started)

    # --- publishing ----------------------------------------------------------------------
    async def publish(self, topic: str, msg: Any, *, retain: bool = False, qos: int = QOS_STATE,
                      kind: str = "", handed: asyncio.Event | None = None) -> int:
        """Publish a message (or ready envelope bytes); returns bytes sent. Chunks large payloads
        (retained ones onto ``{topic}/chunk/{i}``), ``broker.chunk_window`` of them in flight at once, handed
        to the client in order (the broker passes them on in that order).

        ``handed`` is set once the last piece is handed to the client, before the broker's PUBACKs: what is
        published after that goes to the broker after this message, on the same connection. Waits up to
        ``publish_timeout_s`` for a connection; raises BusError after that.
        """
        # retained messages keep one chunk size: a later one of other chunks would leave the earlier's last ones behind
        encoded_kind, pieces = chunks.frames(msg, self.config.chunk_bytes if retain else self.chunk_bytes)
        started = time.perf_counter()
        if len(pieces) == 1:
            targets = [topic]
        elif retain:
            targets = [f"{topic}/{CHUNK_SEGMENT}/{i}" for i in range(len(pieces))]
        else:
            targets = [topic] * len(pieces)
        if len(pieces) == 1:
            await self._publish_raw(topic, pieces[0], retain=retain, qos=qos, handed=handed)
        else:  # a window of chunks in flight: one round trip to the broker per window, not per chunk
            window = asyncio.Semaphore(self.config.chunk_window)
            last = len(pieces) - 1

            async def one(target: str, piece: bytes, i: int) -> None:
                async with window:  # taken in the order asked: the pieces are handed in order
                    await self._publish_raw(target, piece, retain=retain, qos=qos, handed=handed if i == last else None)

            try:
                async with asyncio.TaskGroup() as group:
                    for i, (target, piece) in enumerate(zip(targets, pieces, strict=True)):
                        group.create_task(one(target, piece, i))
            except ExceptionGroup as failed:  # the first chunk that failed says why (a BusError), as one piece would
                raise failed.exceptions[0] from None
        sent = sum(len(piece) for piece in pieces)
        if not retain:
            self._chunk_size.uploaded(sent, time.perf_counter() - started)
        self.metrics.published_messages.labels(kind=kind or encoded_kind).inc()
        self.metrics.published_bytes.inc(sent)
        return sent

    async def _publish_raw(self, topic: str, payload: bytes, *, retain: bool, qos: int,
                           handed: asyncio.Event | None = None) -> None:
        try:
            async with asyncio.timeout(self.config.publish_timeout_s):
                while True:
                    await self._connected.wait()
                    client = self._client
                    if client is None:
                        await asyncio.sleep(0)
                        continue
                    self._taps.handing = handed  # set by the paho client's publish (``Taps``), called at once
                    try:
                        await self._answers.of(client.publish(self._prefix + topic, payload, qos=qos, retain=retain))
                        return
                    except aiomqtt.MqttError as exc:
                        logger.debug("%s: publish on %s failed (%s); retrying", self.client_id, topic, exc)
                        await asyncio.sleep(self.config.backoff_initial_s)
                    finally:
                        self._taps.handing = None  # taken by then, unless the client never got that far
        except TimeoutError:
            raise BusError(f"could not publish on {topic} within {self.config.publish_timeout_s}s") from None


def forget_protocols() -> None:
    """Forget which brokers this process found speaking MQTT 3.1.1 only (another broker now at the same address:
    the tests start many on reused ports)."""
    _SPEAK_3_1_1.clear()


def _code_in(exc: aiomqtt.MqttError, codes: tuple[int, ...]) -> bool:
    """Whether the broker answered with one of ``codes`` (a refused CONNECT)."""
    rc = getattr(exc, "rc", None)
    value = getattr(rc, "value", rc)
    return isinstance(exc, aiomqtt.MqttCodeError) and value in codes


def _unanswered(exc: aiomqtt.MqttError) -> bool:
    """True when the TCP connection opened but no CONNACK came (aiomqtt reports a timeout)."""
    return not isinstance(exc, aiomqtt.MqttCodeError) and "timed out" in str(exc).lower()
