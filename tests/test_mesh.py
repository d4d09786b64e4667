"""Model parallelism inside a cluster: exactness, the MQTT exchange, the PS joining members' shards,
and a cluster of three workers training together."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from edgemesh.common import costs, models
from edgemesh.common.broker import BrokerProcess
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import get_codec
from edgemesh.common.config import Config, load_config
from edgemesh.common.errors import ModelError, WireError
from edgemesh.common.messages import (
    ControlCommand,
    DeviceHello,
    DeviceStatus,
    GradientUpdate,
    LayerDivision,
    MeshSlice,
    ModelDelta,
    ModelSnapshot,
    Plan,
    PlanCluster,
    PlanDevice,
    ShardUpdate,
    SyncState,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.common.wire import Tensor
from edgemesh.common.wire import encode as wire_encode
from edgemesh.services.parameter_server.service import ParameterServer, delta_cuts
from edgemesh.services.planner import mesh
from edgemesh.services.planner.mesh import DeviceInfo
from edgemesh.services.planner.service import Planner, mesh_wire
from edgemesh.services.worker.mesh import BusExchange, LocalHub, MeshMember, MeshTimeout, slices
from edgemesh.services.worker.service import Worker
from edgemesh.services.worker.view import ModelView
from tests.test_parameter_server import Client, client, gradient, make_config, plan_for, running_ps

WAIT_S = 30.0
UNEVEN = {
    "digits-cnn": {"conv1": (7, 5, 4), "conv2": (3, 20, 9), "fc1": (30, 4, 30), "fc2": (5, 0, 5)},
    "cifar-cnn": {"conv1": (20, 8, 4), "conv2": (10, 30, 24), "conv3": (64, 1, 63), "fc1": (100, 100, 56),
                  "fc2": (3, 3, 4)},
}
"""Three uneven members; member 1 has no unit of digits' last layer."""


def reference(spec: str, seed: int, batch: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, float,
                                                           np.ndarray, dict[str, np.ndarray]]:
    """Parameters, a batch, and what one process computes on it: loss, logits, gradients."""
    model = models.build_model(spec, seed=seed)
    params = models.get_params(model)
    shape = models.get_spec(spec).input_shape
    rng = np.random.default_rng(seed)
    x = rng.random((batch, *shape), dtype=np.float32)
    y = rng.integers(0, 10, batch)
    loss, grads = models.compute_gradients(model, x, y)
    with torch.no_grad():
        logits = model(torch.tensor(x)).numpy()
    return params, x, y, loss, logits, grads


def assert_matches_one_process(results: list, loss: float, logits: np.ndarray, grads: dict[str, np.ndarray]) -> None:
    covered = {name: np.zeros(g.shape[0], bool) for name, g in grads.items()}
    for r in results:
        assert r.loss == pytest.approx(loss, abs=1e-5)
        np.testing.assert_allclose(r.logits, logits, rtol=1e-4, atol=1e-5)
        for name, (start, stop, g) in r.grads.items():
            assert not covered[name][start:stop].any(), f"{name}[{start}:{stop}] computed twice"
            covered[name][start:stop] = True
            np.testing.assert_allclose(g, grads[name][start:stop], rtol=1e-4, atol=1e-6)
    assert all(c.all() for c in covered.values()), "some gradient rows were computed by no member"


# --------------------------------------------------------------------------- pure


@pytest.mark.parametrize("spec", sorted(UNEVEN))
async def test_three_uneven_members_compute_what_one_process_does(spec: str) -> None:
    params, x, y, loss, logits, grads = reference(spec, seed=3, batch=16)
    hub = LocalHub(3)
    members = [MeshMember(spec, UNEVEN[spec], i, seed=3) for i in range(3)]
    for m in members:
        m.load(params, version=0)
    results = await asyncio.gather(*(m.step(1, x, y, hub.member(i)) for i, m in enumerate(members)))
    assert_matches_one_process(list(results), loss, logits, grads)
    # a member holds its slices only
    assert sum(m.param_count for m in members) == costs.cost(spec).params


def test_layer_figures_match_the_modules() -> None:
    for spec in models.MODEL_SPECS:
        assert models.measure_layers(spec) == costs.layers(spec)


def test_models_that_cannot_be_divided_are_refused() -> None:
    with pytest.raises(ModelError, match="BatchNorm2d"):
        models.mesh_stages(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    with pytest.raises(ModelError, match="Dropout"):
        models.mesh_stages(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)))
    with pytest.raises(ModelError, match="sequential"):
        models.mesh_stages(nn.Linear(4, 2))


@pytest.mark.parametrize("counts, match", [
    ({"conv1": (8, 8), "conv2": (16, 16), "fc1": (32, 32)}, "division names layers"),
    ({"conv1": (8, 7), "conv2": (16, 16), "fc1": (32, 32), "fc2": (5, 5)}, "add up to 16"),
    ({"conv1": (17, -1), "conv2": (16, 16), "fc1": (32, 32), "fc2": (5, 5)}, "must be >= 0"),
    ({"conv1": (8, 8), "conv2": (16, 16), "fc1": (32, 32), "fc2": (10,)}, "one count per member"),
])
def test_bad_divisions_are_refused(counts: dict, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        MeshMember("digits-cnn", counts, 0)


def test_slices_are_contiguous_in_member_order() -> None:
    assert slices([3, 0, 2]) == [(0, 3), (3, 3), (3, 5)]


# --------------------------------------------------------------------------- over a broker


@contextlib.asynccontextmanager
async def member_buses(broker: BrokerProcess, job: str, cluster: str, devices: list[str], counts: dict,
                       timeout_s: float = 10.0, dtype: str = "float32",
                       batch: int = 12) -> AsyncIterator[list[BusExchange]]:
    """One MQTT connection and :class:`BusExchange` per member, fed by its own consume loop."""
    cfg = load_config(env={}, overrides={"broker.url": broker.url, "job": job})
    topics = Topics(job)
    order = list(counts)
    async with contextlib.AsyncExitStack() as stack:
        exchanges, tasks = [], []
        for device in devices:
            bus = await stack.enter_async_context(Bus(
                cfg.broker, client_id=f"{device}-{os.getpid()}-{time.monotonic_ns()}",
                metrics=ServiceMetrics("worker"), subscriptions=topics.mesh_member(cluster, device, devices)))
            await bus.wait_connected(WAIT_S)
            ex = BusExchange(bus, topics, cluster=cluster, device=device, members=devices, counts=counts,
                             order=order, plan_version=1, timeout_s=timeout_s, dtype=dtype)
            ex.begin(1, batch)

            async def feed(bus: Bus = bus, ex: BusExchange = ex) -> None:
                async for msg in bus.messages():
                    ex.deliver(msg.decode(MeshSlice))

            tasks.append(asyncio.create_task(feed()))
            exchanges.append(ex)
        try:
            yield exchanges
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_members_over_mqtt_compute_what_one_process_does(broker: BrokerProcess) -> None:
    spec = "digits-cnn"
    params, x, y, loss, logits, grads = reference(spec, seed=5, batch=12)
    devices = ["m0", "m1", "m2"]
    members = [MeshMember(spec, UNEVEN[spec], i, seed=5) for i in range(3)]
    for m in members:
        m.load(params, version=0)
    async with member_buses(broker, "meshx", "m-m0", devices, UNEVEN[spec]) as exchanges:
        results = await asyncio.wait_for(asyncio.gather(
            *(m.step(1, x, y, ex) for m, ex in zip(members, exchanges, strict=True))), WAIT_S)
    assert_matches_one_process(list(results), loss, logits, grads)
    # the member without units of fc2 sends nothing for it
    assert all(ex.bytes_sent > 0 for ex in exchanges)
    # a layer's exchanges are booked to it: its all-gather and the reduce-scatter of its output gradient
    # (sent with the next layer), both sized by the member's units of it, as the cost model charges them
    for ex in exchanges:
        sent, received = (sum(b[d] for b in ex.layer_bytes.values()) for d in (0, 1))
        assert sent > 0 and received > 0
    # member 1 holds 4 of fc1's 64 units and none of fc2's (12 samples, float32): for fc2 it only receives
    # the others' 10 units; fc1's bytes are its all-gather (its 4 units out, the others' 60 in) and the
    # reduce-scatter of fc1's output gradient on fc2's topics (its 4 channels in from the 2 fc2 holders)
    assert exchanges[1].layer_bytes["fc2"] == [0, 10 * 12 * 4]
    assert exchanges[1].layer_bytes["fc1"] == [4 * 12 * 4, 60 * 12 * 4 + 2 * 4 * 12 * 4]


async def test_a_missing_member_times_the_step_out(mosquitto_broker: BrokerProcess) -> None:
    spec = "digits-cnn"
    params, x, y, *_ = reference(spec, seed=5, batch=4)
    devices = ["m0", "m1", "m2"]
    members = [MeshMember(spec, UNEVEN[spec], i, seed=5) for i in range(2)]  # m2 never shows up
    for m in members:
        m.load(params, version=0)
    async with member_buses(mosquitto_broker, "meshy", "m-m0", devices, UNEVEN[spec], timeout_s=0.5,
                            batch=4) as exchanges:
        with pytest.raises(MeshTimeout, match="from m2"):
            await asyncio.gather(*(m.step(1, x, y, ex) for m, ex in zip(members, exchanges[:2], strict=True)))


# --------------------------------------------------------------------------- parameter server

LAYOUT = models.param_layout(models.build_model("digits-cnn"))
SPLIT = {"conv1": (10, 6), "conv2": (12, 20), "fc1": (40, 24), "fc2": (4, 6)}


def mesh_plan(devices: list[str], counts: dict, *, cluster: str = "m-a", batch: int = 8, version: int = 1) -> Plan:
    return Plan(version=version, created=time.time(), model_spec="digits-cnn", dataset="digits",
                sync_policy="sync", devices=tuple(PlanDevice(device=d, cluster=cluster, shard_index=0, shard_count=1,
                                                             batch_size=batch) for d in devices),
                clusters=(PlanCluster(cluster=cluster, members=tuple(devices), division=tuple(
                    LayerDivision(layer=k, counts=tuple(v)) for k, v in counts.items())),))


def member_update(device: str, index: int, seq: int, base: int, *, step: int = 1, counts: dict = SPLIT,
                  cluster: str = "m-a") -> GradientUpdate:
    enc = get_codec("none")
    shards = []
    for layer, c in counts.items():
        start, stop = slices(c)[index]
        for part in ("weight", "bias"):
            shape = LAYOUT[f"{layer}.{part}"][0]
            n = (stop - start) * int(np.prod(shape[1:]))
            shards.append(ShardUpdate(param=f"{layer}.{part}", start=start, stop=stop, codec="none",
                                      data=enc.encode(np.full(n, 0.01, np.float32), None)))
    return GradientUpdate(device=device, cluster=cluster, incarnation=1, seq=seq, base_version=base, samples=8,
                          shards=tuple(shards), mesh_step=step, plan_version=1)


def ps_config(broker: BrokerProcess, tmp_path: Path, **extra: object) -> Config:
    return make_config(broker, tmp_path / "ps", **{"training.sync_policy": "sync", **extra})


async def test_ps_applies_a_cluster_step_once_all_members_shards_are_in(broker: BrokerProcess,
                                                                         tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path)
    async with running_ps(cfg) as ps, client(cfg, ["a", "b"]) as c:
        await c.bus.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
        await c.version_at_least(0)
        before = {k: v.copy() for k, v in ps.state.params.items()}  # type: ignore[union-attr]
        await c.bus.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0))
        await c.until("a's shards held", lambda: ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 1)
        assert ps.version == 0  # half a model is not an update
        acks = await asyncio.gather(c.push(member_update("b", 1, 1, 0)), c.ack_for("a", 1))
        assert {a.status for a in acks} == {"accepted"}
        assert ps.version == 1  # one version for the cluster, not one per member
        after = ps.state.params  # type: ignore[union-attr]
        assert all(not np.array_equal(before[k], after[k]) for k in before), "every parameter moved"
        # a resent member update is a duplicate, not a new half-step
        seen = len(c.acks)
        await c.bus.publish(c.topics.grad("m-a", "b"), member_update("b", 1, 1, 0))
        again = await c.until("the resend's ack", lambda: next(
            (a for a in c.acks[seen:] if (a.device, a.seq) == ("b", 1)), None))
        assert again.status == "duplicate"
        assert ps.version == 1


async def test_ps_discards_an_incomplete_or_overlapping_cluster_step(mosquitto_broker: BrokerProcess,
                                                                     tmp_path: Path) -> None:
    cfg = ps_config(mosquitto_broker, tmp_path, **{"ps.mesh_assembly_timeout_s": "0.3"})
    async with running_ps(cfg) as ps, client(cfg, ["a", "b"]) as c:
        await c.bus.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
        await c.version_at_least(0)
        await c.bus.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0, step=7))
        # it times out with no other arrival to sweep it out
        ack = await c.ack_for("a", 1)
        assert (ack.status, ack.reason, ack.resync) == ("discarded", "incomplete", True)
        assert ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 0
        # a resend of a's part is told the same, and opens no new step
        seen = len(c.acks)
        await c.bus.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0, step=7))
        again = await c.until("the resend's ack", lambda: next(
            (a for a in c.acks[seen:] if (a.device, a.seq) == ("a", 1)), None))
        assert (again.status, again.reason) == ("discarded", "incomplete")
        assert ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 0
        # two members claiming the same rows: both told, nothing applied
        await c.bus.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 2, 0, step=9))
        overlap = await c.push(member_update("b", 0, 2, 0, step=9))
        assert (overlap.status, overlap.reason) == ("discarded", "shape")
        assert ps.version == 0
        assert ps.metrics.value("edgemesh_ps_rejected_total", reason="incomplete") >= 1


async def test_ps_discards_the_steps_of_a_replaced_plan_at_once(broker: BrokerProcess, tmp_path: Path) -> None:
    # members abandon a step when the plan changes: the PS must not hold the others' parts for
    # the whole assembly timeout (far longer than this test waits for an ack)
    cfg = ps_config(broker, tmp_path, **{"ps.mesh_assembly_timeout_s": "600"})
    async with running_ps(cfg) as ps, client(cfg, ["a", "b"]) as c:
        await c.bus.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
        await c.version_at_least(0)
        await c.bus.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0, step=7))
        await c.until("a's shards held", lambda: ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 1)
        alone = replace(plan_for(["a", "b"]), version=2, sync_policy="sync")
        await c.bus.publish(c.topics.plan(), alone, retain=True)
        ack = await c.ack_for("a", 1)
        assert (ack.status, ack.reason, ack.resync) == ("discarded", "replanned", True)
        assert ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 0
        # b's part of that step, late: told at once too, nothing held
        late = await c.push(member_update("b", 1, 1, 0, step=7))
        assert (late.status, late.reason) == ("discarded", "replanned")
        assert ps.metrics.value("edgemesh_ps_mesh_assembling_steps") == 0
        # under the new plan both train alone, and the round is theirs
        acks = await asyncio.gather(c.push(gradient("a", 2, 0)), c.push(gradient("b", 2, 0)))
        assert [a.status for a in acks] == ["accepted", "accepted"] and ps.version == 1
        assert ps.metrics.value("edgemesh_ps_updates_total", status="discarded", reason="replanned") == 2


async def test_a_sync_round_lets_go_of_a_cluster_that_left_the_plan(broker: BrokerProcess, tmp_path: Path) -> None:
    # a's update waits in the round for b's cluster; then a new plan joins a and b in one mesh
    # cluster. The round must not wait for clusters the plan no longer has, nor keep a waiting for
    # an ack it would only get once it had trained under the new plan.
    cfg = ps_config(broker, tmp_path)
    async with running_ps(cfg) as ps, client(cfg, ["a", "b"]) as c:
        await c.bus.publish(c.topics.plan(), replace(plan_for(["a", "b"]), sync_policy="sync"), retain=True)
        await c.version_at_least(0)
        await c.bus.publish(c.topics.grad("c-a", "a"), replace(gradient("a", 1, 0), plan_version=1))
        await c.until("the round to hold a's update", lambda: "c-a" in ps._round)
        await c.bus.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT, version=2), retain=True)
        ack = await c.ack_for("a", 1)
        assert (ack.status, ack.reason, ack.resync) == ("discarded", "replanned", True)
        assert ps.version == 0 and not ps._round
        # an update from the old cluster that arrives after the new plan is told the same
        old = await c.push(replace(gradient("b", 1, 0), plan_version=1))
        assert (old.status, old.reason) == ("discarded", "replanned")
        # the mesh cluster's step is the whole round now
        step = [replace(member_update(d, i, 2, 0, step=3), plan_version=2) for i, d in enumerate(["a", "b"])]
        acks = await asyncio.gather(c.push(step[0]), c.push(step[1]))
        assert [a.status for a in acks] == ["accepted", "accepted"] and ps.version == 1
        # an update computed under a plan the PS has not received yet is not from the past: it waits
        await c.bus.publish(c.topics.grad("c-a", "a"), replace(gradient("a", 3, 1), plan_version=3))
        await c.until("the round to hold a's update", lambda: "c-a" in ps._round)
        await c.bus.publish(c.topics.plan(), replace(plan_for(["a", "b"]), version=3, sync_policy="sync"),
                            retain=True)
        acks = await asyncio.gather(c.push(replace(gradient("b", 3, 1), plan_version=3)), c.ack_for("a", 3))
        assert [a.status for a in acks] == ["accepted", "accepted"] and ps.version == 2


# --------------------------------------------------------------------------- three workers, one cluster


def worker_config(broker: BrokerProcess, device: str, **extra: str) -> Config:
    return load_config(env={}, overrides={
        "broker.url": broker.url, "job": "meshe2e", "metrics.address": "127.0.0.1:0", "worker.device": device,
        "broker.backoff_max_s": "0.5", "worker.ack_timeout_s": "5", "worker.codec_wait_s": "0.1",
        "worker.mesh_timeout_s": "10", **extra})


async def test_three_workers_train_one_model_parallel_cluster(broker: BrokerProcess, tmp_path: Path) -> None:
    counts = {"conv1": (8, 5, 3), "conv2": (4, 18, 10), "fc1": (30, 20, 14), "fc2": (4, 3, 3)}
    devices = ["w0", "w1", "w2"]
    cfg = make_config(broker, tmp_path / "ps", job="meshe2e", **{"training.sync_policy": "sync",
                                                                  "ps.broadcast": "delta"})
    ps = ParameterServer(cfg)
    workers = [Worker(worker_config(broker, d)) for d in devices]
    tasks = [asyncio.create_task(s.run()) for s in (ps, *workers)]
    try:
        async with client(cfg, []) as c:
            await c.bus.publish(c.topics.plan(), mesh_plan(devices, counts, cluster="m-w0", batch=16), retain=True)
            await until(c, "ten cluster steps", lambda: ps.version >= 10 and all(w.accepted >= 10 for w in workers))
            cluster_steps = ps.version
            sizes = [w._gradient_bytes for w in workers]
            # a new plan makes every member its own cluster: each goes back to the whole model
            alone = Plan(version=2, created=time.time(), model_spec="digits-cnn", dataset="digits", sync_policy="sync",
                         devices=tuple(PlanDevice(device=d, cluster=f"c-{d}", shard_index=i, shard_count=3,
                                                  batch_size=16) for i, d in enumerate(devices)),
                         clusters=tuple(PlanCluster(cluster=f"c-{d}", members=(d,)) for d in devices))
            await c.bus.publish(c.topics.plan(), alone, retain=True)
            before = [w.accepted for w in workers]
            await until(c, "data-parallel steps", lambda: all(
                w.accepted >= b + 5 and w._mesh is None for w, b in zip(workers, before, strict=True)))
    finally:
        for s in (ps, *workers):
            s.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)
    # one version per cluster step: every member's update of a step went into the same version
    assert cluster_steps <= min(before) + 1
    assert all(w.metrics.value("edgemesh_worker_mesh_steps_total", outcome="done") >= 10 for w in workers)
    # each member pushed only its slices; alone, the whole model
    assert sum(sizes) == costs.cost("digits-cnn").params * 4
    assert all(w._gradient_bytes == costs.cost("digits-cnn").params * 4 for w in workers)


async def until(c: Client, what: str, predicate: object) -> None:
    await c.until(what, predicate, timeout_s=WAIT_S * 2)  # type: ignore[arg-type]


async def test_the_first_member_starts_a_plan_only_once_every_member_is_ready(broker: BrokerProcess,
                                                                              tmp_path: Path) -> None:
    # a step announced before a member has subscribed is lost to it: the first member waits for
    # the others' retained readiness (worker.mesh_timeout_s, long here, would start it anyway)
    devices, cluster = ["w0", "w1"], "m-w0"
    cfg = make_config(broker, tmp_path / "ps", job="meshe2e", **{"training.sync_policy": "sync",
                                                                  "ps.broadcast": "delta"})
    seen: list[tuple[str, str]] = []  # (phase, device) of every step message, in the broker's order
    stray: list[str] = []  # anything else delivered: once, in a full run on amqtt, a one-level topic came
    topics = Topics(cfg.job)
    async with running_ps(cfg) as ps, client(cfg, []) as c, Bus(
            cfg.broker, client_id=f"recorder-{os.getpid()}", metrics=ServiceMetrics("recorder"),
            subscriptions=[topics.mesh(cluster, "step", "+", "+")]) as recorder:

        async def record() -> None:
            async for msg in recorder.messages():
                parts = topics.relative(msg.topic)
                if len(parts) == 5 and parts[:3] == ["mesh", cluster, "step"]:
                    seen.append((parts[3], parts[4]))
                else:
                    stray.append(msg.topic)

        recording = asyncio.create_task(record())
        workers = {d: Worker(worker_config(broker, d, **{"worker.mesh_timeout_s": "120"})) for d in devices}
        tasks = {"w0": asyncio.create_task(workers["w0"].run())}
        try:
            await recorder.wait_connected(WAIT_S)
            await c.bus.publish(c.topics.plan(), mesh_plan(devices, SPLIT, cluster=cluster, batch=16), retain=True)
            leader = workers["w0"]
            await until(c, "the first member in the cluster, holding the model",
                        lambda: leader._exchange is not None and leader.view.ready)
            tasks["w1"] = asyncio.create_task(workers["w1"].run())  # seconds later: it measures itself first
            await until(c, "two cluster steps", lambda: ps.version >= 2 and all(
                w.accepted >= 2 for w in workers.values()))
        finally:
            for w in workers.values():
                w.stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), WAIT_S)
            recording.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await recording
    assert ("ready", "w1") in seen and ("begin", "w0") in seen, (seen, stray)
    assert seen.index(("ready", "w1")) < seen.index(("begin", "w0")), (seen, stray)
    assert workers["w1"].metrics.value("edgemesh_worker_mesh_steps_total", outcome="done") >= 2


# --------------------------------------------------------------------------- a member's view of the model


def snapshot(params: dict[str, np.ndarray], version: int) -> ModelSnapshot:
    return ModelSnapshot(version=version, model_spec="digits-cnn",
                         tensors={k: Tensor.from_numpy(v) for k, v in params.items()})


def test_a_members_view_keeps_only_its_rows_and_follows_deltas_on_them() -> None:
    params = models.get_params(models.build_model("digits-cnn"))
    member = MeshMember("digits-cnn", SPLIT, 1)
    rows = member.rows()
    view = ModelView()
    assert view.restrict(rows)  # nothing held yet: the next snapshot comes in sliced
    view.load(snapshot(params, 3))
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
    delta = ModelDelta(version=4, base_version=3, model_spec="digits-cnn", shards=whole)
    assert view.apply(delta) and view.version == 4
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


async def test_members_receive_their_rows_of_every_delta_cut_from_the_broadcast(mosquitto_broker: BrokerProcess,
                                                                                tmp_path: Path) -> None:
    # Mosquitto: on the embedded broker the PS's first connect may come late enough to turn version 1
    # into a requested snapshot (as in the test below)
    cfg = make_config(mosquitto_broker, tmp_path / "ps", **{"ps.broadcast": "delta", "training.sync_policy": "sync"})
    topics = Topics(cfg.job)
    got: dict[str, list[ModelDelta]] = {"": [], "a": [], "b": []}
    sizes: dict[str, int] = {}
    subs = [topics.model_delta(), topics.model_delta_for("a"), topics.model_delta_for("b")]
    async with running_ps(cfg) as ps, client(cfg, ["a", "b"]) as c, Bus(
            cfg.broker, client_id=f"deltas-{os.getpid()}-{time.monotonic_ns()}", metrics=ServiceMetrics("tester"),
            subscriptions=subs) as deltas:
        await deltas.wait_connected(WAIT_S)

        async def feed() -> None:
            async for msg in deltas.messages():
                parts = topics.relative(msg.topic)
                key = parts[2] if len(parts) == 3 else ""
                got[key].append(msg.decode(ModelDelta))
                sizes[key] = len(wire_encode(got[key][-1]))

        task = asyncio.create_task(feed())
        try:
            await c.bus.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
            snap = await c.version_at_least(0)
            await c.until("the PS has the plan", lambda: ps.plan is not None)
            await c.bus.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0))
            await c.push(member_update("b", 1, 1, 0))
            await c.until("the delta and both members' parts", lambda: all(got.values()))
        finally:
            task.cancel()
    broadcast = got[""][0]
    assert broadcast.version == 1 and all(d[0].version == 1 for d in got.values())
    whole = ModelView()
    whole.load(snap)
    assert whole.apply(broadcast)
    for index, device in enumerate(("a", "b")):
        rows = MeshMember("digits-cnn", SPLIT, index).rows()
        part = got[device][0]
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
    assert not other.apply(got["a"][0]) and other.gap


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


async def test_a_parameter_server_publishes_a_snapshot_on_request(mosquitto_broker: BrokerProcess,
                                                                   tmp_path: Path) -> None:
    async def run() -> None:
        cfg = make_config(mosquitto_broker, tmp_path / "ps", **{"ps.broadcast": "delta",
                                                                "training.sync_policy": "async"})
        async with running_ps(cfg) as ps, client(cfg, ["a", "b"]) as c:
            await c.bus.publish(c.topics.plan(), mesh_plan(["a", "b"], SPLIT), retain=True)
            await c.version_at_least(0)
            await c.bus.publish(c.topics.grad("m-a", "a"), member_update("a", 0, 1, 0))
            await c.push(member_update("b", 1, 1, 0))
            assert ps.version == 1 and c.snapshots[-1].version == 0  # version 1 went out as a delta
            await c.bus.publish(c.topics.control("ps"), ControlCommand(command="snapshot", requester="a"))
            assert (await c.version_at_least(1)).version == 1

    await asyncio.wait_for(run(), WAIT_S)


def test_plans_refuse_a_model_parallel_cluster_without_a_sound_division() -> None:
    with pytest.raises(ValueError, match="no filter division"):
        PlanCluster(cluster="m-a", members=("a", "b")).validate()
    with pytest.raises(ValueError, match="3 counts for 2 members"):
        PlanCluster(cluster="m-a", members=("a", "b"),
                    division=(LayerDivision(layer="conv1", counts=(1, 2, 13)),)).validate()
    with pytest.raises(ValueError, match="appears twice"):
        PlanCluster(cluster="m-a", members=("a", "a"),
                    division=(LayerDivision(layer="conv1", counts=(8, 8)),)).validate()
    plan = mesh_plan(["a", "b"], SPLIT)
    with pytest.raises(ValueError, match="not a member"):
        replace(plan, devices=(*plan.devices, PlanDevice(device="c", cluster="m-a", shard_index=0, shard_count=1,
                                                         batch_size=8))).validate()


# --------------------------------------------------------------------------- the planner lays out a mesh


# gigabit boards, two of which cannot hold the model alone
BOARDS = {"big-0": (60e9, 7 << 30), "big-1": (60e9, 7 << 30), "small-0": (20e9, 268 << 20),
          "small-1": (20e9, 268 << 20), "small-2": (20e9, 268 << 20)}


def board_hello(name: str) -> DeviceHello:
    flops, memory = BOARDS[name]
    return DeviceHello(device=name, incarnation=1, flops=flops, memory_bytes=memory, link_rate_bps=117e6,
                       latency_s=0.0002)


@contextlib.asynccontextmanager
async def mesh_planner(broker: BrokerProcess, job: str,
                       overrides: dict[str, str] | None = None) -> AsyncIterator[tuple[Planner, Bus, Topics]]:
    """A mesh planner for the 64-sample iterations of cifar-cnn, BOARDS announced to it and online,
    and a bus subscribed to its plans."""
    cfg = load_config(env={}, overrides={
        "broker.url": broker.url, "job": job, "metrics.address": "127.0.0.1:0",
        "planner.parallelism": "mesh", "planner.round_samples": "64", "planner.replan_debounce_s": "0.05",
        "training.model_spec": "cifar-cnn", "training.dataset": "synthetic-cifar", **(overrides or {})})
    topics = Topics(job)
    planner = Planner(cfg)
    task = asyncio.create_task(planner.run())
    try:
        async with Bus(cfg.broker, client_id=f"{job}-{os.getpid()}", metrics=ServiceMetrics("test"),
                       subscriptions=[topics.plan()]) as bus:
            await bus.wait_connected(WAIT_S)
            for name in BOARDS:
                await bus.publish(topics.hello(name), board_hello(name), retain=True)
                await bus.publish(topics.status(name), DeviceStatus(device=name, state="online", incarnation=1),
                                  retain=True)
            yield planner, bus, topics
    finally:
        planner.stop.set()
        await asyncio.wait_for(task, WAIT_S)


async def next_plan(bus: Bus, predicate: Callable[[Plan], bool]) -> Plan:
    async with asyncio.timeout(WAIT_S):
        while True:
            plan = (await bus.next_message(WAIT_S)).decode(Plan)
            if predicate(plan):
                return plan


async def test_the_planner_lays_out_a_training_grid_and_re_plans_when_a_member_leaves(
        mosquitto_broker: BrokerProcess) -> None:
    async with mesh_planner(mosquitto_broker, "meshplan") as (planner, bus, topics):
        first = await next_plan(bus, lambda p: len(p.devices) + len(planner.grid.idle if planner.grid else ()) == 5)
        await bus.publish(topics.status("small-1"), DeviceStatus(device="small-1", state="offline", incarnation=1),
                          retain=True)
        second = await next_plan(bus, lambda p: p.device("small-1") is None and p.version > first.version)
    for plan in (first, second):
        batches = {d.cluster: d.batch_size for d in plan.devices}
        assert sum(batches.values()) == 64  # the iteration's samples, split among the clusters
        for c in plan.clusters:
            assert [d.cluster for d in plan.devices if d.device in c.members] == [c.cluster] * len(c.members)
            assert c.predicted_iteration_s > 0
            if len(c.members) > 1:
                assert {d.layer for d in c.division} == {la.name for la in costs.layers("cifar-cnn")}
        # the small boards are never alone: they cannot hold the model
        assert all(len(c.members) > 1 for c in plan.clusters if any(m.startswith("small") for m in c.members))
        assert plan.round_time_s == max(c.predicted_iteration_s for c in plan.clusters)
    assert any(len(c.members) > 1 for c in first.clusters)
    assert second.reason == "leave"


@pytest.mark.parametrize(("overrides", "clusters", "samples"), [
    ({}, 2, 64),
    ({"planner.grid_slack": "1.0"}, 1, 64),  # one replica is within the slack of the fastest layout
    ({"planner.grid_slack": "1.0", "planner.max_batch": "40"}, 2, 64),  # ... but trains more than 40
    ({"planner.max_batch": "20"}, 2, 40),  # the small boards cannot form a third cluster: 40 samples
])
async def test_the_planners_grid_follows_the_slack_and_batch_bounds_it_is_configured_with(
        mosquitto_broker: BrokerProcess, overrides: dict[str, str], clusters: int, samples: int) -> None:
    async with mesh_planner(mosquitto_broker, f"meshbounds{len(overrides)}{clusters}", overrides) as (planner, bus, _):
        plan = await next_plan(bus, lambda p: len(p.devices) == 5)
    batches = {d.cluster: d.batch_size for d in plan.devices}
    assert len(plan.clusters) == clusters
    assert sum(batches.values()) == samples
    low, high = int(overrides.get("planner.min_batch", "4")), int(overrides.get("planner.max_batch", "128"))
    assert all(low <= b <= high for b in batches.values()), batches
    grid = mesh.training_grid("cifar-cnn", [DeviceInfo.from_hello(board_hello(n)) for n in BOARDS], batch=64,
                              slack=float(overrides.get("planner.grid_slack", "0")), min_batch=low, max_batch=high,
                              wire=mesh_wire(planner.cfg))
    assert sorted(c.members for c in plan.clusters) == sorted(c.members for c in grid.clusters)


async def test_under_adaptive_the_grid_gives_a_cluster_of_slow_members_a_smaller_batch(
        mosquitto_broker: BrokerProcess) -> None:
    overrides = {"training.sync_policy": "adaptive"}
    async with mesh_planner(mosquitto_broker, "meshslow", overrides) as (planner, bus, topics):
        first = await next_plan(bus, lambda p: len(p.devices) == 5)
        cluster = first.device("big-1").cluster  # type: ignore[union-attr]
        members = next(c.members for c in first.clusters if c.cluster == cluster)
        before = first.device("big-1").batch_size  # type: ignore[union-attr]
        # the PS finds the cluster's members three versions behind: they train as if 4x slower
        await bus.publish(topics.sync(), SyncState(policy="adaptive", version=9, bound=2, slow=members,
                                                   delay_indices=dict.fromkeys(members, 3.0)), retain=True)
        second = await next_plan(bus, lambda p: p.version > first.version)
    after = {d.device: d.batch_size for d in second.devices}
    assert all(after[m] < before for m in members if m in after), (before, after)  # members may go idle too


# --------------------------------------------------------------------------- small pieces


def test_codec_sizes_the_cost_model_charges_are_measured_from_the_codecs() -> None:
    from edgemesh.common.codecs import bytes_per_value
    from edgemesh.services.planner.service import mesh_wire

    assert bytes_per_value("none") == 4.0 and bytes_per_value("fp16") == 2.0
    assert bytes_per_value("grid", 0.3) < bytes_per_value("grid", 0.9) < 4.0
    wire = mesh_wire(load_config(env={}, overrides={"worker.mesh_dtype": "float16", "ps.delta_codec": "fp16"}))
    assert (wire.activation, wire.gradient, wire.model) == (2.0, 2.0, 2.0)
    assert mesh_wire(load_config(env={}, overrides={"ps.broadcast": "snapshot"})).model == 4.0


def test_members_draw_the_same_batch_for_a_step_and_other_batches_for_other_steps() -> None:
    from edgemesh.common.data import batch_at, synthetic_cifar

    train, test = synthetic_cifar(seed=1, train=256, test=64)
    assert train.x.shape == (256, 3, 32, 32) and test.x.shape == (64, 3, 32, 32)
    assert 0.0 <= train.x.min() and train.x.max() <= 1.0 and len(set(train.y.tolist())) > 5
    a, b = batch_at(train, 16, seed=3, step=7), batch_at(train, 16, seed=3, step=7)
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[0], batch_at(train, 16, seed=3, step=8)[0])
    assert batch_at(train, 1000, seed=3, step=1)[0].shape[0] == 256  # at most the whole set
