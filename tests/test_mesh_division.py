"""Edge Mesh planning, the filter division inside a cluster (planner/mesh/division.py)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from helpers import CLASSES, GIGABIT, check_division, dev, full, held, share_memory

from edgemesh.common import costs
from edgemesh.common.costs import slices
from edgemesh.common.errors import ModelError
from edgemesh.services.planner.mesh import member_cost
from edgemesh.services.planner.mesh.division import divide_filters
from edgemesh.services.planner.mesh.member_cost import FLOAT32_WIRE, cluster_iteration_s


def largest_remainder(units: int, weights: list[float]) -> tuple[int, ...]:
    exact = [units * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: counts[i] - exact[i])[:units - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


def split_by(spec: str, weights: list[float]) -> dict[str, tuple[int, ...]]:
    return {la.name: largest_remainder(la.units, weights) for la in costs.layers(spec)}


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
            per_layer = [member_cost._layer_seconds(layers, d, held(division, "cifar-cnn", i), batch, k, FLOAT32_WIRE)
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
