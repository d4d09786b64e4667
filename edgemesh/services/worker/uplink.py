"""Where a worker's update goes: one uplink, to a parameter server of one process or to every shard of one.

``send(update, policy)`` hands a computed update to the ``Sender`` (which publishes it and waits for its ack,
resending it until the parameter server answers) and returns the answer: the ack that counts, and every
parameter server shard's ack in shard order (the model source's ``resync`` reads them). The encoded bytes are
counted by codec, every ack by status and reason.

* :class:`WholeUplink`: the update on ``grad/{cluster}/{device}``, or raw float32 on ``grad-raw/{cluster}/{device}``
  for the compressor to encode when the device's policy says ``gateway``; its ack on ``ack/{device}``.
* :class:`ShardedUplink`: the update cut at the shards' rows, each part to its shard on the shard's topics with
  the version and gap of that shard's model, all sent at once; the worker waits for every shard's ack. The
  answer that counts is the worst one, with the largest delay. A model-parallel member sends every shard a part
  of each step, empty where the shard holds none of its rows: each shard joins a step once every member's part
  is in.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

from edgemesh.common.bus import Bus
from edgemesh.common.messages import CodecPolicy, GradientUpdate, UpdateAck
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.shards import ShardedView
from edgemesh.common.topics import Topics
from edgemesh.services.worker.sender import APPLIED, Sender


@dataclass(frozen=True, slots=True)
class Answer:
    """What the parameter server said of an update."""

    ack: UpdateAck
    """The ack that counts (a sharded server's: the worst, with the largest delay)."""
    acks: tuple[UpdateAck, ...]
    """Every parameter server shard's ack, in shard order."""


class Uplink(ABC):
    """Sends this device's updates and returns the parameter server's answer."""

    def __init__(self, sender: Sender, topics: Topics, device: str, metrics: ServiceMetrics) -> None:
        self.sender, self.topics, self.device = sender, topics, device
        self.m_updates = metrics.counter("updates", "Updates by the PS's answer", ["status", "reason"])
        self.m_grad_bytes = metrics.counter("gradient_bytes", "Encoded gradient bytes sent", ["codec"])

    @abstractmethod
    def route(self, bus: Bus) -> None:
        """Consume the acks (the sender's), and send on ``bus``."""

    async def send(self, update: GradientUpdate, policy: CodecPolicy | None) -> Answer:
        """Send ``update`` under the device's codec ``policy`` and wait for the parameter server's answer."""
        for s in update.shards:
            self.m_grad_bytes.labels(codec=s.codec).inc(len(s.data))
        answer = await self._send(update, policy)
        for ack in answer.acks:
            self.m_updates.labels(status=ack.status, reason=ack.reason).inc()
        return answer

    @abstractmethod
    async def _send(self, update: GradientUpdate, policy: CodecPolicy | None) -> Answer: ...


class WholeUplink(Uplink):
    """To a parameter server of one process, or through the compressor's gateway."""

    def route(self, bus: Bus) -> None:
        self.sender.bus = bus
        bus.route(self.topics.ack_filter(self.device), UpdateAck, self.sender.on_ack)

    async def _send(self, update: GradientUpdate, policy: CodecPolicy | None) -> Answer:
        raw = policy is not None and policy.gateway
        topic = (self.topics.grad_raw if raw else self.topics.grad)(update.cluster, self.device)
        ack = await self.sender.send(update, topic)
        return Answer(ack, (ack,))


class ShardedUplink(Uplink):
    """To every shard of a sharded parameter server, each its rows of the update (``view``: the model the
    update was computed on, as the shards broadcast it)."""

    def __init__(self, sender: Sender, topics: Topics, device: str, metrics: ServiceMetrics, *,
                 view: ShardedView) -> None:
        super().__init__(sender, topics, device, metrics)
        self.view = view

    def route(self, bus: Bus) -> None:
        self.sender.bus = bus
        for shard in range(len(self.view.views)):
            bus.route(self.topics.for_shard(shard).ack_filter(self.device), UpdateAck, self.sender.on_ack)

    async def _send(self, update: GradientUpdate, policy: CodecPolicy | None) -> Answer:
        view = self.view
        parts, moved = view.split(update.shards), view.split(update.buffers)
        versions, gaps = view.versions, [v.gap for v in view.views]
        acks = await asyncio.gather(*(self.sender.send(
            replace(update, shards=tuple(part), buffers=tuple(moved[i]), base_version=versions[i],
                    need_snapshot=gaps[i]),
            self.topics.for_shard(i).grad(update.cluster, self.device), i) for i, part in enumerate(parts)))
        worst = next((a for a in acks if a.status not in APPLIED), acks[0])
        return Answer(replace(worst, delay=max(a.delay for a in acks), resync=False), tuple(acks))
