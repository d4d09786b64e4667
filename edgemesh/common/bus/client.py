"""The bus's client: one aiomqtt connection per service, its life one ``async with``, and publishing.

* **Connection.** Entering the bus (``async with bus``) starts its connection loop and its router (``router``)
  as two tasks of its own; leaving it stops them, the connection with a DISCONNECT (the broker does not publish
  the will). The loop connects (MQTT 5 where the broker offers it, else 3.1.1: every semantic lives in the
  envelope), subscribes to every route's filter in one SUBSCRIBE, calls the ``on_connect`` hooks and puts what it
  reads in the router's inbox. It reconnects in one place, with capped, jittered exponential backoff, and
  subscribes again. Entering returns once connected (BusError when no connection comes within
  ``connect_timeout_s``), or, with ``connect_first=False``, at once: a service may start before its broker (its
  publishes wait for a connection, ``publish_timeout_s``).
* **Failures.** A login the broker refuses (bad credentials, not authorized) ends the connection loop with a
  BusError instead of retrying for ever. As a failing task of an ``asyncio.TaskGroup`` does, it cancels the
  block the bus was entered in, and leaving the block raises it. ``wait_closed`` raises it too: what a service's
  supervisor runs beside its jobs, so that the service ends with it.
* **On connect.** The ``on_connect`` hooks (announce the service, publish its retained state again) run in
  order, in a task of their own beside the reading of messages, cancelled if the connection is lost (the next
  connection runs them all again); one that fails is logged, not fatal.
* **Publishing** splits large payloads into chunks (retained ones onto ``{topic}/chunk/{i}``), and
  waits up to ``publish_timeout_s`` for a connection.
* **Arrival times.** Every payload is stamped as the MQTT client parses it off the connection (``taps``), before it
  waits for the connection loop and the router, so neither the ``on_connect`` hooks (a retained model arrives
  while they publish) nor a handler that takes its time bunches the chunks behind them: what the router's
  downlink samples are timed by.
* **Zero copy.** A bus built with ``zero_copy=True`` gives its paho clients the reader and writer of
  ``paho_layer`` (``paho_layer.enable``): a received payload is read into its buffer by the kernel and not copied
  again, on the paho-mqtt releases that layer was written for (elsewhere, paho's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiomqtt
from paho.mqtt.reasoncodes import ReasonCode

from edgemesh.common.bus import paho_layer
from edgemesh.common.bus.router import Handler, Route, Router
from edgemesh.common.bus.taps import Answers, Taps
from edgemesh.common.config import BrokerConfig
from edgemesh.common.errors import BusError
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.tasks import cancel_all
from edgemesh.common.topics import CHUNK_SEGMENT, Filter
from edgemesh.common.wire import chunks

logger = logging.getLogger(__name__)

M = TypeVar("M")
Hook = Callable[[], Awaitable[None]]
"""What a service does on every (re)connect (``Bus.on_connect``)."""

QOS_STATE = 1
"""QoS for everything that matters (updates, acks, plan, model); MQTT 3.1.1 and 5 both have it."""
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


class Backoff:
    """Capped, jittered exponential backoff between connection attempts."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self.delay = initial_s
        """The next wait, before its jitter."""

    def reset(self) -> None:
        self.delay = self.initial_s

    async def wait(self) -> None:
        await asyncio.sleep(self.delay * random.uniform(0.5, 1.0))  # noqa: S311 - jitter
        self.delay = min(self.delay * 2, self.max_s)


class Bus:
    """An MQTT connection that survives broker restarts, with its router; running while entered."""

    def __init__(self, config: BrokerConfig, *, client_id: str, metrics: ServiceMetrics,
                 will: tuple[str, bytes] | None = None, connect_first: bool = True, zero_copy: bool = False) -> None:
        self.config = config
        self.client_id = client_id
        self.metrics = metrics
        self._prefix = config.topic_prefix
        """Before every topic on the wire (``broker.topic_prefix``), never in a route's or a caller's."""
        self._will = will
        self._connect_first = connect_first
        """Entering waits for the first connection (else the connection loop tries on, and entering returns)."""
        self._zero_copy = zero_copy
        """The paho clients read and write with ``paho_layer`` (``paho_layer.enable``)."""
        self._router = Router(config, metrics, client_id)
        self._hooks: list[Hook] = []
        self._client: aiomqtt.Client | None = None
        self._connected = asyncio.Event()
        self._answers = Answers()
        self._chunk_size = chunks.ChunkSize(config.chunk_bytes, config.chunk_max_bytes, config.chunk_seconds)
        metrics.chunk_bytes.set_function(lambda: self.chunk_bytes)
        self._taps = Taps(self._refused)
        """What the paho client under aiomqtt tells: PUBACK codes, publishes handed over, arrival times."""
        v311 = config.protocol == "3.1.1" or (config.protocol == "auto" and config.url in _SPEAK_3_1_1)
        self._protocol = aiomqtt.ProtocolVersion.V311 if v311 else aiomqtt.ProtocolVersion.V5
        self._tasks: list[asyncio.Task[None]] = []
        """The connection loop and the router, while the bus is entered."""
        self._owner: asyncio.Task[Any] | None = None
        """The task the bus was entered in: cancelled when a task of the bus fails (``_ended``)."""
        self._owner_cancelled = False
        self._closing = False
        self._refusals_logged: set[tuple[str, str]] = set()
        self.connections = 0

    # --- declaring -------------------------------------------------------------------------
    def route(self, filter_: Filter, message: type[M] | tuple[type, ...], handler: Handler[M], *,
              name: str = "", json_body: bool = False) -> Route[M]:
        """Consume ``filter_`` from the first connect on (declare routes before entering the bus; ``subscribe``
        adds them later)."""
        route = Route(filter_, message, handler, name, json_body)
        self._router.routes.append(route)
        return route

    async def subscribe(self, *routes: Route[Any]) -> None:
        """Add routes now: subscribed at once if connected, and on every reconnect. A route already held is
        subscribed again, in place: the broker sends its retained messages anew, and none finds it gone."""
        self._router.routes.add(routes)
        await self._subscribe_now([p for r in routes for p in r.filter.patterns])

    async def unsubscribe(self, *filters: Filter) -> None:
        """Drop the routes of ``filters`` (what the broker sent on them before it took the UNSUBSCRIBE still goes to
        them, for ``router.UNSUBSCRIBED_GRACE_S``)."""
        gone = self._router.routes.drop(filters)
        client = self._client
        patterns = [p for r in gone for p in r.filter.patterns]
        if client is not None and self._connected.is_set() and patterns:
            with contextlib.suppress(aiomqtt.MqttError):  # a lost connection re-subscribes what is left
                await self._answers.of(client.unsubscribe([self._prefix + p for p in patterns]))

    @property
    def filters(self) -> tuple[Filter, ...]:
        """What this bus consumes: its routes' filters, in the order they are matched."""
        return tuple(r.filter for r in self._router.routes.held)

    def on_connect(self, hook: Hook) -> None:
        """Await ``hook()`` after every (re)connect, once the subscriptions are in place, while messages are read
        (a task cancelled if the connection is lost meanwhile). A hook that raises is logged, not fatal."""
        self._hooks.append(hook)

    def on_joined(self, hook: chunks.Joined) -> None:
        """Call ``hook(topic, bytes, seconds)`` for every message received in several chunks: the payload bytes
        read after its first chunk up to its last, and the seconds between the two (a downlink sample)."""
        self._router.on_joined(hook)

    # --- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Bus:
        """Start the connection loop and the router; with ``connect_first``, return once connected."""
        if self._tasks:
            raise BusError(f"{self.client_id}: the bus is entered already")
        self._closing, self._owner_cancelled = False, False
        self._tasks = [asyncio.create_task(self._connection_loop(), name=f"connection-{self.client_id}"),
                       asyncio.create_task(self._router.run(), name=f"router-{self.client_id}")]
        if self._connect_first:
            try:
                await self._first_connection()
            except BaseException:
                await self._stop()
                raise
        self._owner = asyncio.current_task()
        for task in self._tasks:
            task.add_done_callback(self._ended)
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop the connection loop (a DISCONNECT) and the router; raise what ended either of them on its own (a
        refused login's BusError, a router's bug)."""
        tasks, cancelled = list(self._tasks), False
        try:
            await self._stop()
        except asyncio.CancelledError:  # ours (``_ended``), landing only now, or the owner's own: the tasks ended
            cancelled = True
        if self._owner_cancelled and self._owner is not None:
            self._owner.uncancel()
        self._owner, self._owner_cancelled = None, False
        failure = next((t.exception() for t in tasks if not t.cancelled() and t.exception() is not None), None)
        if failure is not None:
            raise failure
        if cancelled:
            raise asyncio.CancelledError

    async def wait_closed(self) -> None:
        """Wait while the bus is entered: return once it is left, raise what ended its connection loop or its router
        on their own (a refused login's BusError). What a supervisor runs beside the jobs of the service the bus
        serves (``runtime.supervise``'s ``transport``)."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        failure = next((t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception() is not None),
                       None)
        if failure is not None:
            raise failure

    async def _first_connection(self) -> None:
        """Wait for the connection; BusError if the connection loop ends first (a refused login) or none comes
        within ``connect_timeout_s``."""
        waiter = asyncio.create_task(self._connected.wait())
        try:
            done, _ = await asyncio.wait({waiter, *self._tasks}, timeout=self.config.connect_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_all([waiter])
        for task in self._tasks:
            if task in done:
                task.result()  # the login was refused: its BusError
        if waiter not in done:
            raise BusError(f"{self.client_id}: no connection to {self.config.url} "
                           f"within {self.config.connect_timeout_s:g}s")

    async def _stop(self) -> None:
        """End the bus's tasks (the connection leaves with a DISCONNECT), their outcomes left on them."""
        self._closing = True
        tasks, self._tasks = self._tasks, []
        await cancel_all(tasks)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """A task of the bus ended while the bus is entered: it failed. The block the bus was entered in is
        cancelled, once, and leaving it raises the error (``__aexit__``)."""
        if self._closing or task.cancelled() or task.exception() is None:
            return
        if self._owner is not None and not self._owner_cancelled:
            self._owner_cancelled = self._owner.cancel()

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
        if self._zero_copy:
            paho_layer.enable(client._client)  # noqa: SLF001 - paho's reader and writer, under aiomqtt
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
        """Connect, serve the connection until it is lost, and again after a backoff, until the bus is left; a
        refused login ends it with a BusError."""
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while not self._closing:
            try:
                client = await self._connect()
            except aiomqtt.MqttError as exc:
                if _code_in(exc, REFUSED_LOGIN_CODES):
                    who = f"user {self.config.username!r}" if self.config.username else "an anonymous client"
                    raise BusError(f"{self.config.url} refused the login of {who} ({self.client_id}): {exc}") from None
                logger.warning("%s: cannot connect to %s: %s; retry in %.1fs", self.client_id, self.config.url,
                               exc, backoff.delay)
            else:
                await self._serve(client, backoff)
            if not self._closing:
                await backoff.wait()

    async def _serve(self, client: aiomqtt.Client, backoff: Backoff) -> None:
        """Subscribe, run the hooks and read until the connection is lost (logged) or the bus is left (a
        DISCONNECT)."""
        self._client = client
        hooks: asyncio.Task[None] | None = None
        try:
            await self._subscribe_now([p for r in self._router.routes.held for p in r.filter.patterns])
            self._up()
            backoff.reset()
            hooks = asyncio.create_task(self._run_hooks(), name=f"hooks-{self.client_id}")
            await asyncio.sleep(0)  # the hooks begin before the first message of this connection is routed
            await self._read(client)
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

    def _up(self) -> None:
        """Connected and subscribed: counted, logged, and what waits for a connection goes on."""
        self.connections += 1
        self.metrics.connects.inc()
        self.metrics.connected.set(1)
        self._connected.set()
        logger.info("%s: connected to %s (MQTT %s)", self.client_id, self.config.url, self.protocol)
        if 0 < self._taps.max_packet < self.config.chunk_bytes + chunks.CHUNK_HEADROOM:
            logger.warning("%s: %s takes packets of at most %d bytes, less than broker.chunk_bytes (%d) and "
                           "its envelope: it will refuse every chunk; lower broker.chunk_bytes below %d",
                           self.client_id, self.config.url, self._taps.max_packet, self.config.chunk_bytes,
                           self._taps.max_packet - chunks.CHUNK_HEADROOM)

    async def _read(self, client: aiomqtt.Client) -> None:
        """Every message of the connection into the router's inbox, with the time it was read; until the client
        disconnects."""
        async for msg in client.messages:
            arrival = self._taps.arrival(msg.topic.value)
            payload = msg.payload if isinstance(msg.payload, (bytes, bytearray)) else \
                b"" if msg.payload is None else str(msg.payload).encode()
            if not payload and msg.retain:
                continue  # a cleared retained topic
            self.metrics.received_bytes.inc(len(payload))
            topic = msg.topic.value.removeprefix(self._prefix)  # every subscription has the prefix
            await self._router.put(topic, payload, arrival)

    async def _run_hooks(self) -> None:
        """Every ``on_connect`` hook, in order; a failure is logged and the next hook runs."""
        for hook in self._hooks:
            name = getattr(hook, "__qualname__", repr(hook))
            try:
                await hook()
            except (BusError, aiomqtt.MqttError) as exc:
                logger.warning("%s: %s after connecting failed: %s", self.client_id, name, exc)
            except Exception:
                logger.exception("%s: %s after connecting failed", self.client_id, name)

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
