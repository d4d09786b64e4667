"""The parameter server's answers to updates: which are still owed one, and publishing them in batch order.

A step's acks go out once its log is durable, all at once, and the step loop takes the next batch while the
broker's PUBACKs come back; a step that moved the model has it handed to the client first (``step.Stepper.publish``).
A batch's acks wait for the previous batch's, so no device hears of an older model version after a newer one,
even when a broker outage makes a publish retry. A stopping server gives the acks still on their way ``DRAIN_S``;
a device resends what it was not acked, and the resend is answered again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from edgemesh.common.bus import Bus
from edgemesh.common.messages import GradientUpdate, UpdateAck
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.tasks import cancel_all
from edgemesh.common.topics import Topics
from edgemesh.services.parameter_server.scheduler import Ack, UpdateId

logger = logging.getLogger(__name__)

DRAIN_S = 2.0
"""How long a stopping server waits for the acks still on their way to the broker."""


class Acks:
    """Owed answers and their publishing, for one parameter server (``bus`` set when it attaches)."""

    def __init__(self, topics: Topics, metrics: ServiceMetrics, *, watch: Callable[[Ack], None] | None = None) -> None:
        self.topics = topics
        self.bus: Bus | None = None
        self.owed: set[UpdateId] = set()
        """The updates taken and not yet answered (queued, or in an open round): a resend of one is not taken
        again. A paused server would otherwise hold every resend, decoded, without bound, and a ``sync`` round
        longer than the worker's ack timeout would answer its resend ``round_full`` (and the worker resync)
        while the first copy waits in the round."""
        self.in_flight: set[asyncio.Task[None]] = set()
        """Batches of acks on their way to the broker."""
        self._last: asyncio.Task[None] | None = None
        self.watch = watch
        """Told of every ack sent (a sharded server's shards tell each other their discards)."""
        self.m_updates = metrics.counter("updates", "Gradient updates by outcome", ["status", "reason"])

    def owe(self, update: GradientUpdate) -> None:
        self.owed.add(UpdateId.of(update))

    def owes(self, update: GradientUpdate) -> bool:
        return UpdateId.of(update) in self.owed

    async def send(self, ack: Ack, version: int) -> None:
        """Publish ``ack``, naming model ``version``, and wait for the broker to take it."""
        assert self.bus is not None
        u = ack.update
        self.owed.discard(UpdateId.of(u))  # answered: a resend now gets this answer again
        self.m_updates.labels(status=ack.status, reason=ack.reason).inc()
        if self.watch is not None:
            self.watch(ack)
        await self.bus.publish(self.topics.ack(u.device), UpdateAck(
            device=u.device, incarnation=u.incarnation, seq=u.seq, status=ack.status, reason=ack.reason,
            version=version, delay=ack.delay, resync=ack.resync))

    def send_batch(self, acks: list[Ack], version: int) -> None:
        """Publish a batch's ``acks`` after the previous batch's, without waiting for them here."""
        if not acks:
            return
        task = asyncio.create_task(self._in_turn(self._last, acks, version))
        self._last = task
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)

    async def _in_turn(self, before: asyncio.Task[None] | None, acks: list[Ack], version: int) -> None:
        if before is not None:
            await asyncio.wait([before])
        results = await asyncio.gather(*(self.send(ack, version) for ack in acks), return_exceptions=True)
        for ack, result in zip(acks, results, strict=True):
            if isinstance(result, Exception):
                logger.warning("ack of %s seq %d not sent: %s", ack.update.device, ack.update.seq, result)

    async def drain(self) -> None:
        """Wait up to ``DRAIN_S`` for the acks in flight; cancel the rest."""
        if not self.in_flight:
            return
        _, late = await asyncio.wait(self.in_flight, timeout=DRAIN_S)
        await cancel_all(late)
