"""``edgemesh simulate``: the fleet on a virtual clock runs the services' own scheduler, is seeded, follows its
scenario's drop-outs, and reports per policy. Runs are short, on small fleets of slow boards: a run's wall time is
about its gradients', and a slow board computes few per virtual second."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_config, running, until

from edgemesh import cli
from edgemesh.bench.fleet import BATCH, MODEL
from edgemesh.common import costs, models, wire
from edgemesh.common.broadcast import ModelMessage, ModelView
from edgemesh.common.config import AdaptiveConfig, load_config
from edgemesh.common.emulation.dynamics import Timeline
from edgemesh.common.emulation.profiles import get_profile
from edgemesh.common.emulation.scenarios import load_scenarios
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import ModelDelta, ModelSnapshot
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker
from edgemesh.simulate import SimSettings, compare, simulate
from edgemesh.simulate.engine import SimRun, Simulation
from edgemesh.simulate.fleet import Board, Downlink, Published
from edgemesh.simulate.server import CachedDelay, Server

LIVE_WAIT_S = 60.0
UNIFORM = {"planner.batching": "uniform"}
"""Every device at ``training.batch_size``: a sync round is then as slow as its slowest board."""
SLOW = ("pi3", "pi4", "jetson-nano")
SOURCE = "a test figure"
DROPS = """
[scenarios.calm]
description = "nothing happens"
throttle_profiles = []
throttle_speed = 1.0
throttled_s = 0.0
unthrottled_s = 0.0
stalls_per_minute = 0.0
stall_s = 0.0
max_stall_s = 0.0
disconnects_per_hour = 0.0
outage_s = 0.0
max_outage_s = 0.0
bandwidth_sigma = 0.0
bandwidth_interval_s = 0.0

[scenarios.drops]
description = "a drop-out every two seconds per device"
throttle_profiles = []
throttle_speed = 1.0
throttled_s = 0.0
unthrottled_s = 0.0
stalls_per_minute = 0.0
stall_s = 0.0
max_stall_s = 0.0
disconnects_per_hour = 1800.0
outage_s = 1.0
max_outage_s = 2.0
bandwidth_sigma = 0.0
bandwidth_interval_s = 0.0
"""


def _scenarios(tmp_path: Path) -> str:
    """A scenario file with ``calm`` and ``drops``, every figure sourced."""
    figures = ["throttle_profiles", "throttle_speed", "throttled_s", "unthrottled_s", "stalls_per_minute", "stall_s",
               "max_stall_s", "disconnects_per_hour", "outage_s", "max_outage_s", "bandwidth_sigma",
               "bandwidth_interval_s"]
    sources = "".join(f'\n[scenarios.{name}.sources]\n' + "".join(f'{f} = "{SOURCE}"\n' for f in figures)
                      for name in ("calm", "drops"))
    path = tmp_path / "scenarios.toml"
    path.write_text(DROPS + sources)
    return str(path)


def test_a_seed_replays_the_same_run_and_another_seed_does_not() -> None:
    settings = SimSettings(fleet=SLOW, scenario="harsh", policy="async", budget_s=2.0)
    first, again = simulate(settings), simulate(settings)
    other = simulate(SimSettings(fleet=SLOW, scenario="harsh", policy="async", budget_s=2.0, seed=1))
    assert first.curve == again.curve
    assert first.summary() | {"wall_s": 0} == again.summary() | {"wall_s": 0}
    assert first.curve != other.curve


def test_sync_rounds_wait_for_the_slowest_board_and_async_does_not() -> None:
    fleet = ("pi3", "laptop")
    sync = simulate(SimSettings(fleet=fleet, policy="sync", budget_s=2.0, overrides=UNIFORM))
    free = simulate(SimSettings(fleet=fleet, policy="async", budget_s=2.0, overrides=UNIFORM))
    pi3 = get_profile("pi3")
    step_s = BATCH * costs.cost(MODEL).train_flops_per_sample / (pi3.train_gflops * 1e9 * costs.TRAIN_EFFICIENCY)
    per_version = sync.elapsed_s / sync.versions
    # a round is the pi3's step, its upload and the model's way back: the laptop's faster steps do not shorten it
    assert step_s < per_version < step_s * 1.5
    assert sync.details["updates_by_device"]["laptop-0"] == sync.details["updates_by_device"]["pi3-0"]
    assert free.versions > 3 * sync.versions
    assert free.gradients > 3 * sync.gradients


def test_a_drop_out_holds_the_device_back_and_the_planner_replans(tmp_path: Path) -> None:
    overrides = {**UNIFORM, "worker.emulation_scenarios": _scenarios(tmp_path)}
    calm = simulate(SimSettings(fleet=SLOW[1:], scenario="calm", policy="async", budget_s=6.0, overrides=overrides))
    drops = simulate(SimSettings(fleet=SLOW[1:], scenario="drops", policy="async", budget_s=6.0, overrides=overrides))
    scenario = load_scenarios(overrides["worker.emulation_scenarios"])["drops"]
    dropped = [name for name, profile in (("pi4-0", "pi4"), ("jetson-nano-0", "jetson-nano"))
               if Timeline.of(scenario, profile, name, 0).until(6.0, ("drop",))]
    assert dropped  # the seed gives a drop-out within the budget
    for device in dropped:
        assert drops.details["updates_by_device"][device] < 0.8 * calm.details["updates_by_device"][device]
    assert calm.plans == 1
    assert drops.plans > 2  # a device left and came back


def test_the_report_has_each_policy_and_each_run() -> None:
    report = compare(SimSettings(fleet=SLOW[:2], budget_s=1.0, target=0.3),
                     ["sync", "adaptive"], [0, 1])
    assert set(report["policies"]) == {"sync", "adaptive"}
    for summary in report["policies"].values():
        assert set(summary) >= {"runs", "median_time_to_target_s", "time_to_target_spread_s", "reached_share",
                                "diverged_share", "median_final_accuracy", "median_versions", "discarded"}
        assert summary["runs"] == 2
    run = report["runs"]["sync"][1]
    assert run["seed"] == 1
    assert set(run) >= {"time_to_target_s", "final_accuracy", "versions", "updates", "discarded", "curve",
                        "diverged", "seconds_per_version"}
    assert json.loads(json.dumps(report)) == report


def test_each_run_is_reported_as_it_ends_saying_whether_it_reached_the_target() -> None:
    lines: list[str] = []
    compare(SimSettings(fleet=SLOW[:2], budget_s=1.0, target=1.0), ["sync"], [0], progress=lines.append)
    assert len(lines) == 1 and "time to 1 not reached (best " in lines[0], lines


def test_the_digits_job_learns_in_a_few_virtual_seconds() -> None:
    run = simulate(SimSettings(fleet=("pi5", "laptop"), policy="sync", budget_s=3.0, lr=0.05))
    assert run.final_accuracy is not None and run.final_accuracy > 0.5
    assert not run.diverged
    assert run.curve[0][2] < 0.3  # it learned it: version 0 guesses


def test_the_command_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "sim.json"
    code = cli.main(["simulate", "--fleet", "pi3,pi4", "--policy", "sync,async", "--budget-s", "1",
                     "--target", "0.2", "--report", str(report)])
    assert code == 0
    assert set(json.loads(report.read_text())["policies"]) == {"sync", "async"}
    assert "async" in capsys.readouterr().out


@pytest.mark.parametrize(("flag", "value", "named"), [("--policy", "bsp", "unknown policy"),
                                                       ("--fleet", "pi3,toaster", "toaster"),
                                                       ("--scenario", "stormy", "unknown scenario"),
                                                       ("--codec", "zip", "unknown codec"),
                                                       ("--ps-update-s", "-1", "seconds per update"),
                                                       ("--ps-broadcast-s", "-1", "per published model")])
def test_a_bad_argument_is_named_and_exits_2(flag: str, value: str, named: str,
                                             capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = cli.main(["simulate", flag, value, "--budget-s", "0.5", "--report", str(tmp_path / "r.json")])
    assert code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_the_divergence_guard_rolls_a_diverging_run_back_as_the_service_does() -> None:
    """At eight times the digits job's rate, two laptops' sync rounds learn, then diverge: with the guard (the
    default) the run goes back to its best model and halves the rate until it trains; without, it ends at chance.
    Three virtual seconds leave room for two halvings: at 0.2 the run may diverge again (the trajectories of one and of
    two torch threads did, within two seconds)."""
    def run(guard: str) -> SimRun:
        return simulate(SimSettings(fleet=("laptop", "laptop"), policy="sync", budget_s=3.0, lr=0.4,
                                    eval_interval_s=0.05, overrides=UNIFORM | {"ps.guard.enabled": guard}))

    guarded, free = run("true"), run("false")
    assert free.diverged and free.details["rollbacks"] == 0 and free.final_accuracy < 0.2
    rollbacks = guarded.details["rollbacks"]
    assert rollbacks >= 1 and guarded.details["final_lr"] == pytest.approx(0.4 * 0.5 ** rollbacks)
    assert not guarded.diverged and guarded.final_accuracy > free.final_accuracy + 0.3


def test_a_rollback_puts_the_best_weights_back_as_a_new_version_sent_whole() -> None:
    """``Server.evaluated``: the guard's verdict on each evaluation, and its rollback as ``Stepper.restore`` and
    ``Divergence._go_back`` do it: the best weights as the next version (older work discarded), momentum cleared,
    the rate lowered, a snapshot out."""
    cfg = load_config(env={}, overrides={})
    initial = {"w": np.zeros(3, np.float32)}
    server = Server(cfg, "async", initial, buffers={}, momenta={})
    best = {"w": np.ones(3, np.float32)}
    server.state.params["w"][...] = best["w"]
    server.state.momentum["w"][...] = 5.0
    server.clock.version, server.versions[1] = 1, {"w": best["w"].copy()}
    assert not server.evaluated(1, 0.1, 0.9, now=1.0)  # the best so far
    server.state.params["w"][...] = 7.0
    for version in (2, 3, 4):
        server.clock.version, server.versions[version] = version, {"w": np.full(3, 7.0, np.float32)}
        rolled = server.evaluated(version, 9.0, 0.1, now=float(version))
    assert rolled and server.guard.rollbacks == 1  # after patience (3) bad evaluations in a row
    assert server.version == server.clock.floor == 5
    assert np.array_equal(server.state.params["w"], best["w"]) and not server.state.momentum["w"].any()
    assert np.array_equal(server.versions[5]["w"], best["w"])
    assert server.lr == pytest.approx(cfg.training.lr * cfg.ps.guard.lr_factor)
    assert server.published[-1].snapshot and server.published[-1].version == 5
    assert not server.evaluated(3, float("nan"), 0.0, now=6.0)  # a model the rollback left behind is not judged


def test_devices_train_on_the_model_as_a_worker_decodes_the_broadcast_not_on_the_servers_exact_weights() -> None:
    """With the default broadcast (deltas in the lossy ``grid`` codec, a float32 snapshot every
    ``ps.snapshot_every`` versions) a device's step starts from the weights a worker's ``ModelView`` holds after the
    messages the server published: those of a delta differ from the server's a little; a snapshot's are exact."""
    sim = Simulation(SimSettings(fleet=("pi5", "laptop"), policy="sync", budget_s=1.0, overrides=UNIFORM))
    broadcast, messages = sim.server.broadcast, []
    snapshot, delta = broadcast.snapshot, broadcast._delta

    def keep_snapshot(*args: object, **kwargs: object) -> bytes:
        payload = snapshot(*args, **kwargs)  # type: ignore[arg-type]
        messages.append(wire.decode(payload, ModelSnapshot))
        return payload

    def keep_delta(*args: object, **kwargs: object) -> ModelMessage:
        message = delta(*args, **kwargs)  # type: ignore[arg-type]
        messages.append(wire.decode(message.payload, ModelDelta))
        return message

    broadcast.snapshot, broadcast._delta = keep_snapshot, keep_delta  # type: ignore[method-assign]
    started: list[tuple[int, Mapping[str, np.ndarray]]] = []
    update = sim.model.update

    def keep_start(version: int, params: Mapping[str, np.ndarray], *rest: Any) -> models.Update:
        started.append((version, params))
        return update(version, params, *rest)

    sim.model.update = keep_start  # type: ignore[method-assign]
    sim.run()
    view, held = ModelView(), {}
    for message in messages:
        assert view.load(message) if isinstance(message, ModelSnapshot) else view.apply(message)
        assert view.params is not None
        held[view.version] = (isinstance(message, ModelSnapshot), view.params)
    assert sum(snap for snap, _ in held.values()) >= 1 and sum(not snap for snap, _ in held.values()) >= 10
    checked = 0
    for version, params in started:
        snap, decoded = held[version]
        assert all(np.array_equal(params[k], decoded[k]) for k in decoded), version
        if version in sim.server.versions:
            exact = sim.server.versions[version]
            lossy = any(not np.array_equal(exact[k], decoded[k]) for k in decoded)
            assert lossy != snap, version  # a delta's weights are not the server's; a snapshot's are
            checked += 1
    assert len(started) >= 20 and checked >= 10


def test_fedbuff_runs_as_a_reference_whose_devices_never_wait() -> None:
    fleet = ("pi3", "pi4", "pi5", "laptop")
    run = simulate(SimSettings(fleet=fleet, policy="fedbuff", budget_s=1.5, overrides=UNIFORM, buffer_share=0.5))
    sync = simulate(SimSettings(fleet=fleet, policy="sync", budget_s=1.5, overrides=UNIFORM))
    assert run.policy == "fedbuff" and run.details["lr"] > 0
    assert run.versions == run.updates // 2  # K = 2 of 4 devices: a step per two updates
    # no round to wait for: the laptop computes many more steps than the pi3 (whose late ones the staleness bound
    # may even discard), where sync keeps them level
    by_device = run.details["updates_by_device"]
    assert by_device["laptop-0"] > 3 * by_device.get("pi3-0", 0)
    assert run.gradients > 2 * sync.gradients
    assert sync.details["updates_by_device"]["laptop-0"] == sync.details["updates_by_device"]["pi3-0"]


def test_compute_scale_slows_a_board_by_its_factor() -> None:
    fleet = ("laptop", "laptop")
    run = simulate(SimSettings(fleet=fleet, policy="async", budget_s=1.0, overrides=UNIFORM,
                               compute_scale=(1.0, 0.25)))
    by_device = run.details["updates_by_device"]
    assert by_device["laptop-0"] >= 3 * by_device["laptop-1"]  # compute dominates a laptop's step


def test_a_bad_compute_scale_is_refused() -> None:
    with pytest.raises(ConfigError, match="compute_scale"):
        simulate(SimSettings(fleet=("pi3", "pi4"), compute_scale=(1.0,)))


def test_the_parameter_servers_time_per_update_serializes_the_updates() -> None:
    """``ps_update_s``: the server takes one update after another, each for that long, and answers when done."""
    fleet, cost = ("laptop", "laptop"), 0.05
    free = simulate(SimSettings(fleet=fleet, policy="async", budget_s=1.0, overrides=UNIFORM))
    busy = simulate(SimSettings(fleet=fleet, policy="async", budget_s=1.0, overrides=UNIFORM, ps_update_s=cost))
    assert free.updates > 1.0 / cost  # the laptops alone would outrun the server
    assert busy.updates <= 1.0 / cost < free.updates
    rounds = [simulate(SimSettings(fleet=fleet, policy="sync", budget_s=1.0, overrides=UNIFORM, ps_update_s=c))
              for c in (0.0, cost)]
    per_version = [run.elapsed_s / run.versions for run in rounds]
    assert per_version[1] >= per_version[0] + len(fleet) * cost * 0.9  # a round's two updates, one after the other
    with pytest.raises(ConfigError, match="seconds per update"):
        simulate(SimSettings(fleet=fleet, ps_update_s=-1.0))


def test_the_parameter_servers_time_per_model_delays_each_version_and_its_acks() -> None:
    """``ps_broadcast_s``: every model the server publishes holds it that long before its next update, and the
    model and the step's acks go out when it is done: once per version (per update under ``async``, per round under
    ``sync``), where the time per update is paid by every update of a round."""
    fleet, cost = ("laptop", "laptop"), 0.05
    free = simulate(SimSettings(fleet=fleet, policy="async", budget_s=1.0, overrides=UNIFORM))
    busy = simulate(SimSettings(fleet=fleet, policy="async", budget_s=1.0, overrides=UNIFORM, ps_broadcast_s=cost))
    assert free.versions > 1.0 / cost  # the laptops alone would outrun the server
    assert busy.versions <= 1.0 / cost + 1 < free.versions
    rounds = [simulate(SimSettings(fleet=fleet, policy="sync", budget_s=1.0, overrides=UNIFORM, ps_broadcast_s=c))
              for c in (0.0, cost)]
    per_version = [run.elapsed_s / run.versions for run in rounds]
    assert per_version[0] + 0.9 * cost <= per_version[1] < per_version[0] + len(fleet) * cost  # one model a round
    with pytest.raises(ConfigError, match="per published model"):
        simulate(SimSettings(fleet=fleet, ps_broadcast_s=-1.0))


def test_an_ack_waits_behind_the_models_published_before_it_on_the_downlink() -> None:
    """One link carries the broker's messages to a device in order: an ack sent while models are still on their way
    arrives after them (under ``async`` the other devices' versions fill a slow downlink), and one sent on an idle
    link after its latency alone."""
    profile = replace(get_profile("pi3"), downlink_bps=1000.0, latency_s=0.01)
    board = Board.of("pi3-0", profile, Timeline("pi3-0", {}), MODEL)
    published = [Published(0, 0.0, 500, True)]
    link = Downlink(board, published)
    link.join(0)
    published += [Published(1, 0.2, 1000, False), Published(2, 0.3, 1000, False)]
    assert link.free_after(0.3) == pytest.approx(2.5)  # 0.5 s, then from 0.5 s one 1 s, then another
    assert board.message_end(link.free_after(0.3)) == pytest.approx(2.51)
    assert link.holds(0.3) == -1  # asking delivered nothing early
    assert link.when(2) == pytest.approx(2.51)
    assert link.free_after(3.0) == 3.0  # idle: an ack goes at once
    published.append(Published(3, 5.0, 1000, False))  # a model the server will have out at 5 s
    assert link.when(3) == pytest.approx(6.01)
    assert link.free_after(4.0) == 4.0  # an ack at 4 s does not wait for it


def test_the_cached_adaptive_deadline_is_the_rules_own() -> None:
    rule, cached = AdaptiveDelay(AdaptiveConfig()), CachedDelay(AdaptiveConfig())
    rng = random.Random(0)
    for i in range(2000):
        cluster, seconds = f"c{rng.randrange(40)}", rng.expovariate(1.0)
        for r in (rule, cached):
            r.observe_arrival(cluster, seconds)
            if i % 500 == 499:
                r.retain([], [f"c{j}" for j in range(30)])
        live = [f"c{j}" for j in range(rng.randrange(45))]
        assert cached.deadline(live) == rule.deadline(live)
        assert cached.deadline() == rule.deadline()


# --------------------------------------------------------------------------- a user's own job

STRIPES_JOB = """
[job]
name = "stripes"
target_accuracy = 0.8

[model]
input_shape = [1, 12, 12]
classes = ["rows", "columns", "dots"]
layers = [{conv2d = 8, kernel = 3, padding = 1}, "batchnorm", "relu", "globalavgpool", {linear = 3}]

[data]
format = "image-folder"
path = "stripes"

[evaluation]
path = "stripes-eval"

[training]
lr = 0.07
batch_size = 8
"""
"""A job no other test submits: its own images (below), a batch-norm CNN with global pooling, its own rate."""


def draw_stripes(root: Path, per_class: int, seed: int) -> None:
    """12x12 grey PNGs of three kinds, noisy: rows lit, columns lit, a grid of dots."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name in ("rows", "columns", "dots"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            image = rng.uniform(0, 80, (12, 12))
            phase = int(rng.integers(0, 2))
            if name == "rows":
                image[phase::2, :] += 150
            elif name == "columns":
                image[:, phase::2] += 150
            else:
                image[phase::2, phase::2] += 150
            Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(root / name / f"{i}.png")


def test_a_users_job_is_simulated_with_its_model_settings_data_and_target(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    draw_stripes(data / "stripes", 40, seed=1)
    draw_stripes(data / "stripes-eval", 10, seed=2)
    job = tmp_path / "stripes.toml"
    job.write_text(STRIPES_JOB)
    report = tmp_path / "sim.json"
    code = cli.main(["simulate", "--job", str(job), "--data-dir", str(data), "--fleet", "pi5,laptop",
                     "--policy", "async", "--budget-s", "4", "--report", str(report)])
    assert code == 0, capsys.readouterr().err
    out = json.loads(report.read_text())
    assert out["settings"]["job_file"] == str(job) and out["settings"]["target"] == 0.8  # the job's target
    [run] = out["runs"]["async"]
    assert run["lr"] == 0.07  # the job's rate, not the benchmark's
    assert run["curve"][0][2] < 0.5 and run["best_accuracy"] >= 0.6  # its images, learned (chance 1/3)
    assert "async" in capsys.readouterr().out


def test_set_goes_over_the_jobs_own_settings(tmp_path: Path) -> None:
    data = tmp_path / "data"
    draw_stripes(data / "stripes", 6, seed=1)
    draw_stripes(data / "stripes-eval", 2, seed=2)
    job = tmp_path / "stripes.toml"
    job.write_text(STRIPES_JOB)
    report = tmp_path / "sim.json"
    assert cli.main(["simulate", "--job", str(job), "--data-dir", str(data), "--fleet", "pi5", "--policy", "sync",
                     "--budget-s", "0.5", "--set", "training.lr=0.02", "--report", str(report)]) == 0
    [run] = json.loads(report.read_text())["runs"]["sync"]
    assert run["lr"] == 0.02  # the job says 0.07


def test_a_users_job_whose_data_is_missing_is_refused_naming_it(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "stripes.toml"
    job.write_text(STRIPES_JOB)
    code = cli.main(["simulate", "--job", str(job), "--data-dir", str(tmp_path), "--policy", "sync",
                     "--budget-s", "1", "--report", str(tmp_path / "r.json")])
    assert code == 2
    assert "stripes" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


async def test_the_fleet_of_a_running_job_is_simulated_as_its_devices_measured_themselves(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """``--live``: an emulated board is its profile; a plain worker is a board of its own, at the training rate its
    stats measured and the link it declared or measured."""
    job = "sim-live"
    cfg = make_config(mosquitto_broker, job=job, **{
        "ps.state_dir": tmp_path / "ps", "ps.eval_every": "0", "training.sync_policy": "async",
        "worker.stats_interval_s": "0.5", "worker.emulation_host_gflops": "50", "worker.codec_wait_s": "0.5"})
    plain = Worker(replace(cfg, worker=replace(cfg.worker, device="w-plain", state_dir=str(tmp_path / "p"))))
    board = Worker(replace(cfg, worker=replace(cfg.worker, device="w-board", emulate="pi5",
                                               state_dir=str(tmp_path / "b"))))
    async with running(Planner(cfg), ParameterServer(cfg), plain, board):
        await until("both workers' updates", lambda: plain.accepted >= 3 and board.accepted >= 1, LIVE_WAIT_S)
        report = tmp_path / "live.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "edgemesh", "simulate", "--live", job, "--broker", mosquitto_broker.url,
            "--wait", "2", "--policy", "async", "--budget-s", "1", "--report", str(report),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), LIVE_WAIT_S)
    assert proc.returncode == 0, err.decode()[-2000:]
    fleet = json.loads(report.read_text())["settings"]["fleet"]
    assert sorted(fleet) == ["pi5", "w-plain"]
    told = err.decode()
    assert "w-board (" in told and "w-plain (" in told and "async" in out.decode()
    rate = float(told.split("w-plain (")[1].split(" GFLOP/s")[0])
    assert rate > 0  # what its stats measured


async def test_live_with_no_device_on_the_broker_says_so(mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    code = await asyncio.to_thread(cli.main, ["simulate", "--live", "nobody-here", "--broker", mosquitto_broker.url,
                                              "--wait", "0.5", "--report", str(tmp_path / "r.json")])
    assert code == 2 and not (tmp_path / "r.json").exists()
