"""Delta broadcast: workers follow the model from a snapshot plus encoded deltas, exactly as the PS sees them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import numpy as np
import pytest
from test_parameter_server import client, gradient, make_config, publish_plan, running_ps

from edgemesh.common import wire
from edgemesh.common.broker import BrokerProcess
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import get_codec
from edgemesh.common.errors import WireError
from edgemesh.common.messages import CodecPolicy, ModelDelta, ModelSnapshot, ShardUpdate
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.services.worker.view import ModelView

WAIT_S = 20.0


def snapshot(version: int, value: float = 1.0) -> ModelSnapshot:
    return ModelSnapshot(version=version, model_spec="m",
                         tensors={"w": wire.Tensor.from_numpy(np.full((4, 2), value, np.float32))})


def delta(version: int, base: int, change: float) -> ModelDelta:
    data = get_codec("none").encode(np.full(8, change, np.float32), None)
    return ModelDelta(version=version, base_version=base, model_spec="m",
                      shards=(ShardUpdate(param="w", start=0, stop=4, codec="none", data=data),))


def test_view_applies_deltas_in_order_and_marks_gaps() -> None:
    view = ModelView()
    assert not view.apply(delta(1, 0, 0.5))  # nothing to apply it to yet
    assert view.load(snapshot(3))
    held = view.params
    assert view.apply(delta(4, 3, 0.5)) and view.version == 4
    assert np.all(view.params["w"] == 1.5) and np.all(held["w"] == 1.0)  # replaced, not changed in place
    assert not view.apply(delta(4, 3, 0.5))  # a repeat
    assert not view.apply(delta(6, 5, 0.5)) and view.gap and view.version == 4
    assert view.load(snapshot(6, 2.0)) and not view.gap and view.version == 6
    assert not view.load(snapshot(5))  # older than the view


def test_view_rejects_a_delta_that_does_not_fit() -> None:
    view = ModelView()
    view.load(snapshot(0))
    bad = ModelDelta(version=1, base_version=0, model_spec="m",
                     shards=(ShardUpdate(param="w", start=0, stop=9, codec="none", data=b"\0" * 72),))
    with pytest.raises(WireError):
        view.apply(bad)
    truncated = ModelDelta(version=1, base_version=0, model_spec="m",
                           shards=(ShardUpdate(param="w", start=0, stop=4, codec="none", data=b"\0" * 7),))
    with pytest.raises(WireError):
        view.apply(truncated)
    assert view.version == 0


async def test_a_follower_holds_exactly_the_psview_and_gets_a_snapshot_on_request(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = make_config(mosquitto_broker, tmp_path, **{"training.sync_policy": "async", "ps.broadcast": "delta",
                                                     "ps.delta_codec": "grid", "ps.delta_density": "0.2"})
    view = ModelView()
    changed = asyncio.Event()

    async def follow(bus: Bus) -> None:
        async for msg in bus.messages():
            with contextlib.suppress(WireError):
                if msg.topic.endswith("/model"):
                    view.load(msg.decode(ModelSnapshot))
                elif msg.topic.endswith("/model/delta"):
                    view.apply(msg.decode(ModelDelta))
                changed.set()

    async def until(predicate) -> None:  # noqa: ANN001
        async with asyncio.timeout(WAIT_S):
            while not predicate():
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await changed.wait()

    async with client(cfg, ["a"]) as c, running_ps(cfg) as ps, \
            Bus(cfg.broker, client_id=f"follower-{time.monotonic_ns()}", metrics=ServiceMetrics("f"),
                subscriptions=[c.topics.model(), c.topics.model_delta()]) as bus:
        task = asyncio.create_task(follow(bus))
        try:
            await publish_plan(c, ["a"])
            await until(lambda: view.ready)
            for seq in range(1, 8):
                assert (await c.push(gradient("a", seq, view.version, scale=0.01 * seq))).status == "accepted"
            await until(lambda: view.version == ps.version == 7)
            assert not view.gap
            # the follower holds bit for bit what the PS believes the workers hold...
            for name, held in ps._view.items():
                assert np.array_equal(view.params[name], held), name
            # ...which trails the PS's weights only by what the deltas have not carried yet
            drift = max(float(np.abs(ps.state.params[k] - view.params[k]).max()) for k in view.params)
            moved = max(float(np.abs(ps.state.params[k] - c.snapshots[0].tensors[k].to_numpy()).max())
                        for k in view.params)
            assert drift < moved
            # a worker that missed a delta asks; a full snapshot follows, then deltas from it
            view.gap = True
            snapshots = len(c.snapshots)
            update = gradient("a", 8, 7)
            await c.push(type(update)(**{**{f: getattr(update, f) for f in update.__dataclass_fields__},
                                         "need_snapshot": True}))
            await until(lambda: not view.gap and view.version == ps.version == 8)
            assert len(c.snapshots) == snapshots + 1 and c.snapshots[-1].version == 7
            assert c.snapshots[-1].tensors["fc2.bias"].dtype == "float32"  # exact: it resets every view
            for name, held in ps._view.items():
                assert np.array_equal(view.params[name], held), name
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def test_grid_delta_policy_is_valid() -> None:
    CodecPolicy(device="ps", codec="grid", density=0.3).validate()
