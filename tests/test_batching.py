"""Batch sizing (planner/batching.py): balanced batches, the speed fit and the rebalance rule."""

from __future__ import annotations

import time

import pytest

from edgemesh.common import costs
from edgemesh.services.planner.batching import (
    DeviceSpeed,
    SpeedTracker,
    balanced,
    needs_rebalance,
    uniform,
)


def speed(name: str, step_s_at_32: float, *, fixed_s: float = 0.0, max_batch: int = 10_000) -> DeviceSpeed:
    return DeviceSpeed(device=name, sample_s=step_s_at_32 / 32, fixed_s=fixed_s, max_batch=max_batch)


FLEET = [speed("pi3-0", 0.048), speed("pi3-1", 0.048), speed("pi4-0", 0.019), speed("pi4-1", 0.019),
         speed("pi5-0", 0.0073), speed("pi5-1", 0.0073), speed("jetson", 0.026), speed("laptop", 0.006)]


def test_balanced_batches_finish_together_and_carry_the_round_total() -> None:
    b = balanced(FLEET, total=256, min_batch=4, max_batch=128)
    assert sum(b.sizes.values()) >= 256
    assert sum(b.sizes.values()) - 256 < len(FLEET)  # no more than one extra sample per device
    times = {d.device: d.iteration_s(b.sizes[d.device]) for d in FLEET}
    # every device ends within one sample's time of the round time: fast ones no longer wait
    for d in FLEET:
        assert b.round_time_s - d.sample_s <= times[d.device] <= b.round_time_s + 1e-12
    # the slow boards got small batches, the fast ones large ones
    assert b.sizes["pi3-0"] < b.sizes["pi4-0"] < b.sizes["pi5-0"] and b.sizes["laptop"] > 32
    # and the round is far shorter than a uniform one, which waits for the slowest at 32
    assert b.round_time_s < 0.5 * uniform(FLEET, 32).round_time_s


def test_balanced_batches_respect_the_floor_caps_and_fixed_costs() -> None:
    fleet = [speed("slow", 1.0), speed("fast", 0.01, max_batch=40), speed("laggy", 0.01, fixed_s=0.05)]
    b = balanced(fleet, total=96, min_batch=4, max_batch=64)
    assert b.sizes["slow"] == 4  # the floor, however slow
    assert b.sizes["fast"] == 40  # its memory cap
    assert 0 < b.sizes["laggy"] <= 64
    # a fixed cost (an upload) leaves less time for samples
    twin = balanced([speed("a", 0.01), speed("b", 0.01, fixed_s=0.05)], total=64, min_batch=1, max_batch=64)
    assert twin.sizes["b"] < twin.sizes["a"]
    # caps that cannot reach the total: every device at its cap
    assert balanced([speed("x", 0.01, max_batch=3)], total=100, min_batch=1, max_batch=64).sizes == {"x": 3}
    assert balanced([], total=10, min_batch=1, max_batch=2).sizes == {}
    with pytest.raises(ValueError):
        balanced(fleet, total=10, min_batch=0, max_batch=4)


def test_rebalance_needs_a_real_move() -> None:
    now = {"a": 32, "b": 8}
    assert not needs_rebalance(now, {"a": 33, "b": 9}, 0.25)  # noise
    assert not needs_rebalance(now, {"a": 39, "b": 8}, 0.25)  # 22 %: below the threshold
    assert needs_rebalance(now, {"a": 41, "b": 8}, 0.25)
    assert needs_rebalance(now, {"a": 32, "b": 4}, 0.25)
    assert not needs_rebalance({"a": 2}, {"a": 3}, 0.25)  # 50 %, but one sample
    assert needs_rebalance(now, {"a": 32}, 0.25)  # membership changed


def test_speed_tracker_fits_overhead_and_per_sample_time() -> None:
    t = SpeedTracker()
    # before any stats: an estimate from the hello's FLOPS
    guess = t.speed("pi", spec="digits-cnn", matmul_flops=10e9, memory_bytes=1 << 30)
    assert guess is not None and guess.fixed_s == 0.0
    assert guess.sample_s == pytest.approx(costs.step_seconds_estimate("digits-cnn", 32, 10e9) / 32)
    # one batch size: the ratio
    t.observe("pi", 32, 0.074)
    assert t.fit("pi") == (0.0, pytest.approx(0.074 / 32))
    # two batch sizes of t = 0.01 + 0.002 b: the line, overhead included
    t.observe("pi", 8, 0.026)
    t.observe("pi", 8, 0.026)  # a repeat is not a new observation
    overhead, per_sample = t.fit("pi")  # type: ignore[misc]
    assert overhead == pytest.approx(0.01) and per_sample == pytest.approx(0.002)
    t.observe("pi", 16, 0.042, upload_time_s=0.005)
    s = t.speed("pi", spec="digits-cnn", matmul_flops=10e9, memory_bytes=1 << 30)
    assert s is not None and s.fixed_s == pytest.approx(0.015) and s.sample_s == pytest.approx(0.002)
    # it throttles to half speed: planned at the new speed from its next stats, not once older ones age out
    slow = SpeedTracker()
    for batch, seconds in ((8, 0.026), (16, 0.042), (32, 0.074), (16, 0.042 * 2 - 0.01)):
        slow.observe("pi", batch, seconds)
    overhead, per_sample = slow.fit("pi")  # type: ignore[misc]
    assert per_sample > 0.003 and overhead < 0.03
    # a device the PS lists as slow, d versions behind, plans as (1 + d) times slower
    lagging = t.speed("pi", spec="digits-cnn", matmul_flops=10e9, memory_bytes=1 << 30, lag=2.0)
    assert lagging is not None and lagging.sample_s == pytest.approx(0.006) and lagging.fixed_s == pytest.approx(0.045)
    # memory caps the batch; memory that holds no batch gives no speed
    small = costs.training_memory_bytes("digits-cnn", 10)
    capped = t.speed("pi", spec="digits-cnn", matmul_flops=10e9, memory_bytes=small)
    assert capped is not None and capped.max_batch == 10
    assert t.speed("pi", spec="digits-cnn", matmul_flops=10e9, memory_bytes=costs.RUNTIME_BYTES) is None


def test_a_thousand_devices_are_balanced_quickly() -> None:
    fleet = [speed(f"d{i}", 0.005 + 0.05 * (i % 17) / 17, fixed_s=0.001 * (i % 5)) for i in range(1000)]
    started = time.process_time()
    b = balanced(fleet, total=32 * 1000, min_batch=4, max_batch=128)
    assert sum(b.sizes.values()) >= 32_000
    assert time.process_time() - started < 5.0  # generous: a guard against an accidental quadratic, not a benchmark
