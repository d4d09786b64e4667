"""The model broadcast (``edgemesh/common/broadcast.py``): the worker's ``ModelView`` and the parameter
server's ``Broadcaster`` (pure), then workers following the model from a snapshot plus encoded deltas,
exactly as the PS sees them, on a real broker, and a worker asking for the model when a version it waits
for does not come."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    SPLIT,
    UNEVEN,
    Inbox,
    devices,
    gradient,
    inbox,
    make_config,
    member_update,
    mesh_plan,
    plan_for,
    running,
)

from edgemesh.common import costs, models, wire
from edgemesh.common.broadcast import Broadcaster, ModelView, delta_codec, delta_cuts, member_rows
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import get_codec
from edgemesh.common.config import Config, ParameterServerConfig
from edgemesh.common.errors import WireError
from edgemesh.common.messages import (
    ControlCommand,
    GradientUpdate,
    ModelDelta,
    ModelSnapshot,
    ShardUpdate,
    SnapshotRequest,
    UpdateAck,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.shards import Division
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.common.wire.tensors import Tensor
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.worker.mesh.member import MeshMember
from edgemesh.services.worker.service import Worker

JOB = "pstest"
RUN_S = 30.0
"""How long a whole service test below may take."""


def snapshot(version: int, value: float = 1.0) -> ModelSnapshot:
    """A snapshot of model ``m``: one parameter ``w`` of 4 x 2, ``value`` everywhere."""
    return ModelSnapshot(version=version, model_spec="m",
                         tensors={"w": Tensor.from_numpy(np.full((4, 2), value, np.float32))})


def delta(version: int, base: int, change: float) -> ModelDelta:
    """A delta of model ``m`` from ``base`` to ``version``: ``change`` added everywhere."""
    data = get_codec("none").encode(np.full(8, change, np.float32), None)
    return ModelDelta(version=version, base_version=base, model_spec="m",
                      shards=(ShardUpdate(param="w", start=0, stop=4, codec="none", data=data),))


def digits_snapshot(params: dict[str, np.ndarray], version: int) -> ModelSnapshot:
    return ModelSnapshot(version=version, model_spec="digits-cnn",
                         tensors={k: Tensor.from_numpy(v) for k, v in params.items()})


# --------------------------------------------------------------------------- the worker's view (pure)


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


def test_a_view_with_a_gap_still_refuses_a_snapshot_older_than_itself() -> None:
    """Issue 14 (fuzz): one junk delta from a future version marked a gap, and the view then loaded a replayed
    old snapshot: the worker's model rolled back. The snapshot that heals a gap is never older than the view."""
    view = ModelView()
    assert view.load(snapshot(4, 1.0))
    assert not view.apply(delta(10**6, 10**6 - 1, 0.5)) and view.gap
    assert not view.load(snapshot(0, 9.0)) and view.version == 4 and view.params is not None
    assert np.all(view.params["w"] == 1.0)
    assert view.load(snapshot(4, 2.0)) and not view.gap  # the one the worker asked for heals it


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


async def test_a_delta_is_decoded_off_the_loop_without_changing_the_view() -> None:
    view = ModelView()
    view.load(snapshot(3))
    held = view.params
    assert held is not None
    step = delta(4, 3, 0.5)
    decoded = await asyncio.to_thread(view.decode, step)
    assert decoded is not None and (decoded.version, decoded.base_version) == (4, 3)
    assert np.all(decoded.params["w"] == 1.5)
    assert view.version == 3 and view.params is held and np.all(held["w"] == 1.0)  # read, not changed
    assert view.commit(decoded, step) and view.version == 4 and view.params is decoded.params and not view.gap
    # what does not apply decodes to nothing: a repeat, or a delta for a view that holds no model
    assert view.decode(step) is None
    assert ModelView().decode(delta(1, 0, 0.5)) is None


def test_a_decoded_delta_is_committed_only_if_the_view_did_not_change_meanwhile() -> None:
    step = delta(4, 3, 0.5)
    # the same delta came again and was applied meanwhile: the view already is where it leads
    view = ModelView()
    view.load(snapshot(3))
    decoded = view.decode(step)
    assert view.apply(step)
    current = view.params
    assert not view.commit(decoded, step) and view.params is current and view.version == 4 and not view.gap
    # a newer snapshot meanwhile: the delta is older than the view, not a gap
    view = ModelView()
    view.load(snapshot(3))
    decoded = view.decode(step)
    view.load(snapshot(6, 2.0))
    assert not view.commit(decoded, step) and view.version == 6 and not view.gap
    assert view.params is not None and np.all(view.params["w"] == 2.0)
    # other rows kept meanwhile (a new division): decoded for rows it no longer holds, a gap
    view = ModelView()
    view.load(snapshot(3))
    decoded = view.decode(step)
    assert view.restrict({"w": (1, 3)}) and view.version == 3
    assert not view.commit(decoded, step) and view.version == 3 and view.gap
    assert view.params is not None and view.params["w"].shape == (2, 2) and np.all(view.params["w"] == 1.0)
    # emptied meanwhile (it lacks rows it now needs): it waits for a snapshot, not a gap
    view = ModelView()
    view.restrict({"w": (0, 2)})
    view.load(snapshot(3))
    decoded = view.decode(step)
    assert not view.restrict(None) and not view.ready
    assert not view.commit(decoded, step) and not view.gap
    # a delta that does not start where the view is decodes to nothing; committing it marks the gap
    view = ModelView()
    view.load(snapshot(3))
    late = delta(6, 5, 0.5)
    assert view.decode(late) is None
    assert not view.commit(None, late) and view.gap and view.version == 3


def test_a_members_view_keeps_only_its_rows_and_follows_deltas_on_them() -> None:
    params = models.get_params(models.build_model("digits-cnn"))
    member = MeshMember("digits-cnn", SPLIT, 1)
    rows = member.rows()
    view = ModelView()
    assert view.restrict(rows)  # nothing held yet: the next snapshot comes in sliced
    view.load(digits_snapshot(params, 3))
    assert view.params is not None
    for name, (a, b) in rows.items():
        np.testing.assert_array_equal(view.params[name], params[name][a:b])
    held = sum(v.nbytes for v in view.params.values())
    assert held == member.param_count * 4 < sum(v.nbytes for v in params.values()) / 2
    member.load(view.params, 3)  # a member loads from its rows as from the whole model
    # a delta of whole parameters (the broadcast) moves only this member's rows of them
    change = np.arange(16, dtype=np.float32)
    none = get_codec("none")
    whole = tuple(ShardUpdate(param=k, start=0, stop=v.shape[0], codec="none",
                              data=none.encode(change if k == "conv1.bias" else np.zeros(v.size, np.float32), None))
                  for k, v in params.items())
    assert not view.apply(ModelDelta(version=4, base_version=3, model_spec="digits-cnn", shards=whole[:1]))
    assert view.gap and view.version == 3  # a delta without some of its rows: a gap, nothing half-applied
    view.gap = False
    step = ModelDelta(version=4, base_version=3, model_spec="digits-cnn", shards=whole)
    assert view.apply(step) and view.version == 4
    a, b = rows["conv1.bias"]
    np.testing.assert_allclose(view.params["conv1.bias"], params["conv1.bias"][a:b] + change[a:b])
    bad = ModelDelta(version=5, base_version=4, model_spec="digits-cnn", shards=(
        ShardUpdate(param="conv1.bias", start=0, stop=17, codec="none",
                    data=get_codec("none").encode(np.zeros(17, np.float32), None)),))
    with pytest.raises(WireError, match="does not fit"):
        view.apply(bad)
    # fewer rows: sliced in place; other rows: emptied until the next snapshot
    assert view.restrict({k: (a, a + min(1, b - a)) for k, (a, b) in rows.items()})
    assert view.ready
    assert not view.restrict(None)
    assert not view.ready


def test_a_whole_view_takes_no_members_part_nor_loses_sight_of_a_delta_it_missed_while_empty() -> None:
    """Leaving a model-parallel cluster: a member's part of a delta (its route not yet let go) changes some
    rows only, and a delta that comes while the emptied view waits for its snapshot must not go unnoticed: the
    retained snapshot the view gets may be older, and a synchronous server waits for this device's update."""
    none = get_codec("none")
    part = ModelDelta(version=4, base_version=3, model_spec="m", shards=(ShardUpdate(
        param="w", start=0, stop=2, codec="none", data=none.encode(np.full(4, 0.5, np.float32), None)),))
    view = ModelView()
    view.load(snapshot(3))
    assert not view.apply(part) and view.gap and view.version == 3
    assert view.params is not None and np.all(view.params["w"] == 1.0)  # nothing half-applied

    def emptied(version: int) -> ModelView:
        """A member's view at ``version``, emptied by a plan that gives it the whole model."""
        view = ModelView()
        view.restrict({"w": (0, 2)})
        view.load(snapshot(version))
        assert not view.restrict(None) and not view.ready
        return view

    view = emptied(5)
    assert not view.apply(delta(6, 5, 0.5)) and not view.gap  # nothing to apply it to: noted
    assert view.load(snapshot(5)) and view.gap  # older than what it missed: the worker asks for another
    assert view.load(snapshot(6)) and not view.gap
    view = emptied(5)
    assert view.load(snapshot(4)) and view.gap  # older than what it held
    view = emptied(5)
    assert view.load(snapshot(5)) and not view.gap


# --------------------------------------------------------------------------- the parameter server's half (pure)


def test_a_snapshot_resets_the_view_and_a_delta_follows_every_version() -> None:
    broadcaster = Broadcaster(ParameterServerConfig(broadcast="delta", delta_codec="none", snapshot_every=3), "m")
    assert broadcaster.view is None
    params = {"w": np.ones((4, 2), np.float32)}
    first = broadcaster.after_step(params, 0, "async", None)  # nothing sent yet: a snapshot
    assert first.snapshot and not first.parts and broadcaster.last_full == 0
    snap = wire.decode(first.payload, ModelSnapshot)
    assert snap.version == 0 and snap.tensors["w"].dtype == "float32"  # exact: it resets every view
    view = broadcaster.view
    assert view is not None and np.array_equal(view["w"], params["w"]) and view["w"] is not params["w"]
    follower = ModelView()
    follower.load(snap)
    for version in (1, 2):
        params = {"w": params["w"] + 0.25 * version}
        message = broadcaster.after_step(params, version, "async", None)
        assert not message.snapshot and not message.parts  # no model-parallel member: the broadcast alone
        step = wire.decode(message.payload, ModelDelta)
        assert (step.version, step.base_version, step.model_spec) == (version, version - 1, "m")
        assert follower.apply(step) and follower.params is not None
        np.testing.assert_array_equal(follower.params["w"], params["w"])
    # every snapshot_every versions, a snapshot again
    again = broadcaster.after_step(params, 3, "async", None)
    assert again.snapshot and broadcaster.last_full == 3
    # one on request resets the view too, and the deltas go on from it
    params = {"w": params["w"] * 2}
    assert wire.decode(broadcaster.snapshot(params, 3, "async"), ModelSnapshot).version == 3
    view = broadcaster.view
    assert view is not None and np.array_equal(view["w"], params["w"])
    assert not broadcaster.after_step(params, 4, "async", None).snapshot


def test_what_a_lossy_delta_leaves_out_goes_with_the_next_one() -> None:
    broadcaster = Broadcaster(ParameterServerConfig(broadcast="delta", delta_codec="topk", delta_density=0.25), "m")
    follower = ModelView()
    follower.load(wire.decode(broadcaster.after_step({"w": np.zeros((64, 32), np.float32)}, 0, "async",
                                                     None).payload, ModelSnapshot))
    params = {"w": np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)}
    left = []
    for version in range(1, 5):  # the model moved once; a quarter of the change goes with each delta
        step = wire.decode(broadcaster.after_step(params, version, "async", None).payload, ModelDelta)
        assert [s.codec for s in step.shards] == ["topk"]
        assert follower.apply(step) and follower.params is not None and broadcaster.view is not None
        assert np.array_equal(follower.params["w"], broadcaster.view["w"])  # the PS knows what workers hold
        left.append(float(np.abs(params["w"] - follower.params["w"]).max()))
    assert left[0] > left[1] > left[2] > left[3] == 0.0


def test_in_snapshot_mode_every_version_is_a_snapshot_of_the_configured_precision() -> None:
    broadcaster = Broadcaster(ParameterServerConfig(broadcast="snapshot"), "m")
    for version in range(3):
        message = broadcaster.after_step({"w": np.ones((4, 2), np.float32)}, version, "sync", None)
        assert message.snapshot and wire.decode(message.payload, ModelSnapshot).tensors["w"].dtype == "float16"
    assert broadcaster.view is None


def test_member_parts_carry_only_the_blocks_of_their_rows() -> None:
    counts = UNEVEN["digits-cnn"]
    plan = mesh_plan(["a", "b", "c"], counts)
    rows = member_rows(plan)
    assert set(rows) == {"a", "b", "c"}
    assert rows["a"]["conv1.weight"] == rows["a"]["conv1.bias"] == (0, 7) and rows["b"]["conv2.bias"] == (3, 23)
    assert "fc2.weight" not in rows["b"] and rows["c"]["fc2.bias"] == (5, 10)  # b has no unit of fc2
    assert member_rows(plan_for(["a", "b"])) == {} and member_rows(None) == {}  # no model-parallel cluster
    params = models.get_params(models.build_model("digits-cnn"))
    broadcaster = Broadcaster(ParameterServerConfig(broadcast="delta", delta_codec="none"), "digits-cnn")
    assert broadcaster.after_step(params, 0, "sync", plan).snapshot
    message = broadcaster.after_step({k: v + 0.01 for k, v in params.items()}, 1, "sync", plan)
    step = wire.decode(message.payload, ModelDelta)
    # every parameter cut at the members' boundaries
    for layer, c in counts.items():
        bounds = [(a, b) for a, b in costs.slices(c) if b > a]
        assert [(s.start, s.stop) for s in step.shards if s.param == f"{layer}.weight"] == bounds
    assert set(message.parts) == {"a", "b", "c"}
    for device, payload in message.parts.items():
        part = wire.decode(payload, ModelDelta)
        assert (part.version, part.base_version) == (1, 0)
        mine = rows[device]
        # the very blocks of the broadcast that hold its rows, the same bytes
        assert part.shards == tuple(s for s in step.shards if s.param in mine and (s.start, s.stop) == mine[s.param])
        assert {s.param for s in part.shards} == set(mine)
        assert len(payload) < 0.75 * len(message.payload)


def test_a_delta_is_cut_at_most_into_max_delta_blocks_and_members_get_little_beyond_their_rows() -> None:
    assert delta_cuts(10, [], 64) == [0, 10]
    assert delta_cuts(10, [0, 3, 3, 7, 10, 12], 64) == [0, 3, 7, 10]
    rng = np.random.default_rng(3)
    for rows, members, most in ((256, 300, 64), (32, 40, 8), (128, 129, 1), (10, 5, 2)):
        bounds = np.sort(rng.integers(0, rows + 1, members + 1))
        slices = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
        points = delta_cuts(rows, bounds.tolist(), most)
        assert points[0] == 0 and points[-1] == rows and points == sorted(set(points))
        assert len(points) - 1 <= most and set(points) <= {0, rows, *bounds.tolist()}
        blocks = list(zip(points[:-1], points[1:], strict=True))
        for start, stop in slices:  # the blocks a member's part holds: those overlapping its slice
            mine = [(a, b) for a, b in blocks if a < stop and start < b]
            extra = sum(b - a for a, b in mine) - (stop - start)
            ends = [b - a for a, b in blocks if a < start < b or a < stop < b]
            assert 0 <= extra <= sum(ends)  # only the (at most two) blocks its slice ends fall in
    assert delta_cuts(256, range(1, 256), 64) == [0, *range(4, 256, 4), 256]  # evenly spaced


def test_by_default_a_round_s_delta_goes_whole_in_half_precision_and_an_async_update_s_grid_coded() -> None:
    """``ps.delta_codec = "auto"``: a round moves the model by every device's batch at once, and a lossy delta would
    leave the devices computing on a model behind by much of that step; an async update is one batch's step."""
    config = ParameterServerConfig(broadcast="delta")
    assert config.delta_codec == "auto"
    assert [delta_codec(config, policy) for policy in ("sync", "adaptive", "async", "ssp")] == [
        "fp16", "fp16", "grid", "grid"]
    assert delta_codec(replace(config, delta_codec="topk"), "sync") == "topk"  # a codec set is a codec kept
    broadcaster = Broadcaster(config, "m")
    change = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    broadcaster.after_step({"w": np.zeros((64, 32), np.float32)}, 0, "sync", None)
    step = wire.decode(broadcaster.after_step({"w": change}, 1, "sync", None).payload, ModelDelta)
    assert [s.codec for s in step.shards] == ["fp16"]
    assert broadcaster.view is not None and np.abs(broadcaster.view["w"] - change).max() < 2e-3  # all of it


def test_under_async_a_delta_carries_the_largest_share_of_the_change_grid_coded() -> None:
    config = ParameterServerConfig(broadcast="delta")
    assert config.delta_density == 0.3  # the defaults a fleet runs with
    broadcaster = Broadcaster(config, "m")
    follower = ModelView()
    follower.load(wire.decode(broadcaster.after_step({"w": np.zeros((64, 32), np.float32)}, 0, "async",
                                                     None).payload, ModelSnapshot))
    change = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    step = wire.decode(broadcaster.after_step({"w": change}, 1, "async", None).payload, ModelDelta)
    assert [s.codec for s in step.shards] == ["grid"]
    assert follower.apply(step) and follower.params is not None and broadcaster.view is not None
    assert np.array_equal(follower.params["w"], broadcaster.view["w"])  # the PS knows what the workers hold
    moved = follower.params["w"] != 0
    assert moved.sum() == pytest.approx(0.3 * change.size, rel=0.02)  # ps.delta_density of the entries
    assert np.abs(change[moved]).min() >= np.abs(change[~moved]).max()  # the largest ones
    assert np.abs(follower.params["w"][moved] - change[moved]).max() < 0.5 * np.abs(change[moved]).min()


# --------------------------------------------------------------------------- the parameter server and its followers


def ps_config(broker: BrokerProcess, state_dir: Path, **settings: object) -> Config:
    return make_config(broker, job=JOB, **{"ps.state_dir": state_dir, "ps.eval_every": 0, "ps.broadcast": "delta",
                                           **settings})


@contextlib.asynccontextmanager
async def follower(config: Config) -> AsyncIterator[tuple[ModelView, Inbox]]:
    """A worker's view of the model, following the PS's snapshots and broadcast deltas as they come;
    the :class:`Inbox` keeps them and wakes its waiters."""
    topics = Topics(config.job)
    bus = Bus(config.broker, client_id=f"follower-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("follower"))
    box, view = Inbox(bus, topics), ModelView()

    async def follow(msg: ModelSnapshot | ModelDelta, match: TopicMatch) -> None:
        with contextlib.suppress(WireError):
            if isinstance(msg, ModelSnapshot):
                view.load(msg)
            else:
                view.apply(msg)
        await box.keep(msg, match)

    bus.route(topics.model_filter(), ModelSnapshot, follow)
    bus.route(topics.delta_filter(), ModelDelta, follow)
    async with bus:
        yield view, box


async def test_a_follower_holds_exactly_the_psview_and_gets_a_snapshot_on_request(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(mosquitto_broker, tmp_path, **{"training.sync_policy": "async", "ps.delta_codec": "grid",
                                                   "ps.delta_density": "0.2"})
    ps = ParameterServer(cfg)
    async with devices(cfg, ["a"]) as c, running(ps), follower(cfg) as (view, f):
        await c.publish_plan(["a"])
        await f.until("the first snapshot", lambda: view.ready)
        for seq in range(1, 8):
            assert (await c.push(gradient("a", seq, view.version, scale=0.01 * seq))).status == "accepted"
        await f.until("version 7", lambda: view.version == ps.version == 7)
        assert not view.gap and view.params is not None
        # the follower holds bit for bit what the PS believes the workers hold...
        held_by_workers = ps.broadcast.view
        assert held_by_workers is not None
        for name, held in held_by_workers.items():
            assert np.array_equal(view.params[name], held), name
        # ...which trails the PS's weights only by what the deltas have not carried yet
        assert ps.state is not None
        drift = max(float(np.abs(ps.state.params[k] - view.params[k]).max()) for k in view.params)
        moved = max(float(np.abs(ps.state.params[k] - c.snapshots[0].tensors[k].to_numpy()).max())
                    for k in view.params)
        assert drift < moved
        # a worker that missed a delta asks; a full snapshot follows, then deltas from it
        view.gap = True
        snapshots = len(c.snapshots)
        await c.push(replace(gradient("a", 8, 7), need_snapshot=True))
        await f.until("the snapshot and version 8", lambda: not view.gap and view.version == ps.version == 8)
        assert len(c.snapshots) == snapshots + 1 and c.snapshots[-1].version == 7
        assert c.snapshots[-1].tensors["fc2.bias"].dtype == "float32"  # exact: it resets every view
        held_by_workers = ps.broadcast.view
        assert held_by_workers is not None and view.params is not None
        for name, held in held_by_workers.items():
            assert np.array_equal(view.params[name], held), name


async def test_members_receive_their_rows_of_every_delta_cut_from_the_broadcast(mosquitto_broker: BrokerProcess,
                                                                                tmp_path: Path) -> None:
    # Mosquitto: on the embedded broker the PS's first connect may come late enough to turn version 1
    # into a requested snapshot (as in the test below)
    cfg = ps_config(mosquitto_broker, tmp_path / "ps", **{"training.sync_policy": "sync"})
    topics = Topics(cfg.job)
    ps = ParameterServer(cfg)
    async with running(ps), devices(cfg, ["a", "b"]) as c, inbox(
            cfg, *((topics.delta_filter(d), ModelDelta) for d in ("", "a", "b")), name="deltas") as deltas:
        await c.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
        snap = await c.version_at_least(0)
        await c.until("the PS has the plan", lambda: ps.plan is not None)
        await c.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0))
        await c.push(member_update("b", 1, 1, 0))

        def got() -> dict[str, list[ModelDelta]]:
            return {key: deltas.of(ModelDelta, lambda t, key=key: t.device == key) for key in ("", "a", "b")}

        await deltas.until("the delta and both members' parts", lambda: all(got().values()))
    received = got()
    sizes = {key: len(wire.encode(messages[0])) for key, messages in received.items()}
    broadcast = received[""][0]
    assert broadcast.version == 1 and all(d[0].version == 1 for d in received.values())
    whole = ModelView()
    whole.load(snap)
    assert whole.apply(broadcast)
    for index, device in enumerate(("a", "b")):
        rows = MeshMember("digits-cnn", SPLIT, index).rows()
        part = received[device][0]
        blocks = {(s.param, s.start, s.stop) for s in broadcast.shards}
        assert {(s.param, s.start, s.stop) for s in part.shards} <= blocks
        assert all(rows[s.param][0] <= s.start and s.stop <= rows[s.param][1] for s in part.shards)  # its rows only
        assert sizes[device] < 0.75 * sizes[""]
        view = ModelView()
        view.restrict(rows)
        view.load(snap)
        assert view.apply(part)  # the same bytes as the broadcast's blocks: the same model
        assert view.params is not None and whole.params is not None
        for name, (a, b) in rows.items():
            np.testing.assert_array_equal(view.params[name], whole.params[name][a:b])
    other = ModelView()  # member b's rows are not in a's part: a gap, not a silent partial update
    other.restrict(MeshMember("digits-cnn", SPLIT, 1).rows())
    other.load(snap)
    assert not other.apply(received["a"][0]) and other.gap


async def test_a_parameter_server_publishes_a_snapshot_on_request(mosquitto_broker: BrokerProcess,
                                                                   tmp_path: Path) -> None:
    async def run() -> None:
        cfg = ps_config(mosquitto_broker, tmp_path / "ps", **{"training.sync_policy": "async"})
        ps = ParameterServer(cfg)
        async with running(ps), devices(cfg, ["a", "b"]) as c:
            await c.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
            await c.version_at_least(0)
            await c.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0))
            await c.push(member_update("b", 1, 1, 0))
            assert ps.version == 1 and c.snapshots[-1].version == 0  # version 1 went out as a delta
            await c.publish(c.topics.control("ps"), ControlCommand(command="snapshot", requester="a"))
            assert (await c.version_at_least(1)).version == 1

    await asyncio.wait_for(run(), RUN_S)


@pytest.mark.parametrize("shards", [1, 2])
async def test_a_worker_asks_for_the_model_when_the_version_its_ack_named_does_not_come(
        mosquitto_broker: BrokerProcess, shards: int) -> None:
    """The version an ack names may never reach a worker (a delta sent only to the members of a cluster it was
    leaving, or lost in a reconnect): every ``worker.ack_timeout_s`` it asks for a snapshot, and trains on from the
    one that comes. The test plays the parameter server (each of its shards: the last asks for version 4)."""
    cfg = make_config(mosquitto_broker, job=JOB, **{"worker.device": "a", "worker.ack_timeout_s": "0.5",
                                                    "worker.codec_wait_s": "0.1", "ps.shards": shards})
    topics = Topics(cfg.job)
    params = models.get_params(models.build_model("digits-cnn"))
    shapes = {name: p.shape for name, p in params.items()}
    parts = [Division.of(shapes, i, shards).take(params) if shards > 1 else params for i in range(shards)]
    worker = Worker(cfg)
    grads = [(topics.for_shard(i if shards > 1 else None).grad_filter(), GradientUpdate) for i in range(shards)]
    async with inbox(cfg, *grads, (topics.snapshot_request_filter(), SnapshotRequest), name="ps") as ps, \
            running(worker):
        await ps.publish(topics.plan(), plan_for(["a"]), retain=True)
        for i, part in enumerate(parts):
            await ps.publish(topics.for_shard(i if shards > 1 else None).model(), digits_snapshot(part, 3), retain=True)
        first = [await ps.next(GradientUpdate) for _ in range(shards)]
        assert all(u.base_version == 3 for u in first) and not ps.of(SnapshotRequest)
        for i, u in enumerate(first):
            await ps.publish(topics.for_shard(i if shards > 1 else None).ack("a"), UpdateAck(
                device="a", incarnation=u.incarnation, seq=u.seq, status="accepted", version=4 if i == shards - 1
                else 3, delay=0, resync=True))
        request = await ps.next(SnapshotRequest)
        assert (request.device, request.version) == ("a", 3)
        last = topics.for_shard(shards - 1 if shards > 1 else None)
        await ps.publish(last.model(), digits_snapshot(parts[-1], 4), retain=True)
        second = await ps.next(GradientUpdate, lambda u: u.seq > first[0].seq and u.base_version == 4)
        assert second.seq == first[0].seq + 1 and worker.accepted == 1


def test_a_version_no_one_listens_to_is_skipped_and_the_next_message_is_a_snapshot() -> None:
    broadcaster = Broadcaster(ParameterServerConfig(broadcast="delta", delta_codec="none"), "m")
    params = {"w": np.ones((4, 2), np.float32)}
    assert broadcaster.after_step(params, 0, "async", None).snapshot
    assert not broadcaster.after_step(params, 1, "async", None).snapshot
    broadcaster.skip()
    assert broadcaster.skipped and broadcaster.view is None
    again = broadcaster.after_step(params, 2, "async", None)  # the workers' view is unknown: a snapshot
    assert again.snapshot and not broadcaster.skipped
