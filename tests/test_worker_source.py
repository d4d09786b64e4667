"""A worker's model source, without a broker: the whole model of a parameter server of one process and the
model put together from every shard of a sharded one. Each takes only snapshots of the plan's model holding
what they must, follows deltas, holds the model only at the versions the acks asked for, and asks for a
snapshot with the version it holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from edgemesh.common.broadcast import ModelView
from edgemesh.common.bus import Route
from edgemesh.common.errors import WireError
from edgemesh.common.messages import ModelDelta, ModelSnapshot, ShardUpdate, SnapshotRequest, UpdateAck
from edgemesh.common.shards import ShardedView, divide
from edgemesh.common.topics import Filter, TopicMatch, Topics
from edgemesh.common.wire.tensors import Tensor
from edgemesh.services.worker.source import ShardedModel, WholeModel

SPEC = "tiny"
LAYOUT = {"w": ((4, 3), "float32"), "b": ((4,), "float32")}
SHAPES = {name: shape for name, (shape, _) in LAYOUT.items()}
TOPICS = Topics("src")
WHOLE = TopicMatch(job="src", kind="model")


@dataclass
class Layouts:
    """The trainer's part a source uses: the layout, learned from the first snapshot."""

    layout: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    learned: list[str] = field(default_factory=list)

    def know_model(self, model_spec: str, seed: int) -> None:
        self.learned.append(model_spec)
        self.layout = dict(LAYOUT)


@dataclass
class Bus:
    """Routes and publishes, recorded."""

    routes: list[Route[Any]] = field(default_factory=list)
    published: list[tuple[str, Any]] = field(default_factory=list)

    def route(self, filter_: Filter, message: type, handler: Any) -> Route[Any]:
        self.routes.append(Route(filter_, message, handler))
        return self.routes[-1]

    async def publish(self, topic: str, msg: Any, **_: Any) -> int:
        self.published.append((topic, msg))
        return 0


class Changes:
    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> None:
        self.count += 1


def model(value: float) -> dict[str, np.ndarray]:
    return {name: np.full(shape, value, np.float32) for name, shape in SHAPES.items()}


def snapshot(params: dict[str, np.ndarray], version: int, spec: str = SPEC) -> ModelSnapshot:
    return ModelSnapshot(version=version, model_spec=spec, tensors={k: Tensor.from_numpy(v) for k, v in params.items()})


def delta(params: dict[str, np.ndarray], change: float, version: int) -> ModelDelta:
    """``change`` added to every value of ``params`` (whole tensors, float32)."""
    shards = tuple(ShardUpdate(param=name, start=0, stop=v.shape[0], codec="none",
                               data=np.full(v.shape, change, np.float32).tobytes()) for name, v in params.items())
    return ModelDelta(version=version, base_version=version - 1, model_spec=SPEC, shards=shards)


def whole(layouts: Layouts | None = None, changes: Changes | None = None) -> WholeModel:
    return WholeModel(ModelView(), topics=TOPICS, device="d0", trainer=layouts or Layouts(), seed=0,
                      spec=lambda: SPEC, changed=changes or Changes())


def sharded(shards: int = 2) -> ShardedModel:
    return ShardedModel(ShardedView(shards), topics=TOPICS, device="d0", trainer=Layouts(), seed=0,
                        spec=lambda: SPEC, changed=Changes())


def shard_match(shard: int) -> TopicMatch:
    return TopicMatch(job="src", kind="model", shard=shard)


def shard_params(params: dict[str, np.ndarray], shard: int, shards: int = 2) -> dict[str, np.ndarray]:
    """Shard ``shard``'s rows of ``params``, as the shard keeps them (each parameter's rows under its name)."""
    return {s.param: params[s.param][s.start:s.stop] for s in divide(SHAPES, shards)[shard]}


def ack(*, resync: bool = False, version: int = 0) -> UpdateAck:
    return UpdateAck(device="d0", incarnation=1, seq=1, status="accepted", version=version, resync=resync)


# --------------------------------------------------------------------------- the whole model


async def test_the_first_snapshot_teaches_the_trainer_the_layout_and_a_step_trains_on_it() -> None:
    layouts, changes = Layouts(), Changes()
    source = whole(layouts, changes)
    await source.on_snapshot(snapshot(model(1.0), 3), WHOLE)
    assert layouts.learned == [SPEC] and changes.count == 1
    held = source.held()
    assert (held.version, held.stamp, held.gap, held.spans) == (3, 3, False, None)
    assert np.array_equal(held.params["w"], model(1.0)["w"])
    assert source.holds() and not source.behind
    evaluated = source.for_evaluation()
    assert evaluated is not None and evaluated.version == 3


@pytest.mark.parametrize("tensors", [
    {"w": np.zeros((4, 2), np.float32), "b": np.zeros(4, np.float32)},  # misshapen
    {"w": np.zeros((4, 3), np.float32)},  # missing
    {**model(0.0), "extra": np.zeros(2, np.float32)},  # more than the model
])
async def test_a_snapshot_that_does_not_hold_the_model_is_refused(tensors: dict[str, np.ndarray]) -> None:
    source = whole(Layouts(layout=dict(LAYOUT)))
    with pytest.raises(WireError) as refused:
        await source.on_snapshot(snapshot(tensors, 1), WHOLE)
    assert refused.value.reason == "shape" and not source.view.ready


async def test_a_snapshot_or_delta_of_another_model_is_refused() -> None:
    source = whole()
    with pytest.raises(WireError):
        await source.on_snapshot(snapshot(model(0.0), 1, spec="other"), WHOLE)
    await source.on_snapshot(snapshot(model(0.0), 1), WHOLE)
    with pytest.raises(WireError):
        await source.on_delta(ModelDelta(version=2, base_version=1, model_spec="other", shards=()), WHOLE)
    assert source.view.version == 1


async def test_after_an_ack_asks_for_a_resync_the_source_holds_the_model_only_at_that_version() -> None:
    source = whole()
    await source.on_snapshot(snapshot(model(1.0), 1), WHOLE)
    source.resync([ack(resync=True, version=3)])
    assert source.behind and not source.holds()
    await source.on_delta(delta(model(1.0), 0.5, 2), WHOLE)
    assert not source.holds()
    await source.on_delta(delta(model(1.5), 0.5, 3), WHOLE)
    assert source.holds() and np.allclose(source.held().params["b"], 2.0)
    source.resync([ack()])
    assert not source.behind and source.holds()


async def test_a_missed_delta_is_a_gap_the_source_holds_and_a_step_reports() -> None:
    source = whole()
    await source.on_snapshot(snapshot(model(1.0), 1), WHOLE)
    source.resync([ack(resync=True, version=5)])
    await source.on_delta(delta(model(1.0), 0.5, 5), WHOLE)  # from version 4, which it never had
    assert source.holds() and source.held().gap and source.held().version == 1


async def test_a_source_routes_the_model_and_asks_for_a_snapshot_with_the_version_it_holds() -> None:
    source, bus = whole(), Bus()
    models, deltas = source.route(bus)
    assert [r.filter for r in models] == [TOPICS.model_filter()]
    assert [r.filter for r in deltas] == [TOPICS.delta_filter()]
    await source.on_snapshot(snapshot(model(0.0), 7), WHOLE)
    await source.ask()
    assert bus.published == [(TOPICS.snapshot_request("d0"), SnapshotRequest(device="d0", version=7))]


# --------------------------------------------------------------------------- the sharded model


async def test_the_sharded_source_holds_the_model_once_every_shard_sent_its_rows() -> None:
    source, params = sharded(), model(0.0)
    params["w"][:] = np.arange(12, dtype=np.float32).reshape(4, 3)
    await source.on_snapshot(snapshot(shard_params(params, 0), 4), shard_match(0))
    assert not source.holds() and not source.view.ready
    await source.on_snapshot(snapshot(shard_params(params, 1), 6), shard_match(1))
    assert source.holds()
    held = source.held()
    assert (held.version, held.stamp) == (4, 10)  # the oldest shard's version; the sum tells models apart
    assert held.spans == source.view.spans and {(s.param, s.start, s.stop) for s in held.spans} == {
        (s.param, s.start, s.stop) for run in divide(SHAPES, 2) for s in run}
    assert all(np.array_equal(held.params[k], params[k]) for k in params)
    assert source.for_evaluation() is None


async def test_a_shard_snapshot_holding_other_rows_is_refused() -> None:
    source = sharded()
    with pytest.raises(WireError) as refused:
        await source.on_snapshot(snapshot(shard_params(model(0.0), 0), 1), shard_match(1))
    assert refused.value.reason == "shape" and not source.views[1].ready


async def test_the_sharded_source_waits_for_each_shard_at_the_version_its_ack_named() -> None:
    source, params = sharded(), model(1.0)
    for shard in (0, 1):
        await source.on_snapshot(snapshot(shard_params(params, shard), 1), shard_match(shard))
    source.resync([ack(), ack(resync=True, version=2)])  # shard 1 asks for its version 2
    assert source.behind and not source.holds()
    await source.on_delta(delta(shard_params(params, 0), 0.5, 2), shard_match(0))
    assert not source.holds()  # shard 0's new version is not what shard 1 asked for
    await source.on_delta(delta(shard_params(params, 1), 0.5, 2), shard_match(1))
    assert source.holds() and source.view.versions == (2, 2)
    assert all(np.allclose(v, 1.5) for v in source.held().params.values())


async def test_the_sharded_source_routes_every_shards_model() -> None:
    source, bus = sharded(3), Bus()
    models, deltas = source.route(bus)
    assert [r.filter for r in models] == [TOPICS.for_shard(i).model_filter() for i in range(3)]
    assert [r.filter for r in deltas] == [TOPICS.for_shard(i).delta_filter() for i in range(3)]
