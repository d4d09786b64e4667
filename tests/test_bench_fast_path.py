"""The benchmarks of the parameter server's fast path and scale, quick runs: ``bench transport``, ``bench ddp`` and
``bench scale``. Each writes its report layout and a PNG beside it; nothing here asserts a speed. (Apart from
test_bench.py so that the test runner's two workers share the long benchmark runs.)"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import uuid
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from edgemesh.bench import transport
from edgemesh.local.broker import BrokerProcess

pytestmark = pytest.mark.timeout(400)
"""Each quick run is a cluster of processes; a loaded CI host makes it slower than the default limit."""


def test_bench_transport_sets_the_parameter_servers_ingest_beside_the_broker_alone(tmp_path: Path) -> None:
    """Two short rounds of trials: the broker alone (answered and streamed) and a real PS acking every replayed
    gradient it applied, as one process and as two shards; the ratio is the PS's MB/s over the broker's at the
    same payload and number in flight."""
    report = tmp_path / "transport.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "transport", "--report", str(report), "--payloads", "300KB",
         "--in-flight", "1,2", "--seconds", "1", "--rounds", "2"],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["failure"] is None and data["replayed_gradients"] is True
    assert data["payloads"] == {"300KB": 300_000}
    # ingest as the issue counts it: no held-out evaluation beside it, every update logged and fsynced
    assert data["ps_settings"] == {"ps.eval_every": 0, "ps.fsync": True, "ps.checkpoint_every": 200}
    for kind in ("raw", "stream", "ps"):
        assert set(data[kind]) == {"300KB/1", "300KB/2"}, kind
        for entry in data[kind].values():
            assert entry["messages"] > 0 and entry["mb_per_s"] > 0, kind
    for kind in ("raw", "stream"):  # the broker alone is answered by a process of its own, as the PS is one
        for key, cores in data["cpu_cores"][kind].items():
            assert cores["subscriber"] > 0 and cores["devices"] > 0, (kind, key)
    for key, ps in data["ps"].items():
        assert ps["p50_ms"] <= ps["p99_ms"]
        assert data["ps_ingest_ratio"][key] == pytest.approx(ps["mb_per_s"] / data["raw"][key]["mb_per_s"], abs=1e-3)
        assert data["ps_cpu_s_per_update"][key] > 0
        assert data["ps_parts"][key]["wal_bytes_per_update"] >= 300_000  # every applied gradient was logged
    # two shards, each taking its half of every gradient: together they log all of it
    sharded = data["sharded"]["2"]
    for key, ps in sharded["ps"].items():
        assert ps["messages"] > 0
        assert sharded["speedup_vs_1"][key] == pytest.approx(ps["mb_per_s"] / data["ps"][key]["mb_per_s"], abs=1e-3)
        assert sharded["ps_parts"][key]["wal_bytes_per_update"] >= 300_000
    # each side twice, first and last in turn; what the report says of a side pools its rounds
    assert data["rounds_per_key"] == 2
    for key, rounds in data["rounds"].items():
        assert [r["first"] for r in rounds] == ["raw", "ps/2"]
        assert all(r[side] > 0 for r in rounds for side in ("raw", "stream", "ps/1", "ps/2"))
        for side, entry in (("raw", data["raw"][key]), ("ps/1", data["ps"][key]), ("ps/2", sharded["ps"][key])):
            assert min(r[side] for r in rounds) - 0.1 <= entry["mb_per_s"] <= max(r[side] for r in rounds) + 0.1
    assert report.with_suffix(".png").stat().st_size > 1000


DDP_KEYS = {"edgemesh_seconds_per_version", "ddp_seconds_per_step", "step_time_ratio", "initial_loss",
            "edgemesh_final_loss", "ddp_final_loss", "final_loss_ratio", "edgemesh_final_accuracy",
            "ddp_final_accuracy", "edgemesh_worker_step_seconds", "edgemesh_worker_ack_seconds", "steps",
            "edgemesh_final_loss_mean", "ddp_final_loss_mean", "final_loss_ratio_of_means", "rounds_with_losses",
            "warmup_steps", "batch_per_worker", "lr", "momentum", "torch_threads", "settings", "edgemesh", "ddp"}


def test_bench_ddp_quick_sets_edgemesh_sync_beside_torch_ddp(tmp_path: Path) -> None:
    """``--quick``: 30 steps of a real two-worker EdgeMesh cluster under ``sync`` and of two DDP ranks, on digits at
    lr 0.1 (``--set``): cifar-cnn learns synthetic-cifar over a hundred steps or more, while in 30 on digits both
    sides end well below the loss they start from, at a fraction of the cost per step. Bad arguments exit 2."""
    for args, message in ((["--steps", "10", "--warmup", "20"], "--steps >= --warmup + 2"),
                          (["--rounds", "0"], "--rounds must be >= 1"),
                          (["--set", "training.lr=0"], "training.lr: must be > 0")):
        refused = subprocess.run([sys.executable, "-m", "edgemesh", "bench", "ddp",
                                  "--report", str(tmp_path / "x.json"), *args],
                                 capture_output=True, text=True, timeout=120, check=False)
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    report = tmp_path / "ddp.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "ddp", "--quick", "--rounds", "2", "--report", str(report),
         "--set", "training.model_spec=digits-cnn", "--set", "training.dataset=digits",
         "--set", "training.lr=0.1"],
        capture_output=True, text=True, timeout=480, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert DDP_KEYS <= data.keys() and data["failure"] is None
    assert data["model"] == "digits-cnn" and data["settings"]["training.sync_policy"] == "sync"
    assert data["steps"] == 30 and data["workers"] == 2 and data["batch_per_worker"] == 32
    assert data["edgemesh"]["plan"]["batches"] == {"w0": 32, "w1": 32}  # the planner gave each worker the batch
    assert data["final_version"] == data["edgemesh"]["final_version"] == data["ddp"]["final_step"] == 30
    # neither side evaluates while it is timed: EdgeMesh's one held-out evaluation is at version 30
    assert [v for v, *_ in data["edgemesh"]["curve"]] == [30]
    assert data["step_time_ratio"] == pytest.approx(
        data["edgemesh_seconds_per_version"] / data["ddp_seconds_per_step"], abs=1e-3)
    # two rounds, the second with DDP first; the seconds are their means
    assert [r["first"] for r in data["rounds"]] == ["edgemesh", "ddp"]
    assert data["rounds"][0]["edgemesh_seconds_per_version"] == data["edgemesh"]["seconds_per_version"]
    for side, key in (("edgemesh", "edgemesh_seconds_per_version"), ("ddp", "ddp_seconds_per_step")):
        assert data[key] == pytest.approx(sum(r[key] for r in data["rounds"]) / 2, abs=1e-3), side
    assert data["final_loss_ratio"] == pytest.approx(data["edgemesh_final_loss"] / data["ddp_final_loss"], abs=1e-3)
    # each round at a seed of its own, its final losses, and their means over the rounds (all at version 30)
    assert [r["seed"] for r in data["rounds"]] == [data["settings"]["training.seed"] + i for i in range(2)]
    assert data["rounds"][0]["edgemesh_final_loss"] == data["edgemesh_final_loss"]
    assert data["rounds_with_losses"] == 2 and all(r["final_version"] == 30 for r in data["rounds"])
    assert data["rounds"][1]["ddp_final_loss"] != data["rounds"][0]["ddp_final_loss"]  # another seed, another run
    for side in ("edgemesh", "ddp"):
        losses = [r[f"{side}_final_loss"] for r in data["rounds"]]
        assert data[f"{side}_final_loss_mean"] == pytest.approx(sum(losses) / 2, abs=1e-3), side
    assert data["final_loss_ratio_of_means"] == pytest.approx(
        data["edgemesh_final_loss_mean"] / data["ddp_final_loss_mean"], abs=1e-3)
    for side in ("edgemesh", "ddp"):
        assert data[f"{side}_final_loss"] < data["initial_loss"], side  # both learned
    assert data["edgemesh_worker_step_seconds"] > 0 and data["edgemesh_worker_ack_seconds"] > 0
    assert report.with_suffix(".png").stat().st_size > 1000


def test_bench_scale_runs_light_devices_against_the_real_services(tmp_path: Path) -> None:
    """Four load devices for a few seconds: every update they sent is answered or still in flight at the end, the
    report has the PS's queue over time and each process's CPU and memory. Bad arguments exit 2."""
    refused = subprocess.run([sys.executable, "-m", "edgemesh", "bench", "scale", "--workers", "0",
                              "--report", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120,
                             check=False)
    assert refused.returncode == 2 and "--workers >= 1" in refused.stderr
    report = tmp_path / "scale.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "scale", "--workers", "4", "--minutes", "0.1", "--step-s", "0.3",
         "--sample-s", "1", "--report", str(report)],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["failure"] is None and data["replayed_gradients"] is True and data["workers"] == 4
    assert data["updates_accepted"] > 0 and data["updates_discarded"] == 0 and data["updates_lost"] == 0
    assert data["updates_sent"] == data["updates_accepted"] + data["updates_in_flight_at_end"]
    assert 0 <= data["updates_in_flight_at_end"] <= 4
    assert data["ack_p50_ms"] <= data["ack_p99_ms"]
    assert data["model_versions"] > 0 and data["model_messages_received"] >= data["model_versions"]
    assert set(data["cpu_share"]) == set(data["rss_mib_peak"]) == {"planner", "ps", "compressor", "broker", "load"}
    assert all(v > 0 for v in data["rss_mib_peak"].values())
    assert len(data["samples"]) >= 3 and max(s["ps_pending"] for s in data["samples"]) <= 4
    assert data["acceptance"] == {"queue_bounded": True, "no_update_discarded": True}
    assert report.with_suffix(".png").stat().st_size > 1000


@pytest.mark.requires_binary("mosquitto")
def test_a_raw_subscriber_that_fell_behind_still_hears_the_stop(tmp_path: Path) -> None:
    """A stream trial's subscriber that falls behind the devices has a queue at Mosquitto's limit, which drops
    what arrives while it is full, the stop as well (CI saw the trial time out so): the stop is said again until
    one gets in, and the subscriber reports what it received."""
    with BrokerProcess.mosquitto(extra_config="max_queued_messages 5\n", workdir=tmp_path,
                                 max_packet_size=transport.MAX_PACKET_BYTES) as broker:
        run = uuid.uuid4().hex[:6]
        spawn = multiprocessing.get_context("spawn")
        parent, child = spawn.Pipe()
        subscriber = spawn.Process(target=transport._subscriber_main,
                                   args=(broker.host, broker.port, run, True, child), daemon=True)
        subscriber.start()
        try:
            assert transport._heard(parent, transport.SUBSCRIBER_START_S) == "ready"
            os.kill(subscriber.pid, signal.SIGSTOP)  # it falls behind: the broker's queue for it fills
            asyncio.run(flood(broker, run, parent, subscriber))
        finally:
            os.kill(subscriber.pid, signal.SIGCONT)
            subscriber.join(30)
            if subscriber.is_alive():
                subscriber.kill()


async def flood(broker: BrokerProcess, run: str, parent: Connection, subscriber: BaseProcess) -> None:
    """Payloads past the queue's limit, a stop that is dropped with them, then the stops of ``_stop``; the stalled
    subscriber goes on once the first of those has passed the broker."""
    sent = 200
    async with transport._client(broker.host, broker.port, f"flood-{run}") as devices, \
            transport._client(broker.host, broker.port, f"watch-{run}") as watch:
        await watch.subscribe(f"{transport.RAW_TOPIC}-stop/{run}", qos=1)
        for _ in range(sent):
            await devices.publish(f"{transport.RAW_TOPIC}/{run}/0", bytes(100_000), qos=1)
        await devices.publish(f"{transport.RAW_TOPIC}-stop/{run}", b"stop", qos=1)  # dropped: the queue is full
        await anext(aiter(watch.messages))
        stopping = asyncio.create_task(transport._stop(broker.host, broker.port, run, parent, subscriber))
        async with asyncio.timeout(30):
            await anext(aiter(watch.messages))  # the first of _stop's, while the queue is still full (a single
            # stop, as before, left the subscriber waiting: with a repeat of 20 s this run took 22 s)
        os.kill(subscriber.pid, signal.SIGCONT)
        report = await stopping
    assert isinstance(report, tuple), report
    messages, payload, _ = report
    assert 0 < messages < sent and payload == messages * 100_000  # the broker dropped some, and said the stop
