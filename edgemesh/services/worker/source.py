"""What a worker holds of the model, and how it follows the parameter server: one source, whole or sharded.

A source takes the parameter server's snapshots and deltas into its view, each checked against the model the
plan names (the trainer learns the model's layout from the first snapshot), and says what a step trains on
(``held``: the parameters, their version, whether a delta was missed, and where a gradient is cut). The acks of
an update may ask for a newer model (``resync``): until the view holds it (``holds``) the worker waits, asking
for a snapshot every ack timeout (``ask``).

* :class:`WholeModel`: a parameter server of one process: ``model`` and ``model/delta`` into one ``ModelView``,
  a snapshot checked to hold every parameter at its shape.
* :class:`ShardedModel`: one split into ``ps.shards`` processes: every shard's snapshots and deltas, on the
  shard's topics, into that shard's view, each snapshot checked to hold exactly the shard's rows. The model is
  the shards' rows put together (``ShardedView``), its version the oldest shard's, and a gradient is cut at the
  shards' rows; an ack names the version to wait for in its own shard's view.

A model-parallel member keeps only its rows of either (``mesh.session`` restricts the view, and swaps the delta
routes for its own part of every delta, which it hands to ``on_delta``).
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from edgemesh.common.broadcast import ModelView
from edgemesh.common.bus import Bus, Route
from edgemesh.common.errors import BusError, WireError
from edgemesh.common.messages import ModelDelta, ModelSnapshot, SnapshotRequest, UpdateAck
from edgemesh.common.shards import ShardedView, Span
from edgemesh.common.topics import TopicMatch, Topics

V = TypeVar("V", ModelView, ShardedView)
"""The view a source keeps: one ``ModelView``, or a ``ShardedView`` of one per parameter server shard."""


class KnowsModel(Protocol):
    """What a source needs of the trainer: the model's parameters (name: shape, dtype), learned from its spec."""

    @property
    def layout(self) -> Mapping[str, tuple[tuple[int, ...], str]]: ...

    def know_model(self, model_spec: str, seed: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Held:
    """The model a step trains on."""

    params: Mapping[str, np.ndarray]
    version: int
    """Its version (a sharded model's: its oldest shard's): the update's base version."""
    gap: bool
    """A delta was missed: the update asks for a snapshot."""
    stamp: int
    """What tells this model from another where ``version`` does not (a sharded one moves shard by shard)."""
    spans: Sequence[Span] | None = None
    """Where a gradient is cut: at each parameter server shard's rows (None: whole tensors)."""


class ModelSource(ABC, Generic[V]):
    """The model as this worker holds it (``view``), and the versions the last acks asked it to wait for."""

    def __init__(self, view: V, *, topics: Topics, device: str, trainer: KnowsModel, seed: int,
                 spec: Callable[[], str], changed: Callable[[], Awaitable[None]]) -> None:
        self.view: V = view
        self.topics, self.device = topics, device
        self._trainer, self._seed = trainer, seed
        self._spec = spec
        """The model the current plan names (the configuration's before a plan)."""
        self._changed = changed
        """Wakes whoever waits for the model."""
        self._bus: Bus | None = None
        self._wanted: dict[int, int] = {}
        """Parameter server shard -> the version its last ack asked this worker to wait for."""

    @property
    @abstractmethod
    def views(self) -> Sequence[ModelView]:
        """One view per parameter server shard, in shard order."""

    @abstractmethod
    def route(self, bus: Bus) -> tuple[list[Route[Any]], list[Route[Any]]]:
        """Consume the parameter server's model: the routes of its snapshots and those of its deltas (a
        model-parallel member trades the deltas' for its own part of every delta)."""

    @abstractmethod
    def held(self) -> Held:
        """What a step trains on (the view must be ready)."""

    @abstractmethod
    def for_evaluation(self) -> Held | None:
        """The model to evaluate on this device's validation share, if there is one."""

    @abstractmethod
    def _load(self, snap: ModelSnapshot, shard: int) -> None:
        """Take a snapshot of parameter server shard ``shard`` (0 for a whole one), checked against the layout."""

    async def on_snapshot(self, snap: ModelSnapshot, match: TopicMatch) -> None:
        """A snapshot (a shard's rows of the model): the trainer learns the model's layout from the first."""
        if snap.model_spec != self._spec():
            raise WireError(f"snapshot is for model {snap.model_spec}", "shape")
        if not self._trainer.layout:
            await asyncio.to_thread(self._trainer.know_model, snap.model_spec, self._seed)
        self._load(snap, max(match.shard, 0))
        await self._changed()

    async def on_delta(self, delta: ModelDelta, match: TopicMatch) -> None:
        """A delta (a shard's), or a model-parallel member's part of one: decoded off the event loop."""
        if delta.model_spec != self._spec():
            raise WireError(f"delta is for model {delta.model_spec}", "shape")
        await self.views[max(match.shard, 0)].receive(delta)
        await self._changed()

    def resync(self, acks: Sequence[UpdateAck]) -> None:
        """The acks of the last update, one per parameter server shard in shard order: each that asks for a
        resync names the version to wait for in its shard's view."""
        self._wanted = {shard: ack.version for shard, ack in enumerate(acks) if ack.resync}

    @property
    def behind(self) -> bool:
        """An ack asked for a newer model: while waiting for it, ask for a snapshot."""
        return bool(self._wanted)

    def holds(self) -> bool:
        """The view holds the model, at the versions the last acks asked for or knowing it missed a delta."""
        views = self.views
        return self.view.ready and all(views[i].version >= v or views[i].gap for i, v in self._wanted.items())

    @property
    def waiting_for(self) -> str:
        """What ``holds`` waits for, in words."""
        if not self._wanted:
            return "the model"
        return "model version " + ", ".join(str(v) for v in self._wanted.values())

    async def ask(self) -> None:
        """Ask for the model (every parameter server shard hears it): a version an ack named has not come, or a
        new division needs rows the view lacks."""
        assert self._bus is not None, "route() first"
        with contextlib.suppress(BusError):
            await self._bus.publish(self.topics.snapshot_request(self.device),
                                    SnapshotRequest(device=self.device, version=self.view.version))


class WholeModel(ModelSource[ModelView]):
    """The model of a parameter server of one process."""

    @property
    def views(self) -> Sequence[ModelView]:
        return (self.view,)

    def route(self, bus: Bus) -> tuple[list[Route[Any]], list[Route[Any]]]:
        self._bus = bus
        return ([bus.route(self.topics.model_filter(), ModelSnapshot, self.on_snapshot)],
                [bus.route(self.topics.delta_filter(), ModelDelta, self.on_delta)])

    def held(self) -> Held:
        view = self.view
        assert view.params is not None
        return Held(view.params, view.version, view.gap, view.version)

    def for_evaluation(self) -> Held | None:
        return self.held() if self.view.ready else None

    def _load(self, snap: ModelSnapshot, shard: int) -> None:
        """The snapshot, if it holds every parameter of the layout at its shape and nothing else."""
        layout = self._trainer.layout
        for name, (shape, _) in layout.items():
            t = snap.tensors.get(name)
            if t is None or t.shape != shape:
                raise WireError(f"snapshot tensor {name} missing or misshapen", "shape")
        if layout and len(snap.tensors) != len(layout):
            raise WireError("snapshot has extra tensors", "shape")
        self.view.load(snap)


class ShardedModel(ModelSource[ShardedView]):
    """The model of a sharded parameter server: every shard's rows, put together."""

    @property
    def views(self) -> Sequence[ModelView]:
        return self.view.views

    def route(self, bus: Bus) -> tuple[list[Route[Any]], list[Route[Any]]]:
        self._bus = bus
        shards = [self.topics.for_shard(i) for i in range(len(self.views))]
        return ([bus.route(st.model_filter(), ModelSnapshot, self.on_snapshot) for st in shards],
                [bus.route(st.delta_filter(), ModelDelta, self.on_delta) for st in shards])

    def held(self) -> Held:
        view = self.view
        params, versions = view.params, view.versions
        assert params is not None
        return Held(params, min(versions), view.gap, sum(versions), view.spans)

    def for_evaluation(self) -> Held | None:
        """None: the devices do not evaluate a sharded parameter server's model on their validation shares (a
        known gap: every shard would hear their reports)."""
        return None

    def _load(self, snap: ModelSnapshot, shard: int) -> None:
        """Shard ``shard``'s snapshot, if it holds exactly the shard's rows of the model."""
        layout = self._trainer.layout
        self.view.know({name: shape for name, (shape, _) in layout.items()})
        rows = self.view.shapes(shard) or {}
        if set(snap.tensors) != set(rows) or any(
                t.shape != (rows[name][0], *layout[name][0][1:]) for name, t in snap.tensors.items()):
            raise WireError(f"snapshot of shard {shard} does not hold its rows of the model", "shape")
        self.view.views[shard].load(snap)
