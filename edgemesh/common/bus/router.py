"""The bus's router: what a bus consumes (its routes) and the dispatch of every message it receives.

* **Routes.** A service declares what it consumes: ``bus.route(topics.grad_filter(), GradientUpdate,
  self.on_gradient)``. The bus subscribes to every route's filter (``Routes.held``) on every connect. For each
  message the router finds its route and the topic parsed (``Routes.find``), unpacks the envelope (joining
  chunks), decodes the body to the route's type, checks it against the topic (the device a topic names is the
  device in the body) and awaits ``handler(message, match)``. A failure at any step, and any exception a handler
  raises, is counted on ``rejected_total{route,reason}`` and logged (the first time per reason, then sparsely);
  the loop goes on. The router also counts ``received_messages_total{route}`` and times
  ``handler_seconds{route}``, so no service counts what it receives.
* **The route of a topic** is found once: a received topic is matched against the routes in order and parsed by
  the kind of the filter it fell under (``topics.match``), and the answer is kept for that topic (the last
  ``ROUTE_CACHE_TOPICS`` topics seen) until the routes change.
* **Dropped routes.** A broker sends on a subscription until it takes the UNSUBSCRIBE; what it sent before arrives
  after the bus dropped the route (a mesh member leaving its cluster lets go of its own model-delta topic while
  parts of a step are on their way). For ``UNSUBSCRIBED_GRACE_S`` such messages still go to the dropped route, as
  they would have a moment earlier, instead of being counted as unrouted junk.
* **Unsolicited messages.** The routes are the subscriptions: a message no route takes is on a topic no
  subscription of this client covers, which a broker should never send. One does: amqtt (the embedded broker)
  sends every client that connects the retained messages of every filter any client holds (the job files
  under the job hosts' ``edgemesh/v1/+/job``, to an ``edgemesh job status`` that asked for one job's state).
  Such a message is not a peer's bad message: it is dropped before it is decoded and counted on
  ``unsolicited_messages_total``, never as a rejection.
* **The inbox.** The connection puts each payload in the router's inbox (``inbox_messages``, bounded: a router
  that falls behind holds the connection back) and the router takes them out in order; while partial chunked
  messages are held, an idle router still lets them time out.
* **Downlink samples.** ``on_joined`` hooks hear of each message joined from several chunks (``chunks.Joined``),
  timed by when the connection read its payloads (``chunks.Arrival``): what a device measures its downlink by.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from edgemesh.common import wire
from edgemesh.common.config import BrokerConfig
from edgemesh.common.errors import WireError
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Filter, TopicError, TopicMatch, match
from edgemesh.common.wire import chunks

logger = logging.getLogger(__name__)

M = TypeVar("M")
Handler = Callable[[M, TopicMatch], Awaitable[None]]
"""What a route calls with each decoded message and its parsed topic."""
Found = tuple["Route[Any]", TopicMatch]
"""A topic's route, and the topic parsed."""
UNSUBSCRIBED_GRACE_S = 5.0
"""How long a dropped route still takes what arrives on it."""
ROUTE_CACHE_TOPICS = 4096
"""Topics whose route is kept (the least recently seen go first): a service's own topics, its peers' and the chunks
of retained messages, many times over."""
INBOX_MESSAGES = 10_000
"""Messages buffered between the network and the router before back-pressure."""
UNROUTED = "none"
"""Route label of a message whose topic no route could be found for (a topic that is not EdgeMesh's)."""


@dataclass(frozen=True, slots=True)
class Route(Generic[M]):
    """Messages on ``filter`` decode to ``message`` and go to ``handler``; ``name`` labels the metrics."""

    filter: Filter
    message: type[M] | tuple[type, ...]
    handler: Handler[M]
    name: str = ""
    json_body: bool = False
    """Also take a UTF-8 JSON object as the body (control topics: operators steer with ``mosquitto_pub``)."""

    @property
    def label(self) -> str:
        return self.name or self.filter.kind


class Routes:
    """The routes a bus holds (subscribed on every connect, matched in order) and those it dropped in the last grace
    period; the route of each topic seen, until the held routes change."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, cached: int = ROUTE_CACHE_TOPICS) -> None:
        self._held: list[Route[Any]] = []
        self._dropped: list[tuple[float, Route[Any]]] = []
        self._clock = clock
        self._find_held = functools.lru_cache(maxsize=cached)(self._scan_held)
        """``topic`` -> its held route and the topic parsed, or None (a TopicError is not kept: raised each time)."""

    @property
    def held(self) -> Sequence[Route[Any]]:
        """The routes held, in the order a topic is matched against them."""
        return tuple(self._held)

    def append(self, route: Route[Any]) -> None:
        """Hold ``route`` after the others (matched after them, even where another holds its filter)."""
        self._held.append(route)
        self._find_held.cache_clear()

    def add(self, routes: Collection[Route[Any]]) -> None:
        """Hold ``routes``, but those whose filter is held already (that route stays)."""
        filters, held = {r.filter for r in routes}, {r.filter for r in self._held}
        self._dropped = [(t, r) for t, r in self._dropped if r.filter not in filters]
        self._held.extend(r for r in routes if r.filter not in held)
        self._find_held.cache_clear()

    def drop(self, filters: Collection[Filter]) -> list[Route[Any]]:
        """Let go of the routes of ``filters`` (they take what arrives for the grace period); returns them."""
        gone = [r for r in self._held if r.filter in filters]
        self._held = [r for r in self._held if r.filter not in filters]
        now = self._clock()
        self._dropped = [*((t, r) for t, r in self._dropped if r.filter not in filters), *((now, r) for r in gone)]
        self._find_held.cache_clear()
        return gone

    def find(self, topic: str) -> Found | None:
        """The held route ``topic`` falls under, else a route dropped within the grace period; None if neither.
        Raises TopicError as ``match`` does."""
        found = self._find_held(topic)
        if found is not None or not self._dropped:  # none dropped, but for a few seconds after an unsubscribe
            return found
        now = self._clock()
        self._dropped = [(t, r) for t, r in self._dropped if now - t < UNSUBSCRIBED_GRACE_S]
        return _scan(topic, [r for _, r in self._dropped])

    def _scan_held(self, topic: str) -> Found | None:
        return _scan(topic, self._held)


def _scan(topic: str, routes: Sequence[Route[Any]]) -> Found | None:
    """The first of ``routes`` whose filter ``topic`` falls under, and the topic parsed by that filter's kind."""
    found = match(topic, [r.filter for r in routes])
    return None if found is None else (routes[found[0]], found[1])


class Router:
    """The routes of one bus and the dispatch of what its connection receives, counted on ``metrics``."""

    def __init__(self, config: BrokerConfig, metrics: ServiceMetrics, client_id: str) -> None:
        self.metrics = metrics
        self.client_id = client_id
        """Who this router is, in its logs (the bus's client id)."""
        self.routes = Routes()
        self._inbox: asyncio.Queue[tuple[str, bytes, chunks.Arrival | None]] = asyncio.Queue(maxsize=INBOX_MESSAGES)
        metrics.inbox.set_function(self._inbox.qsize)
        self._joined_hooks: list[chunks.Joined] = []
        self._receiver = chunks.Receiver(max_bytes=config.max_message_bytes,
                                         budget_bytes=config.reassembly_budget_bytes,
                                         timeout_s=config.reassembly_timeout_s, on_drop=self._partial_dropped,
                                         on_joined=self._joined, sample_bytes=config.chunk_bytes)
        self._reassembly_timeout_s = config.reassembly_timeout_s
        self._unsolicited_logged = False

    def on_joined(self, hook: chunks.Joined) -> None:
        """Call ``hook(topic, bytes, seconds)`` for every message received in several chunks."""
        self._joined_hooks.append(hook)

    async def put(self, topic: str, payload: bytes, arrival: chunks.Arrival | None) -> None:
        """A payload the connection received on ``topic`` (without the bus's prefix), read as ``arrival`` says: in
        the inbox, waiting while it is full. A ``bytearray`` stays one: no copy."""
        await self._inbox.put((topic, payload, arrival))

    async def run(self) -> None:
        """Dispatch what the inbox holds, in order, until cancelled."""
        while True:
            try:  # while partial chunked messages are held, an idle bus still lets them time out
                async with asyncio.timeout(self._reassembly_timeout_s if self._receiver.partials else None):
                    topic, payload, arrival = await self._inbox.get()
            except TimeoutError:
                if (task := asyncio.current_task()) is not None and task.cancelling():
                    raise asyncio.CancelledError from None  # a cancel as the timeout expired (Python 3.11 drops it)
                self._receiver.expire()
                continue
            await self.dispatch(topic, payload, arrival)

    async def dispatch(self, topic: str, payload: bytes, arrival: chunks.Arrival | None = None) -> None:
        """Route one received payload: find its route and its topic parsed, decode and check its body, hand it to
        the route's handler. Every failure is counted, with the route's label."""
        decoded = self._decode(topic, payload, arrival)
        if decoded is None:
            return
        route, where, message = decoded
        label = route.label
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

    def _decode(self, topic: str, payload: bytes,
                arrival: chunks.Arrival | None) -> tuple[Route[Any], TopicMatch, Any] | None:
        """The route of ``topic``, the topic parsed and the message ``payload`` completes; None when there is no
        message yet (more chunks to come) or none at all (unsolicited, or refused: counted)."""
        label = UNROUTED
        try:
            found = self.routes.find(topic)
            if found is None:
                self._unsolicited(topic)
                return None
            route, where = found
            label = route.label
            message = self._receiver.take(where.topic, payload, route.message,
                                          json_kind="control" if route.json_body else "", arrival=arrival)
            if message is None:
                return None  # more chunks to come
            why = where.disagreement(message)
            if why is not None:
                raise WireError(why, "topic")
        except TopicError as exc:
            self.metrics.reject("topic", topic, exc, route=label)
            return None
        except WireError as exc:
            self.metrics.reject(exc.reason, topic, f"{exc} payload={wire.truncate(payload)}", route=label)
            return None
        return route, where, message

    def _partial_dropped(self, topic: str, reason: str) -> None:
        """A partial chunked message let go (timed out, evicted, contradicted): counted on its own route."""
        found = self.routes.find(topic)
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
