"""Workers training model-parallel end to end (``worker/mesh/session.py`` with the worker and the
parameter server, on real brokers): a cluster of three trains one model, then each member alone;
the first member starts a plan only once every member is ready."""

from __future__ import annotations

import time
from pathlib import Path

from helpers import SPLIT, devices, inbox, make_config, mesh_plan, running

from edgemesh.common import costs
from edgemesh.common.config import Config
from edgemesh.common.messages import MeshBegin, MeshReady, Plan, PlanCluster, PlanDevice
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.worker.service import Worker

JOB = "meshe2e"
TRAIN_S = 60.0
"""How long the workers may take to train the steps a test waits for."""


def ps_config(broker: BrokerProcess, tmp_path: Path) -> Config:
    return make_config(broker, job=JOB, **{"ps.state_dir": tmp_path / "ps", "ps.eval_every": 0,
                                           "training.sync_policy": "sync", "ps.broadcast": "delta"})


def worker_config(broker: BrokerProcess, device: str, **settings: str) -> Config:
    return make_config(broker, job=JOB, **{"worker.device": device, "worker.ack_timeout_s": "5",
                                           "worker.codec_wait_s": "0.1", "worker.mesh_timeout_s": "10", **settings})


async def test_three_workers_train_one_model_parallel_cluster(broker: BrokerProcess, tmp_path: Path) -> None:
    counts = {"conv1": (8, 5, 3), "conv2": (4, 18, 10), "fc1": (30, 20, 14), "fc2": (4, 3, 3)}
    names = ["w0", "w1", "w2"]
    cfg = ps_config(broker, tmp_path)
    ps = ParameterServer(cfg)
    workers = [Worker(worker_config(broker, d)) for d in names]
    async with devices(cfg, []) as c, running(ps, *workers):
        await c.publish(c.topics.plan(), mesh_plan(names, counts, cluster="m-w0", batch=16), retain=True)
        await c.until("ten cluster steps", lambda: ps.version >= 10 and all(w.accepted >= 10 for w in workers),
                      TRAIN_S)
        cluster_steps = ps.version
        sizes = [w.trainer.gradient_bytes for w in workers]
        # a new plan makes every member its own cluster: each goes back to the whole model
        alone = Plan(version=2, created=time.time(), model_spec="digits-cnn", dataset="digits", sync_policy="sync",
                     devices=tuple(PlanDevice(device=d, cluster=f"c-{d}", shard_index=i, shard_count=3,
                                              batch_size=16) for i, d in enumerate(names)),
                     clusters=tuple(PlanCluster(cluster=f"c-{d}", members=(d,)) for d in names))
        await c.publish(c.topics.plan(), alone, retain=True)
        before = [w.accepted for w in workers]
        await c.until("data-parallel steps", lambda: all(
            w.accepted >= b + 5 and not w.mesh.active
            for w, b in zip(workers, before, strict=True)), TRAIN_S)
    # one version per cluster step: every member's update of a step went into the same version
    assert cluster_steps <= min(before) + 1
    assert all(w.metrics.value("edgemesh_worker_mesh_steps_total", outcome="done") >= 10 for w in workers)
    # each member pushed only its slices; alone, the whole model
    assert sum(sizes) == costs.cost("digits-cnn").params * 4
    assert all(w.trainer.gradient_bytes == costs.cost("digits-cnn").params * 4 for w in workers)


async def test_the_first_member_starts_a_plan_only_once_every_member_is_ready(broker: BrokerProcess,
                                                                              tmp_path: Path) -> None:
    # a step announced before a member has subscribed is lost to it: the first member waits for
    # the others' retained readiness (worker.mesh_timeout_s, long here, would start it anyway)
    names, cluster = ["w0", "w1"], "m-w0"
    cfg = ps_config(broker, tmp_path)
    topics = Topics(cfg.job)
    ps = ParameterServer(cfg)
    workers = {d: Worker(worker_config(broker, d, **{"worker.mesh_timeout_s": "120"})) for d in names}
    leader = workers["w0"]
    # every step message, in the broker's order
    async with running(ps), devices(cfg, []) as c, inbox(
            cfg, (topics.mesh_filter(cluster, "step", "+", "+"), (MeshReady, MeshBegin)), name="recorder") as recorder:
        async with running(leader):
            await c.publish(c.topics.plan(), mesh_plan(names, SPLIT, cluster=cluster, batch=16), retain=True)
            await c.until("the first member in the cluster, holding the model",
                          lambda: leader.mesh.active and leader.view.ready,
                          TRAIN_S)
            async with running(workers["w1"]):  # seconds later: it measures itself first
                await c.until("two cluster steps", lambda: ps.version >= 2 and all(
                    w.accepted >= 2 for w in workers.values()), TRAIN_S)
        seen = [(t.phase, t.device) for t, _ in recorder.received]
    assert ("ready", "w1") in seen and ("begin", "w0") in seen, seen
    assert seen.index(("ready", "w1")) < seen.index(("begin", "w0")), seen
    assert workers["w1"].metrics.value("edgemesh_worker_mesh_steps_total", outcome="done") >= 2
