"""The virtual clock: a queue of timed events, popped in time order (pure).

Nothing sleeps. Two events at the same time come out in the order they were pushed, so a run is a function of its
inputs alone: the same seed gives the same trajectory.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

Action = Callable[[float], None]
"""What an event does, given its time."""


@dataclass(order=True, slots=True)
class _Entry:
    at: float
    order: int
    action: Action = field(compare=False)


class EventQueue:
    """Virtual seconds since the run's start, and what happens when."""

    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._order = itertools.count()
        self.now = 0.0

    def at(self, when: float, action: Action) -> None:
        """Do ``action`` at virtual time ``when`` (never before now: the past is done)."""
        heapq.heappush(self._heap, _Entry(max(when, self.now), next(self._order), action))

    def run_until(self, end: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Pop and do events in time order up to ``end`` (inclusive), or until ``stop()``."""
        while self._heap and self._heap[0].at <= end and not stop():
            entry = heapq.heappop(self._heap)
            self.now = entry.at
            entry.action(entry.at)
        if not stop():
            self.now = end

    def __len__(self) -> int:
        return len(self._heap)
