"""A submitted job in mesh mode: a user's layer-list model, divided unevenly among three members of one
model-parallel cluster, trained by hosts that serve submitted jobs (on a real broker, in this process)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

from helpers import inbox, make_config, mesh_plan

from edgemesh.common import costs
from edgemesh.common.config import Config
from edgemesh.common.jobs import parse_job, render_job
from edgemesh.common.messages import JobState, Plan
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


@contextlib.asynccontextmanager
async def hosts(config: Config) -> AsyncIterator[dict[str, JobHost]]:
    ps = JobHost("ps", config, ps_jobs.for_job)
    board = JobBoard(ps)
    workers = {d: JobHost("worker", dataclasses.replace(config, worker=dataclasses.replace(
        config.worker, device=d)), worker_command.for_job, device=d) for d in DEVICES}
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
