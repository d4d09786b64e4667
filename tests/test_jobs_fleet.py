"""Jobs on a running fleet, end to end: real processes serving submitted jobs, as systemd runs them.

The planner, the parameter server, the compressor and three workers start once, with no job; each
worker has its own local data. Jobs are submitted with ``edgemesh job submit``, trained to their
target, exported with ``edgemesh job export``; the next job trains on the same processes.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import inbox, make_config, write_shapes

from edgemesh.common import models
from edgemesh.common.config import Config
from edgemesh.common.jobs import model_spec, parse_job
from edgemesh.common.messages import JobState, ModelSnapshot
from edgemesh.common.topics import Topics, all_job_states_filter
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import LocalCluster

pytestmark = pytest.mark.e2e

CLASSES = ["circle", "square", "triangle"]
DEVICES = ("w0", "w1", "w2")
JOB_WAIT_S = 150.0
"""How long a test job may take to reach its target on this machine's two cores (it takes 10-40 s)."""

SHAPES_JOB = """
[job]
name = "shapes"
target_accuracy = 0.9
max_versions = 1500

[model]
input_shape = [3, 24, 24]
classes = ["circle", "square", "triangle"]
layers = [{conv2d = 8, kernel = 3, padding = 1}, "relu", {maxpool2d = 2},
          {conv2d = 16, kernel = 3, padding = 1}, "relu", {maxpool2d = 2},
          "flatten", {linear = 32}, "relu", {linear = 3}]

[data]
format = "image-folder"
path = "shapes"
mean = [0.5]
std = [0.3]

[evaluation]
path = "shapes-eval"
every = 5

[training]
sync_policy = "async"
lr = 0.05
batch_size = 16
"""

SENSORS_JOB = """
[job]
name = "vibration"
target_accuracy = 0.9
max_versions = 1500

[model]
input_shape = [8]
classes = ["idle", "normal", "worn"]
entry_point = "vibration_net:build"
module_path = "{module_path}"

[data]
format = "csv"
path = "vibration.csv"
label_column = "state"

[evaluation]
local_share = 0.25
every = 5

[training]
sync_policy = "async"
lr = 0.05
batch_size = 16
"""

VIBRATION_NET = '''
from torch import nn


def build(input_shape, num_classes):
    return nn.Sequential(nn.Linear(input_shape[0], 32), nn.ReLU(), nn.Linear(32, num_classes))
'''


def write_sensor_csv(path: Path, rows: int, seed: int) -> None:
    """A CSV of 8 features and a ``state`` column: three Gaussian clusters."""
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(99).normal(0.0, 1.0, (3, 8))
    lines = [",".join([f"f{i}" for i in range(8)] + ["state"])]
    for r in range(rows):
        label = r % 3
        features = centers[label] + rng.normal(0.0, 0.35, 8)
        lines.append(",".join(f"{v:.5f}" for v in features) + f",{['idle', 'normal', 'worn'][label]}")
    path.write_text("\n".join(lines) + "\n")


def edgemesh(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run the ``edgemesh`` command as a user would."""
    return subprocess.run([sys.executable, "-m", "edgemesh", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture
def fleet(mosquitto_broker: BrokerProcess, tmp_path: Path) -> Iterator[tuple[LocalCluster, Config]]:
    """The services of a fleet, started once with no job; w2's image folder lacks the class ``triangle``."""
    for i, device in enumerate(DEVICES):
        write_shapes(tmp_path / device / "shapes", CLASSES if device != "w2" else CLASSES[:2], 40, seed=i)
    write_shapes(tmp_path / "ps" / "shapes-eval", CLASSES, 30, seed=10)
    config = make_config(mosquitto_broker, job="fleet", **{"broker.backoff_max_s": "0.5"})
    cluster = LocalCluster(config, tmp_path, serve_jobs=True)
    cluster.spawn("planner", "planner")
    cluster.spawn("ps", "ps", ["--state-dir", str(tmp_path / "ps" / "state"), "--set",
                               f"ps.data_dir={tmp_path / 'ps'}"])
    cluster.spawn("compressor", "compressor")
    for device in DEVICES:
        cluster.spawn("worker", device, ["--device", device, "--set", f"worker.data_dir={tmp_path / device}"])
    try:
        yield cluster, config
    finally:
        cluster.stop()


async def wait_for_job(config: Config, name: str, phases: tuple[str, ...], timeout_s: float = JOB_WAIT_S) -> JobState:
    """The job's retained state once it is in one of ``phases``."""
    async with inbox(config, (Topics(name).job_state_filter(), JobState)) as box:
        return await box.next(JobState, lambda s: s.name == name and s.state in phases, timeout_s)


def pids(cluster: LocalCluster) -> dict[str, int]:
    return {c.name: c.proc.pid for c in cluster.children if c.proc.poll() is None}


async def test_jobs_submitted_to_a_running_fleet_train_export_and_follow_each_other(
        fleet: tuple[LocalCluster, Config], tmp_path: Path) -> None:
    cluster, config = fleet
    started = pids(cluster)
    assert len(started) == 6
    job_file = tmp_path / "shapes.toml"
    job_file.write_text(SHAPES_JOB)

    submitted = edgemesh("job", "submit", str(job_file), "--broker", config.broker.url, "--wait", "60")
    assert submitted.returncode == 0, submitted.stderr
    running = await wait_for_job(config, "shapes", ("running",), 60)
    # a bad job file while it runs: every error named, and the running job is not disturbed
    bad = tmp_path / "bad.toml"
    bad.write_text(SHAPES_JOB.replace('"relu", {maxpool2d = 2},\n          {conv2d = 16', '"relux", {maxpool2d = 2},\n'
                                      '          {conv2d = 16').replace("[3, 24, 24]", "[3, 24, 24]"))
    refused = edgemesh("job", "submit", str(bad), "--broker", config.broker.url)
    assert refused.returncode == 2 and "relux" in refused.stderr and "unknown layer" in refused.stderr

    finished = await wait_for_job(config, "shapes", ("finished", "failed", "stopped"))
    assert finished.state == "finished", finished.reason
    assert finished.sha256 == running.sha256
    assert finished.accuracy is not None and finished.accuracy >= 0.9
    assert set(finished.devices) == set(DEVICES)  # w2, lacking a class, trains too (non-IID is normal)

    # the model out, from the broker: ONNX gives the logits torch gives
    out = tmp_path / "export" / "shapes.onnx"
    exported = edgemesh("job", "export", "shapes", "--format", "onnx", "--out", str(out), "--broker",
                        config.broker.url)
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "export" / "shapes.onnx.card.json").is_file()
    async with inbox(dataclasses.replace(config, job="shapes"), (Topics("shapes").job_model_filter(),
                                                                  ModelSnapshot)) as box:
        snapshot = await box.next(ModelSnapshot)
    spec = parse_job(SHAPES_JOB)
    model_spec(spec)
    module = models.build_model(spec.model_key)
    models.set_params(module, {k: t.to_numpy() for k, t in snapshot.tensors.items()})
    module.eval()
    import onnxruntime
    import torch
    x = np.random.default_rng(0).random((5, 3, 24, 24), dtype=np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    assert np.abs(got - expected).max() < 1e-4

    # the next job: an entry-point model on CSV files, evaluated on the devices' own validation shares;
    # w2 has no CSV: it leaves the job, naming the file, and the others train on
    modules = tmp_path / "models"
    modules.mkdir()
    (modules / "vibration_net.py").write_text(VIBRATION_NET)
    for i, device in enumerate(DEVICES[:2]):
        write_sensor_csv(tmp_path / device / "vibration.csv", 240, seed=i)
    sensors = tmp_path / "sensors.toml"
    sensors.write_text(SENSORS_JOB.format(module_path=modules))
    submitted = edgemesh("job", "submit", str(sensors), "--broker", config.broker.url, "--wait", "60")
    assert submitted.returncode == 0, submitted.stderr
    done = await wait_for_job(config, "vibration", ("finished", "failed", "stopped"))
    assert done.state == "finished", done.reason
    assert done.accuracy is not None and done.accuracy >= 0.9
    assert set(done.devices) == {"w0", "w1"}
    assert "w2" in done.device_errors and "vibration.csv" in done.device_errors["w2"]
    assert pids(cluster) == started  # the same processes served both jobs

    listed = edgemesh("job", "list", "--broker", config.broker.url)
    assert listed.returncode == 0 and "shapes" in listed.stdout and "vibration" in listed.stdout
    status = edgemesh("job", "status", "vibration", "--once", "--broker", config.broker.url)
    assert status.returncode == 0 and "finished" in status.stdout


async def test_a_job_is_paused_resumed_and_stopped_by_the_operator(fleet: tuple[LocalCluster, Config],
                                                                  tmp_path: Path) -> None:
    cluster, config = fleet
    job_file = tmp_path / "long.toml"
    job_file.write_text(SHAPES_JOB.replace("target_accuracy = 0.9", "target_accuracy = 1.0")
                        .replace("max_versions = 1500", "max_versions = 100000").replace('"shapes"\n', '"long"\n', 1))
    assert edgemesh("job", "submit", str(job_file), "--broker", config.broker.url, "--wait", "60").returncode == 0
    async with inbox(dataclasses.replace(config, job="long"), (all_job_states_filter(), JobState)) as box:
        await box.next(JobState, lambda s: s.name == "long" and s.state == "running" and s.version > 0, JOB_WAIT_S)
        paused = edgemesh("job", "pause", "long", "--broker", config.broker.url)
        assert paused.returncode == 0, paused.stderr
        held = await box.next(JobState, lambda s: s.name == "long" and s.state == "paused")
        # while paused the model does not move
        later = await box.next(JobState, lambda s: s.name == "long" and s.state == "paused" and s is not held)
        assert later.version == held.version or later.version <= held.version + 1
        assert edgemesh("job", "resume", "long", "--broker", config.broker.url).returncode == 0
        await box.next(JobState, lambda s: s.name == "long" and s.state == "running" and s.version > held.version + 1,
                       60)
        assert edgemesh("job", "stop", "long", "--broker", config.broker.url).returncode == 0
        stopped = await box.next(JobState, lambda s: s.name == "long" and s.state == "stopped")
    assert stopped.reason == "stopped by an operator"
    again = edgemesh("job", "stop", "long", "--broker", config.broker.url)
    assert again.returncode == 1 and "already ended" in again.stderr
    assert all(c.proc.poll() is None for c in cluster.children)
