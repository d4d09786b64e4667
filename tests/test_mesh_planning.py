"""Edge Mesh planning (planner/mesh.py): the cost model, the filter division and the training grid."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from edgemesh.common import costs
from edgemesh.common.costs import slices
from edgemesh.common.emulation.profiles import get_profile
from edgemesh.common.errors import ModelError
from edgemesh.common.topics import valid_name
from edgemesh.services.planner import mesh
from edgemesh.services.planner.layout import DeviceInfo, cluster_name
from edgemesh.services.planner.mesh import (
    DEFAULT_LINK_BPS,
    Division,
    Grid,
    cluster_iteration_s,
    divide_filters,
    member_memory,
    member_step,
    member_time,
    mesh_cluster_name,
    needs_replan,
    sample_fleet,
    time_layout,
    training_grid,
)

MIB = 2**20
GIB = 2**30
GIGABIT = 117e6
"""Gigabit ethernet, bytes/s."""
CLASSES = {
    # matmul FLOP/s, memory, uplink bytes/s
    "pi3": (9.2e9, 566 * MIB, 6.25e6),
    "pi4": (23.8e9, int(3.3 * GIB), 4.8e6),
    "pi5": (60.5e9, 7 * GIB, 14e6),
    "laptop": (115e9, 8 * GIB, 25e6),
}


def dev(name: str, kind: str, *, link: float | None = None, memory: int | None = None, flops: float | None = None,
        latency: float = 0.001) -> DeviceInfo:
    f, m, up = CLASSES[kind]
    return DeviceInfo(device=name, flops=flops or f, memory_bytes=memory or m, link_rate_bps=link or up,
                      latency_s=latency)


def full(spec: str) -> list[int]:
    return [la.units for la in costs.layers(spec)]


def share_memory(spec: str, fraction: float, batch: int) -> int:
    """Memory that holds ``fraction`` of the model (and nothing more) at ``batch``."""
    empty = member_memory(spec, [0] * len(full(spec)), batch=batch)
    return int(empty + fraction * (member_memory(spec, full(spec), batch=batch) - empty))


def held(division: Division, spec: str, i: int) -> list[int]:
    return [division.counts[la.name][i] for la in costs.layers(spec)]


def largest_remainder(units: int, weights: list[float]) -> tuple[int, ...]:
    exact = [units * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: counts[i] - exact[i])[:units - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


def split_by(spec: str, weights: list[float]) -> dict[str, tuple[int, ...]]:
    return {la.name: largest_remainder(la.units, weights) for la in costs.layers(spec)}


def check_division(division: Division, spec: str, members: list[DeviceInfo], batch: int) -> None:
    assert division.members == tuple(d.device for d in members)
    for layer in costs.layers(spec):
        counts = division.counts[layer.name]
        assert len(counts) == len(members) and sum(counts) == layer.units
        assert all(isinstance(n, int) and n >= 0 for n in counts)
    for i, d in enumerate(members):
        assert division.member_seconds[i] == pytest.approx(
            member_time(spec, d, held(division, spec, i), batch=batch, cluster_size=len(members)))
        assert division.member_memory_bytes[i] == member_memory(spec, held(division, spec, i), batch=batch)
    assert division.predicted_s >= max(division.member_seconds) * (1 - 1e-9)  # members meet at every layer
    assert division.predicted_s == pytest.approx(cluster_iteration_s(spec, members, division.counts, batch=batch))
    assert division.fits == all(m <= d.memory_bytes for m, d in zip(division.member_memory_bytes, members,
                                                                     strict=True))


# --------------------------------------------------------------------------- cost model


def test_a_single_device_pays_compute_and_the_parameter_server_only() -> None:
    pi = dev("pi", "pi4", latency=0.002)
    step = member_step("cifar-cnn", pi, full("cifar-cnn"), batch=32, cluster_size=1)
    assert step.compute_s == pytest.approx(costs.step_seconds_estimate("cifar-cnn", 32, pi.flops))
    assert step.gather_s == step.scatter_s == 0.0
    model_bytes = costs.cost("cifar-cnn").params * costs.FLOAT32_BYTES
    assert step.ps_s == pytest.approx(2 * model_bytes / pi.link_rate_bps + 2 * 0.002)  # unknown downlink = uplink
    assert step.total_s == member_time("cifar-cnn", pi, full("cifar-cnn"), batch=32, cluster_size=1)
    # an unmeasured link is the default rate
    blind = DeviceInfo(device="blind", flops=1e10, memory_bytes=GIB)
    assert member_step("digits-cnn", blind, full("digits-cnn"), batch=8, cluster_size=1).ps_s == pytest.approx(
        2 * costs.cost("digits-cnn").params * costs.FLOAT32_BYTES / DEFAULT_LINK_BPS)


def test_exchange_traffic_follows_the_documented_formulas() -> None:
    layers = costs.layers("digits-cnn")
    d = DeviceInfo(device="d", flops=1e10, memory_bytes=GIB, link_rate_bps=1e6, downlink_rate_bps=4e6, latency_s=0.01)
    b = 16
    # holding everything in a cluster of 3: it uploads all its slices and downloads every gradient channel twice
    step = member_step("digits-cnn", d, full("digits-cnn"), batch=b, cluster_size=3)
    gathered = sum(la.units * la.gathered_per_unit for la in layers) * b * mesh.FLOAT32_WIRE.activation
    inputs = sum(la.in_values for la in layers[1:]) * b * mesh.FLOAT32_WIRE.activation
    assert step.gather_s == pytest.approx(gathered / 1e6 + len(layers) * 0.01)
    assert step.scatter_s == pytest.approx(2 * inputs / 4e6 + (len(layers) - 1) * 0.01)
    # holding nothing: it downloads every slice and uploads every channel of its partial gradients
    step = member_step("digits-cnn", d, [0] * len(layers), batch=b, cluster_size=3)
    assert step.compute_s == 0.0 and step.ps_s == pytest.approx(2 * 0.01)
    assert step.gather_s == pytest.approx(gathered / 4e6 + len(layers) * 0.01)
    assert step.scatter_s == pytest.approx(inputs / 1e6 + (len(layers) - 1) * 0.01)
    # memory grows with the share and the batch, from the runtime up
    assert costs.RUNTIME_BYTES < member_memory("cifar-cnn", [0] * 5, batch=32) < member_memory(
        "cifar-cnn", [16, 32, 64, 128, 5], batch=32) < member_memory("cifar-cnn", full("cifar-cnn"), batch=32)
    with pytest.raises(ValueError):
        member_time("digits-cnn", d, [17, 0, 0, 0], batch=b, cluster_size=2)  # conv1 has 16 filters


def test_the_linear_forms_the_planner_optimises_are_the_cost_model() -> None:
    rng = random.Random(0)
    for spec in ("cifar-cnn", "digits-cnn"):
        layers = costs.layers(spec)
        for _ in range(100):
            d = DeviceInfo(device="d", flops=rng.uniform(1e9, 1e11), memory_bytes=GIB,
                           link_rate_bps=rng.choice([0.0, rng.uniform(1e6, 1e8)]),
                           downlink_rate_bps=rng.choice([0.0, rng.uniform(1e6, 1e8)]), latency_s=rng.uniform(0, 0.01))
            k, batch = rng.randint(1, 8), rng.randint(1, 64)
            counts = [rng.randint(0, la.units) for la in layers]
            const, weights = mesh._coefficients(layers, d, batch, k, mesh.FLOAT32_WIRE)
            assert const + sum(w * n for w, n in zip(weights, counts, strict=True)) == pytest.approx(
                member_time(spec, d, counts, batch=batch, cluster_size=k), rel=1e-12)
            # the layers' seconds (what members meet at) and the parameter-server exchange make up the step
            step = mesh.member_step(spec, d, counts, batch=batch, cluster_size=k)
            assert sum(mesh.layer_seconds(spec, d, counts, batch=batch, cluster_size=k)) + step.ps_s == pytest.approx(
                step.total_s, rel=1e-12)
            # the grid's affine form in the batch: fixed seconds and seconds per whole model
            c0, c1, p0, p1 = mesh._line(layers, d, k, mesh.FLOAT32_WIRE)
            assert c0 + c1 * batch + p0 + p1 * batch == pytest.approx(
                member_time(spec, d, full(spec), batch=batch, cluster_size=k), rel=1e-9)


# --------------------------------------------------------------------------- filter division


def test_counts_cover_every_layer_and_slices_are_contiguous() -> None:
    rng = random.Random(7)
    kinds = list(CLASSES)
    for spec in ("cifar-cnn", "digits-cnn"):
        for size in (1, 2, 3, 5, 8):
            members = [dev(f"d{i}", rng.choice(kinds), link=rng.choice([None, GIGABIT])) for i in range(size)]
            for batch in (1, 32):
                division = divide_filters(spec, members, batch)
                check_division(division, spec, members, batch)
                for counts in division.counts.values():
                    ranges = slices(counts)
                    assert ranges[0][0] == 0 and ranges[-1][1] == sum(counts)
                    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert slices((3, 0, 2)) == [(0, 3), (3, 3), (3, 5)]


def test_equal_devices_get_equal_shares() -> None:
    members = [dev(f"pi5-{i}", "pi5", link=GIGABIT) for i in range(3)]
    division = divide_filters("cifar-cnn", members, 32)
    for counts in division.counts.values():
        assert max(counts) - min(counts) <= 1
    # the rounding's spare units spread out (the layers' meetings, not the totals, set the iteration)
    assert max(division.member_seconds) - min(division.member_seconds) < 0.02 * division.predicted_s


def test_a_three_times_faster_member_gets_about_three_times_the_work() -> None:
    slow, fast = dev("slow", "pi5", flops=30e9, link=GIGABIT), dev("fast", "pi5", flops=90e9, link=GIGABIT)
    layers = costs.layers("cifar-cnn")
    division = divide_filters("cifar-cnn", [slow, fast], 256)  # a large batch: compute dominates
    macs = [sum(n * la.macs_per_unit for n, la in zip(held(division, "cifar-cnn", i), layers, strict=True))
            for i in range(2)]
    assert 2.6 < macs[1] / macs[0] < 3.2
    for name in ("conv1", "conv2", "conv3", "fc1"):
        low, high = division.counts[name]
        assert 2.3 < high / low < 3.5
    # and both finish together
    assert division.member_seconds[0] == pytest.approx(division.member_seconds[1], rel=0.05)


def test_memory_limits_shares() -> None:
    big = [dev(f"pi5-{i}", "pi5", link=GIGABIT) for i in range(2)]
    small = dev("small", "pi5", link=GIGABIT, memory=share_memory("cifar-cnn", 0.15, 32))
    division = divide_filters("cifar-cnn", [*big, small], 32)
    assert division.fits
    assert division.member_memory_bytes[2] <= small.memory_bytes
    for counts in division.counts.values():
        assert counts[2] <= counts[0] and counts[2] <= counts[1]
    assert sum(held(division, "cifar-cnn", 2)) < 0.16 * sum(full("cifar-cnn"))
    even = divide_filters("cifar-cnn", [*big, replace(small, memory_bytes=big[0].memory_bytes)], 32)
    assert sum(held(even, "cifar-cnn", 2)) > sum(held(division, "cifar-cnn", 2))
    # members that cannot hold the model even together: a division all the same, flagged
    tiny = [dev(f"t{i}", "pi5", link=GIGABIT, memory=share_memory("cifar-cnn", 0.3, 32)) for i in range(3)]
    crowded = divide_filters("cifar-cnn", tiny, 32)
    check_division(crowded, "cifar-cnn", tiny, 32)
    assert not crowded.fits
    alone = divide_filters("cifar-cnn", [tiny[0]], 32)
    assert not alone.fits and alone.counts["conv1"] == (32,)


def test_a_slow_link_shifts_work_away() -> None:
    members = [dev("wired", "pi5", link=GIGABIT), dev("wifi", "pi5", link=40e6)]
    division = divide_filters("cifar-cnn", members, 32)
    wired, wifi = (sum(held(division, "cifar-cnn", i)) for i in range(2))
    assert 0 < wifi < wired
    both_wired = divide_filters("cifar-cnn", [members[0], replace(members[1], link_rate_bps=GIGABIT)], 32)
    assert sum(held(both_wired, "cifar-cnn", 1)) > wifi


def test_every_layer_is_balanced_among_the_members_that_hold_it() -> None:
    """Members meet at every layer's exchanges: each layer must end about together, not only the steps."""
    layers = costs.layers("cifar-cnn")
    clusters = [[dev("a", "pi3"), dev("b", "pi3"), dev("c", "pi4")],
                [dev("a", "pi4", link=GIGABIT), dev("b", "pi5", link=GIGABIT), dev("c", "laptop", link=GIGABIT)],
                [dev("a", "pi4", link=GIGABIT, latency=0.0), dev("b", "pi5", link=GIGABIT, latency=0.0)]]
    for members in clusters:
        for batch in (8, 32):
            division = divide_filters("cifar-cnn", members, batch)
            k = len(members)
            per_layer = [mesh._layer_seconds(layers, d, held(division, "cifar-cnn", i), batch, k, mesh.FLOAT32_WIRE)
                         for i, d in enumerate(members)]
            slow = fast = 0.0
            for li, layer in enumerate(layers):
                times = [per_layer[i][li] for i in range(k) if division.counts[layer.name][i]]
                slow, fast = slow + max(times), fast + min(times)
                if layer.units >= 64 and layer.name.startswith("conv"):  # fc1 also weighs its parameter traffic
                    assert max(times) / min(times) < 1.3, (layer.name, division.counts[layer.name], times)
            assert slow / fast < 1.15
            # the iteration is the layers' slowest members: barely above the members' own steps
            assert division.predicted_s < 1.1 * max(division.member_seconds)


@pytest.mark.parametrize("spec", ["cifar-cnn", "digits-cnn"])
def test_the_division_beats_even_and_flops_proportional_splits(spec: str) -> None:
    rng = random.Random(3)
    fleets = [
        [dev("a", "pi3", link=GIGABIT), dev("b", "pi5", link=GIGABIT), dev("c", "laptop", link=GIGABIT)],
        [dev("a", "pi4"), dev("b", "pi4", link=GIGABIT)],
        [dev(f"d{i}", rng.choice(list(CLASSES)), link=rng.choice([GIGABIT, 50e6, 20e6])) for i in range(6)],
        [dev("a", "laptop", link=GIGABIT), dev("b", "laptop", link=GIGABIT, latency=0.02)],
    ]
    for members in fleets:
        for batch in (8, 32, 128):
            best = divide_filters(spec, members, batch).predicted_s
            even = cluster_iteration_s(spec, members, split_by(spec, [1.0] * len(members)), batch=batch)
            by_flops = cluster_iteration_s(spec, members, split_by(spec, [d.flops for d in members]), batch=batch)
            assert best <= even * (1 + 1e-9)
            assert best <= by_flops * (1 + 1e-9)


def test_division_rejects_bad_input() -> None:
    pi = dev("pi", "pi5")
    with pytest.raises(ValueError):
        divide_filters("cifar-cnn", [], 32)
    with pytest.raises(ValueError):
        divide_filters("cifar-cnn", [pi], 0)
    with pytest.raises(ValueError):
        divide_filters("cifar-cnn", [pi, replace(pi, device="zero", flops=0.0)], 32)
    with pytest.raises(ValueError):
        divide_filters("cifar-cnn", [pi, pi], 32)
    with pytest.raises(ModelError):
        divide_filters("no-such-model", [pi], 32)


# --------------------------------------------------------------------------- training grid


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
        assert cluster.name == mesh_cluster_name(cluster.members)
        members = [by_name[m] for m in cluster.members]
        check_division(cluster.division, spec, members, cluster.batch)
        assert cluster.division.fits
        assert cluster.predicted_s == cluster.division.predicted_s
        # every member has work: one the division gave nothing is idle, not in the cluster
        assert all(any(n[i] for n in cluster.division.counts.values()) for i in range(len(members)))
    if grid.clusters:
        assert grid.predicted_iteration_s == max(c.predicted_s for c in grid.clusters)
        assert grid.predicted_iteration_s == pytest.approx(mesh.grid_iteration_s(spec, grid, devices))
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
    assert [c.name for c in grid.clusters] == [cluster_name(d.device) for d in wifi]
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
    memory = mesh.member_memory("cifar-cnn", full("cifar-cnn"), batch=40)
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
        for k in mesh._sizes(len(useful), 64, 8, 4):
            groups = mesh._groups(useful, k, 8)
            batches, times = mesh._balance(layers, groups, 64, mesh.FLOAT32_WIRE, {}, (4, 0))
            if math.isfinite(max(times)):
                exact.append(max(c.predicted_s for c in mesh._build(layers, groups, batches, mesh.FLOAT32_WIRE)[0]))
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
        groups = mesh._groups(ordered, k, 8)
        batches, _ = mesh._balance(layers, groups, 64, mesh.FLOAT32_WIRE, {}, (4, 0))
        built = mesh._build(layers, groups, batches, mesh.FLOAT32_WIRE)[0]
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
            balanced = mesh._balance(costs.layers(spec), [[d] for d in fleet], batch, mesh.FLOAT32_WIRE, {})[1]
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


def test_cluster_names() -> None:
    assert mesh_cluster_name(("pi-1",)) == "c-pi-1"
    assert mesh_cluster_name(("pi-1", "pi-2")) == "m-pi-1"
    long = "x" * 70
    name = mesh_cluster_name((long, "y"))
    assert len(name) == 64 and valid_name(name) and name.startswith("m-x")
    assert name != mesh_cluster_name(("x" * 69 + "z", "y"))
    with pytest.raises(ValueError):
        mesh_cluster_name(())


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


def test_replanning_on_join_leave_and_slowdown() -> None:
    fleet = [dev(f"pi5-{i}", "pi5", link=GIGABIT) for i in range(4)] + [
        dev(f"small-{i}", "pi4", link=GIGABIT, memory=share_memory("cifar-cnn", 0.5, 32)) for i in range(2)]
    grid = training_grid("cifar-cnn", fleet, batch=64)
    assert not needs_replan(grid, fleet, "cifar-cnn", 64)
    assert needs_replan(grid, [*fleet, dev("pi5-new", "pi5", link=GIGABIT)], "cifar-cnn", 64)  # join
    assert needs_replan(grid, fleet[1:], "cifar-cnn", 64)  # leave
    noisy = [replace(d, flops=d.flops * 0.97) if i == 0 else d for i, d in enumerate(fleet)]
    assert not needs_replan(grid, noisy, "cifar-cnn", 64)
    slowed = [replace(d, flops=d.flops / 8) if i == 0 else d for i, d in enumerate(fleet)]
    assert needs_replan(grid, slowed, "cifar-cnn", 64)
    assert not needs_replan(training_grid("cifar-cnn", slowed, batch=64), slowed, "cifar-cnn", 64)
    # a member whose memory no longer holds its share
    member = next(m for c in grid.clusters if len(c.members) > 1 for m in c.members)
    shrunk = [replace(d, memory_bytes=share_memory("cifar-cnn", 0.05, 64)) if d.device == member else d
              for d in fleet]
    assert needs_replan(grid, shrunk, "cifar-cnn", 64)
