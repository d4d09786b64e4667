"""A worker's side of a sharded parameter server (``ps.shards`` > 1).

The model is put together from every shard's broadcast (``shards.ShardedView``), each shard's snapshot checked
to hold exactly its rows. A step's gradient is cut at the shards' rows and each part goes to its shard, on the
shard's topics, with the version and gap of that shard's model; the worker waits for every shard's ack. The
answer that counts is the worst one; a shard that asks for a resync names the version the worker waits for in
that shard's view before its next step. A model-parallel member sends every shard a part of each step, empty
where the shard holds none of its rows: each shard joins a step once every member's part is in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace

from edgemesh.common.errors import WireError
from edgemesh.common.messages import GradientUpdate, ModelDelta, ModelSnapshot, UpdateAck
from edgemesh.common.shards import ShardedView
from edgemesh.common.topics import Topics
from edgemesh.services.worker.sender import Sender


class ShardedModel:
    """Every shard's rows of the model, and the versions the shards' last acks asked for."""

    def __init__(self, shards: int, topics: Topics, device: str) -> None:
        self.view = ShardedView(shards)
        self.topics, self.device = topics, device
        self._min_versions: dict[int, int] = {}

    @property
    def count(self) -> int:
        return len(self.view.views)

    def load(self, snap: ModelSnapshot, shard: int, layout: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
        """Shard ``shard``'s snapshot, checked against the model's ``layout`` (name: shape, dtype)."""
        self.view.know({name: shape for name, (shape, _) in layout.items()})
        rows = self.view.shapes(shard) or {}
        if set(snap.tensors) != set(rows) or any(
                t.shape != (rows[name][0], *layout[name][0][1:]) for name, t in snap.tensors.items()):
            raise WireError(f"snapshot of shard {shard} does not hold its rows of the model", "shape")
        self.view.views[shard].load(snap)

    async def receive(self, delta: ModelDelta, shard: int) -> None:
        await self.view.views[shard].receive(delta)

    @property
    def resyncing(self) -> bool:
        """Some shard's last ack named a version for this worker to wait for."""
        return bool(self._min_versions)

    def holds(self) -> bool:
        """Every shard's view holds the model at the version its last ack asked for, or knows it missed a delta."""
        views = self.view.views
        return self.view.ready and all(views[i].version >= v or views[i].gap for i, v in self._min_versions.items())

    async def send(self, sender: Sender, update: GradientUpdate) -> tuple[UpdateAck, list[UpdateAck]]:
        """Send each shard its rows of ``update`` and wait for every ack: the answer that counts, and each."""
        parts, moved = self.view.split(update.shards), self.view.split(update.buffers)
        versions, gaps = self.view.versions, [v.gap for v in self.view.views]
        acks = await asyncio.gather(*(sender.send(
            replace(update, shards=tuple(part), buffers=tuple(moved[i]), base_version=versions[i],
                    need_snapshot=gaps[i]),
            self.topics.for_shard(i).grad(update.cluster, self.device), i) for i, part in enumerate(parts)))
        self._min_versions = {i: ack.version for i, ack in enumerate(acks) if ack.resync}
        worst = next((a for a in acks if a.status not in ("accepted", "duplicate")), acks[0])
        return replace(worst, delay=max(a.delay for a in acks), resync=False), list(acks)
