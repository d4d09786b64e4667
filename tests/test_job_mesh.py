"""A submitted job in mesh mode: a user's layer-list model, divided unevenly among three members of one
model-parallel cluster, trained by hosts that serve submitted jobs (on a real broker, in this process); also on
members holding different classes in their own npz files, each step on one member's batch, in turn."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from helpers import inbox, make_config, mesh_plan

from edgemesh.common import costs
from edgemesh.common.config import Config
from edgemesh.common.data import load_dataset
from edgemesh.common.errors import JobError
from edgemesh.common.jobs import parse_job, render_job
from edgemesh.common.messages import JobState, MeshSlice, Plan
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.operator.job import submission_of
from edgemesh.services.host import JobHost
from edgemesh.services.parameter_server import jobs as ps_jobs
from edgemesh.services.parameter_server.jobs import JobBoard
from edgemesh.services.worker import command as worker_command
from edgemesh.services.worker.service import Worker

TRAIN_S = 90.0
DEVICES = ("m0", "m1", "m2")
MODEL = {"input_shape": [1, 8, 8], "classes": [str(d) for d in range(10)],
         "layers": [{"conv2d": 12, "kernel": 3, "padding": 1}, "relu", {"avgpool2d": 2}, "flatten",
                    {"linear": 24}, "tanh", {"linear": 10}]}
DIVISION = {"conv1": (2, 7, 3), "fc1": (12, 1, 11), "fc2": (3, 3, 4)}
"""Uneven: a member with 2 of 12 filters, another with 1 of 24 features."""


CLASSES = {"m0": (0, 1, 2), "m1": (3, 4, 5, 6), "m2": (7, 8, 9)}
"""The digits each device holds in its own data."""


@contextlib.asynccontextmanager
async def hosts(config: Config, data_dirs: dict[str, str] | None = None) -> AsyncIterator[dict[str, JobHost]]:
    ps = JobHost("ps", config, ps_jobs.for_job)
    board = JobBoard(ps)
    workers = {d: JobHost("worker", dataclasses.replace(config, worker=dataclasses.replace(
        config.worker, device=d, data_dir=(data_dirs or {}).get(d, config.worker.data_dir))),
        worker_command.for_job, device=d) for d in DEVICES}
    tasks = [asyncio.create_task(ps.run(extra=board.attach))] + [asyncio.create_task(w.run()) for w in workers.values()]
    try:
        yield {"ps": ps, **workers}
    finally:
        for host in (ps, *workers.values()):
            host.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)


async def test_a_layer_list_job_trains_in_one_model_parallel_cluster_of_uneven_members(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    config = make_config(mosquitto_broker, job="", **{
        "ps.state_dir": tmp_path, "worker.ack_timeout_s": "5", "worker.codec_wait_s": "0.1",
        "worker.mesh_timeout_s": "10"})
    spec = parse_job(render_job({
        "job": {"name": "mesh-job", "max_versions": 100000}, "model": MODEL,
        "data": {"format": "digits", "mean": [0.3055], "std": [0.3761]}, "evaluation": {"every": 5},
        "training": {"sync_policy": "sync", "lr": 0.05}, "planner": {"parallelism": "mesh"}}))
    submission = dataclasses.replace(submission_of(spec, search_path=[]), submitted_at=time.time())
    assert [la.name for la in submission.layers] == list(DIVISION)  # the figures mesh divides by travel along
    client = dataclasses.replace(config, job="mesh-job")
    async with hosts(config) as running, inbox(client, (Topics("mesh-job").job_state_filter(), JobState)) as box:
        await box.publish(Topics("mesh-job").job_file(), submission, retain=True)
        await box.next(JobState, lambda s: s.state == "running")
        # the plan of one model-parallel cluster (the planner's grid is tested on its own)
        plan = dataclasses.replace(mesh_plan(list(DEVICES), DIVISION, cluster="m-m0", batch=16),
                                   model_spec=spec.model_key)
        assert isinstance(plan, Plan)
        await box.publish(Topics("mesh-job").plan(), plan, retain=True)
        ps = running["ps"]

        def members() -> list[Worker]:
            return [w for d in DEVICES if isinstance(w := running[d].service, Worker)]

        await box.until("ten cluster steps", lambda: ps.service is not None and len(members()) == 3
                        and getattr(ps.service, "version", 0) >= 10 and all(w.accepted >= 10 for w in members()),
                        TRAIN_S)
        workers = members()
        sizes = [w.trainer.gradient_bytes for w in workers]
        done = [w.metrics.value("edgemesh_worker_mesh_steps_total", outcome="done") for w in workers]
    assert all(d >= 10 for d in done)
    # each member pushed its own rows only: together, the whole model once
    assert sum(sizes) == costs.cost(spec.model_key).params * 4


def write_npz(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=x.astype(np.float32), y=y.astype(np.int64))


async def test_a_cluster_of_members_holding_different_classes_trains_on_each_members_batches_in_turn(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    train, held_out = load_dataset("digits", seed=0)
    for d, classes in CLASSES.items():  # each device its own classes, in its own file
        mine = np.isin(train.y, classes)
        write_npz(tmp_path / d / "own.npz", train.x[mine], train.y[mine])
    write_npz(tmp_path / "ps-data" / "held.npz", held_out.x, held_out.y)  # every class
    config = make_config(mosquitto_broker, job="", **{
        "ps.state_dir": tmp_path / "ps", "ps.data_dir": tmp_path / "ps-data", "worker.ack_timeout_s": "5",
        "worker.codec_wait_s": "0.1", "worker.mesh_timeout_s": "10"})
    spec = parse_job(render_job({
        "job": {"name": "mesh-own", "max_versions": 100000}, "model": MODEL,
        "data": {"format": "npz", "path": "own.npz", "mean": [0.3055], "std": [0.3761]},
        "evaluation": {"path": "held.npz", "every": 5},
        "training": {"sync_policy": "sync", "lr": 0.05}, "planner": {"parallelism": "mesh"}}))
    submission = dataclasses.replace(submission_of(spec, search_path=[]), submitted_at=time.time())
    client = dataclasses.replace(config, job="mesh-own")
    topics = Topics("mesh-own")
    async with hosts(config, {d: str(tmp_path / d) for d in DEVICES}) as running, inbox(
            client, (topics.job_state_filter(), JobState),
            (topics.mesh_filter("m-m0", "+", "input", "+"), MeshSlice)) as box:
        await box.publish(topics.job_file(), submission, retain=True)
        await box.next(JobState, lambda s: s.state == "running")
        plan = dataclasses.replace(mesh_plan(list(DEVICES), DIVISION, cluster="m-m0", batch=16),
                                   model_spec=spec.model_key)
        await box.publish(topics.plan(), plan, retain=True)
        ps = running["ps"]

        def accuracy() -> float:
            return getattr(ps.service, "last_accuracy", None) or 0.0

        # chance is 0.1 on held-out digits of every class; no device holds more than four of them
        await box.until("accuracy well above chance", lambda: accuracy() >= 0.6, 3 * TRAIN_S)
        workers = [w for d in DEVICES if isinstance(w := running[d].service, Worker)]
        inputs = [(t.device, m) for t, m in box.received if isinstance(m, MeshSlice)]
    assert len(workers) == 3
    # each step's batch came from one member, member step % 3 in turn, and held that member's classes alone
    steps = [m.step for _, m in inputs]
    assert len(steps) == len(set(steps)) >= 10
    for device, msg in inputs:
        assert device == DEVICES[msg.sender] and msg.sender == msg.step % 3, (device, msg.step)
        assert msg.labels is not None and set(msg.labels.to_numpy().tolist()) <= set(CLASSES[device])
        assert msg.tensor.shape == (16, 1, 8, 8)
    assert {d for d, _ in inputs} == set(DEVICES)


def test_a_mesh_job_whose_model_the_grid_cannot_divide_is_refused_unless_it_allows_data_parallel(
        capsys: pytest.CaptureFixture[str]) -> None:
    """At submit: a group-norm model under ``parallelism = "mesh"`` is refused naming the layer and the way out;
    with ``mesh_fallback = true`` it is taken, and the operator told it will train data parallel."""
    model = {"input_shape": [1, 8, 8], "classes": [str(d) for d in range(10)],
             "layers": [{"conv2d": 8, "kernel": 3, "padding": 1}, {"groupnorm": 2}, "relu", "globalavgpool",
                        {"linear": 10}]}
    job = {"job": {"name": "grouped"}, "model": model, "data": {"format": "digits"}}
    with pytest.raises(JobError, match=r"cannot divide module 'gn1'.*planner.mesh_fallback = true"):
        submission_of(parse_job(render_job({**job, "planner": {"parallelism": "mesh"}})), search_path=[])
    taken = submission_of(parse_job(render_job({**job, "planner": {"parallelism": "mesh", "mesh_fallback": True}})),
                          search_path=[])
    assert taken.refusal and not taken.layers
    assert "it will train data parallel (planner.mesh_fallback)" in capsys.readouterr().err
