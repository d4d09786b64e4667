"""The parameter server's answers to updates: which are still owed one, and publishing them, after the model
they name (``publish_model``).

A step's acks go out once its log is durable, all at once, and the step loop takes the next batch while the
broker's PUBACKs come back. A step that moved the model broadcasts it first, and its acks follow as soon as the
model is handed to the client (``send_after``): on one connection the broker passes them on in that order, so a
worker has the model its ack names without the PS waiting for the model's PUBACKs first. A batch's acks wait
for the previous batch's, so no device hears of an older model version after a newer one, even when a broker
outage makes a publish retry. A stopping server gives the acks still on their way ``DRAIN_S``; a device
resends what it was not acked, and the resend is answered again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from edgemesh.common.broadcast import ModelMessage
from edgemesh.common.bus import Bus
from edgemesh.common.messages import GradientUpdate, UpdateAck
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.tasks import cancel_all
from edgemesh.common.topics import Topics
from edgemesh.services.parameter_server.scheduler import Ack

logger = logging.getLogger(__name__)

DRAIN_S = 2.0
"""How long a stopping server waits for the acks still on their way to the broker."""

Key = tuple[str, int, int]
"""(device, incarnation, seq): one update."""


def key_of(update: GradientUpdate) -> Key:
    return update.device, update.incarnation, update.seq


class Acks:
    """Owed answers and their publishing, for one parameter server (``bus`` set when it attaches)."""

    def __init__(self, topics: Topics, metrics: ServiceMetrics) -> None:
        self.topics = topics
        self.bus: Bus | None = None
        self.owed: set[Key] = set()
        """The updates taken and not yet answered (queued, or in an open round): a resend of one is not taken
        again. A paused server would otherwise hold every resend, decoded, without bound, and a ``sync`` round
        longer than the worker's ack timeout would answer its resend ``round_full`` (and the worker resync)
        while the first copy waits in the round."""
        self.in_flight: set[asyncio.Task[None]] = set()
        """Batches of acks on their way to the broker."""
        self._last: asyncio.Task[None] | None = None
        self.watch: Callable[[Ack], None] | None = None
        """Told of every ack sent (a sharded server's shards tell each other their discards)."""
        self.m_updates = metrics.counter("updates", "Gradient updates by outcome", ["status", "reason"])

    def owe(self, update: GradientUpdate) -> None:
        self.owed.add(key_of(update))

    def owes(self, update: GradientUpdate) -> bool:
        return key_of(update) in self.owed

    async def send(self, ack: Ack, version: int) -> None:
        """Publish ``ack``, naming model ``version``, and wait for the broker to take it."""
        assert self.bus is not None
        u = ack.update
        self.owed.discard(key_of(u))  # answered: a resend now gets this answer again
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

    async def send_after(self, model: Callable[[asyncio.Event], Awaitable[None]], acks: list[Ack],
                         version: int) -> None:
        """Publish the model (``model(handed)``), then ``acks`` (as ``send_batch``) as soon as the model is handed
        to the client, not after its PUBACKs: the broker passes them on in that order. Returns once the model is
        published (or raises why it was not; its acks went out all the same: their steps are logged)."""
        handed = asyncio.Event()
        publishing = asyncio.ensure_future(model(handed))
        waiting = asyncio.ensure_future(handed.wait())
        try:
            await asyncio.wait([publishing, waiting], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            self.send_batch(acks, version)
        await publishing

    async def publish_model(self, message: ModelMessage, handed: asyncio.Event) -> None:
        """The broadcast; ``handed`` set once it is handed to the client (with per-device parts: once sent)."""
        assert self.bus is not None
        if message.snapshot:
            await self.bus.publish(self.topics.model(), message.payload, retain=True, kind="model", handed=handed)
            return
        await asyncio.gather(self.bus.publish(self.topics.model_delta(), message.payload, kind="model_delta",
                                              handed=None if message.parts else handed),
                             *(self.bus.publish(self.topics.model_delta_for(device), part, kind="model_delta")
                               for device, part in message.parts.items()))
        handed.set()

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
