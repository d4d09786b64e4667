"""The whole cluster as separate processes: ``edgemesh demo`` and in-process services across a broker crash."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from edgemesh.common.broker import BrokerProcess
from edgemesh.common.config import Config, load_config
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

WAIT_S = 60.0
POLL_S = 0.1
REPORT_KEYS = {"final_accuracy", "wall_seconds", "model_version", "updates_accepted", "updates_discarded",
               "bytes_published", "workers"}


def processes_of(job: str) -> list[str]:
    """Command lines of live processes that belong to ``job``."""
    out = subprocess.run(["pgrep", "-af", "--", f"--job {job}"], capture_output=True, text=True, check=False)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


@pytest.mark.e2e
@pytest.mark.parametrize("broker_flag", ["", "--embedded-broker"], ids=["mosquitto", "amqtt"])
def test_demo_runs_to_its_version_limit_and_reports(tmp_path: Path, broker_flag: str) -> None:
    job = f"e2e-{uuid.uuid4().hex[:6]}"
    report = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "edgemesh.services.cli", "demo", "--workers", "2", "--max-versions", "10",
           "--report", str(report), "--quiet", "--job", job, "--timeout", "150"]
    if broker_flag:
        cmd.append(broker_flag)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=200, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert REPORT_KEYS <= data.keys()
    assert data["workers"] == 2
    assert data["model_version"] >= 10
    assert data["updates_accepted"] >= 2 * 10  # sync: both workers contribute to every version
    assert data["bytes_published"] > 0
    assert 0.0 <= data["final_accuracy"] <= 1.0
    assert data["stopped_by"] in ("max_versions", "target")
    assert "final accuracy" in result.stdout
    assert processes_of(job) == []


@pytest.mark.e2e
def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    job = f"e2e-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgemesh.services.cli", "demo", "--workers", "2", "--job", job, "--quiet",
         "--max-versions", "100000", "--target-accuracy", "1.0", "--timeout", "150"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        # wait until training is visibly under way (the progress line shows a version > 0)
        for line in proc.stderr:
            if "version" in line and "accuracy" in line and " version     0" not in line:
                break
        assert len(processes_of(job)) >= 5  # planner, ps, compressor, 2 workers
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert processes_of(job) == []


# --------------------------------------------------------------------------- in-process services


def config(broker: BrokerProcess, tmp_path: Path, **extra: str) -> Config:
    overrides = {"broker.url": broker.url, "job": "e2e", "metrics.address": "127.0.0.1:0",
                 "ps.state_dir": str(tmp_path / "ps"), "broker.backoff_max_s": "0.5",
                 "worker.ack_timeout_s": "2", "training.sync_policy": "async", **extra}
    return load_config(env={}, overrides=overrides)


@contextlib.asynccontextmanager
async def services(*objs: object) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(o.run()) for o in objs]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for o in objs:
            o.stop.set()  # type: ignore[attr-defined]
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)


async def until(what: str, predicate: object, timeout_s: float = WAIT_S) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():  # type: ignore[operator]
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_training_survives_a_broker_crash(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = config(broker, tmp_path)
    planner, ps, comp = Planner(cfg), ParameterServer(cfg), Compressor(cfg)
    worker = Worker(load_config(env={}, overrides={**{k: v for k, v in [
        ("broker.url", broker.url), ("job", "e2e"), ("metrics.address", "127.0.0.1:0"),
        ("broker.backoff_max_s", "0.5"), ("worker.ack_timeout_s", "2")]}, "worker.device": "w0"}))
    async with services(planner, ps, comp, worker):
        await until("training to start", lambda: worker.accepted >= 5)
        broker.kill()
        at_crash = worker.accepted
        broker.restart()
        await until("the worker to reconnect",
                    lambda: worker.metrics.value("edgemesh_worker_broker_connects_total") >= 2)
        await until("training to go on after the crash", lambda: worker.accepted >= at_crash + 10)
        # every service reconnects and re-subscribes (one whose CONNECT the restarting broker lost
        # retries after broker.connect_timeout_s)
        await until("every service to reconnect", lambda: all(
            svc.metrics.value(f"edgemesh_{name}_broker_connects_total") >= 2
            for svc, name in ((planner, "planner"), (ps, "ps"), (comp, "compressor"))))
        # no update was applied twice: one worker, one step per update, so the PS cannot be
        # further than the updates the worker made, and has applied every one it acked
        assert worker.accepted <= ps.version <= worker.seq


async def test_worker_answers_control_and_ignores_commands_for_other_devices(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    from edgemesh.common.bus import Bus
    from edgemesh.common.messages import ControlReply
    from edgemesh.common.metrics import ServiceMetrics
    from edgemesh.common.topics import Topics

    cfg = config(mosquitto_broker, tmp_path)
    worker = Worker(load_config(env={}, overrides={"broker.url": mosquitto_broker.url, "job": "e2e",
                                                   "metrics.address": "127.0.0.1:0", "worker.device": "w0"}))
    topics = Topics("e2e")
    async with services(worker), Bus(cfg.broker, client_id="ctl-test", metrics=ServiceMetrics("t"),
                                     subscriptions=[topics.control_reply("op")]) as bus:
        await bus.wait_connected(WAIT_S)
        await until("the worker to connect", lambda: worker.bus is not None and worker.bus.is_connected)
        await bus.publish(topics.control("all"), b'{"command": "stop", "device": "w7", "requester": "op"}')
        await bus.publish(topics.control("device/w0"), b'{"command": "status", "requester": "op", '
                                                       b'"request_id": "s1"}')
        reply = (await bus.next_message(WAIT_S)).decode(ControlReply)
        assert (reply.request_id, reply.ok, reply.source) == ("s1", True, "device/w0")
        assert not worker.stop.is_set()  # the stop for w7 was not for us
        await bus.publish(topics.control("device/w0"), b'{"command": "stop", "requester": "op", "request_id": "s2"}')
        reply = (await bus.next_message(WAIT_S)).decode(ControlReply)
        assert reply.request_id == "s2" and reply.ok
        await until("the worker to stop", worker.stop.is_set)
