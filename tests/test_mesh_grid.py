"""Edge Mesh planning, the hybrid training grid of a fleet and re-planning (planner/mesh/grid.py)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from helpers import GIGABIT, check_division, dev, full, share_memory

from edgemesh.common import costs
from edgemesh.common.emulation.profiles import get_profile
from edgemesh.common.errors import ModelError
from edgemesh.common.messages import Plan, PlanCluster, PlanDevice
from edgemesh.common.topics import valid_name
from edgemesh.services.planner.mesh import grid as grid_mod
from edgemesh.services.planner.mesh.devices import DeviceInfo, cluster_name, sample_fleet
from edgemesh.services.planner.mesh.grid import (
    Grid,
    grid_iteration_s,
    time_layout,
    training_grid,
)
from edgemesh.services.planner.mesh.member_cost import FLOAT32_WIRE, member_memory, member_time
from edgemesh.services.worker.profile import share_refusal


def check_grid(grid: Grid, devices: list[DeviceInfo], spec: str, batch: int, max_size: int = 8) -> None:
    by_name = {d.device: d for d in devices}
    placed = [m for c in grid.clusters for m in c.members]
    assert len(placed) == len(set(placed))
    assert sorted(placed + list(grid.excluded) + list(grid.idle)) == sorted(by_name)
    names = [c.name for c in grid.clusters]
    assert len(names) == len(set(names)) and all(valid_name(n) for n in names)
    assert sum(c.batch for c in grid.clusters) == (batch if grid.clusters else 0)
    for cluster in grid.clusters:
        assert 1 <= len(cluster.members) <= max_size and cluster.batch >= 1
        assert cluster.members == tuple(sorted(cluster.members))
        assert cluster.name == cluster_name(cluster.members)
        members = [by_name[m] for m in cluster.members]
        check_division(cluster.division, spec, members, cluster.batch)
        assert cluster.division.fits
        assert cluster.predicted_s == cluster.division.predicted_s
        # every member has work: one the division gave nothing is idle, not in the cluster
        assert all(any(n[i] for n in cluster.division.counts.values()) for i in range(len(members)))
    if grid.clusters:
        assert grid.predicted_iteration_s == max(c.predicted_s for c in grid.clusters)
        assert grid.predicted_iteration_s == pytest.approx(grid_iteration_s(spec, grid, devices))
        assert grid.throughput_samples_s == pytest.approx(batch / grid.predicted_iteration_s)


def alone(spec: str, device: DeviceInfo, batch: int) -> float:
    return member_time(spec, device, full(spec), batch=batch, cluster_size=1)


def data_parallel(fleet: list[DeviceInfo], spec: str, batch: int) -> float:
    """Iteration time of one cluster per device, each with an equal part of the batch."""
    return max(alone(spec, d, batch // len(fleet)) for d in fleet)


def test_devices_too_small_to_train_alone_join_clusters_that_hold_the_model() -> None:
    small = [dev(f"small-{i}", "pi4", link=GIGABIT, memory=share_memory("cifar-cnn", 0.4, 64)) for i in range(6)]
    useless = dev("useless", "pi4", link=GIGABIT, memory=share_memory("cifar-cnn", 0.05, 1))
    big = [dev(f"big-{i}", "pi5", link=GIGABIT) for i in range(2)]
    fleet = [*small, useless, *big]
    grid = training_grid("cifar-cnn", fleet, batch=64)
    check_grid(grid, fleet, "cifar-cnn", 64)
    assert grid.excluded == ("useless",)
    for cluster in grid.clusters:
        if any(m.startswith("small") for m in cluster.members):
            assert len(cluster.members) > 1 and cluster.name.startswith("m-")
    # at 64 samples none holds the model alone (at ten, one does: smaller batches keep fewer activations)
    only_small = training_grid("cifar-cnn", small, batch=64, min_batch=64)
    check_grid(only_small, small, "cifar-cnn", 64)
    assert len(only_small.clusters) == 1 and len(only_small.clusters[0].members) >= 2
    for c in training_grid("cifar-cnn", small, batch=64).clusters:
        alone = member_memory("cifar-cnn", full("cifar-cnn"), batch=c.batch)
        assert len(c.members) > 1 or alone <= small[0].memory_bytes
    empty = training_grid("cifar-cnn", [useless], batch=64)
    assert empty.clusters == () and empty.excluded == ("useless",) and empty.throughput_samples_s == 0.0


def test_slow_links_keep_the_model_whole_and_fast_ones_divide_it() -> None:
    # slow wifi makes every exchange dear: devices that fit alone stay alone
    wifi = [dev(f"pi4-{i}", "pi4", link=1e6) for i in range(4)]
    grid = training_grid("cifar-cnn", wifi, batch=64)
    check_grid(grid, wifi, "cifar-cnn", 64)
    assert all(len(c.members) == 1 for c in grid.clusters)
    assert [c.name for c in grid.clusters] == [cluster_name([d.device]) for d in wifi]
    # on gigabit, slow boards together beat them alone: the batch's work is divided, not repeated
    wired = [dev(f"pi3-{i}", "pi3", link=GIGABIT) for i in range(6)]
    grid = training_grid("cifar-cnn", wired, batch=64)
    check_grid(grid, wired, "cifar-cnn", 64)
    assert any(len(c.members) > 1 for c in grid.clusters)


def test_clusters_finish_together_and_beat_single_devices_and_data_parallelism() -> None:
    kinds = ["pi3"] * 2 + ["pi4"] * 2 + ["pi5"] * 2 + ["laptop"]
    for link in (None, GIGABIT):  # each board's wifi, or gigabit
        fleet = [dev(f"{k}-{i}", k, link=link) for i, k in enumerate(kinds)]
        for batch in (32, 64, 128):
            grid = training_grid("cifar-cnn", fleet, batch=batch)
            check_grid(grid, fleet, "cifar-cnn", batch)
            times = [c.predicted_s for c in grid.clusters]
            assert max(times) / min(times) < 1.3
            assert grid.predicted_iteration_s < alone("cifar-cnn", fleet[2], batch) / 3  # one pi4
            assert grid.predicted_iteration_s < data_parallel(fleet[:1] + fleet[1:], "cifar-cnn", batch - batch % 7)


def test_a_slack_trades_iteration_time_for_fewer_model_replicas() -> None:
    kinds = ["pi3"] * 2 + ["pi4"] * 2 + ["pi5"] * 2 + ["laptop"]
    fleet = [dev(f"{k}-{i}", k, link=GIGABIT) for i, k in enumerate(kinds)]
    fastest = training_grid("cifar-cnn", fleet, batch=64)
    counts = [len(fastest.clusters)]
    for slack in (0.1, 0.5, 1.0):
        grid = training_grid("cifar-cnn", fleet, batch=64, slack=slack)
        check_grid(grid, fleet, "cifar-cnn", 64)
        assert grid.predicted_iteration_s <= (1 + slack) * fastest.predicted_iteration_s * (1 + 1e-9)
        assert len(grid.clusters) <= counts[-1]  # more slack, never more replicas
        counts.append(len(grid.clusters))
    assert counts[-1] < counts[0]
    # fewer replicas: less of the model held per device, on average
    def mean_memory(grid: Grid) -> float:
        return sum(m for c in grid.clusters for m in c.division.member_memory_bytes) / len(fleet)
    assert mean_memory(training_grid("cifar-cnn", fleet, batch=64, slack=1.0)) < mean_memory(fastest)
    with pytest.raises(ValueError, match="slack"):
        training_grid("cifar-cnn", fleet, batch=64, slack=-0.1)


def test_cluster_batches_stay_within_the_configured_bounds() -> None:
    fleet = sample_fleet(12, seed=1)
    free = training_grid("cifar-cnn", fleet, batch=64)
    assert min(c.batch for c in free.clusters) < 4 < max(c.batch for c in free.clusters) - 20  # unbounded
    for low, high in ((4, 0), (8, 24), (16, 16), (1, 10)):
        grid = training_grid("cifar-cnn", fleet, batch=64, min_batch=low, max_batch=high)
        check_grid(grid, fleet, "cifar-cnn", 64)
        assert all(low <= c.batch <= (high or 64) for c in grid.clusters), (low, high, grid.clusters)
        assert len(grid.clusters) <= 64 // low
    # a minimum above the iteration's samples: one cluster trains them all
    assert [c.batch for c in training_grid("cifar-cnn", fleet, batch=64, min_batch=100).clusters] == [64]
    # too few devices for the samples at the maximum: every cluster at the maximum, the most samples won
    few = [d for d in fleet if d.device.startswith(("pi5", "laptop"))][:2]
    short = training_grid("cifar-cnn", few, batch=64, max_batch=8)
    assert [c.batch for c in short.clusters] == [8] * len(few)
    assert short.throughput_samples_s == pytest.approx(8 * len(few) / short.predicted_iteration_s)
    with pytest.raises(ValueError, match="min_batch"):
        training_grid("cifar-cnn", fleet, batch=64, min_batch=0)
    with pytest.raises(ValueError, match="max_batch"):
        training_grid("cifar-cnn", fleet, batch=64, min_batch=8, max_batch=4)


def test_devices_that_hold_their_share_of_the_batch_but_not_twice_it_are_laid_out() -> None:
    # the batch split is fitted from two estimates; the second must not overflow memory
    memory = member_memory("cifar-cnn", full("cifar-cnn"), batch=40)
    fleet = [dev(f"pi4-{i}", "pi4", memory=memory) for i in range(2)]
    grid = training_grid("cifar-cnn", fleet, batch=64)
    check_grid(grid, fleet, "cifar-cnn", 64)
    assert sorted(c.batch for c in grid.clusters) == [32, 32]


def test_a_small_fleet_gets_the_fastest_exact_layout_of_every_cluster_count() -> None:
    # the quick estimate ranks these fleets' layouts wrongly: only exact divisions find the best
    layers = costs.layers("cifar-cnn")
    for n, seed in ((16, 14), (16, 24), (8, 1)):
        fleet = sorted(sample_fleet(n, seed), key=lambda d: d.device)
        grid = training_grid("cifar-cnn", fleet, batch=64, min_batch=4)
        check_grid(grid, fleet, "cifar-cnn", 64)
        useful = [d for d in fleet if d.device not in grid.excluded]
        exact = []
        for k in grid_mod._sizes(len(useful), 64, 8, 4):
            groups = grid_mod._groups(useful, k, 8)
            batches, times = grid_mod._balance(layers, groups, 64, FLOAT32_WIRE, {}, (4, 0))
            if math.isfinite(max(times)):
                exact.append(max(c.predicted_s for c in grid_mod._build(layers, groups, batches, FLOAT32_WIRE)[0]))
        assert grid.predicted_iteration_s <= min(exact) * (1 + 1e-9)


def test_fast_boards_stay_whole_when_a_slow_partner_is_not_worth_its_exchanges() -> None:
    # the bench fleet's boards (16x dilated, as emulated): equal-FLOPS clusters would pair each Pi 5
    # with a Pi 3 that gets no convolution filters at all
    kinds = ["pi3", "pi3", "pi4", "pi4", "pi5", "pi5", "jetson-nano", "laptop"]
    fleet = []
    for i, kind in enumerate(kinds):
        p = get_profile(kind).dilated(16)
        fleet.append(DeviceInfo(device=f"{kind}-{i}", flops=p.train_gflops * 1e9, memory_bytes=p.memory_bytes,
                                link_rate_bps=p.uplink_bps, downlink_rate_bps=p.downlink_bps, latency_s=p.latency_s))
    grid = training_grid("cifar-cnn", fleet, batch=64, min_batch=4)
    check_grid(grid, fleet, "cifar-cnn", 64)
    layers = costs.layers("cifar-cnn")
    ordered = sorted(fleet, key=lambda d: d.device)
    for k in range(2, 6):  # every equal-FLOPS layout is slower
        groups = grid_mod._groups(ordered, k, 8)
        batches, _ = grid_mod._balance(layers, groups, 64, FLOAT32_WIRE, {}, (4, 0))
        built = grid_mod._build(layers, groups, batches, FLOAT32_WIRE)[0]
        assert grid.predicted_iteration_s < max(c.predicted_s for c in built)
    alone = {c.members[0] for c in grid.clusters if len(c.members) == 1}
    assert {"laptop-7", "pi5-4", "pi5-5"} <= alone


def test_the_grid_never_loses_to_balanced_data_parallelism() -> None:
    for seed in range(3):
        fleet = [d for d in sample_fleet(30, seed) if not d.device.startswith(("zero", "tiny"))]
        for spec in ("cifar-cnn", "digits-cnn"):
            batch = 4 * len(fleet)
            grid = training_grid(spec, fleet, batch=batch)
            check_grid(grid, fleet, spec, batch)
            # one cluster per device with the batch split to speed is one of the layouts it weighs
            balanced = grid_mod._balance(costs.layers(spec), [[d] for d in fleet], batch, FLOAT32_WIRE, {})[1]
            assert grid.predicted_iteration_s <= max(balanced) * 1.05


def test_the_grid_is_deterministic() -> None:
    fleet = sample_fleet(120, seed=4)
    grid = training_grid("cifar-cnn", fleet, batch=480)
    shuffled = list(fleet)
    random.Random(1).shuffle(shuffled)
    assert training_grid("cifar-cnn", shuffled, batch=480) == grid
    assert training_grid("cifar-cnn", fleet, batch=480, max_cluster_size=4) == training_grid(
        "cifar-cnn", shuffled, batch=480, max_cluster_size=4)


def test_a_thousand_devices_get_a_valid_layout() -> None:
    fleet = sample_fleet(1000, seed=0)
    grid = training_grid("cifar-cnn", fleet, batch=4000)
    check_grid(grid, fleet, "cifar-cnn", 4000)
    assert len(grid.clusters) > 100
    assert all(d.startswith("tiny") for d in grid.excluded)  # the boards that cannot hold 1/8 of the model
    assert any(len(c.members) > 1 for c in grid.clusters)  # the "zero" boards need company
    # more devices than the batch has work for: the fastest train, the rest wait
    few = training_grid("cifar-cnn", fleet[:300], batch=20, max_cluster_size=3)
    check_grid(few, fleet[:300], "cifar-cnn", 20, max_size=3)
    assert len(few.members) <= 60 and len(few.idle) >= 300 - 60 - len(few.excluded)
    assert time_layout(50) > 0.0


def test_grid_rejects_bad_input() -> None:
    fleet = [dev("a", "pi5"), dev("b", "pi4")]
    assert training_grid("cifar-cnn", [], batch=32).clusters == ()
    with pytest.raises(ValueError):
        training_grid("cifar-cnn", fleet, batch=0)
    with pytest.raises(ValueError):
        training_grid("cifar-cnn", fleet, batch=32, max_cluster_size=0)
    with pytest.raises(ValueError):
        training_grid("cifar-cnn", [*fleet, dev("a", "pi3")], batch=32)
    with pytest.raises(ValueError):
        training_grid("cifar-cnn", [*fleet, replace(fleet[0], device="c", flops=-1.0)], batch=32)
    with pytest.raises(ValueError):
        training_grid("cifar-cnn", [*fleet, replace(fleet[0], device="c", link_rate_bps=math.nan)], batch=32)
    with pytest.raises(ModelError):
        training_grid("no-such-model", fleet, batch=32)


def test_a_lone_member_the_grid_sizes_is_not_refused_by_its_device() -> None:
    """Under high latency the grid may give every device a cluster of its own with a small batch, sized by the
    per-layer accounting; the device's own check of the share must agree (it used a larger whole-model
    estimate, refused the share, and the job never trained)."""
    devices = [DeviceInfo(device=f"pi-0{i}", flops=flops, memory_bytes=memory, link_rate_bps=1.7e9, latency_s=0.037)
               for i, flops, memory in ((1, 1.2e8, 273_650_000), (2, 1.4e8, 273_700_000), (3, 1.3e8, 273_700_000))]
    grid = training_grid("digits-cnn", devices, batch=32, max_cluster_size=8, min_batch=4, max_batch=128)
    assert [len(c.members) for c in grid.clusters] == [1, 1, 1]
    for c in grid.clusters:
        me = PlanDevice(device=c.members[0], cluster=f"c-{c.members[0]}", shard_index=0, shard_count=3,
                        batch_size=c.batch)
        plan = Plan(version=1, created=0.0, model_spec="digits-cnn", dataset="digits", devices=(me,),
                    clusters=(PlanCluster(cluster=me.cluster, members=(me.device,)),))
        assert share_refusal(plan, me, next(d.memory_bytes for d in devices if d.device == me.device)) == "", c
