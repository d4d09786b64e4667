"""The fleet benchmark's headroom: how much faster than sync a policy that waits for no one could go, replayed
on hand-made timelines whose answers are worked out here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgemesh.bench import headroom
from edgemesh.bench.headroom import Load, Workload
from edgemesh.common.emulation.dynamics import Episode, Timeline
from edgemesh.common.emulation.profiles import load_profiles
from edgemesh.common.emulation.scenarios import load_scenarios

REPORTS = Path(__file__).resolve().parent.parent / "bench" / "reports"


def timeline(device: str, *episodes: Episode) -> Timeline:
    by_kind: dict = {}
    for e in episodes:
        by_kind.setdefault(e.kind, []).append(e)
    return Timeline(device, by_kind)


def test_a_transfer_waits_out_stalls_and_drop_outs_and_follows_the_link_rate() -> None:
    quiet = timeline("a")
    assert quiet.transfer_end(3.0, 2.0) == 3.0 + 2.0
    stalled = timeline("a", Episode("stall", 4.0, 3.0), Episode("drop", 6.0, 4.0))
    assert stalled.blocked_until(5.0) == 10.0  # the drop-out begun in the stall outlasts it
    assert stalled.transfer_end(3.0, 2.0) == pytest.approx(11.0)  # 1 s sent, held 4..10, 1 s more
    assert stalled.transfer_end(5.0, 1.0) == pytest.approx(11.0)
    halved = timeline("a", Episode("bandwidth", 0.0, 10.0, 0.5), Episode("bandwidth", 10.0, 10.0, 2.0))
    assert halved.transfer_end(8.0, 2.0) == pytest.approx(10.0 + 1.0 / 2.0)  # 2 s at half rate send 1 s


def test_drop_between_finds_the_drop_out_under_way_or_begun_in_the_interval() -> None:
    t = timeline("a", Episode("drop", 10.0, 5.0), Episode("drop", 30.0, 5.0))
    assert t.drop_between(12.0, 12.0) == Episode("drop", 10.0, 5.0)
    assert t.drop_between(16.0, 31.0) == Episode("drop", 30.0, 5.0)
    assert t.drop_between(16.0, 29.0) is None


def two(up_s: float = 0.0, down_s: float = 0.0, overhead_s: float = 0.0) -> Workload:
    """Two equal devices: 10 samples in 1 s of compute each."""
    return Workload((Load("a", 10.0, 10, up_s, down_s), Load("b", 10.0, 10, up_s, down_s)), overhead_s)


def test_with_nothing_happening_sync_and_free_go_equally_fast() -> None:
    timelines = {"a": timeline("a"), "b": timeline("b")}
    load = two(up_s=0.1, down_s=0.2, overhead_s=0.05)
    sync = headroom._sync_rate(load, timelines, 100.0, lag_s=4.0, detect_s=0.5)
    free = headroom._free_rate(load, timelines, 100.0)
    assert sync == pytest.approx(free) == pytest.approx(20 / 1.35)


def test_a_stall_holds_every_sync_round_but_only_its_own_devices_free_loop() -> None:
    timelines = {"a": timeline("a", Episode("stall", 5.5, 10.0)), "b": timeline("b")}
    sync = headroom._sync_rate(two(), timelines, 100.0, lag_s=0.0, detect_s=1.0)
    free = headroom._free_rate(two(), timelines, 100.0)
    # sync: 5 rounds; the 6th computed by 6, its update held until 15.5; 85 more: 91 rounds of 20 samples
    assert sync == pytest.approx(91 * 20 / 100.5)
    # free: b 100 steps in 100 s; a as sync's rounds
    assert free == pytest.approx(91 * 10 / 100.5 + 10)


def test_sync_waits_for_a_dropped_device_until_the_planner_leaves_it_out() -> None:
    timelines = {"a": timeline("a", Episode("drop", 10.5, 20.0)), "b": timeline("b")}
    sync = headroom._sync_rate(two(), timelines, 100.0, lag_s=0.0, detect_s=1.0)
    # 10 full rounds; the 11th waits until 11.5 and counts only b's 10 samples; b alone (full batch of 20 in
    # 2 s) until a is back at 30.5; then full rounds again
    rounds_alone = (30.5 - 11.5) / 2.0
    expected = (10 * 20 + 10 + rounds_alone * 20 + (100 - 30.5) * 20) / 100
    assert sync == pytest.approx(expected, rel=0.02)


def test_throttling_costs_sync_nothing_once_it_rebalanced() -> None:
    timelines = {"a": timeline("a", Episode("throttle", 0.0, 1000.0, 0.5)), "b": timeline("b")}
    sync = headroom._sync_rate(two(), timelines, 100.0, lag_s=0.0, detect_s=1.0)
    assert sync == pytest.approx(15.0)  # the round's 20 samples split 1:2, in 4/3 s
    assert headroom._free_rate(two(), timelines, 100.0) == pytest.approx(15.0)


def test_the_shipped_scenarios_headroom_grows_with_their_harshness() -> None:
    """On the workload of the shipped steady report: the scenario's events leave a policy that waits for no one
    more to gain the harsher the scenario, and steady nothing but the fleet's own imbalance."""
    steady_report = json.loads((REPORTS / "fleet.json").read_text())["scenarios"]["steady"]
    scenarios, profiles = load_scenarios(), load_profiles()
    fleet = [(d["device"], d["profile"]) for d in steady_report["fleet"]]
    load = headroom.workload("digits-wide-cnn", {device: profiles[p] for device, p in fleet},
                             steady_report["policies"]["sync"])
    ratios = {name: headroom.headroom(scenarios[name], scenarios["steady"], fleet, load, 0, 600.0, lag_s=4.0,
                                      detect_s=0.3)["dynamics_ratio"] for name in ("steady", "dynamic", "harsh")}
    assert ratios["steady"] == 1.0
    assert 1.0 < ratios["dynamic"] < ratios["harsh"]


def test_without_a_steady_sync_run_the_headroom_says_why_it_is_missing() -> None:
    scenarios, profiles = load_scenarios(), load_profiles()
    result = {"fleet": [], "seed": 0, "budget_s": 10.0, "policies": {}}
    h = headroom.of_bench(result, scenario=scenarios["dynamic"], steady=scenarios["steady"], model="digits-wide-cnn",
                          profiles=profiles, steady_report=None, lag_s=4.0, detect_s=0.3)
    assert "steady" in h["skipped"]
