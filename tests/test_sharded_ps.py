"""A parameter server split into shards (``edgemesh ps --shard i/n``): the division of the model's rows, the
shard topics, and services on a real broker training exactly what one server trains."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import gradient, inbox, make_config, mesh_plan, plan_for, running, until

from edgemesh import cli
from edgemesh.common import models, wire
from edgemesh.common.broadcast import Broadcaster, ModelView, member_rows
from edgemesh.common.config import Config, ParameterServerConfig
from edgemesh.common.errors import ConfigError, WireError
from edgemesh.common.messages import (
    GradientUpdate,
    LayerDivision,
    ModelDelta,
    ModelSnapshot,
    Plan,
    PlanCluster,
    PlanDevice,
    ShardNorms,
    ShardSteps,
    ShardUpdate,
    StepPart,
    StepRecord,
    UpdateAck,
)
from edgemesh.common.models import layer_list_spec, register_spec
from edgemesh.common.shards import Division, ShardedView, cut, divide
from edgemesh.common.topics import TopicError, Topics, parse
from edgemesh.common.wire.tensors import Tensor
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import Child, LocalCluster, scrape
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.mesh import session
from edgemesh.services.worker.service import Worker

MODEL = "digits-cnn"
STEPS = 6
"""Sync rounds the exactness test trains."""
TRAIN_S = 90.0


def shapes_of(spec: str) -> dict[str, tuple[int, ...]]:
    return {k: v.shape for k, v in models.get_params(models.build_model(spec, seed=0)).items()}


# --------------------------------------------------------------------------- the division


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_the_division_covers_every_row_once_in_runs_of_about_equal_size(shards: int) -> None:
    shapes = shapes_of("cifar-cnn")  # one tensor holds 85 % of the values: it is cut by rows
    runs = divide(shapes, shards)
    assert len(runs) == shards
    rows: dict[str, list[tuple[int, int]]] = {}
    for run in runs:
        for span in run:
            rows.setdefault(span.param, []).append((span.start, span.stop))
    for name, shape in shapes.items():
        spans = sorted(rows[name])
        assert spans[0][0] == 0 and spans[-1][1] == shape[0]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # no gap, no overlap
    sizes = [sum((s.stop - s.start) * int(np.prod(shapes[s.param][1:])) for s in run) for run in runs]
    row = max(int(np.prod(shape[1:])) for shape in shapes.values())
    assert max(sizes) - min(sizes) <= 2 * row  # equal to within a row or two of the widest tensor


def test_a_model_too_small_for_its_shards_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="too few rows"):
        divide({"w": (2, 3)}, 3)


def test_a_shard_takes_only_its_rows_and_a_worker_puts_them_back_together() -> None:
    shapes = shapes_of(MODEL)
    params = models.get_params(models.build_model(MODEL, seed=3))
    parts = [Division.of(shapes, i, 2).take(params) for i in range(2)]
    view = ShardedView(2)
    view.know(shapes)
    whole = view.assemble(parts)
    assert whole.keys() == params.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(whole[name], value)
    split = Division.of(shapes, 1, 2)
    span = split.spans[0]
    g = gradient("a", 1, 0).shards[0]
    inside = type(g)(param=span.param, start=span.start, stop=span.start + 1, codec="none", data=b"")
    assert split.localize([inside])[0].start == 0  # counted from the shard's first row
    outside = type(g)(param=span.param, start=max(span.start - 1, 0), stop=span.start + 1, codec="none", data=b"")
    if span.start:
        with pytest.raises(WireError, match="not parameter server shard 1's"):
            split.localize([outside])


def test_a_model_parallel_members_rows_are_cut_at_the_shards_and_put_back_together() -> None:
    """A member's rows within each shard's (an empty range where it has none), its gradient cut at the shards'
    rows and sent to their owners, its view of every shard restricted to those rows and put together as its rows
    of the model, and each shard's part of a delta for it: an empty one where the shard holds none of its rows."""
    shapes = shapes_of(MODEL)
    params = models.get_params(models.build_model(MODEL, seed=3))
    divisions = [Division.of(shapes, i, 2) for i in range(2)]
    plan = mesh_plan(["w0", "w1", "w2"], SPLIT_ACROSS, cluster="m-w0")
    rows = member_rows(plan)
    assert set(divisions[1].local_rows(rows["w1"]).values()) == {(0, 0)}  # no dense unit: nothing on shard 1
    assert set(divisions[0].local_rows(rows["w2"]).values()) == {(0, 0)}  # fc1.weight[30:] on: nothing on shard 0
    assert divisions[1].local_rows(rows["w0"])["fc1.weight"] == (0, 2)  # its fc1.weight[28:30] is shard 1's
    view = ShardedView(2)
    assert view.restrict(rows["w0"])  # before the model's shapes are known: kept for then
    view.know(shapes)
    for i, d in enumerate(divisions):
        view.views[i].load(ModelSnapshot(version=4, model_spec=MODEL, created=0.0, sync_policy="sync", tensors={
            k: Tensor.from_numpy(v) for k, v in d.take(params).items()}))
    assert view.params is not None and view.params.keys() == params.keys()
    for name, (start, stop) in rows["w0"].items():
        np.testing.assert_array_equal(view.params[name], params[name][start:stop], err_msg=name)
    # its gradient: pieces within one shard's rows each, which each owner takes
    grads = {name: (start, stop, np.ones((stop - start, *shapes[name][1:]), np.float32))
             for name, (start, stop) in rows["w0"].items()}
    pieces = cut(grads, view.spans)
    assert ("fc1.weight", 0, 28) in [p[:3] for p in pieces] and ("fc1.weight", 28, 30) in [p[:3] for p in pieces]
    shards = [ShardUpdate(param=n, start=a, stop=b, codec="none", data=g.tobytes()) for n, a, b, g in pieces]
    for i, part in enumerate(view.split(shards)):
        assert part and divisions[i].localize(part)
    assert view.split([s for s in shards if s.param.startswith("conv")])[1] == []  # w1's gradient: shard 0's alone
    # shard 1's delta: a part for every member, w1's empty
    broadcaster = Broadcaster(ParameterServerConfig(broadcast="delta", delta_codec="none"), MODEL)
    broadcaster.own = divisions[1].local_rows
    mine = divisions[1].take(params)
    broadcaster.snapshot(mine, 4, "sync")
    message = broadcaster.after_step({k: v + 1 for k, v in mine.items()}, 5, "sync", plan)
    parts = {d: wire.decode(b, ModelDelta) for d, b in message.parts.items()}
    assert parts.keys() == {"w0", "w1", "w2"} and parts["w1"].shards == () and parts["w2"].shards
    assert {(s.param, s.start, s.stop) for s in parts["w0"].shards if s.param == "fc1.weight"} == {("fc1.weight", 0, 2)}
    member = view.views[1]  # w0's rows of shard 1 take w0's part, and w1's (empty) would move a view of none of them
    assert member.apply(parts["w0"]) and member.version == 5
    whole = ModelView()  # the broadcast is never empty: a delta of no rows there is junk
    with pytest.raises(WireError, match="no rows"):
        whole.apply(parts["w1"])


def test_shard_topics_are_parsed_with_their_shard_and_nothing_else_lives_under_shard() -> None:
    t = Topics("j", 1)
    for topic, kind in [(t.grad("c", "d"), "grad"), (t.ack("d"), "ack"), (t.model(), "model"),
                        (t.model_delta(), "delta"), (Topics.chunk(t.model(), 3), "model")]:
        found = parse(topic)
        assert (found.kind, found.shard) == (kind, 1)
    assert parse(Topics("j").grad("c", "d")).shard == -1
    for bad in ["edgemesh/v1/j/shard/1/plan", "edgemesh/v1/j/shard/x/model", "edgemesh/v1/j/shard/99/model"]:
        with pytest.raises(TopicError):
            parse(bad)
    assert t.plan() == Topics("j").plan() and t.sync() == Topics("j").sync()  # the job's own


def test_sharded_settings_that_cannot_work_are_refused_at_load(tmp_path: Path) -> None:
    broker = BrokerProcess.default()
    with pytest.raises(ConfigError, match="ps.shard"):
        make_config(broker, job="s", **{"ps.shards": 2, "ps.shard": 2})
    with pytest.raises(ConfigError, match="ps.shard_wait_s"):
        make_config(broker, job="s", **{"ps.shards": 2, "ps.shard_wait_s": 0})
    bad = subprocess.run([sys.executable, "-m", "edgemesh", "ps", "--shard", "1-2", "--job", "s"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode != 0 and "--shard expects INDEX/COUNT" in bad.stderr
    # the index alone (the systemd template's edgemesh-ps@1): the count is the configuration's ps.shards
    argv = ["ps", "--shard", "1", "--job", "s"]
    assert cli.build_parser(argv).parse_args(argv).set == ["ps.shard=1"]
    alone = subprocess.run([sys.executable, "-m", "edgemesh", *argv], capture_output=True, text=True, timeout=60,
                           check=False, env={**os.environ, "EDGEMESH_PS__SHARDS": "1"})
    assert alone.returncode == 2 and "ps.shard" in alone.stderr and "[0, ps.shards = 1)" in alone.stderr


# --------------------------------------------------------------------------- services on a broker


def sharded_config(broker: BrokerProcess, tmp_path: Path, shards: int, **extra: object) -> Config:
    """Two workers under ``sync`` with exact transport (float32 snapshots, no gradient codec), so that any
    difference between one server and its shards would show."""
    # a job of its own: a retained model of another run on the same broker would be taken for this one's
    return make_config(broker, job=f"s{shards}-{uuid.uuid4().hex[:6]}", **{
        "ps.state_dir": tmp_path / f"ps{shards}", "ps.shards": shards, "training.model_spec": MODEL,
        "training.sync_policy": "sync", "training.seed": 5, "planner.min_devices": 2,
        "ps.broadcast": "snapshot", "ps.snapshot_dtype": "float32", "ps.eval_every": 0,
        "compressor.mode": "static", "compressor.default_codec": "none", "worker.max_steps": STEPS,
        "worker.ack_timeout_s": 5, **extra})


async def train(cfg: Config, tmp_path: Path) -> dict[str, np.ndarray]:
    """Planner, compressor, the PS (every shard, in this process) and two workers until both made STEPS steps;
    the whole model the servers end with."""
    servers = [ParameterServer(replace(cfg, ps=replace(cfg.ps, shard=i))) for i in range(cfg.ps.shards)]
    workers = [Worker(replace(cfg, worker=replace(cfg.worker, device=f"w{i}",
                                                  state_dir=str(tmp_path / f"{cfg.job}-w{i}")))) for i in range(2)]
    async with running(Planner(cfg), Compressor(cfg), *servers, *workers):
        await until("both workers' steps", lambda: all(w.stop.is_set() for w in workers), TRAIN_S)
    # a sync round is a round on every shard
    assert [s.version for s in servers] == [cfg.worker.max_steps] * cfg.ps.shards
    parts = [s.state.params for s in servers if s.state is not None]
    view = ShardedView(cfg.ps.shards)
    view.know(shapes_of(cfg.training.model_spec))
    return view.assemble(parts)


BN_MODEL = "digits-bn-sharded"
"""A digits CNN with batch norm: its running statistics and counter are rows of the model like its weights."""


@pytest.mark.parametrize("spec", [MODEL, BN_MODEL])
async def test_two_shards_train_exactly_what_one_server_trains(mosquitto_broker: BrokerProcess, tmp_path: Path,
                                                               spec: str) -> None:
    register_spec(layer_list_spec(BN_MODEL, [{"conv2d": 8, "kernel": 3, "padding": 1, "bias": False}, "batchnorm",
                                             "relu", {"maxpool2d": 2}, "flatten", {"linear": 32}, "batchnorm", "relu",
                                             {"linear": 10}], (1, 8, 8), 10))
    one = await train(sharded_config(mosquitto_broker, tmp_path, 1, **{"training.model_spec": spec}), tmp_path)
    two = await train(sharded_config(mosquitto_broker, tmp_path, 2, **{"training.model_spec": spec}), tmp_path)
    initial = models.get_params(models.build_model(spec, seed=5))
    assert any(not np.allclose(one[k], initial[k]) for k in one)  # it trained
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=0, atol=1e-6, err_msg=name)
    if spec == BN_MODEL:  # the statistics moved, on both shards alike, and the counter counts the steps
        assert not np.allclose(two["bn2.running_var"], 1.0)
        assert two["bn1.num_batches_tracked"].tolist() == [STEPS]


SPLIT_ACROSS: dict[str, tuple[int, ...]] = {"conv1": (8, 8, 0), "conv2": (16, 16, 0), "fc1": (30, 0, 34),
                                            "fc2": (5, 0, 5)}
"""Three members of a ``digits-cnn`` cluster beside two shards (shard 1 owns ``fc1.weight[28:]`` on): the first has
rows on both shards, the second on shard 0 alone (no unit of the dense layers), the third on shard 1 alone."""


@pytest.mark.parametrize(("broadcast", "rule", "policy"), [("delta", "mean", "sync"), ("snapshot", "clip", "sync"),
                                                        ("delta", "mean", "adaptive")])
async def test_a_model_parallel_cluster_trains_with_a_sharded_server(mosquitto_broker: BrokerProcess, tmp_path: Path,
                                                                     broadcast: str, rule: str, policy: str) -> None:
    """Each member sends every shard its rows there, an empty part where it has none, and takes its part of each
    shard's deltas; each shard joins a cluster step once every member's part is in, and the others take shard 0's
    steps by the same update (the first member's): a round is a round on every shard, none missing a part.
    Under ``clip`` shard 0 hears the other's part of each cluster update's norm. Then each member trains alone, on
    the whole model again."""
    cfg = sharded_config(mosquitto_broker, tmp_path, 2, **{"ps.broadcast": broadcast, "ps.aggregation": rule,
                                                          "training.sync_policy": policy,
                                                          "worker.max_steps": 0,
                                                          "worker.codec_wait_s": 0.1, "worker.mesh_timeout_s": 10})
    names = ["w0", "w1", "w2"]
    servers = [ParameterServer(replace(cfg, ps=replace(cfg.ps, shard=i))) for i in range(2)]
    workers = [Worker(replace(cfg, worker=replace(cfg.worker, device=d, state_dir=str(tmp_path / d)))) for d in names]
    async with inbox(cfg) as box, running(*servers, *workers):
        await box.publish(box.topics.plan(), mesh_plan(names, SPLIT_ACROSS, cluster="m-w0", batch=16), retain=True)
        await until("ten cluster steps on both shards", lambda: all(s.version >= 10 for s in servers) and all(
            w.accepted >= 10 for w in workers), TRAIN_S)
        sizes = [w.trainer.gradient_bytes for w in workers]
        # a plan that makes each member a cluster of its own: whole tensors again, from every shard
        await box.publish(box.topics.plan(), plan_for(names, version=2, batch=16), retain=True)
        before = [w.accepted for w in workers]
        await until("data-parallel steps", lambda: all(w.accepted >= b + 5 and not w.mesh.active
                                                       for w, b in zip(workers, before, strict=True)), TRAIN_S)
    assert abs(servers[0].version - servers[1].version) <= 1  # the follower at most one step behind at the stop
    assert servers[1].metrics.value("edgemesh_ps_shard_parts_missed_total") == 0
    assert servers[0].metrics.value("edgemesh_ps_shard_norms_missing_total") == 0
    # a member that heard no ack in time resent its part (a loaded host): each shard answers the resend with the
    # queued copy's ack and counts it, and rejects nothing else
    resends = sum(w.metrics.value("edgemesh_worker_resends_total") for w in workers)
    for s in servers:
        rejected = s.metrics.value("edgemesh_ps_rejected_total")
        assert rejected == s.metrics.value("edgemesh_ps_rejected_total", reason="queued") <= resends
        assert s.division is not None and s.state is not None
        start = s.division.take(models.get_params(models.build_model(MODEL, seed=5)))
        assert all(not np.allclose(s.state.params[k], start[k]) for k in start if k not in s.state.buffers), \
            "a shard's rows did not train"
    assert all(w.metrics.value("edgemesh_worker_mesh_steps_total", outcome="done") >= 10 for w in workers)
    # each member pushed only its rows; alone, the whole model
    whole = sum(p.numel() for p in models.build_model(MODEL).parameters()) * 4  # a gradient: the parameters alone
    assert sum(sizes) == whole and all(w.trainer.gradient_bytes == whole for w in workers)


async def test_a_shard_tells_shard_0_the_norm_of_a_clusters_whole_part_not_of_its_first_members(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """Under ``clip`` shard 1 measures a cluster's update once every member's part is in: the squared norm it tells
    shard 0 for the update (named by the first member's part) is that of all the members' rows it holds."""
    cfg = sharded_config(mosquitto_broker, tmp_path, 2, **{"ps.shard": 1, "ps.aggregation": "clip"})
    names = ["w0", "w1", "w2"]
    plan = mesh_plan(names, SPLIT_ACROSS, cluster="m-w0", batch=16)
    ps = ParameterServer(cfg)
    t = Topics(cfg.job, 1)
    async with running(ps), inbox(cfg, (t.norms_filter(), ShardNorms)) as box:
        await box.publish(Topics(cfg.job).plan(), plan, retain=True)
        await until("the plan", lambda: ps.plan is not None and ps.division is not None)
        assert ps.division is not None
        shapes, rows, expected = shapes_of(MODEL), member_rows(plan), 0.0
        for value, device in enumerate(names, start=1):  # w1 holds none of shard 1's rows: an empty part
            shards = []
            for span in ps.division.spans:
                start, stop = rows[device].get(span.param, (0, 0))
                a, b = max(start, span.start), min(stop, span.stop)
                if a < b:
                    n = (b - a) * math.prod(shapes[span.param][1:])
                    shards.append(ShardUpdate(param=span.param, start=a, stop=b, codec="none",
                                              data=np.full(n, value, np.float32).tobytes()))
                    expected += n * value**2
            await box.publish(t.grad("m-w0", device), GradientUpdate(
                device=device, cluster="m-w0", incarnation=1, seq=1, base_version=0, samples=16,
                shards=tuple(shards), mesh_step=5, plan_version=plan.version))
        told = await box.next(ShardNorms)
    assert [(p.device, p.seq) for p in told.parts] == [("w0", 1)]
    assert told.parts[0].squared == pytest.approx(expected, rel=1e-6)


async def test_krum_on_shards_scores_a_model_parallel_clusters_update_beside_devices_alone(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """Under ``krum`` shard 1 tells shard 0 its part of the distances between a round's updates, the cluster's by
    its first member's part: no distance is missing, no part is missed, and both shards take the same steps."""
    cfg = sharded_config(mosquitto_broker, tmp_path, 2, **{"ps.aggregation": "krum", "ps.krum_f": 1,
                                                          "worker.max_steps": 0, "worker.codec_wait_s": 0.1,
                                                          "worker.mesh_timeout_s": 10})
    members, alone = ["w0", "w1", "w2"], ["w3", "w4"]
    base = mesh_plan(members, SPLIT_ACROSS, cluster="m-w0", batch=16)
    plan = replace(base, devices=(*base.devices, *(PlanDevice(device=d, cluster=f"c-{d}", shard_index=0,
                                                              shard_count=1, batch_size=16) for d in alone)),
                   clusters=(*base.clusters, *(PlanCluster(cluster=f"c-{d}", members=(d,)) for d in alone)))
    servers = [ParameterServer(replace(cfg, ps=replace(cfg.ps, shard=i))) for i in range(2)]
    workers = [Worker(replace(cfg, worker=replace(cfg.worker, device=d, state_dir=str(tmp_path / d))))
               for d in members + alone]
    async with inbox(cfg) as box, running(*servers, *workers):
        await box.publish(box.topics.plan(), plan, retain=True)
        await until("eight rounds on both shards", lambda: all(s.version >= 8 for s in servers) and all(
            w.accepted >= 8 for w in workers), TRAIN_S)
    assert abs(servers[0].version - servers[1].version) <= 1
    assert servers[0].metrics.value("edgemesh_ps_shard_norms_missing_total") == 0
    assert servers[1].metrics.value("edgemesh_ps_shard_parts_missed_total") == 0
    assert all(s.metrics.value("edgemesh_ps_rejected_total") == 0 for s in servers)


async def norms_missing(shard_0: Child) -> float:
    """``edgemesh_ps_shard_norms_missing_total`` of a running shard 0 process: the updates (or pairs) its rule
    judged without another shard's part of their norm (or distance)."""
    samples = await asyncio.to_thread(scrape, shard_0.port_file)
    counted = [v for (name, _), v in samples.items() if name == "edgemesh_ps_shard_norms_missing_total"]
    assert len(counted) == 1, "shard 0 has no edgemesh_ps_shard_norms_missing_total"
    return counted[0]


@pytest.mark.parametrize(("victim", "rule"), [(1, "mean"), (0, "mean"), (0, "clip")])
async def test_a_shard_killed_with_9_under_a_model_parallel_cluster_recovers_and_the_cluster_trains_on(
        mosquitto_broker: BrokerProcess, tmp_path: Path, victim: int, rule: str) -> None:
    """The shards as processes, under the cluster of ``SPLIT_ACROSS``; one killed with -9 and started again: it
    resumes from its checkpoint and log, the members resend the parts it did not ack, and both shards go on
    taking the same cluster steps. Under ``clip`` a restarted shard 0 hears the cluster's norms again from shard 1
    as the first member resends its part (a step waiting for a norm it never gets would stop both shards)."""
    cfg = sharded_config(mosquitto_broker, tmp_path, 2, **{"ps.broadcast": "delta", "ps.checkpoint_every": 7,
                                                          "ps.aggregation": rule,
                                                          "worker.max_steps": 0, "worker.ack_timeout_s": 1,
                                                          "worker.codec_wait_s": 0.1, "worker.mesh_timeout_s": 10})
    names = ["w0", "w1", "w2"]
    cluster = LocalCluster(cfg, tmp_path)
    workers = [Worker(replace(cfg, worker=replace(cfg.worker, device=d, state_dir=str(tmp_path / d)))) for d in names]
    shards = [Topics(cfg.job, i) for i in range(2)]
    try:
        for i in range(2):
            cluster.spawn("ps", f"ps-{i}", ["--state-dir", str(cluster.ps_state_dir), "--shard", f"{i}/2"])
        async with inbox(cfg, *((t.model_filter(), ModelSnapshot) for t in shards),
                         *((t.delta_filter(), ModelDelta) for t in shards)) as box:
            def versions() -> list[int]:
                return [max((m.version for m in box.of((ModelSnapshot, ModelDelta), lambda t, i=i: t.shard == i)),
                            default=-1) for i in range(2)]

            await box.publish(box.topics.plan(), mesh_plan(names, SPLIT_ACROSS, cluster="m-w0", batch=16),
                              retain=True)
            async with running(*workers):
                await box.until(f"shard {victim} past its first checkpoint", lambda: versions()[victim] >= 9, TRAIN_S)
                killed = next(c for c in cluster.children if c.name == f"ps-{victim}")
                # clip: shard 0 judges no update on a part of its norm; a shard 0 about to be killed says so first
                unmeasured = await norms_missing(killed) if victim == 0 else 0.0
                killed.proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(killed.proc.wait, 30)
                at_kill = min(w.accepted for w in workers)
                cluster.spawn("ps", f"ps-{victim}", ["--state-dir", str(cluster.ps_state_dir), "--shard",
                                                     f"{victim}/2"])
                await until("ten more cluster steps", lambda: all(w.accepted >= at_kill + 10 for w in workers),
                            TRAIN_S)
            await box.until("both shards at the same version", lambda: versions()[0] == versions()[1])
            shard_0 = next(c for c in reversed(cluster.children) if c.name == "ps-0")  # the one running now
            assert unmeasured + await norms_missing(shard_0) == 0
        logs = [(tmp_path / f"{cfg.job}-ps-{i}.log").read_text() for i in range(2)]
        assert "resumed from checkpoint" in logs[victim]
    finally:
        cluster.stop()


async def test_a_shard_refuses_rows_it_does_not_own_and_acks_on_its_own_topic(mosquitto_broker: BrokerProcess,
                                                                              tmp_path: Path) -> None:
    cfg = sharded_config(mosquitto_broker, tmp_path, 2, **{"ps.shard": 1, "training.sync_policy": "async"})
    ps = ParameterServer(cfg)
    t = Topics(cfg.job, 1)
    async with running(ps), inbox(cfg, (t.ack_filter("a"), UpdateAck), (t.model_filter(), ModelSnapshot)) as box:
        await box.publish(Topics(cfg.job).plan(), plan_for(["a"]))
        snap = await box.next(ModelSnapshot)
        assert ps.division is not None and set(snap.tensors) == {s.param for s in ps.division.spans}
        whole = gradient("a", 1, 0)  # every tensor whole: most rows are shard 0's
        await box.publish(t.grad("c-a", "a"), whole)
        ack = await box.next(UpdateAck)
        assert (ack.seq, ack.status, ack.reason) == (1, "discarded", "shape")
        assert ps.metrics.value("edgemesh_ps_rejected_total", reason="shape") == 1
        rows = gradient("a", 2, 0, spans=[(s.param, s.start, s.stop) for s in ps.division.spans])
        await box.publish(t.grad("c-a", "a"), rows)
        await until("the update held for shard 0's step", lambda: len(ps.scheduler.pending()) == 1)
        assert not [a for a in box.of(UpdateAck) if a.seq == 2] and ps.version == 0  # shard 0 has not stepped
        # this test stands in for shard 0: its step 1 took update 2 with weight 1
        await box.publish(Topics(cfg.job).steps(), ShardSteps(version=1, policy="async", steps=(
            StepRecord(version=1, parts=(StepPart(device="a", incarnation=1, seq=2, weight=1.0),)),)), retain=True)
        ack = await box.next(UpdateAck)
        assert (ack.seq, ack.status) == (2, "accepted")
        await until("the shard's version 1", lambda: ps.version == 1)


@pytest.mark.parametrize("victim", [1, 0])
async def test_a_shard_killed_with_9_recovers_alone_and_the_model_is_still_exact(mosquitto_broker: BrokerProcess,
                                                                                  tmp_path: Path, victim: int) -> None:
    """Shards as processes of their own; one killed with -9 in the middle of training and started again: it
    resumes from its checkpoint and log, the workers resend what it did not ack, the other never stops, and the
    model both end with is the one a single server trains from the same seeds. Shard 0, which decides the steps,
    publishes its latest again when it is back: the other may have missed the last before the kill."""
    steps = 40
    one = await train(sharded_config(mosquitto_broker, tmp_path, 1, **{"worker.max_steps": steps}), tmp_path)
    cfg = sharded_config(mosquitto_broker, tmp_path, 2, **{"worker.max_steps": steps, "ps.checkpoint_every": 7,
                                                          "worker.ack_timeout_s": 1})
    cluster = LocalCluster(cfg, tmp_path)
    workers = [Worker(replace(cfg, worker=replace(cfg.worker, device=f"w{i}",
                                                  state_dir=str(tmp_path / f"w{i}")))) for i in range(2)]
    shards = [Topics(cfg.job, i) for i in range(2)]
    try:
        cluster.start_services(min_devices=2)
        async with inbox(cfg, *((t.model_filter(), ModelSnapshot) for t in shards)) as box:
            def latest(shard: int) -> ModelSnapshot | None:
                return next(iter(reversed(box.of(ModelSnapshot, lambda m: m.shard == shard))), None)

            async with running(*workers):
                await box.until(f"shard {victim} past its first checkpoint",
                                lambda: (s := latest(victim)) and s.version >= 9, TRAIN_S)
                killed = next(c for c in cluster.children if c.name == f"ps-{victim}")
                killed.proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(killed.proc.wait, 30)
                at_kill = latest(1 - victim)
                cluster.spawn("ps", f"ps-{victim}", ["--state-dir", str(cluster.ps_state_dir), "--shard",
                                                     f"{victim}/2"])
                await until("both workers' steps", lambda: all(w.stop.is_set() for w in workers), TRAIN_S)
            await box.until("both shards' last version", lambda: all(
                (s := latest(i)) and s.version == steps for i in range(2)))
            assert at_kill is not None and at_kill.version < steps  # the other trained on around the restart
            parts = [{k: t.to_numpy() for k, t in latest(i).tensors.items()} for i in range(2)]  # type: ignore[union-attr]
        assert "resumed from checkpoint" in (tmp_path / f"{cfg.job}-ps-{victim}.log").read_text()
    finally:
        cluster.stop()
    view = ShardedView(2)
    view.know(shapes_of(MODEL))
    two = view.assemble(parts)
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=0, atol=1e-6, err_msg=name)


def mixed_plan(version: int = 1) -> Plan:
    """``w0`` and ``w1`` one model-parallel cluster divided by ``SPLIT_TWO``, ``w2`` a cluster of its own: the
    demo's shape under ``planner.parallelism = mesh``."""
    return Plan(version=version, created=time.time(), model_spec=MODEL, dataset="digits", sync_policy="sync",
                devices=(PlanDevice(device="w0", cluster="m-w0", shard_index=0, shard_count=2, batch_size=16),
                         PlanDevice(device="w1", cluster="m-w0", shard_index=0, shard_count=2, batch_size=16),
                         PlanDevice(device="w2", cluster="c-w2", shard_index=1, shard_count=2, batch_size=16)),
                clusters=(PlanCluster(cluster="m-w0", members=("w0", "w1"), division=tuple(
                    LayerDivision(layer=k, counts=v) for k, v in SPLIT_TWO.items())),
                          PlanCluster(cluster="c-w2", members=("w2",))))


SPLIT_TWO: dict[str, tuple[int, ...]] = {"conv1": (10, 6), "conv2": (12, 20), "fc1": (40, 24), "fc2": (6, 4)}


async def train_mixed(cfg: Config, tmp_path: Path) -> dict[str, np.ndarray]:
    """Every shard and three workers under ``mixed_plan`` until each made STEPS accepted steps; the whole model."""
    servers = [ParameterServer(replace(cfg, ps=replace(cfg.ps, shard=i))) for i in range(cfg.ps.shards)]
    workers = [Worker(replace(cfg, worker=replace(cfg.worker, device=d, state_dir=str(tmp_path / f"{cfg.job}-{d}"))))
               for d in ("w0", "w1", "w2")]
    async with inbox(cfg) as box, running(*servers, *workers):
        await box.publish(box.topics.plan(), mixed_plan(), retain=True)
        await until("every worker's steps", lambda: all(w.stop.is_set() for w in workers), TRAIN_S)
    assert [s.version for s in servers] == [STEPS] * cfg.ps.shards
    view = ShardedView(cfg.ps.shards)
    view.know(shapes_of(MODEL))
    return view.assemble([s.state.params for s in servers if s.state is not None])


@pytest.mark.parametrize("scaling", ["linear", "none"])
async def test_a_model_parallel_cluster_beside_a_device_trains_on_shards_exactly_what_one_server_trains(
        mosquitto_broker: BrokerProcess, tmp_path: Path, scaling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's shape under ``planner.parallelism = mesh`` (a cluster of two beside a device alone): two shards
    end with the model one server ends with. The cluster's leader numbers its steps from a fixed clock here, so that
    both runs draw the same batches."""
    monkeypatch.setattr(session, "time", SimpleNamespace(time_ns=lambda: 1_000_000_000_000,
                                                         perf_counter=time.perf_counter))
    extra = {"ps.round_scaling": scaling, "worker.codec_wait_s": 0.1, "worker.mesh_timeout_s": 10}
    one = await train_mixed(sharded_config(mosquitto_broker, tmp_path / "one", 1, **extra), tmp_path / "one")
    two = await train_mixed(sharded_config(mosquitto_broker, tmp_path / "two", 2, **extra), tmp_path / "two")
    initial = models.get_params(models.build_model(MODEL, seed=5))
    assert any(not np.allclose(one[k], initial[k]) for k in one)
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=0, atol=1e-5, err_msg=name)
