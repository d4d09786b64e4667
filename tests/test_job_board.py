"""The job board on a real broker: jobs queue and start one after another, operators steer them, and junk
submissions are counted and dropped while the running job goes on (the PS's host, in this process)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers import WAIT_S, inbox, make_config, running, until

from edgemesh.common.config import Config
from edgemesh.common.jobs import parse_job, render_job
from edgemesh.common.messages import (
    ControlCommand,
    ControlReply,
    DeviceStatus,
    Event,
    JobState,
    JobSubmission,
    Plan,
    PlanCluster,
    PlanDevice,
)
from edgemesh.common.messages.jobs import EVALUATIONS_KEPT
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics, all_job_states_filter
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.demo import DIGITS_MODEL, DIGITS_NORMALIZATION
from edgemesh.operator.devices import list_devices
from edgemesh.operator.job import job_states, list_jobs, status, submission_of, submit
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.host import ActiveJob, JobHost
from edgemesh.services.parameter_server import jobs as ps_jobs
from edgemesh.services.parameter_server.jobs import JobBoard
from edgemesh.services.worker import command as worker_command


def digits_job(name: str, **job: object) -> JobSubmission:
    """A job on digits (every host has it), no workers needed to start it."""
    spec = parse_job(render_job({"job": {"name": name, **job}, "model": DIGITS_MODEL,
                                 "data": {"format": "digits", **DIGITS_NORMALIZATION}}))
    return dataclasses.replace(submission_of(spec, search_path=[]), submitted_at=time.time())


@contextlib.asynccontextmanager
async def board(config: Config) -> AsyncIterator[JobHost]:
    host = JobHost("ps", config, ps_jobs.for_job)
    task = asyncio.create_task(host.run(extra=JobBoard(host).attach))
    try:
        yield host
    finally:
        host.stop.set()
        await asyncio.wait_for(task, 30)


async def test_job_commands_and_the_services_serving_a_job_count_no_rejection(broker: BrokerProcess,
                                                                            tmp_path: Path) -> None:
    """Each ``edgemesh job`` command and each service logged a rejection "on edgemesh/v1/{job}/job (none topic)": amqtt
    sends every client that connects the retained messages of every client's filters, here the job file under the
    hosts' ``edgemesh/v1/+/job``. A message no subscription of the client covers is not a rejection."""
    # a 30-s window for each command's first connection: in two full runs of the suite on a loaded host the job list's
    # connection to amqtt did not come within 10 s, for a reason not found yet (not a retry: none was logged)
    config = make_config(broker, job="", **{"ps.state_dir": tmp_path, "broker.connect_timeout_s": 30})
    operator = ServiceMetrics("operator")

    async def compressor(active: ActiveJob) -> Compressor:
        return Compressor(active.config)

    compressor_host = JobHost("compressor", config, compressor)
    serving = asyncio.create_task(compressor_host.run())
    try:
        async with board(config) as host:
            job = digits_job("quiet", max_versions=100000)
            assert await submit(config, parse_job(job.source), job, wait_s=WAIT_S, metrics=operator) == 0
            await until("both hosts serving the job", lambda: host.service is not None
                        and compressor_host.service is not None and host.service.state is not None)
            services = [host.service, compressor_host.service]
            assert set(await job_states(config, metrics=operator)) == {"quiet"}
            assert await status(config, "quiet", once=True, timeout_s=0, metrics=operator) == 0
            hosts = [host.metrics, compressor_host.metrics, *(s.metrics for s in services)]
    finally:
        compressor_host.stop.set()
        await asyncio.wait_for(serving, 30)
    assert operator.value("edgemesh_operator_received_messages_total", route="job_state") >= 3
    for metrics in (operator, *hosts):
        assert metrics.value(f"{metrics.prefix}rejected_total") == 0, metrics.service


async def test_why_a_device_is_out_of_a_running_job_shows_in_job_status_job_list_and_devices(
        mosquitto_broker: BrokerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A worker whose images are broken leaves the job, and a device whose memory holds no share refuses it: while
    the job runs, ``job status --once``, ``job list`` and ``devices`` say which and why (once only a followed
    status said it, when the job ended)."""
    config = make_config(mosquitto_broker, job="", **{"ps.state_dir": tmp_path / "state"})
    spec = parse_job(render_job({
        "job": {"name": "pics", "max_versions": 100000},
        "model": {"input_shape": [3, 8, 8], "classes": ["a", "b"], "layers": ["flatten", {"linear": 2}]},
        "data": {"format": "image-folder", "path": "pics"}, "evaluation": {"local_share": 0.2}}))
    job = dataclasses.replace(submission_of(spec, search_path=[]), submitted_at=time.time())
    (tmp_path / "w1" / "pics" / "a").mkdir(parents=True)
    (tmp_path / "w1" / "pics" / "a" / "x.png").write_bytes(b"these bytes are not a PNG")
    worker = JobHost("worker", make_config(mosquitto_broker, job="", **{"worker.data_dir": tmp_path / "w1"}),
                     worker_command.for_job, device="w1")
    client = dataclasses.replace(config, job="pics")
    memory = "needs 812 MiB for batch 128, has 700 MiB"
    async with board(config), running(worker), inbox(client, (all_job_states_filter(), JobState)) as box:
        await box.publish(Topics("pics").status("pi-3"), DeviceStatus(device="pi-3", state="online", refused_plan=3,
                                                                      reason=memory), retain=True)
        await box.publish(Topics("pics").job_file(), job, retain=True)
        await box.next(JobState, lambda s: s.name == "pics" and s.state == "running"
                       and {"w1", "pi-3"} <= set(s.device_errors))
        capsys.readouterr()
        assert await status(config, "pics", once=True, timeout_s=0) == 0
        shown = capsys.readouterr().out
        assert await list_jobs(config) == 0
        listed = capsys.readouterr().out
        assert await list_devices(client, wait_s=1.0) == 0
        devices = capsys.readouterr().out
    for out in (shown, listed, devices):
        assert "w1" in out and "x.png" in out and "plan v3" in out and memory in out, out
    assert "pics: running" in shown and "2 device(s) out" in shown
    assert "w1 left the job" in devices and "pi-3 refused its share of plan v3" in devices
    for out in (shown, listed):  # no device is left to train it: the state says so
        assert "warning: no device is in the job: the 2 heard from are out of it" in out, out


async def test_job_status_shows_the_latest_evaluations_of_a_running_job(
        mosquitto_broker: BrokerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The job's state keeps its latest ``EVALUATIONS_KEPT`` evaluations (the parameter server's events), one per
    version in version order, and ``job status`` shows them, not only the last accuracy."""
    config = make_config(mosquitto_broker, job="", **{"ps.state_dir": tmp_path})
    client = dataclasses.replace(config, job="evals")
    topics = Topics("evals")
    async with board(config) as host, inbox(client, (all_job_states_filter(), JobState)) as box:
        await box.publish(topics.job_file(), digits_job("evals", max_versions=100000), retain=True)
        await box.next(JobState, lambda s: s.name == "evals" and s.state == "running")
        await box.until("the PS serving the job", lambda: host.service is not None and host.service.state is not None)
        count = EVALUATIONS_KEPT + 5
        for i in range(1, count + 1):
            await box.publish(topics.events(), Event(kind="evaluation", source="ps", time=time.time(), data={
                "version": 10 * i, "accuracy": i / 100, "loss": 3.0 - i / 10}))
        # a later report for a version replaces it (devices' evaluations are combined as each comes in)
        await box.publish(topics.events(), Event(kind="evaluation", source="ps", time=time.time(),
                                                 data={"version": 10 * count, "accuracy": 0.5, "loss": 0.5}))
        state = await box.next(JobState, lambda s: s.name == "evals" and s.evaluations
                               and s.evaluations[-1].accuracy == 0.5)
        capsys.readouterr()
        assert await status(config, "evals", once=True, timeout_s=0) == 0
        printed = capsys.readouterr().out
    kept = range(count - EVALUATIONS_KEPT + 1, count + 1)
    assert [e.version for e in state.evaluations] == [10 * i for i in kept]
    assert [e.accuracy for e in state.evaluations[:-1]] == [i / 100 for i in kept][:-1]
    assert state.evaluations[0].loss == pytest.approx(3.0 - kept[0] / 10)
    rows = [line.split() for line in printed.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [10 * i for i in kept]
    assert rows[-1][1:3] == ["0.5000", "0.5000"] and f"the latest {EVALUATIONS_KEPT}" in printed


async def test_jobs_queue_start_in_order_and_follow_operators(mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    config = make_config(mosquitto_broker, job="", **{"ps.state_dir": tmp_path})
    client = dataclasses.replace(config, job="client")
    async with board(config) as host, inbox(client, (all_job_states_filter(), JobState),
                                            (Topics("client").reply_filter("op"), ControlReply)) as box:
        first, second = digits_job("first"), digits_job("second")
        await box.publish(Topics("first").job_file(), first, retain=True)
        await box.next(JobState, lambda s: s.name == "first" and s.state == "running")
        await box.publish(Topics("second").job_file(), second, retain=True)
        await box.next(JobState, lambda s: s.name == "second" and s.state == "queued")
        await box.until("the PS serving the first job", lambda: host.current == ("first", first.sha256)
                        and host.service is not None)

        async def command(job: str, what: str) -> ControlReply:
            request = f"r-{job}-{what}-{time.monotonic_ns()}"
            await box.publish(Topics(job).control("job"), ControlCommand(
                command=what, requester="op", request_id=request, reply_to=Topics("client").control_reply("op")))
            return await box.next(ControlReply, lambda r: r.request_id == request)

        assert not (await command("second", "pause")).ok  # only a running job pauses
        assert not (await command("first", "explode")).ok
        assert (await command("first", "pause")).ok
        await box.next(JobState, lambda s: s.name == "first" and s.state == "paused")
        assert (await command("first", "stop")).ok
        await box.next(JobState, lambda s: s.name == "first" and s.state == "stopped")
        started = await box.next(JobState, lambda s: s.name == "second" and s.state == "running")
        assert started.started_at > 0
        await box.until("the PS serving the second job", lambda: host.current == ("second", second.sha256))
        # the first job again: a new run of it queues behind the one running
        again = dataclasses.replace(first, submitted_at=time.time())
        await box.publish(Topics("first").job_file(), again, retain=True)
        await box.next(JobState, lambda s: s.name == "first" and s.state == "queued"
                       and s.submitted_at == again.submitted_at)
        assert (await command("second", "stop")).ok
        await box.next(JobState, lambda s: s.name == "first" and s.state == "running"
                       and s.submitted_at == again.submitted_at)


async def test_junk_submissions_are_counted_and_the_running_job_goes_on(mosquitto_broker: BrokerProcess,
                                                                      tmp_path: Path) -> None:
    config = make_config(mosquitto_broker, job="", **{"ps.state_dir": tmp_path})
    client = dataclasses.replace(config, job="client")
    async with board(config) as host, inbox(client, (all_job_states_filter(), JobState)) as box:
        good = digits_job("good", max_versions=100000)
        await box.publish(Topics("good").job_file(), good, retain=True)
        await box.next(JobState, lambda s: s.name == "good" and s.state == "running")
        source = b"[job]\nname = 'broken'\n[model]\nlayers = 3\n"
        broken = dataclasses.replace(good, name="broken", source=source, sha256=hashlib.sha256(source).hexdigest())
        await box.publish(Topics("broken").job_file(), broken, retain=True)  # a job file that is not valid
        await box.publish(Topics("other").job_file(), good, retain=True)  # its topic names another job
        await box.bus._publish_raw(Topics("junk").job_file(), b"\x93garbage", retain=False, qos=1)
        forged = dataclasses.replace(good, source=good.source.replace(b"100000", b"100001"))  # the hash of another file
        await box.publish(Topics("good").job_file(), forged)
        renamed = dataclasses.replace(good, name="renamed")  # the file names job "good"
        await box.publish(Topics("renamed").job_file(), renamed)
        metrics = host.metrics
        await box.until("five rejections", lambda: metrics.value("edgemesh_ps_host_rejected_total", route="job") >= 5)
        assert metrics.value("edgemesh_ps_host_rejected_total", route="job", reason="job_file") == 1
        assert metrics.value("edgemesh_ps_host_rejected_total", route="job", reason="topic") == 1
        assert metrics.value("edgemesh_ps_host_rejected_total", route="job", reason="field") == 2
        assert metrics.value("edgemesh_ps_host_rejected_total", route="job", reason="malformed") == 1
        assert set(host.submissions) == {"good"}
        assert host.current == ("good", good.sha256) and host.wanted() == ("good", good.sha256)
        assert all(s.name == "good" for s in box.of(JobState))


async def test_a_job_whose_held_out_set_is_missing_fails_naming_it(mosquitto_broker: BrokerProcess,
                                                                  tmp_path: Path) -> None:
    config = make_config(mosquitto_broker, job="", **{"ps.state_dir": tmp_path / "state", "ps.data_dir": tmp_path})
    client = dataclasses.replace(config, job="client")
    spec = parse_job(render_job({
        "job": {"name": "blind"}, "model": {"input_shape": [3, 8, 8], "classes": ["a", "b"],
                                             "layers": ["flatten", {"linear": 2}]},
        "data": {"format": "image-folder", "path": "pics"}, "evaluation": {"path": "no-such-eval"}}))
    submission = dataclasses.replace(submission_of(spec, search_path=[]), submitted_at=time.time())
    async with board(config), inbox(client, (all_job_states_filter(), JobState)) as box:
        await box.publish(Topics("blind").job_file(), submission, retain=True)
        failed = await box.next(JobState, lambda s: s.name == "blind" and s.ended)
    assert failed.state == "failed"
    assert "'no-such-eval' does not exist" in failed.reason  # as the job wrote it: relative to ps.data_dir
    assert str(tmp_path) not in failed.reason  # the host's own folders are not published


async def test_a_resume_is_not_undone_by_the_board_while_the_parameter_server_writes_its_checkpoint(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """A resumed PS writes a checkpoint before the job's state says "running"; a board tick in between used to
    see a paused job and a running PS, and pause the PS again ("a restarted PS resumes paused"): the job said
    running and never moved. A slow disk makes the window wide here."""
    config = make_config(mosquitto_broker, job="", **{"ps.state_dir": tmp_path})
    client = dataclasses.replace(config, job="client")
    host = JobHost("ps", config, ps_jobs.for_job)
    task = asyncio.create_task(host.run(extra=JobBoard(host, progress_interval_s=0.05).attach))
    try:
        async with inbox(client, (all_job_states_filter(), JobState),
                         (Topics("client").reply_filter("op"), ControlReply)) as box:
            job = digits_job("steered")
            await box.publish(Topics("steered").job_file(), job, retain=True)
            await box.until("the PS serving the job", lambda: host.current == ("steered", job.sha256)
                            and host.service is not None and host.service.state is not None)
            ps = host.service
            assert isinstance(ps, ps_jobs.ParameterServer)
            checkpoint = ps._checkpoint

            def slow_checkpoint() -> None:  # a slow disk: the board ticks 20 times meanwhile
                time.sleep(1.0)
                checkpoint()

            ps._checkpoint = slow_checkpoint  # type: ignore[method-assign]

            async def command(what: str) -> ControlReply:
                request = f"r-{what}-{time.monotonic_ns()}"
                await box.publish(Topics("steered").control("job"), ControlCommand(
                    command=what, requester="op", request_id=request, reply_to=Topics("client").control_reply("op")))
                return await box.next(ControlReply, lambda r: r.request_id == request)

            assert (await command("pause")).ok
            await box.until("the PS paused", lambda: ps.paused)
            assert (await command("resume")).ok
            resumed = await box.next(JobState, lambda s: s.name == "steered" and s.state == "running")
            # ten intervals on, the board publishes its progress again: ticks ran after the resume
            await box.next(JobState, lambda s: s.name == "steered" and s.updated_at >= resumed.updated_at + 0.5)
            assert not ps.paused
    finally:
        host.stop.set()
        await asyncio.wait_for(task, 30)


async def test_a_restarted_parameter_server_counts_on_from_the_state_it_finds(mosquitto_broker: BrokerProcess,
                                                                             tmp_path: Path) -> None:
    """A PS host that finds its job running (the process before it died) goes on counting the job's gradient bytes
    and rollbacks from the retained state's, not from zero: the operator's figures do not go back, and the guard's
    ``max_rollbacks`` spans restarts."""
    config = make_config(mosquitto_broker, job="", **{"ps.state_dir": tmp_path})
    client = dataclasses.replace(config, job="client")
    job = digits_job("carried")
    found = JobState(name="carried", state="running", sha256=job.sha256, submitted_at=job.submitted_at,
                     started_at=time.time() - 30, updated_at=time.time() - 1, version=40, bytes_received=10**9,
                     rollbacks=2)
    async with inbox(client, (all_job_states_filter(), JobState)) as box:
        await box.publish(Topics("carried").job_file(), job, retain=True)
        await box.publish(Topics("carried").job_state(), found, retain=True)
        async with board(config) as host:
            await box.until("the PS serving the job", lambda: host.current == ("carried", job.sha256)
                            and host.service is not None and host.service.state is not None)
            published = await box.next(JobState, lambda s: s.name == "carried" and s.updated_at > found.updated_at)
            assert published.bytes_received >= 10**9 and published.rollbacks == 2
            ps = host.service
            assert isinstance(ps, ps_jobs.ParameterServer) and ps.guard.rollbacks == 2
        await box.publish(Topics("carried").job_state(), b"", retain=True)
        await box.publish(Topics("carried").job_file(), b"", retain=True)


async def test_a_device_the_plan_leaves_out_of_a_job_on_its_own_data_is_a_warning(
        mosquitto_broker: BrokerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose data lives on the devices (a CSV each): a device online for it but in no cluster of the plan (a
    training grid leaves it idle) trains none of its data, which the job's state says once it has lasted
    ``IDLE_WARN_S``; gone, or planned again, the warning goes."""
    monkeypatch.setattr(ps_jobs, "IDLE_WARN_S", 0.3)
    config = make_config(mosquitto_broker, job="", **{"ps.state_dir": tmp_path})
    spec = parse_job(render_job({"job": {"name": "idler"}, "model": {"input_shape": [4], "classes": ["a", "b"],
                                                                      "layers": [{"linear": 2}]},
                                 "data": {"format": "csv", "path": "rows.csv"}, "evaluation": {"local_share": 0.2}}))
    job = dataclasses.replace(submission_of(spec, search_path=[]), submitted_at=time.time())
    topics = Topics("idler")
    plan = Plan(version=1, created=time.time(), model_spec=spec.model_key, dataset="csv",
                devices=(PlanDevice(device="d0", cluster="c-d0", shard_index=0, shard_count=1, batch_size=8),),
                clusters=(PlanCluster(cluster="c-d0", members=("d0",)),))
    async with inbox(dataclasses.replace(config, job="client"), (all_job_states_filter(), JobState)) as box:
        await box.publish(topics.job_file(), job, retain=True)
        async with board(config) as host:
            await box.until("the PS serving the job", lambda: host.current == ("idler", job.sha256)
                            and host.service is not None and host.service.state is not None)
            for device in ("d0", "d1"):
                await box.publish(topics.status(device), DeviceStatus(device=device, state="online", incarnation=1),
                                  retain=True)
            await box.publish(topics.plan(), plan, retain=True)
            warned = await box.next(JobState, lambda s: s.name == "idler" and "d1 is online but in no" in s.warning)
            assert warned.devices == ("d0",) and "the data it holds is not trained on" in warned.warning
            await box.publish(topics.status("d1"), DeviceStatus(device="d1", state="offline", incarnation=1),
                              retain=True)
            await box.next(JobState, lambda s: s.name == "idler" and not s.warning)
        for topic in (topics.job_state(), topics.job_file(), topics.plan(), topics.status("d0"), topics.status("d1")):
            await box.publish(topic, b"", retain=True)
