"""Fleet emulation: the profile file, stretched compute, emulated workers, memory refusal, and a
straggler that drops off for 30 s under the adaptive policy. Services run in-process against a
Mosquitto the test starts; the link emulator itself is tested in ``test_emulation_link.py``."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import inbox, make_config, running, until

from edgemesh.common import costs
from edgemesh.common.config import Config
from edgemesh.common.emulation.compute import ComputeStretch
from edgemesh.common.emulation.profiles import FIGURES, get_profile, load_profiles, parallel_efficiency, parse_profiles
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import DeviceHello, DeviceStatus, Event, Plan, PlanCluster, PlanDevice, UpdateAck
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.board import Board, EmulatedBoard
from edgemesh.services.worker.service import Worker

BOARD_WAIT_S = 30.0
"""Seconds one expected event of emulated boards (slower than the host, behind their links) may take."""
OUTAGE_S = 30.0
"""How long the straggler drops off (the issue's scenario)."""
PROFILES = ("pi3", "pi4", "pi5", "jetson-nano", "laptop")


# --------------------------------------------------------------------------- the profile file


def test_the_builtin_profiles_cover_the_fleet_and_source_every_figure() -> None:
    profiles = load_profiles()
    assert set(PROFILES) <= set(profiles)
    for p in profiles.values():
        assert set(p.sources) == set(FIGURES) and all(len(text) > 20 for text in p.sources.values()), p.name
        assert p.gflops > 0 and p.memory_bytes > 0 and p.uplink_bps > 0 and p.downlink_bps > 0
        assert 0 < p.train_gflops < p.gflops
        assert not p.link().off
    # the ordering every source agrees on: a Pi 3 is the slowest board, a Pi 5 beats a Pi 4
    speed = {name: profiles[name].train_gflops for name in PROFILES}
    assert speed["pi3"] < speed["pi4"] < speed["pi5"]
    assert min(speed, key=speed.__getitem__) == "pi3"
    assert profiles["pi3"].memory_bytes < 1 << 30  # a 1 GiB board
    assert parallel_efficiency(1, 1.22) == 1.0 and parallel_efficiency(4, 2.0) == 1.0
    assert parallel_efficiency(4, 1.22) == pytest.approx(1.22**2 / 4)


def _profiles(**changes: Any) -> dict[str, Any]:
    table: dict[str, Any] = {"description": "d", "cores": 4, "gflops": 10.0, "memory_mib": 500, "uplink_mbit": 10.0,
                             "downlink_mbit": 10.0, "latency_ms": 2.0, "disconnects_per_hour": 1.0, "outage_s": 5.0}
    table["sources"] = {k: "measured somewhere, 2026" for k in FIGURES}
    table.update(changes)
    return {"emulation": {"thread_scaling": 1.5, "thread_scaling_source": "a measurement"},
            "profiles": {"board": table}}


@pytest.mark.parametrize("change,message", [
    ({"gflops": 0.0}, "gflops: must be > 0"),
    ({"latency_ms": -1.0}, "latency_ms: must be >= 0"),
    ({"memory_mib": "lots"}, "memory_mib: expected a number"),
    ({"cores": 2.5}, "cores: expected a whole number"),
    ({"outage_s": 0.0}, "outage_s: must be > 0 when disconnects_per_hour > 0"),
    ({"speed": 3.0}, "unknown field"),
    ({"sources": {k: "x" for k in FIGURES if k != "gflops"}}, "no source noted for gflops"),
])
def test_a_profile_file_with_a_bad_or_unsourced_figure_is_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_profiles(_profiles(**change), source="mine.toml")


def test_profiles_load_from_a_file_of_ones_own(tmp_path: Path) -> None:
    path = tmp_path / "boards.toml"
    path.write_text('[emulation]\nthread_scaling = 2.0\nthread_scaling_source = "ideal"\n'
                    '[profiles.box]\ncores = 1\ngflops = 2.0\nmemory_mib = 100\nuplink_mbit = 8.0\n'
                    'downlink_mbit = 16.0\nlatency_ms = 5.0\ndisconnects_per_hour = 0\noutage_s = 0\n'
                    '[profiles.box.sources]\n' + "".join(f'{k} = "my bench"\n' for k in FIGURES))
    box = get_profile("box", path)
    assert (box.train_gflops, box.uplink_bps, box.downlink_bps, box.latency_s) == (2.0, 1e6, 2e6, 0.005)
    with pytest.raises(ConfigError, match="unknown device profile 'pi9'; known: box"):
        get_profile("pi9", path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_profiles(tmp_path / "missing.toml")
    (tmp_path / "broken.toml").write_text("[profiles\n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_profiles(tmp_path / "broken.toml")


# --------------------------------------------------------------------------- stretched compute


def test_steps_are_stretched_to_the_boards_speed_from_the_hosts_uncontended_time() -> None:
    stretch = ComputeStretch.for_device(host_gflops=100.0, device_train_gflops=10.0)
    assert stretch.ratio == 10.0
    # calibration: the best of the repeats at batch 4 is 1 ms, at batch 64 3 ms (a busy host's
    # slower repeats do not count)
    calls: list[int] = []

    def step(batch: int) -> float:
        calls.append(batch)
        best = 0.001 if batch == 4 else 0.003
        return best if len(calls) % 2 else 4 * best  # every other repeat slowed down by the others

    assert stretch.calibrate(step) == (pytest.approx(0.001 - 4 * 0.002 / 60), pytest.approx(0.002 / 60))
    assert sorted(set(calls)) == [4, 64]
    line = stretch.line
    assert line is not None
    expected_32 = 10 * (line[0] + 32 * line[1])
    # a step the busy host took 5 ms for still ends when the board would have: the reference,
    # not this step's own time, is stretched
    assert stretch.emulated(32, 0.005) == pytest.approx(expected_32)
    assert stretch.hold_s(32, 0.005) == pytest.approx(expected_32 - 0.005)
    # a faster real step lowers the reference for that batch size
    assert stretch.emulated(32, 0.0015) == pytest.approx(0.015)
    assert stretch.emulated(32, 0.004) == pytest.approx(0.015)
    # the host could not keep up: the step runs at the host's pace, and that is counted
    assert stretch.emulated(32, 0.030) == 0.030
    assert (stretch.steps, stretch.overruns) == (5, 1)
    with pytest.raises(ValueError):
        ComputeStretch.for_device(0.0, 1.0)


# --------------------------------------------------------------------------- services

def emulation_config(broker: BrokerProcess, tmp_path: Path, job: str, **settings: object) -> Config:
    return make_config(broker, job=job, **{
        "ps.state_dir": tmp_path / "ps", "ps.fsync": "false", "ps.eval_every": "0", "broker.connect_timeout_s": "2",
        "planner.replan_debounce_s": "0.2", "worker.ack_timeout_s": "2", "worker.codec_wait_s": "0.5",
        "worker.emulation_host_gflops": "50", "worker.stats_interval_s": "0.5", **settings})


def quiet_profiles(tmp_path: Path) -> Path:
    """The built-in pi5 without spontaneous disconnects, so only the test cuts links."""
    p = get_profile("pi5")
    path = tmp_path / "quiet.toml"
    path.write_text(f'[emulation]\nthread_scaling = {p.thread_scaling}\nthread_scaling_source = "built-in"\n'
                    f'[profiles.quiet-pi5]\ncores = {p.cores}\ngflops = {p.gflops}\n'
                    f'memory_mib = {p.memory_bytes // 2**20}\nuplink_mbit = {p.uplink_bps * 8 / 1e6}\n'
                    f'downlink_mbit = {p.downlink_bps * 8 / 1e6}\nlatency_ms = {p.latency_s * 1e3}\n'
                    'disconnects_per_hour = 0\noutage_s = 0\n[profiles.quiet-pi5.sources]\n'
                    + "".join(f'{k} = "the built-in pi5 (drops off)"\n' for k in FIGURES))
    return path


def emulated(worker: Worker) -> EmulatedBoard:
    """The emulated board ``worker`` runs on."""
    assert isinstance(worker.board, EmulatedBoard), worker.board
    return worker.board


async def test_an_emulated_worker_reports_its_board_and_trains_through_its_link(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    job = "emu-hello"
    cfg = emulation_config(mosquitto_broker, tmp_path, job, **{"training.sync_policy": "async"})
    topics = Topics(job)
    pi3 = get_profile("pi3")
    worker = Worker(emulation_config(mosquitto_broker, tmp_path, job, **{
        "worker.device": "board", "worker.emulate": "pi3", "worker.max_steps": "6"}))
    async with inbox(cfg, (topics.hello_filter(), DeviceHello)) as rec, \
            running(Planner(cfg), ParameterServer(cfg), worker):
        hello = await rec.next(DeviceHello, lambda h: h.device == "board", BOARD_WAIT_S)
        # the board's figures, not the host's
        assert (hello.profile, hello.flops, hello.memory_bytes, hello.link_rate_bps) == (
            "pi3", pi3.train_gflops * 1e9, pi3.memory_bytes, pi3.uplink_bps)
        await until("six accepted updates", lambda: worker.accepted >= 6, BOARD_WAIT_S)
        board = emulated(worker)
        link = board.emulated_link
        assert link is not None and link.bytes_up > 0 and link.bytes_down > 0
        # its steps took as long as a Pi 3's would have: its FLOPs at the training share of its rate
        stretch = board.stretch
        assert stretch is not None and stretch.ratio == pytest.approx(50 / pi3.train_gflops)
        steps = worker.metrics.value("edgemesh_worker_step_seconds_count")
        mean_step = worker.metrics.value("edgemesh_worker_step_seconds_sum") / steps
        board_step = costs.step_seconds_estimate("digits-cnn", 32, pi3.train_gflops * 1e9)
        assert mean_step >= 0.99 * board_step
    # a real worker has no emulated link and no stretched steps: it reports what it measured
    real = Worker(emulation_config(mosquitto_broker, tmp_path, job, **{"worker.device": "real"}))
    assert type(real.board) is Board and real.board.profile_name == ""


async def test_an_emulated_worker_over_tls_or_of_an_unknown_board_is_refused_at_start(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown device profile 'pi9'"):
        Worker(emulation_config(mosquitto_broker, tmp_path, "emu-bad", **{"worker.emulate": "pi9"}))
    ca = tmp_path / "ca.pem"
    ca.write_text("not used")
    with pytest.raises(ConfigError, match="plain TCP"):
        Worker(emulation_config(mosquitto_broker, tmp_path, "emu-bad", **{
            "worker.emulate": "pi4", "broker.url": "mqtts://127.0.0.1:8883", "broker.ca_file": str(ca)}))


async def test_a_device_refuses_a_share_that_does_not_fit_its_memory(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    job = "emu-refuse"
    topics = Topics(job)
    # holds a batch of 64, not of 65, by the smaller of the worker's two estimates (the mesh grid's accounting)
    layers = costs.layers("digits-cnn")
    memory = costs.member_memory_bytes(layers, [la.units for la in layers], 64)
    worker = Worker(emulation_config(mosquitto_broker, tmp_path, job, **{"worker.device": "small",
                                                                        "worker.memory_bytes": str(memory)}))
    cfg = emulation_config(mosquitto_broker, tmp_path, job)
    async with inbox(cfg, (topics.status_filter(), DeviceStatus), (topics.events_filter(), Event)) as rec, \
            running(worker):
        await rec.next(DeviceStatus, lambda s: s.device == "small" and s.state == "online", BOARD_WAIT_S)

        def plan(version: int, batch: int) -> Plan:
            return Plan(version=version, created=time.time(), model_spec="digits-cnn", dataset="digits",
                        devices=(PlanDevice(device="small", cluster="c-small", shard_index=0, shard_count=1,
                                            batch_size=batch),),
                        clusters=(PlanCluster(cluster="c-small", members=("small",)),))

        await rec.publish(topics.plan(), plan(1, 65), retain=True)
        refusal = await rec.next(DeviceStatus, lambda s: s.refused_plan != 0, BOARD_WAIT_S)
        assert refusal.refused_plan == 1 and "batch 65" in refusal.reason and refusal.state == "online"
        event = await rec.next(Event, lambda e: e.kind == "share_refused", BOARD_WAIT_S)
        assert event.data["plan_version"] == 1
        assert worker.metrics.value("edgemesh_worker_refused_shares_total") == 1
        assert worker.metrics.value("edgemesh_worker_steps_total") == 0
        # a plan that fits: the worker takes it (it then waits for a model: there is no PS here)
        await rec.publish(topics.plan(), plan(2, 64), retain=True)
        await until("the new plan", lambda: worker.plan is not None and worker.plan.version == 2, BOARD_WAIT_S)
        assert worker.metrics.value("edgemesh_worker_refused_shares_total") == 1


async def test_a_straggler_that_drops_off_for_30s_rejoins_and_resyncs_without_a_stale_update_applied(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    job = "emu-straggler"
    topics = Topics(job)
    bound = 2
    profiles = quiet_profiles(tmp_path)
    cfg = emulation_config(mosquitto_broker, tmp_path, job, **{
        "training.sync_policy": "adaptive", "training.staleness_bound": bound, "planner.min_devices": 2,
        "ps.adaptive.max_deadline_s": "5", "worker.emulation_profiles": str(profiles)})

    def worker(name: str) -> Worker:
        return Worker(emulation_config(mosquitto_broker, tmp_path, job, **{
            "training.sync_policy": "adaptive", "worker.device": name, "worker.emulate": "quiet-pi5",
            "worker.emulation_profiles": str(profiles)}))

    steady, straggler = worker("steady"), worker("straggler")
    planner, ps = Planner(cfg), ParameterServer(cfg)
    async with inbox(cfg, (topics.ack_filter("straggler"), UpdateAck), (topics.plan_filter(), Plan)) as rec, \
            running(planner, ps, Compressor(cfg), steady, straggler):
        await until("both training", lambda: steady.accepted >= 3 and straggler.accepted >= 3, 60)
        link = emulated(straggler).emulated_link
        assert link is not None

        # the straggler's Wi-Fi drops for 30 s: the broker publishes its will, the planner drops it
        before = ps.version
        await link.outage(OUTAGE_S)
        cut_at = time.monotonic()
        await until("a plan without the straggler", lambda: planner.plan is not None
                    and [d.device for d in planner.plan.devices] == ["steady"], BOARD_WAIT_S)
        # training goes on without waiting for it
        await until("progress while it is away", lambda: ps.version >= before + 10, BOARD_WAIT_S)
        away_acks = len(rec.of(UpdateAck))

        # it comes back, is planned again, resyncs to the current model and trains on
        await until("a plan with the straggler again", lambda: planner.plan is not None
                    and len(planner.plan.devices) == 2, OUTAGE_S + BOARD_WAIT_S)
        assert time.monotonic() - cut_at >= OUTAGE_S - 1
        back_at = straggler.accepted
        await until("the straggler's updates accepted again", lambda: straggler.accepted >= back_at + 3,
                    BOARD_WAIT_S)

        acks = rec.of(UpdateAck)
        after = acks[away_acks:]
        assert after, "no ack for the straggler after it came back"
        # what it sent before the drop was either applied once (then acked as a duplicate on resend)
        # or thrown away (stale or unknown): never applied late
        first = after[0]
        assert first.status in ("duplicate", "discarded"), first
        if first.status == "discarded":
            assert first.reason in ("stale", "unknown_device")
        for ack in acks:
            if ack.status == "accepted":
                assert ack.delay <= bound, ack  # no update beyond the bound was ever applied
        # the model it trains on now is the current one
        assert straggler.view.version >= ps.version - bound
        # and the PS never applied an update later than its bound
        delays = ps.metrics.registry.get_sample_value
        over_bound = (ps.metrics.value("edgemesh_ps_update_delay_versions_count")
                      - (delays("edgemesh_ps_update_delay_versions_bucket", {"le": f"{float(bound)}"}) or 0.0))
        assert over_bound == 0
        assert link.outages == 1 and link.disconnects >= 1 and math.isclose(link.down_seconds, OUTAGE_S)
        await until("the cut in the worker's metrics", lambda: straggler.metrics.value(
            "edgemesh_worker_emulation_link_disconnects") >= 1, BOARD_WAIT_S)
