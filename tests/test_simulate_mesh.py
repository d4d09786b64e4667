"""``edgemesh simulate`` under mesh parallelism: the planner's training grid on the virtual clock. A model-parallel
cluster steps as one (its first member starts the step once every member holds the model), its step lasts as its
members' shares of every layer and their exchanges do, and ``--parallelism`` compares each policy under data and
mesh parallelism. Boards too small to train digits-cnn alone at a useful batch make the grid pair them up."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from edgemesh import cli
from edgemesh.bench.fleet import MODEL
from edgemesh.common import costs, models
from edgemesh.common.emulation.dynamics import Timeline
from edgemesh.common.emulation.profiles import FIGURES, get_profile
from edgemesh.common.emulation.scenarios import load_scenarios
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import LayerDivision, PlanCluster
from edgemesh.services.planner.mesh import FLOAT32_WIRE, DeviceInfo
from edgemesh.simulate import SimSettings, compare
from edgemesh.simulate.engine import Simulation
from edgemesh.simulate.fleet import Board, Crew

SMALL_MIB = 261
"""A board's memory in which digits-cnn trains a batch of a few samples alone, but half of it a batch of 8: the
planner's grid pairs such boards up."""


def small_boards(tmp_path: Path) -> str:
    """The built-in profiles and ``small``: a Pi 4 with ``SMALL_MIB`` of memory and no drop-outs."""
    builtin = Path(get_profile.__code__.co_filename).with_name("profiles.toml").read_text()
    p = get_profile("pi4")
    path = tmp_path / "profiles.toml"
    path.write_text(builtin + f'\n[profiles.small]\ncores = {p.cores}\ngflops = {p.gflops}\nmemory_mib = {SMALL_MIB}\n'
                    f'uplink_mbit = {p.uplink_bps * 8 / 1e6}\ndownlink_mbit = {p.downlink_bps * 8 / 1e6}\n'
                    f'latency_ms = {p.latency_s * 1e3}\ndisconnects_per_hour = 0\noutage_s = 0\n'
                    '[profiles.small.sources]\n' + "".join(f'{k} = "a test board"\n' for k in FIGURES))
    return str(path)


def mesh_settings(tmp_path: Path) -> SimSettings:
    """Four small boards, ``sync``, mesh parallelism, 16 samples an iteration."""
    return SimSettings(fleet=("small",) * 4, policy="sync", parallelism="mesh", budget_s=3.0, lr=0.05,
                       overrides={"worker.emulation_profiles": small_boards(tmp_path), "training.batch_size": "16"})


def test_a_mesh_run_trains_the_planners_grid_each_cluster_stepping_as_one(tmp_path: Path) -> None:
    sim = Simulation(mesh_settings(tmp_path))
    run = sim.run()
    assert sim.plan is not None
    pairs = [c for c in sim.plan.clusters if len(c.members) > 1]
    assert pairs, sim.plan.clusters  # the boards are too small alone: the grid divides the model
    leads = {c.members[0] for c in sim.plan.clusters}
    # only a cluster's first member sends: one update per cluster and round, for the cluster's whole batch
    assert set(run.details["updates_by_device"]) <= leads
    assert run.versions > 10 and run.gradients >= run.versions * len(sim.plan.clusters)
    # a round lasts about what the planner predicts for the grid (the model's way down and the acks come on top)
    predicted = sim.plan.round_time_s
    assert predicted > 0
    assert predicted <= run.elapsed_s / run.versions < 1.5 * predicted
    assert run.summary()["parallelism"] == "mesh"
    again = Simulation(mesh_settings(tmp_path)).run()
    assert again.curve == run.curve  # seeded: the same run again


def test_data_parallelism_on_the_same_boards_trains_every_device_alone(tmp_path: Path) -> None:
    sim = Simulation(replace(mesh_settings(tmp_path), parallelism="data"))
    run = sim.run()
    assert sim.plan is not None and all(len(c.members) == 1 for c in sim.plan.clusters)
    assert len(run.details["updates_by_device"]) == 4
    assert run.summary()["parallelism"] == "data"


def _crew(scales: tuple[float, float], link_bps: float) -> tuple[Crew, Board]:
    """Two laptops (at ``scales`` of their rate) holding half of every layer of digits-cnn, on links of
    ``link_bps``; and a laptop at full rate alone."""
    laptop = get_profile("laptop")
    steady = load_scenarios()["steady"]
    boards = {name: Board.of(name, laptop, Timeline.of(steady, "laptop", name, 0), MODEL, scale=scale)
              for name, scale in zip(("a", "b"), scales, strict=True)}
    layers = costs.layers(MODEL)
    cluster = PlanCluster(cluster="m-a", members=("a", "b"), division=tuple(
        LayerDivision(layer=layer.name, counts=(layer.units // 2, layer.units - layer.units // 2)) for layer in layers))
    infos = {name: DeviceInfo(device=name, flops=1e12, memory_bytes=2**30, link_rate_bps=link_bps,
                              downlink_rate_bps=link_bps, latency_s=0.0) for name in boards}
    alone = Board.of("alone", laptop, Timeline.of(steady, "laptop", "alone", 0), MODEL)
    return Crew.of(cluster, boards, infos, MODEL, FLOAT32_WIRE), alone


def test_a_crew_divides_a_step_among_its_members_and_waits_for_the_slowest() -> None:
    even, alone = _crew((1.0, 1.0), link_bps=1e12)
    whole = alone.step_end(0.0, 64)
    # two equal members on links that cost nothing: half of each layer each, half the time
    assert even.step_end(0.0, 64) == pytest.approx(whole / 2, rel=0.05)
    # a member at half speed: each layer waits for it, as long as one board alone
    uneven, _ = _crew((1.0, 0.5), link_bps=1e12)
    assert uneven.step_end(0.0, 64) == pytest.approx(whole, rel=0.05)
    # on a slow link the exchanges at every layer add to the step
    slow, _ = _crew((1.0, 1.0), link_bps=1e6)
    assert slow.step_end(0.0, 64) > 2 * even.step_end(0.0, 64)
    # each member pushes its half of the update over its own link, side by side
    nbytes = 1_000_000
    assert even.upload_end(0.0, nbytes) < 0.6 * alone.upload_end(0.0, nbytes)


def test_parallelism_all_compares_each_policy_under_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "sim.json"
    code = cli.main(["simulate", "--fleet", "small,small", "--policy", "sync", "--parallelism", "all",
                     "--budget-s", "1", "--target", "0.3",
                     "--set", f"worker.emulation_profiles={small_boards(tmp_path)}",
                     "--set", "training.batch_size=16", "--report", str(report)])
    assert code == 0
    written = json.loads(report.read_text())
    assert set(written["policies"]) == {"sync/data", "sync/mesh"}
    assert [r["parallelism"] for r in written["runs"]["sync/mesh"]] == ["mesh"]
    assert "sync/mesh" in capsys.readouterr().out


def test_an_unknown_parallelism_is_named_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["simulate", "--parallelism", "pipeline", "--budget-s", "0.5", "--report",
                     str(tmp_path / "r.json")])
    assert code == 2
    assert "unknown parallelism pipeline" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_a_model_mesh_cannot_divide_is_named_before_any_run() -> None:
    """Group norm's groups would span the members' channels: under mesh the planner refuses the model, and so does
    the simulation, naming the layer, before the data-parallel runs of the comparison take their time."""
    models.register_spec(models.layer_list_spec("test-sim-groupnorm", [{"conv2d": 8, "kernel": 3, "padding": 1},
                                                                        {"groupnorm": 2}, "relu", "globalavgpool",
                                                                        {"linear": 10}], (1, 8, 8), 10))
    lines: list[str] = []
    with pytest.raises(ConfigError, match="planner.parallelism = mesh: .*cannot divide module"):
        compare(SimSettings(fleet=("pi4", "pi4"), budget_s=0.5,
                            overrides={"training.model_spec": "test-sim-groupnorm"}),
                ["sync"], [0], progress=lines.append, parallelisms=["data", "mesh"])
    assert lines == []
