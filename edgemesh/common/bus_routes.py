"""The bus's routes: what it consumes, in the order they are matched, and the routes just dropped.

A broker sends on a subscription until it takes the UNSUBSCRIBE; what it sent before arrives after the bus
dropped the route (a mesh member leaving its cluster lets go of its own model-delta topic while parts of a
step are on their way). For ``UNSUBSCRIBED_GRACE_S`` such messages still go to the dropped route, as they
would have a moment earlier, instead of being counted as unrouted junk.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from edgemesh.common.topics import Filter, TopicMatch, match

M = TypeVar("M")
Handler = Callable[[M, TopicMatch], Awaitable[None]]
"""What a route calls with each decoded message and its parsed topic."""
UNSUBSCRIBED_GRACE_S = 5.0
"""How long a dropped route still takes what arrives on it."""


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
    """The routes a bus holds (subscribed on every connect) and those it dropped in the last grace period."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.held: list[Route[Any]] = []
        self._dropped: list[tuple[float, Route[Any]]] = []
        self._clock = clock

    def add(self, routes: Collection[Route[Any]]) -> None:
        """Hold ``routes``, but those whose filter is held already (that route stays)."""
        filters, held = {r.filter for r in routes}, {r.filter for r in self.held}
        self._dropped = [(t, r) for t, r in self._dropped if r.filter not in filters]
        self.held.extend(r for r in routes if r.filter not in held)

    def drop(self, filters: Collection[Filter]) -> list[Route[Any]]:
        """Let go of the routes of ``filters`` (they take what arrives for the grace period); returns them."""
        gone = [r for r in self.held if r.filter in filters]
        self.held = [r for r in self.held if r.filter not in filters]
        now = self._clock()
        self._dropped = [*((t, r) for t, r in self._dropped if r.filter not in filters), *((now, r) for r in gone)]
        return gone

    def find(self, topic: str) -> tuple[Route[Any], TopicMatch] | None:
        """The held route ``topic`` falls under, else a route dropped within the grace period; None if neither.
        Raises TopicError as ``match`` does."""
        if self._dropped:  # none, but for a few seconds after an unsubscribe: every message comes through here
            now = self._clock()
            self._dropped = [(t, r) for t, r in self._dropped if now - t < UNSUBSCRIBED_GRACE_S]
        for routes in (self.held, [r for _, r in self._dropped]):
            found = match(topic, [r.filter for r in routes])
            if found is not None:
                return routes[found[0]], found[1]
        return None
