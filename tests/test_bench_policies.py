"""``edgemesh bench policies``: the FedBuff reference scheduler, the learning-rate rule, the headroom share and the
quick report's structure and arithmetic. The quick run is two boards for three virtual seconds."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgemesh import cli
from edgemesh.bench import policies_search
from edgemesh.bench.policies import STRAGGLER, bench_of, case_settings, refigure, register
from edgemesh.bench.policies_figures import headroom_share, quartiles
from edgemesh.bench.policies_search import SEARCHED, candidates, default, geometric_mean, score
from edgemesh.bench.policies_tuning import choose_lr
from edgemesh.common.errors import EdgeMeshError
from edgemesh.common.messages import GradientUpdate, ShardUpdate
from edgemesh.services.parameter_server.optimizer import ShardGrad
from edgemesh.services.parameter_server.scheduler import Candidate, Clock, Fleet
from edgemesh.simulate import SimRun, straggler_fleet
from edgemesh.simulate.reference import FedBuffScheduler, fedbuff_damping

FOUR = Fleet(clusters=("c-a", "c-b", "c-c", "c-d"), plan_version=1, devices=frozenset("abcd"), bound=8,
             planned_samples=32)


def _update(device: str, seq: int, base: int, samples: int = 8) -> Candidate:
    u = GradientUpdate(device=device, cluster=f"c-{device}", incarnation=1, seq=seq, base_version=base,
                       samples=samples, plan_version=1,
                       shards=(ShardUpdate(param="w", start=0, stop=1, codec="none", data=b"\0" * 4),))
    return Candidate(u, [ShardGrad("w", 0, 1, np.ones(1, np.float32))], 0.0)


def test_fedbuff_acknowledges_on_arrival_and_steps_every_k_updates() -> None:
    scheduler = FedBuffScheduler(Clock(), share=0.5)  # K = 2 of 4 devices
    first = scheduler.take([_update("a", 1, 0)], FOUR)
    assert not first.steps
    assert [(a.status, a.resync) for a in first.acks] == [("accepted", False)]  # the device goes on at once
    second = scheduler.take([_update("b", 1, 0, samples=24)], FOUR)
    assert [s.version for s in second.steps] == [1]
    assert scheduler.pending() == []
    scheduler.clock.version = 1  # the parameter server applied the step
    third = scheduler.take([_update("c", 1, 0), _update("a", 2, 1)], FOUR)
    (step,) = third.steps
    assert step.version == 2
    # sample shares, each damped by 1 / sqrt(1 + d): c computed on version 0 (d = 1), a on version 1 (d = 0)
    assert step.weights == pytest.approx((0.5 / math.sqrt(2), 0.5))


def test_fedbuff_damping_is_gentler_than_inverse_delay() -> None:
    assert fedbuff_damping(0) == 1.0
    assert fedbuff_damping(3) == pytest.approx(0.5)
    assert fedbuff_damping(8) > 1 / (1 + 8)


def test_a_straggler_fleet_spans_its_spread() -> None:
    fleet, scale = straggler_fleet(8, 10.0)
    assert len(fleet) == len(scale) == 8 and len(set(fleet)) == 1
    assert max(scale) / min(scale) == pytest.approx(10.0)
    assert list(scale) == sorted(scale, reverse=True)


def _run(t: float | None, accuracy: float = 0.9) -> SimRun:
    return SimRun(policy="sync", seed=0, time_to_target_s=t, final_accuracy=accuracy, best_accuracy=accuracy,
                  versions=1, updates=1, discarded={}, steps_refused=0, diverged=False, curve=[], gradients=1,
                  elapsed_s=1.0, wall_s=0.0, plans=1)


def test_the_rate_with_the_best_median_wins_and_unreached_runs_rank_last() -> None:
    chosen = choose_lr({0.01: [_run(3.0), _run(3.0)], 0.03: [_run(1.0), _run(None)], 0.1: [_run(2.0), _run(2.5)]})
    assert chosen["lr"] == 0.1  # 0.03's median is infinite: one of its two runs never arrived
    assert choose_lr({0.01: [_run(2.0)], 0.03: [_run(2.0)]})["lr"] == 0.01  # a tie goes to the smaller rate
    nowhere = choose_lr({0.01: [_run(None, 0.7)], 0.03: [_run(None, 0.8)]})
    assert nowhere["lr"] == 0.03 and "accuracy" in nowhere["by"]


def test_headroom_share_is_the_gain_over_sync_in_units_of_the_headroom() -> None:
    assert headroom_share(10.0, 5.0, 3.0) == 0.5  # twice as fast, of a headroom of 3x
    assert headroom_share(10.0, 10.0, 2.0) == 0.0
    assert headroom_share(10.0, 20.0, 2.0) == -0.5
    assert headroom_share(10.0, 5.0, 1.01) is None  # no headroom to take a share of
    assert headroom_share(None, 5.0, 2.0) is None
    assert quartiles([1.0, 2.0, 3.0, math.inf]) == (1.75, 2.5, math.inf)


def test_the_quick_report_has_its_structure_and_its_figures_agree(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "policies.json"
    assert cli.main(["bench", "policies", "--quick", "--report", str(path)]) == 0
    report: dict[str, Any] = json.loads(path.read_text())
    assert report["settings"]["policies"] == ["sync", "adaptive"]
    assert report["settings"]["seeds"] == [0, 1] and report["settings"]["tuning_seeds"] == [1000]
    assert not set(report["settings"]["seeds"]) & set(report["settings"]["tuning_seeds"])
    (case,) = report["cases"].values()
    ratio = case["headroom"]["ratio"]
    assert ratio >= 1.0  # free waits for no one: never slower than sync
    assert min(case["headroom"]["per_seed"].values()) <= ratio <= max(case["headroom"]["per_seed"].values())
    sync = case["policies"]["sync"]["median_time_to_target_s"]
    reached_somewhere = False
    for policy, f in case["policies"].items():
        runs = case["runs"][policy]
        assert f["runs"] == len(runs) == 2
        assert case["lr"][policy] == report["tuning"]["steady"][policy]["lr"]
        assert all(r["lr"] == case["lr"][policy] for r in runs)
        times = [r["time_to_target_s"] for r in runs]
        assert f["reached_share"] == sum(t is not None for t in times) / 2
        assert f["reached_share"] + f["never_reached_share"] == pytest.approx(1.0)
        assert f["diverged_share"] == sum(r["diverged"] for r in runs) / 2
        median = f["median_time_to_target_s"]
        if median is not None:
            reached_somewhere = True
            low, high = f["min_max_time_to_target_s"]
            q1, q3 = f["iqr_time_to_target_s"]
            assert low <= q1 <= median <= q3 <= high
            assert f["headroom_share"] == headroom_share(sync, median, ratio)
            assert f["speedup_over_sync"] == pytest.approx(sync / median, abs=1e-3)
        assert f["seeds_paired_with_sync"] == 2 and 0 <= f["sooner_than_sync"] <= 2
    assert reached_somewhere  # the quick run's target is one the job reaches: its figures are not all empty
    assert case["policies"]["sync"]["headroom_share"] in (0.0, None)
    assert refigure(copy.deepcopy(report)) == report  # every figure follows from the runs and the headroom
    assert path.with_suffix(".png").exists()
    assert "| `adaptive` |" in capsys.readouterr().out
    # the scale run alone, afterwards: at the rate the bench tuned, on its fleet replicated; nothing else changes
    assert cli.main(["bench", "policies", "--scale-only", "--scale-devices", "6", "--report", str(path), "--set",
                     "ps.aggregation=mean"]) == 0
    again: dict[str, Any] = json.loads(path.read_text())
    scale = again.pop("scale")
    assert again == report
    assert scale["devices"] == 6 and scale["policy"] == "adaptive" and scale["lr"] == case["lr"]["adaptive"]
    assert scale["gradients"] > 0 and scale["fits"] == (scale["time_to_target_s"] is not None)
    assert scale["overrides"] == {**report["settings"]["overrides"], "ps.aggregation": "mean"}
    assert "--scale-only --scale-devices 6" in scale["measured"] and "--set ps.aggregation=mean" in scale["measured"]
    assert cli.main(["bench", "policies", "--scale-only", "--report", str(tmp_path / "none.json")]) == 2
    assert "--scale-only needs a report of a bench that ran steady" in capsys.readouterr().err


def test_set_reaches_every_simulated_run_the_report_and_its_command() -> None:
    """``--set`` settles a setting for every case, the scale run and ``--quick`` alike, and the report's command
    repeats it, so that the run can be made again."""
    parser = argparse.ArgumentParser()
    register(parser)
    sets = ["--set", "ps.round_scaling=adascale", "--set", "ps.norm_factor=0"]
    bench = bench_of(parser.parse_args(["--cases", f"steady,{STRAGGLER}", *sets]))
    assert dict(bench.overrides) == {"ps.round_scaling": "adascale", "ps.norm_factor": "0"}
    for case in ("steady", STRAGGLER):
        overrides = case_settings(bench, case).overrides
        assert overrides["ps.round_scaling"] == "adascale" and overrides["ps.norm_factor"] == "0"
        assert overrides["training.model_spec"] == bench.model
    assert bench.command.endswith(" --set ps.round_scaling=adascale --set ps.norm_factor=0")
    assert bench_of(parser.parse_args(["--quick", *sets])).overrides == bench.overrides
    with pytest.raises(EdgeMeshError, match="KEY=VALUE"):
        bench_of(parser.parse_args(["--set", "adascale"]))


def test_the_search_scores_a_rule_by_its_speedup_and_never_rewards_divergence() -> None:
    assert score([_run(4.0), _run(6.0)], [_run(2.0), _run(3.0)]) == 2.0  # twice as fast in the median
    assert score([_run(4.0)], [_run(None)]) == 0.0  # never arrived
    diverging = dataclasses.replace(_run(1.0), diverged=True)
    assert score([_run(4.0)], [diverging]) == 0.0  # faster, but it diverged where sync did not
    assert geometric_mean([2.0, 0.5]) == pytest.approx(1.0) and geometric_mean([2.0, 0.0]) == 0.0
    rules = candidates()
    assert default() in rules and len(rules) == len({tuple(r.items()) for r in rules})


def test_the_adaptive_search_picks_a_rule_on_its_own_seeds_and_checks_it_on_the_evaluation_seeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid where one candidate waits for the slowest cluster at twice its cycle (a round as slow as sync's or
    slower): the default or a quicker rule wins, never that one; a winner that is not the default is run again on
    the evaluation seeds beside the default rule and sync."""
    monkeypatch.setattr(policies_search, "GRID", {"deadline_quantile": (0.5, 1.0), "slack": (1.5, 3.0)})
    monkeypatch.setattr(policies_search, "SEARCH_SEEDS", (2000,))
    path = tmp_path / "policies.json"
    assert cli.main(["bench", "policies", "--quick", "--search-adaptive", "--report", str(path)]) == 0
    found = json.loads(path.read_text())["adaptive_search"]
    assert found["default"] == {"deadline_quantile": 0.5, "slack": 1.5} and found["search_seeds"] == [2000]
    assert len(found["candidates"]) == 4
    best = max(row["geometric_mean"] for row in found["candidates"])
    chosen = next(row for row in found["candidates"] if row["rule"] == found["chosen"])
    assert chosen["geometric_mean"] == best
    if found["chosen_is_default"]:
        assert found["check"] == {}
    else:
        (case,) = found["check"].values()
        assert set(case) == {"sync", "adaptive", SEARCHED} and case[SEARCHED]["runs"] == 2
