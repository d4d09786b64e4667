"""Jobs on a running fleet, end to end: real processes serving submitted jobs, as systemd runs them.

The planner, the parameter server, the compressor and three workers start once, with no job; each
worker has its own local data. Jobs are submitted with ``edgemesh job submit``, trained to their
target, exported with ``edgemesh job export``; the next job trains on the same processes.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import inbox, make_config

from edgemesh.bench import jobs as jobs_bench
from edgemesh.bench.jobs import VIBRATION_NET, draw_shapes, write_sensor_csv
from edgemesh.bench.model_jobs import ENTRY_POINT, ENTRY_POINT_FILE, ENTRY_POINT_MODULE, ENTRY_POINT_NET
from edgemesh.common import models
from edgemesh.common.config import Config, GuardConfig
from edgemesh.common.jobs import model_spec, parse_job
from edgemesh.common.messages import JobState, ModelSnapshot
from edgemesh.common.topics import Topics, all_job_states_filter
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import LocalCluster
from edgemesh.services.parameter_server.ledger import read_ledger

CLASSES = ["circle", "square", "triangle"]
DEVICES = ("w0", "w1", "w2")
JOB_WAIT_S = 150.0
"""How long a test job may take to reach its target on this machine's two cores (it takes 10-40 s)."""
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3 * JOB_WAIT_S)]
"""A test here trains up to two jobs and exports one, each wait bounded by ``JOB_WAIT_S``: the suite's 120 s limit is
less than one such wait, and two of these tests once ran over it (35 s alone, 59 s in the full suite here, over 120 s
in one CI run on a slower host)."""

SHAPES_JOB = jobs_bench.SHAPES_JOB.format(target=0.9)
SENSORS_JOB = jobs_bench.VIBRATION_JOB
ENTRY_POINT_MODULES = ("vibration_net", ENTRY_POINT_MODULE)
"""The entry-point modules of the tests' jobs: what the hosts, and the operator submitting, allow."""


def edgemesh(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run the ``edgemesh`` command as a user would."""
    return subprocess.run([sys.executable, "-m", "edgemesh", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def start_fleet(broker: BrokerProcess, tmp_path: Path, devices: tuple[str, ...]) -> tuple[LocalCluster, Config]:
    """The services of a fleet, started with no job, and ``devices``' workers; each device has its own image
    folder (w2's lacks the class ``triangle``), the PS host a held-out folder."""
    for i, device in enumerate(DEVICES):
        draw_shapes(tmp_path / device / "shapes", CLASSES if device != "w2" else CLASSES[:2], 40, seed=i)
    draw_shapes(tmp_path / "ps" / "shapes-eval", CLASSES, 30, seed=10)
    config = make_config(broker, job="fleet", **{"broker.backoff_max_s": "0.5"}, **host_models(tmp_path))
    cluster = LocalCluster(config, tmp_path, serve_jobs=True)
    cluster.spawn("planner", "planner")
    start_ps(cluster, tmp_path)
    cluster.spawn("compressor", "compressor")
    for device in devices:
        start_worker(cluster, tmp_path, device)
    return cluster, config


def host_models(tmp_path: Path) -> dict[str, str]:
    """The hosts' own ``[models]``: they allow the tests' entry-point modules, from ``tmp_path/models`` (the jobs'
    ``model.module_path``); a job cannot add that directory itself."""
    return {"models.allowed": ",".join(ENTRY_POINT_MODULES), "models.path": json.dumps([str(tmp_path / "models")])}


def start_ps(cluster: LocalCluster, tmp_path: Path) -> None:
    cluster.spawn("ps", "ps", ["--state-dir", str(tmp_path / "ps" / "state"), "--set",
                               f"ps.data_dir={tmp_path / 'ps'}"])


def start_worker(cluster: LocalCluster, tmp_path: Path, device: str) -> None:
    cluster.spawn("worker", device, ["--device", device, "--set", f"worker.data_dir={tmp_path / device}"])


@pytest.fixture
def fleet(mosquitto_broker: BrokerProcess, tmp_path: Path) -> Iterator[tuple[LocalCluster, Config]]:
    """A fleet of three workers, all started before any job."""
    cluster, config = start_fleet(mosquitto_broker, tmp_path, DEVICES)
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
    # its latest evaluations, in version order, the last the one it finished with
    versions = [e.version for e in finished.evaluations]
    assert versions == sorted(set(versions)) and versions[-1] <= finished.version
    assert finished.evaluations[-1].accuracy == finished.accuracy
    # the reason names the version whose evaluation reached the target (the job's model may have moved on since)
    assert f">= 0.9 at version {finished.model_version}" in finished.reason, finished.reason

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
    sensors.write_text(SENSORS_JOB.format(target=0.9, module_path=modules))
    submitted = edgemesh("job", "submit", str(sensors), "--broker", config.broker.url, "--wait", "60", "--set",
                         "models.allowed=vibration_net")
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
    draw_shapes(tmp_path / "w1" / "shapes", ["hexagon"], 2, seed=7)  # a class the job does not know
    job_file = tmp_path / "long.toml"
    # no target: 90 drawn shapes can be learnt to 100 %, which once ended the job before the test paused it
    job_file.write_text(SHAPES_JOB.replace("target_accuracy = 0.9", "target_accuracy = 0")
                        .replace("max_versions = 3000", "max_versions = 100000").replace('"shapes"\n', '"long"\n', 1))
    assert edgemesh("job", "submit", str(job_file), "--broker", config.broker.url, "--wait", "60").returncode == 0
    async with inbox(dataclasses.replace(config, job="long"), (all_job_states_filter(), JobState)) as box:
        await box.next(JobState, lambda s: s.name == "long" and s.state == "running" and s.version > 0
                       and "w1" in s.device_errors, JOB_WAIT_S)
        # while it runs, its status says which device is out and why
        once = edgemesh("job", "status", "long", "--once", "--broker", config.broker.url)
        assert once.returncode == 0 and "w1 is out of the job" in once.stdout and "hexagon" in once.stdout
        # the live status follows the running job (here for 2 s), then says where it stands
        followed = edgemesh("job", "status", "long", "--timeout", "2", "--broker", config.broker.url)
        assert followed.returncode == 0 and "long: running, version" in followed.stdout
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
    assert "hexagon" in stopped.device_errors["w1"] and set(stopped.devices) == {"w0", "w2"}
    again = edgemesh("job", "stop", "long", "--broker", config.broker.url)
    assert again.returncode == 1 and "already ended" in again.stderr
    assert all(c.proc.poll() is None for c in cluster.children)


async def test_a_restarted_ps_resumes_the_job_and_a_late_worker_joins_it(mosquitto_broker: BrokerProcess,
                                                                          tmp_path: Path) -> None:
    cluster, config = start_fleet(mosquitto_broker, tmp_path, DEVICES[:2])
    try:
        job_file = tmp_path / "shapes.toml"
        job_file.write_text(SHAPES_JOB.replace("target_accuracy = 0.9", "target_accuracy = 0.95"))
        assert edgemesh("job", "submit", str(job_file), "--broker", config.broker.url, "--wait", "60").returncode == 0
        async with inbox(dataclasses.replace(config, job="shapes"), (all_job_states_filter(), JobState)) as box:
            before = await box.next(JobState, lambda s: s.name == "shapes" and s.version >= 10, JOB_WAIT_S)
            ps = next(c for c in cluster.children if c.name == "ps")
            ps.proc.kill()  # no goodbye: the checkpoint and the log are all it has
            ps.proc.wait()
            cluster.children.remove(ps)
            start_ps(cluster, tmp_path)
            start_worker(cluster, tmp_path, "w2")  # a device that joins late gets the job, the plan, the model
            joined = await box.next(JobState, lambda s: s.name == "shapes" and "w2" in s.devices, JOB_WAIT_S)
            assert joined.version >= before.version  # resumed, not restarted from scratch
            assert joined.started_at == before.started_at and joined.sha256 == before.sha256
            # the job's count of gradient bytes goes on from the killed process's, not from zero
            assert before.bytes_received > 0 and joined.bytes_received > before.bytes_received
            done = await box.next(JobState, lambda s: s.name == "shapes" and s.ended, JOB_WAIT_S)
        assert done.state == "finished", done.reason
        assert done.bytes_received > before.bytes_received
    finally:
        cluster.stop()


async def test_a_job_submitted_to_a_fleet_with_a_sharded_parameter_server_trains_and_exports_whole(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """The parameter server as two shard processes serving submitted jobs (``edgemesh ps --shard i`` with
    ``ps.shards = 2`` in the fleet's file, as the systemd template runs them): shard 0's host keeps the job board,
    shard 1's serves what it starts; the job reaches its target, both shards apply the same updates as the same
    versions, and the exported model holds every row of every tensor."""
    devices = DEVICES[:2]
    for i, device in enumerate(devices):
        draw_shapes(tmp_path / device / "shapes", CLASSES, 40, seed=i)
    draw_shapes(tmp_path / "ps" / "shapes-eval", CLASSES, 30, seed=10)
    config = make_config(mosquitto_broker, job="fleet", **{"broker.backoff_max_s": "0.5", "ps.shards": 2})
    cluster = LocalCluster(config, tmp_path, serve_jobs=True)
    try:
        cluster.spawn("planner", "planner")
        for shard in range(2):
            cluster.spawn("ps", f"ps-{shard}", ["--shard", str(shard), "--state-dir", str(tmp_path / "ps" / "state"),
                                                "--set", f"ps.data_dir={tmp_path / 'ps'}"])
        cluster.spawn("compressor", "compressor")
        for device in devices:
            start_worker(cluster, tmp_path, device)
        job_file = tmp_path / "shapes.toml"
        job_file.write_text(SHAPES_JOB)
        submitted = edgemesh("job", "submit", str(job_file), "--broker", config.broker.url, "--wait", "60")
        assert submitted.returncode == 0, submitted.stderr
        finished = await wait_for_job(config, "shapes", ("finished", "failed", "stopped"))
        assert finished.state == "finished", finished.reason
        assert finished.accuracy is not None and finished.accuracy >= 0.9
        async with inbox(dataclasses.replace(config, job="shapes"), (Topics("shapes").job_model_filter(),
                                                                      ModelSnapshot)) as box:
            snapshot = await box.next(ModelSnapshot)
    finally:
        cluster.stop()
    spec = parse_job(SHAPES_JOB)
    model_spec(spec)
    whole = models.get_params(models.build_model(spec.model_key))
    assert {k: t.shape for k, t in snapshot.tensors.items()} == {k: v.shape for k, v in whole.items()}
    ledgers = [read_ledger(next((tmp_path / "ps" / "state").glob(f"shapes/*/shard-{i}-of-2/ledger.log")))
               for i in range(2)]
    # the same updates as the same versions, up to the exported model's; a shard may have stepped once more
    # while the other was leaving the ended job
    upto = [[e for e in ledger if e.version <= snapshot.version] for ledger in ledgers]
    assert upto[0] == upto[1] and {e.version for e in upto[0]} == set(range(1, snapshot.version + 1))


async def test_a_running_job_trains_on_after_the_broker_restarts_empty(fleet: tuple[LocalCluster, Config],
                                                                     mosquitto_broker: BrokerProcess,
                                                                     tmp_path: Path) -> None:
    """A broker restarted without persistence has lost every retained job spec, plan and model, and a stopping
    Mosquitto sends every device's will: the fleet's services put the job back and train on."""
    cluster, config = fleet
    job_file = tmp_path / "long.toml"
    # no target: 90 drawn shapes can be learnt to 100 %, which once ended the job before the test paused it
    job_file.write_text(SHAPES_JOB.replace("target_accuracy = 0.9", "target_accuracy = 0")
                        .replace("max_versions = 3000", "max_versions = 100000").replace('"shapes"\n', '"long"\n', 1))
    assert edgemesh("job", "submit", str(job_file), "--broker", config.broker.url, "--wait", "60").returncode == 0
    await wait_for_job(config, "long", ("running",), JOB_WAIT_S)
    for restart in (mosquitto_broker.stop, mosquitto_broker.kill):
        restart()
        mosquitto_broker.start()
        async with inbox(dataclasses.replace(config, job="long"), (all_job_states_filter(), JobState)) as box:
            back = await box.next(JobState, lambda s: s.name == "long", 60)  # published since: the broker was empty
            assert back.state == "running", back
            # every device back in it (one reconnecting after the broker's will said it left may take a while)
            after = await box.next(JobState, lambda s, since=back.version: s.name == "long" and s.state == "running"
                                   and s.version > since + 5 and set(s.devices) == set(DEVICES), 90)
    assert set(after.devices) == set(DEVICES)
    assert all(c.proc.poll() is None for c in cluster.children)


# --------------------------------------------------------------------------- users' CNNs: buffers, guard

BN_JOB = """
[job]
name = "{name}"
target_accuracy = {target}
max_versions = 20000
max_minutes = 4

[model]
input_shape = [3, 24, 24]
classes = ["circle", "square", "triangle"]
{model}

[data]
format = "image-folder"
path = "shapes"
mean = [0.5]
std = [0.3]

[evaluation]
path = "shapes-eval"
every = 5

[training]
sync_policy = "{policy}"
lr = 0.02
batch_size = 16
{extra}
"""
BN_LAYERS = """layers = [{conv2d = 8, kernel = 3, padding = 1, bias = false}, "batchnorm", "relu", {maxpool2d = 2},
          {conv2d = 16, kernel = 3, padding = 1, bias = false}, "batchnorm", "relu", {maxpool2d = 2},
          "flatten", {linear = 32}, "relu", {dropout = 0.2}, {linear = 3}]"""


def held_out_accuracy(model_file: Path, eval_folder: Path) -> float:
    """Accuracy of an exported ONNX model on a held-out image folder, as a user would measure it."""
    import onnxruntime

    from edgemesh.common.data import load_local

    data = load_local("image-folder", eval_folder, input_shape=(3, 24, 24), classes=CLASSES).train
    session = onnxruntime.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: data.x.astype(np.float32)})[0]
    return float((logits.argmax(axis=1) == data.y).mean())


async def finished_job(config: Config, job_file: Path, name: str) -> JobState:
    """Submit ``job_file`` with ``edgemesh job submit`` (allowing the tests' entry-point modules, as the hosts do) and
    wait until job ``name`` ended; its state (finished)."""
    submitted = edgemesh("job", "submit", str(job_file), "--broker", config.broker.url, "--wait", "60", "--set",
                         f"models.allowed={','.join(ENTRY_POINT_MODULES)}")
    assert submitted.returncode == 0, submitted.stderr
    done = await wait_for_job(config, name, ("finished", "failed", "stopped"))
    assert done.state == "finished", done.reason
    return done


async def kept_model(config: Config, job: str) -> ModelSnapshot:
    async with inbox(dataclasses.replace(config, job=job), (Topics(job).job_model_filter(), ModelSnapshot)) as box:
        return await box.next(ModelSnapshot)


async def test_a_batch_norm_model_trains_and_exports_the_accuracy_the_job_reports_with_the_datas_statistics(
        fleet: tuple[LocalCluster, Config], tmp_path: Path) -> None:
    """The running statistics of batch norm are part of the model: the PS's, evaluated and exported, are those of
    the devices' images (not their initial 0 and 1), and the exported ONNX model scores what the job reported."""
    import torch

    from edgemesh.common.data import load_local

    _, config = fleet
    job_file = tmp_path / "bn.toml"
    job_file.write_text(BN_JOB.format(name="bn-shapes", target=0.9, model=BN_LAYERS, policy="adaptive", extra=""))
    done = await finished_job(config, job_file, "bn-shapes")
    assert done.accuracy is not None and done.accuracy >= 0.9 and done.model_version > 0

    out = tmp_path / "export" / "bn.onnx"
    exported = edgemesh("job", "export", "bn-shapes", "--format", "onnx", "--out", str(out), "--broker",
                        config.broker.url)
    assert exported.returncode == 0, exported.stderr
    assert abs(held_out_accuracy(out, tmp_path / "ps" / "shapes-eval") - done.accuracy) <= 0.005
    card = json.loads((tmp_path / "export" / "bn.onnx.card.json").read_text())
    assert card["version"] == done.model_version and card["accuracy"] == done.accuracy  # reported = exported

    # the PS's statistics of the first batch norm are those of its input on the devices' images
    snapshot = await kept_model(config, "bn-shapes")
    assert snapshot.version == done.model_version
    spec = parse_job(job_file.read_text())
    model_spec(spec)
    module = models.build_model(spec.model_key)
    models.set_params(module, {k: t.to_numpy() for k, t in snapshot.tensors.items()})
    module.eval()
    images = np.concatenate([load_local("image-folder", tmp_path / d / "shapes", input_shape=(3, 24, 24),
                                        classes=CLASSES).train.x for d in DEVICES])
    with torch.no_grad():
        into = module.conv1(module.input(torch.from_numpy(images)))
    mean, var = into.mean(dim=(0, 2, 3)).numpy(), into.var(dim=(0, 2, 3)).numpy()
    running_mean, running_var = module.bn1.running_mean.numpy().copy(), module.bn1.running_var.numpy().copy()
    assert int(module.bn1.num_batches_tracked) > 10
    # an average of the latest batches' statistics while the weights still move: within a third of a standard
    # deviation (the initial 0 and 1, the bug this guards against, are 0.5-1 of one away here; a correct run was
    # once 0.27 off, the non-IID devices' means spreading: docs/synchronization.md)
    assert float(np.mean(np.abs(running_mean - mean) / np.sqrt(var))) <= 0.35, (running_mean, mean)
    # the variance of the mixture of the devices' batches (models.mixture_variance_change): with batch norm's own
    # change, the mean of the devices' variances, some channel fell to 0.30 and 0.34 of its data's in 2 of 12 runs;
    # 0.49 at the lowest in 22 with it
    assert np.all((running_var > 0.4 * var) & (running_var < 2.5 * var)), (running_var, var)  # 2.07x once
    # what the user relies on: the statistics recomputed on the devices' images score no better
    for bn in (module.bn1, module.bn2):
        bn.reset_running_stats()
        bn.momentum = None  # a cumulative average over every batch
    module.train()
    with torch.no_grad():
        for start in range(0, len(images), 64):
            module(torch.from_numpy(images[start:start + 64]))
    module.eval()
    held = load_local("image-folder", tmp_path / "ps" / "shapes-eval", input_shape=(3, 24, 24), classes=CLASSES).train
    with torch.no_grad():
        recomputed = float((module(torch.tensor(held.x)).argmax(1).numpy() == held.y).mean())
    # the bug this guards against cost 50 points (0.377 against 0.873). Up to 6.7 points remain in 22 runs
    # (statistics trail the weights they were gathered under), 0.1 on average
    assert recomputed <= done.accuracy + 0.1, (recomputed, done.accuracy)


async def test_an_entry_point_module_with_batch_norm_a_residual_and_a_depthwise_conv_trains_and_exports(
        fleet: tuple[LocalCluster, Config], tmp_path: Path) -> None:
    _, config = fleet
    modules = tmp_path / "models"
    modules.mkdir()
    (modules / ENTRY_POINT_FILE).write_text(ENTRY_POINT_NET)  # batch norm, depthwise blocks with residuals
    model = f'entry_point = "{ENTRY_POINT}"\nmodule_path = "{modules}"'
    job_file = tmp_path / "dw.toml"
    job_file.write_text(BN_JOB.format(name="dw-shapes", target=0.85, model=model, policy="async", extra=""))
    done = await finished_job(config, job_file, "dw-shapes")
    assert done.accuracy is not None and done.accuracy >= 0.85
    for fmt in ("onnx", "torch"):
        out = tmp_path / "export" / f"dw.{fmt}"
        exported = edgemesh("job", "export", "dw-shapes", "--format", fmt, "--out", str(out), "--broker",
                            config.broker.url, "--module-path", str(modules), "--trust-code")
        assert exported.returncode == 0, exported.stderr
    assert abs(held_out_accuracy(tmp_path / "export" / "dw.onnx", tmp_path / "ps" / "shapes-eval")
               - done.accuracy) <= 0.005
    snapshot = await kept_model(config, "dw-shapes")
    assert not np.allclose(snapshot.tensors["net.block1.bn2.running_var"].to_numpy(), 1.0)  # the statistics trained


async def test_the_divergence_guard_rolls_a_job_back_when_its_learning_rate_is_raised_fifty_times(
        fleet: tuple[LocalCluster, Config], tmp_path: Path) -> None:
    """An operator raises the learning rate 50 times while the job trains: the model diverges, the guard rolls it
    back to its best evaluated version with a lower rate, training recovers, and the job ends within 2 points of its
    best."""
    _, config = fleet
    job_file = tmp_path / "guard.toml"
    job_file.write_text(BN_JOB.format(name="guarded", target=0, model=BN_LAYERS, policy="async",
                                      extra="[ps.guard]\nlr_factor = 0.2\n"))
    submitted = edgemesh("job", "submit", str(job_file), "--broker", config.broker.url, "--wait", "60")
    assert submitted.returncode == 0, submitted.stderr
    async with inbox(dataclasses.replace(config, job="guarded"), (Topics("guarded").job_state_filter(),
                                                                   JobState)) as box:
        trained = await box.next(JobState, lambda s: s.accuracy is not None and s.accuracy >= 0.8, JOB_WAIT_S)
        raised = edgemesh("ctl", "set-lr", "--value", "1.0", "--job", "guarded", "--broker", config.broker.url)
        assert raised.returncode == 0, raised.stderr
        rolled = await box.next(JobState, lambda s: s.rollbacks > trained.rollbacks, JOB_WAIT_S)
        best = max(e.accuracy for e in rolled.evaluations)
        # recovered: an evaluation after the rollback within 2 points of the best
        await box.next(JobState, lambda s: any(e.version > rolled.version and e.accuracy >= best - 0.02
                                               for e in s.evaluations), JOB_WAIT_S)
    stopped = edgemesh("job", "stop", "guarded", "--broker", config.broker.url)
    assert stopped.returncode == 0, stopped.stderr
    done = await wait_for_job(config, "guarded", ("stopped",), 60)
    # the job keeps its best evaluated model when its last scored lower (async training of a batch-norm model on
    # devices of different data is noisy from one evaluation of 90 images to the next)
    assert done.accuracy is not None and done.accuracy >= best - 0.02
    assert done.accuracy >= max(e.accuracy for e in done.evaluations) - 1e-9
    assert 1 <= done.rollbacks - trained.rollbacks < GuardConfig().max_rollbacks  # it recovered before giving up
    out = tmp_path / "export" / "guarded.onnx"
    exported = edgemesh("job", "export", "guarded", "--format", "onnx", "--out", str(out), "--broker",
                        config.broker.url)
    assert exported.returncode == 0, exported.stderr
    assert abs(held_out_accuracy(out, tmp_path / "ps" / "shapes-eval") - done.accuracy) <= 0.005
