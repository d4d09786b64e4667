"""``edgemesh bench fleet``: its quick run (each policy tuned, then the scenario) and its refusals; a file of its own
so that the suite's two processes (``--dist loadfile``) share the slow benchmark tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgemesh import cli
from edgemesh.bench.fleet import tuned_from
from edgemesh.common.errors import ConfigError

pytestmark = pytest.mark.timeout(400)
"""A quick run is clusters of processes, one after another (the subprocesses have their own timeouts)."""

LEARNED = 0.3
"""Held-out accuracy a run that trained reaches (chance on digits: 0.1), as in tests/test_bench.py."""


FLEET_KEYS = {"time_to_target_s", "avg_iteration_delay_s", "final_accuracy", "updates_discarded", "bytes_published",
              "emulation_overrun_share", "valid", "lr", "slowest_step_s", "curve", "rollbacks"}


def test_bench_fleet_quick_tunes_each_policy_then_runs_the_scenario(tmp_path: Path) -> None:
    """``--quick`` (what the issue asks the suite to run): each policy's learning rate picked from a grid on
    ``steady`` with another seed, then the ``dynamic`` scenario's run at it, in board time, its events listed."""
    report = tmp_path / "fleet.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "fleet", "--quick", "--scenario", "dynamic", "--report",
         str(report)], capture_output=True, text=True, timeout=380, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads(report.read_text())
    assert list(written["scenarios"]) == ["dynamic"]  # one report, a run per scenario (tests/test_fleet_report.py)
    data = written["scenarios"]["dynamic"]
    assert data["scenario"]["scenario"] == "dynamic" and data["time_dilation"] == 2.0 and data["budget_s"] == 6.0
    assert [d["profile"] for d in data["fleet"]] == ["pi5", "laptop"]
    assert data["single"]["device"] == "pi5-0"  # no Pi 4 in this fleet: its first device, alone
    assert data["settings"]["model"] == "digits-wide-cnn" and data["settings"]["planner_batching"] == "balanced"
    # the events every policy met, per device, from the scenario's seeded timelines
    assert set(data["events"]["devices"]) == {"pi5-0", "laptop-0"}
    for events in data["events"]["devices"].values():
        assert all(e["kind"] in ("throttle", "stall", "drop") and 0 <= e["start_s"] < 6.0 for e in events)
    assert set(data["policies"]) == set(data["tuning"]) == {"single", "adaptive"}
    for name, tuning in data["tuning"].items():
        assert set(tuning["grid"]) == {"0.1", "0.2"}, name
        reached = {lr: e["time_to_target_s"] for lr, e in tuning["grid"].items() if e["time_to_target_s"]}
        if reached:  # the chosen rate is the one that got there first
            assert tuning["lr"] == float(min(reached, key=reached.__getitem__)), name
        assert data["policies"][name]["lr"] == tuning["lr"]
    for name, entry in data["policies"].items():
        assert FLEET_KEYS <= entry.keys(), name
        assert entry["failure"] is None
        assert entry["avg_iteration_delay_s"] > 0 and entry["bytes_published"] > 0 and entry["model_versions"] > 0
        assert 0.0 <= entry["emulation_overrun_share"] <= 1.0
        assert entry["valid"] == (entry["emulation_overrun_share"] <= 0.05)
        # board time: a run lasts the budget in board seconds whatever the dilation
        assert 6.0 <= entry["elapsed_s"] < 6.0 + 1.0 and entry["curve"][-1][0] <= entry["elapsed_s"]
        assert entry["curve"] and 0.0 <= entry["final_accuracy"] <= 1.0, name
        assert isinstance(entry["rollbacks"], int) and entry["rollbacks"] >= 0, name  # the guard's, from the PS
        if entry["model_versions"] >= 20:
            assert max(accuracy for _, _, accuracy in entry["curve"]) >= LEARNED, name
        reached = [t for t, _, accuracy in entry["curve"] if accuracy >= data["target_accuracy"]]
        if reached:  # the curve and the figure agree
            assert abs(entry["time_to_target_s"] - reached[0]) < 1e-2, name
        else:
            assert entry["time_to_target_s"] is None, name
    assert data["policies"]["single"]["devices"] == 1 and data["policies"]["adaptive"]["devices"] == 2
    assert data["policies"]["single"]["round_overhead_s"] is not None  # one device: every version is a round
    assert "every_run_valid" in data["acceptance"]
    assert report.with_suffix(".png").stat().st_size > 1000
    # the other scenarios reuse these rates (``--lr-from``: what a run of another scenario takes, without a cluster)
    carried = tuned_from(report, ["single"])
    assert carried["single"]["lr"] == data["tuning"]["single"]["lr"] and carried["single"]["from"] == str(report)
    with pytest.raises(ConfigError, match="no tuned learning rate for sync"):
        tuned_from(report, ["single", "sync"])


def test_bench_fleet_refuses_unknown_profiles_and_policies(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in ((["--fleet", "pi3,pi9"], "unknown device profile(s) pi9"),
                          (["--policies", "sync,bogus"], "unknown polic"),
                          (["--scenario", "stormy"], "unknown scenario 'stormy'"),
                          (["--lrs", "fast"], "--lrs expects numbers"),
                          (["--lr-from", str(tmp_path / "none.json")], "not a fleet report")):
        code = cli.main(["bench", "fleet", "--report", str(tmp_path / "x.json"), *args])  # refused before any run
        err = capsys.readouterr().err
        assert code == 2 and message in err, err
