"""No job takes a service down (docs/reliability.md#crash-memory, docs/jobs.md#memory-budget).

A job whose allowed model code kills the process (``os.abort`` while the model is built) kills its host once: the
host remembers the run across its restart, fails it (the parameter server's host) or leaves it (a worker's), and
serves the next job. A model over a host's memory budget is refused before it is built, whatever cost the
submission declares. An exception in a step of a job's service (``MemoryError`` in a worker's forward pass,
``RecursionError`` in the parameter server's evaluation, any ``BaseException`` but a cancellation) ends the job on
that host, which serves the next. Real processes where a process dies; the pure parts (the crash marker's rule,
the estimate) on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import inbox, make_config, running, until
from torch import nn

from edgemesh.common.config import Config
from edgemesh.common.errors import EdgeMeshError, ModelError
from edgemesh.common.jobs import JobSpec, parse_job, render_job
from edgemesh.common.messages import ControlCommand, ControlReply, DeviceStatus, JobState, JobSubmission, ModelSnapshot
from edgemesh.common.messages.jobs import JobPhase
from edgemesh.common.models import ModelSpec
from edgemesh.common.models.derived_costs import meta_costs
from edgemesh.common.topics import Topics, all_job_states_filter
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.demo import DIGITS_MODEL, DIGITS_NORMALIZATION
from edgemesh.local.processes import Child, LocalCluster, peak_rss_kb
from edgemesh.operator.job import submission_of
from edgemesh.services.budget import MemoryBudget
from edgemesh.services.crash_memory import CRASH_LOOP_S, RUNNING_DEATHS, CrashMemory, Marker, Run
from edgemesh.services.host import ActiveJob, JobHost, survivable
from edgemesh.services.parameter_server import jobs as ps_jobs
from edgemesh.services.parameter_server.jobs import JobBoard
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker import command as worker_command

PROCESS_WAIT_S = 120.0
"""How long a real service process may take to start (torch's import on a loaded two-core host) and act."""
TRAIN_WAIT_S = 90.0
"""How long a job on digits may take to train a few versions with in-process services on a loaded host."""
DIGITS_DATA = {"format": "digits", **DIGITS_NORMALIZATION}
ABORTING_MODULE = '''
import os

from torch import nn


def build(num_classes):
    os.abort()  # the process ends here: no except, no finally
    return nn.Linear(64, num_classes)
'''
STEP_BOMBS_MODULE = '''
from torch import nn


class OutOfMemoryInTraining(nn.Module):
    """Fine on the one-sample probes; a training batch raises MemoryError."""

    def forward(self, x):
        if self.training and x.shape[0] > 1:
            raise MemoryError("a training batch did not fit")
        return x


class RecursesInEvaluation(nn.Module):
    """Fine in training; an evaluation batch recurses without end."""

    def forward(self, x):
        if not self.training and x.shape[0] > 1:
            return self.forward(x)
        return x


def memory():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10), OutOfMemoryInTraining())


def recursion():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10), RecursesInEvaluation())
'''
BIG_MODULE = '''
from torch import nn


def build(num_classes):
    return nn.Sequential(nn.Linear(1000, 1_000_000), nn.Linear(1_000_000, num_classes))
'''
"""1,003,000,002 parameters (4 GB of float32) from a (1000,) input, the 1.28e9-parameter job's kind: allowed code
(a layer list is bounded to fewer parameters when the job is read)."""
BIG_PARAMS = 1_003_000_002
BIG_INPUT = {"input_shape": [1000], "classes": ["a", "b"]}
BIG_DATA = {"format": "csv", "path": "huge.csv"}


def job_tree(name: str, model: dict[str, Any], data: dict[str, Any] | None = None, **job: Any) -> dict[str, Any]:
    tree: dict[str, Any] = {"job": {"name": name, **job}, "model": model, "data": data or DIGITS_DATA}
    if data is not None and data["format"] != "digits":
        tree["evaluation"] = {"local_share": 0.2}
    return tree


def declared(tree: dict[str, Any], params: int = 1000) -> tuple[JobSpec, JobSubmission]:
    """A job and a submission declaring what its submitter says the model costs (nothing is built here: the model
    may kill the process that builds it)."""
    spec = parse_job(render_job(tree))
    return spec, JobSubmission(name=spec.name, source=spec.source.encode(), sha256=spec.sha256,
                               submitted_at=time.time(), params=params, macs_per_sample=params,
                               activations_per_sample=10)


def good_job(name: str) -> JobSubmission:
    """A layer-list job on digits, its costs derived as ``edgemesh job submit`` derives them."""
    spec = parse_job(render_job(job_tree(name, DIGITS_MODEL, max_versions=100000)))
    return dataclasses.replace(submission_of(spec, search_path=[]), submitted_at=time.time())


def running_state(sub: JobSubmission, state: JobPhase = "running") -> JobState:
    """The state the parameter server's host publishes (a test standing in for it, before a lone worker)."""
    return JobState(name=sub.name, state=state, sha256=sub.sha256, submitted_at=sub.submitted_at,
                    started_at=time.time(), updated_at=time.time())


def write_module(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(text)
    return folder


def trusting(broker: BrokerProcess, modules: Path, allowed: str, **settings: object) -> Config:
    """A host configuration that allows the entry points of ``allowed`` in ``modules`` (the operator installed
    them there)."""
    return make_config(broker, job="", **{"models.allowed": allowed, "models.path": modules, **settings})


def client(config: Config) -> Config:
    """The test's own client of the broker (its topics name a job of its own)."""
    return dataclasses.replace(config, job="client")


@contextlib.contextmanager
def processes(config: Config, workdir: Path) -> Iterator[LocalCluster]:
    """Real service processes serving submitted jobs (as systemd runs them), stopped at the end."""
    cluster = LocalCluster(dataclasses.replace(config, job="crash-safety"), workdir, serve_jobs=True)
    try:
        yield cluster
    finally:
        cluster.stop()


async def died(child: Child) -> int:
    """The exit code of a process a job killed (negative: the signal)."""
    await until(f"{child.name} to die", lambda: child.proc.poll() is not None, PROCESS_WAIT_S)
    return child.proc.returncode


# --------------------------------------------------------------------------- crash memory, real processes


@pytest.mark.e2e
@pytest.mark.timeout(2 * PROCESS_WAIT_S)
async def test_a_parameter_server_a_job_aborts_while_building_fails_it_after_its_restart_and_serves_the_next(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """``os.abort`` in an allowed entry point used to end the parameter server's host with code 134 at every
    restart (the retained job is read again) until systemd gave up on the unit."""
    modules = write_module(tmp_path / "models", "abort_ps", ABORTING_MODULE)
    config = trusting(mosquitto_broker, modules, "abort_ps")
    state_dir = tmp_path / "ps-state"
    model = {"input_shape": [1, 8, 8], "classes": [str(d) for d in range(10)], "entry_point": "abort_ps:build"}
    _, crash = declared(job_tree("killer", model))
    good = good_job("after")
    with processes(config, tmp_path) as cluster:
        ps = cluster.spawn("ps", "ps", ["--state-dir", str(state_dir)])
        async with inbox(client(config), (all_job_states_filter(), JobState),
                         (Topics("after").model_filter(), ModelSnapshot)) as box:
            await box.publish(Topics("killer").job_file(), crash, retain=True)
            assert await died(ps) == -signal.SIGABRT
            cluster.children.remove(ps)
            again = cluster.spawn("ps", "ps", ["--state-dir", str(state_dir)])  # what systemd does
            failed = await box.next(JobState, lambda s: s.name == "killer" and s.ended, PROCESS_WAIT_S)
            assert failed.state == "failed"
            assert failed.reason.startswith("the parameter server died while starting it (process ")
            await box.publish(Topics("after").job_file(), good, retain=True)
            await box.next(JobState, lambda s: s.name == "after" and s.state == "running", PROCESS_WAIT_S)
            snapshot = await box.next(ModelSnapshot, timeout_s=PROCESS_WAIT_S)  # the PS serves the next job
            assert snapshot.model_spec == parse_job(good.source).model_key
            assert again.proc.poll() is None
            assert all(s.state == "failed" for s in box.of(JobState) if s.name == "killer" and s.ended)


@pytest.mark.e2e
@pytest.mark.timeout(3 * PROCESS_WAIT_S)
async def test_a_worker_a_job_aborts_while_building_leaves_it_after_its_restart_for_good_and_serves_the_next(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """The worker's host dies with the job once; restarted, it leaves the job naming why, and restarted again
    while the job still runs it leaves it again without building the model; the next job it serves. The test
    stands in for the parameter server's host (the job's retained state)."""
    modules = write_module(tmp_path / "models", "abort_worker", ABORTING_MODULE)
    config = trusting(mosquitto_broker, modules, "abort_worker")
    model = {"input_shape": [1, 8, 8], "classes": [str(d) for d in range(10)], "entry_point": "abort_worker:build"}
    _, crash = declared(job_tree("killer", model))
    good = good_job("after")
    worker_flags = ["--device", "w1", "--set", f"worker.state_dir={tmp_path / 'w1-state'}"]
    with processes(config, tmp_path) as cluster:
        worker = cluster.spawn("worker", "w1", worker_flags)
        async with inbox(client(config), (Topics("killer").status_filter(), DeviceStatus),
                         (Topics("after").status_filter(), DeviceStatus)) as box:
            await box.publish(Topics("killer").job_file(), crash, retain=True)
            await box.publish(Topics("killer").job_state(), running_state(crash), retain=True)
            assert await died(worker) == -signal.SIGABRT
            cluster.children.remove(worker)
            restarted = time.time()
            worker = cluster.spawn("worker", "w1", worker_flags)
            left = await box.next(DeviceStatus, lambda s: s.state == "left" and s.time >= restarted, PROCESS_WAIT_S)
            assert left.device == "w1" and left.reason.startswith("device w1 died while starting it (process ")
            # killed for another reason while the job still runs: it does not try the job again
            worker.proc.kill()
            worker.proc.wait()
            cluster.children.remove(worker)
            restarted = time.time()
            worker = cluster.spawn("worker", "w1", worker_flags)
            again = await box.next(DeviceStatus, lambda s: s.state == "left" and s.time >= restarted, PROCESS_WAIT_S)
            assert again.reason == left.reason
            # the job ends; the next one this worker serves
            await box.publish(Topics("killer").job_state(), running_state(crash, "failed"), retain=True)
            await box.publish(Topics("after").job_file(), good, retain=True)
            await box.publish(Topics("after").job_state(), running_state(good), retain=True)
            online = await box.next(DeviceStatus, lambda s: s.state == "online" and s.time >= restarted,
                                    PROCESS_WAIT_S)
            assert online.device == "w1"
            assert worker.proc.poll() is None


# --------------------------------------------------------------------------- memory budget


@pytest.mark.e2e
async def test_a_model_over_the_parameter_servers_memory_budget_fails_unbuilt_whatever_it_declares(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """A job with a layer of a billion parameters, declaring a thousand, took the parameter server to 8.4 GB. The
    host measures the model itself on the meta device and refuses it, naming its budget and the estimate; its
    memory stays far below the model's 4 GB of parameters, and the next job runs."""
    modules = write_module(tmp_path / "models", "big_ps", BIG_MODULE)
    config = trusting(mosquitto_broker, modules, "big_ps", **{"ps.memory_limit_mb": 1024})
    _, big = declared(job_tree("huge", {**BIG_INPUT, "entry_point": "big_ps:build"}, BIG_DATA), params=1000)
    good = good_job("after")
    with processes(config, tmp_path) as cluster:
        ps = cluster.spawn("ps", "ps", ["--state-dir", str(tmp_path / "ps-state")])
        async with inbox(client(config), (all_job_states_filter(), JobState),
                         (Topics("after").model_filter(), ModelSnapshot)) as box:
            await box.publish(Topics("huge").job_file(), big, retain=True)
            failed = await box.next(JobState, lambda s: s.name == "huge" and s.ended, PROCESS_WAIT_S)
            peak = peak_rss_kb(ps.proc.pid) * 1024
            assert failed.state == "failed"
            assert "over this host's memory budget" in failed.reason and f"{BIG_PARAMS:,} parameters" in failed.reason
            assert "the budget is 1024 MiB (ps.memory_limit_mb)" in failed.reason
            assert 0 < peak < 4 * BIG_PARAMS / 4, f"peak RSS {peak / 2**20:.0f} MiB"  # well below the 4 GB of weights
            await box.publish(Topics("after").job_file(), good, retain=True)
            snapshot = await box.next(ModelSnapshot, timeout_s=PROCESS_WAIT_S)
            assert snapshot.model_spec == parse_job(good.source).model_key
            assert ps.proc.poll() is None


async def test_a_model_over_a_workers_memory_budget_is_left_unbuilt_and_the_next_job_served(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    modules = write_module(tmp_path / "models", "big_worker", BIG_MODULE)
    config = trusting(mosquitto_broker, modules, "big_worker", **{"worker.memory_limit_mb": 512,
                                                                  "worker.device": "w1",
                                                                  "worker.state_dir": tmp_path / "w1"})
    _, big = declared(job_tree("huge", {**BIG_INPUT, "entry_point": "big_worker:build"}, BIG_DATA), params=1000)
    good = good_job("after")
    host = JobHost("worker", config, worker_command.for_job, device="w1")
    async with running(host), inbox(client(config), (Topics("huge").status_filter(), DeviceStatus),
                                    (Topics("after").status_filter(), DeviceStatus)) as box:
        await box.publish(Topics("huge").job_file(), big, retain=True)
        await box.publish(Topics("huge").job_state(), running_state(big), retain=True)
        left = await box.next(DeviceStatus, lambda s: s.state == "left", TRAIN_WAIT_S)
        assert "over this host's memory budget" in left.reason and "512 MiB (worker.memory_limit_mb)" in left.reason
        assert f"{BIG_PARAMS:,} parameters x 4 copies" in left.reason
        assert host.metrics.value("edgemesh_worker_host_jobs_total", outcome="refused") == 1
        await box.publish(Topics("huge").job_state(), running_state(big, "failed"), retain=True)
        await box.publish(Topics("after").job_file(), good, retain=True)
        await box.publish(Topics("after").job_state(), running_state(good), retain=True)
        await box.next(DeviceStatus, lambda s: s.state == "online" and s.device == "w1", TRAIN_WAIT_S)


def test_the_estimate_is_of_the_model_measured_unallocated_and_the_budget_names_itself() -> None:
    spec = ModelSpec(name="big-check", input_shape=(1000,), num_classes=2, description="a billion parameters",
                     builder=lambda: nn.Sequential(nn.Linear(1000, 1_000_000), nn.Linear(1_000_000, 2)))
    cost, _, _ = meta_costs(spec)
    assert cost.params == BIG_PARAMS and cost.activations_per_sample == 1000 + 1_000_000 + 2
    budget = MemoryBudget.of("ps", make_offline_config(), ram_bytes=8 * 2**30)
    assert budget is not None and budget.limit_bytes == int(0.8 * 8 * 2**30)
    assert budget.describe() == "6553 MiB (ps.memory_limit_mb = 0: 80% of this host's RAM)"
    need = budget.estimate(cost, make_offline_config())
    assert need.total_bytes > 6 * 4 * BIG_PARAMS
    assert MemoryBudget.of("planner", make_offline_config()) is None  # it never builds the model


def make_offline_config(**settings: object) -> Config:
    from edgemesh.common.config import load_config

    return load_config(env={}, overrides={k: str(v) for k, v in settings.items()})


# --------------------------------------------------------------------------- exceptions in a step


@contextlib.asynccontextmanager
async def fleet(config: Config) -> AsyncIterator[tuple[JobHost, JobHost, JobHost]]:
    """The parameter server's host (with the job board), the planner's and worker w1's, in this process."""
    ps = JobHost("ps", config, ps_jobs.for_job)
    board = asyncio.create_task(ps.run(extra=JobBoard(ps).attach))

    async def planner(active: ActiveJob) -> Planner:
        return Planner(active.config)

    plans = JobHost("planner", config, planner)
    worker = JobHost("worker", config, worker_command.for_job, device="w1")
    try:
        async with running(plans, worker):
            yield ps, plans, worker
    finally:
        ps.stop.set()
        await asyncio.wait_for(board, 30)


async def test_an_exception_in_a_step_ends_the_job_on_that_host_and_the_host_serves_the_next(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """A MemoryError in a worker's training step: the worker leaves the job naming it, the job goes on. A
    RecursionError in the parameter server's evaluation: the job fails naming it. Both hosts serve the next job."""
    modules = write_module(tmp_path / "models", "step_bombs", STEP_BOMBS_MODULE)
    config = trusting(mosquitto_broker, modules, "step_bombs", **{
        "ps.state_dir": tmp_path / "ps", "worker.device": "w1", "worker.state_dir": tmp_path / "w1",
        "worker.codec_wait_s": "0.2"})
    digits = {"input_shape": [1, 8, 8], "classes": [str(d) for d in range(10)]}
    _, oom = declared(job_tree("oom", {**digits, "entry_point": "step_bombs:memory"}, max_versions=100000))
    _, deep = declared(job_tree("deep", {**digits, "entry_point": "step_bombs:recursion"}, max_versions=100000)
                       | {"evaluation": {"every": 1}})
    good = good_job("good")
    async with fleet(config) as (ps, _, worker), inbox(
            client(config), (all_job_states_filter(), JobState),
            (Topics("client").reply_filter("op"), ControlReply)) as box:
        await box.publish(Topics("oom").job_file(), oom, retain=True)
        out = await box.next(JobState, lambda s: s.name == "oom" and "w1" in s.device_errors, TRAIN_WAIT_S)
        assert out.state == "running"
        assert out.device_errors["w1"] == "MemoryError: a training batch did not fit"
        assert worker.failure is not None and worker.service is None
        await box.publish(Topics("oom").control("job"), ControlCommand(
            command="stop", requester="op", request_id="stop-oom", reply_to=Topics("client").control_reply("op")))
        assert (await box.next(ControlReply, lambda r: r.request_id == "stop-oom")).ok

        await box.publish(Topics("deep").job_file(), deep, retain=True)
        failed = await box.next(JobState, lambda s: s.name == "deep" and s.ended, TRAIN_WAIT_S)
        assert failed.state == "failed" and failed.reason.startswith("the parameter server failed: ")
        assert "maximum recursion depth exceeded" in failed.reason

        await box.publish(Topics("good").job_file(), good, retain=True)
        await box.next(JobState, lambda s: s.name == "good" and s.version >= 3, TRAIN_WAIT_S)
        assert ps.metrics.value("edgemesh_ps_host_jobs_total", outcome="failed") == 1
        assert worker.metrics.value("edgemesh_worker_host_jobs_total", outcome="failed") == 1
        assert worker.current is not None and worker.current[0] == "good" and worker.service is not None


async def test_a_factory_raising_any_base_exception_but_an_exit_is_a_refusal_and_the_host_serves_on(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """What a job's code raises outside ``Exception`` (a ``BaseException`` of its own, in an exception group) used
    to escape the host's TaskGroup and end the process."""

    class Escaped(BaseException):
        pass

    async def factory(active: ActiveJob) -> None:
        if active.spec.name == "escaping":
            raise BaseExceptionGroup("the job's own task group", [Escaped("out of the group")])
        return None

    config = make_config(mosquitto_broker, job="", **{"worker.state_dir": tmp_path / "w1"})
    host = JobHost("worker", config, factory, device="w1")
    escaping, after = good_job("escaping"), good_job("after")
    async with running(host), inbox(client(config), (Topics("escaping").status_filter(), DeviceStatus)) as box:
        await box.publish(Topics("escaping").job_file(), escaping, retain=True)
        await box.publish(Topics("escaping").job_state(), running_state(escaping), retain=True)
        left = await box.next(DeviceStatus, lambda s: s.state == "left", TRAIN_WAIT_S)
        assert left.reason == "Escaped: out of the group"
        await box.publish(Topics("escaping").job_state(), running_state(escaping, "failed"), retain=True)
        await box.publish(Topics("after").job_file(), after, retain=True)
        await box.publish(Topics("after").job_state(), running_state(after), retain=True)
        await until("the host on the next job", lambda: host.current is not None and host.current[0] == "after")
        assert host.metrics.value("edgemesh_worker_host_jobs_total", outcome="refused") == 1
    assert survivable(BaseExceptionGroup("g", [Escaped(), MemoryError(), RecursionError()]))
    assert not survivable(BaseExceptionGroup("g", [MemoryError(), SystemExit(1)]))
    assert not survivable(KeyboardInterrupt()) and not survivable(asyncio.CancelledError())


# --------------------------------------------------------------------------- the crash marker's rule


RUN = Run(job="j", sha256="a" * 64, submitted_at=100.0)


def marker_of(memory: CrashMemory) -> dict[str, Any]:
    assert memory.path is not None
    data: dict[str, Any] = json.loads(memory.path.read_text())
    return data


def test_a_host_that_died_starting_a_run_gives_it_up_for_good_and_a_clean_stop_leaves_no_marker(
        tmp_path: Path) -> None:
    path = tmp_path / "serving-ps.json"
    first = CrashMemory(path, "the parameter server")
    first.load()
    assert first.recall(RUN) == ""
    first.starting(RUN)
    assert marker_of(first)["phase"] == "starting"
    # the process dies here; the next one reads the marker
    second = CrashMemory(path, "the parameter server")
    second.load()
    assert second.recall(Run(job="j", sha256="a" * 64, submitted_at=200.0)) == ""  # another run of the same file
    second.clear()  # a host leaves whatever it served (nothing yet) before it joins a job
    reason = second.recall(RUN)
    assert reason.startswith("the parameter server died while starting it (process ")
    second.give_up(RUN, reason)
    assert second.given_up
    third = CrashMemory(path, "the parameter server")
    third.load()
    assert third.recall(RUN) == reason  # still given up after another restart
    third.give_up(RUN, reason)
    third.clear()  # the run ended
    assert not path.exists()
    fourth = CrashMemory(path, "the parameter server")
    fourth.load()
    assert fourth.recall(RUN) == "" and fourth.found is None


def test_deaths_while_running_are_resumed_until_they_come_in_a_quick_row(tmp_path: Path) -> None:
    """One ``kill -9`` or power cut while running is resumed from (the checkpoint and the log); a step that kills
    the host every time is given up at the ``RUNNING_DEATHS``-th quick death in a row."""
    path = tmp_path / "serving-worker-w1.json"
    now = time.time()
    first = CrashMemory(path, "device w1")
    first.starting(RUN)
    first.running(RUN)
    for death in range(1, RUNNING_DEATHS + 1):  # each process dies while running the run
        memory = CrashMemory(path, "device w1")
        memory.load()
        reason = memory.recall(RUN, now=now + 1)
        if death < RUNNING_DEATHS:
            assert reason == "", death
            memory.starting(RUN)
            memory.running(RUN)
            assert marker_of(memory)["deaths"] == death
        else:
            assert reason.startswith(f"device w1 died while running it, {RUNNING_DEATHS} times in a row")
    # a death long after the run (re)started running starts the count again
    path.write_text(Marker(run=RUN, phase="running", pid=1, since=now - 2 * CRASH_LOOP_S, deaths=5).to_json())
    memory = CrashMemory(path, "device w1")
    memory.load()
    assert memory.recall(RUN, now=now) == ""
    memory.starting(RUN)
    assert marker_of(memory)["deaths"] == 1


def test_a_marker_is_written_whole_and_one_that_is_not_a_marker_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "state" / "serving-ps.json"
    memory = CrashMemory(path, "the parameter server")
    memory.starting(RUN)
    assert Marker.from_json(path.read_text()).run == RUN
    assert not list(path.parent.glob("*.partial"))
    path.write_text("{not json")
    memory = CrashMemory(path, "the parameter server")
    memory.load()
    assert memory.found is None and memory.recall(RUN) == ""
    assert CrashMemory(None, "the planner").recall(RUN) == ""


def test_errors_a_job_may_raise_are_named_in_a_refusal() -> None:
    from edgemesh.services.host import as_error, describe

    assert describe(BaseExceptionGroup("g", [MemoryError("x"), MemoryError("x")])) == "MemoryError: x"
    assert describe(RecursionError()) == "RecursionError"
    assert str(as_error(ExceptionGroup("g", [ModelError("the model is broken")]))) == "the model is broken"
    error = ModelError("kept")
    assert as_error(error) is error and isinstance(as_error(ValueError("v")), EdgeMeshError)
