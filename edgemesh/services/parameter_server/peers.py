"""The other shards of a sharded parameter server, as shard 0 sees them: it evaluates the whole model.

Shard 0 follows every other shard's broadcast (its retained snapshot and its deltas) on the shard's own topics;
an evaluation of version v waits, up to ``WAIT_S``, for every shard's broadcast to reach v, then puts the model
together from shard 0's own rows and theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import numpy as np

from edgemesh.common.bus import Bus
from edgemesh.common.errors import WireError
from edgemesh.common.messages import ModelDelta, ModelSnapshot
from edgemesh.common.shards import ShardedView
from edgemesh.common.topics import TopicMatch, Topics

logger = logging.getLogger(__name__)

WAIT_S = 10.0
"""Longest an evaluation of shard 0 waits for every other shard's broadcast to reach its version."""


class Peers:
    """Every other shard's rows of the model, from their broadcasts."""

    def __init__(self, shards: int) -> None:
        self.view = ShardedView(shards)
        self._moved = asyncio.Event()

    def know(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """The whole model's shapes (known once the model is built): which rows each shard holds."""
        self.view.know(shapes)

    def attach(self, bus: Bus, topics: Topics) -> None:
        for shard in range(1, len(self.view.views)):
            bus.route(topics.for_shard(shard).model_filter(), ModelSnapshot, self._on_snapshot)
            bus.route(topics.for_shard(shard).delta_filter(), ModelDelta, self._on_delta)

    async def _on_snapshot(self, snap: ModelSnapshot, match: TopicMatch) -> None:
        shapes = self.view.shapes(match.shard) or {}
        if set(snap.tensors) != set(shapes) or any(t.shape[:1] != shapes[k] for k, t in snap.tensors.items()):
            raise WireError(f"snapshot of shard {match.shard} does not hold its rows of the model", "shape")
        self.view.views[match.shard].load(snap)
        self._moved.set()

    async def _on_delta(self, delta: ModelDelta, match: TopicMatch) -> None:
        await self.view.views[match.shard].receive(delta)
        self._moved.set()

    async def whole_model(self, version: int, own: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The whole model at ``version``: shard 0's rows ``own`` and every other shard's broadcast once it
        reached ``version``; None if one has not within ``WAIT_S``."""
        views = self.view.views[1:]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WAIT_S):
                while not all(v.ready and v.version >= version for v in views):
                    self._moved.clear()
                    await self._moved.wait()
                return self.view.assemble([own, *(v.params or {} for v in views)])
        logger.info("evaluation of version %d skipped: not every shard's model reached it", version)
        return None
