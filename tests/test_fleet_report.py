"""The fleet benchmark's one report: each scenario's latest run in it, a run replacing only its own scenario's, the
tuned learning rates read from its steady run, and a report of the layout before (one run) still read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edgemesh.bench.fleet import steady_run, tuned_from
from edgemesh.bench.fleet_report import merged, plot, read_runs
from edgemesh.common.errors import ConfigError

REPORTS = Path(__file__).resolve().parents[1] / "bench" / "reports"


def run(scenario: str, lr: float, *, accuracy: float = 0.9) -> dict[str, Any]:
    """A run as ``bench fleet`` writes it, cut to what the report's readers and its plot use."""
    return {"scenario": {"scenario": scenario}, "target_accuracy": 0.96, "budget_s": 10.0,
            "fleet": [{"device": "pi5-0", "profile": "pi5"}], "single": {"device": "pi5-0", "profile": "pi5"},
            "events": {"devices": {"pi5-0": [{"kind": "stall", "start_s": 1.0, "length_s": 2.0}]}},
            "tuning": {"sync": {"lr": lr, "grid": {}}},
            "policies": {"sync": {"lr": lr, "valid": True, "curve": [[1.0, 3, 0.5], [9.0, 30, accuracy]]}}}


def write(path: Path, report: dict[str, Any]) -> None:
    path.write_text(json.dumps(report))


def test_a_run_replaces_its_scenario_and_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    write(path, merged(path, "steady", run("steady", 0.1)))
    write(path, merged(path, "dynamic", run("dynamic", 0.2)))
    write(path, merged(path, "steady", run("steady", 0.05, accuracy=0.97)))  # a rerun of steady
    runs = read_runs(path)
    assert list(runs) == ["dynamic", "steady"]
    assert runs["steady"]["tuning"]["sync"]["lr"] == 0.05 and runs["dynamic"]["tuning"]["sync"]["lr"] == 0.2
    assert json.loads(path.read_text())["benchmark"] == "fleet"


def test_learning_rates_come_from_the_steady_run(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    write(path, {"scenarios": {"dynamic": run("dynamic", 0.2), "steady": run("steady", 0.1)}})
    assert tuned_from(path, ["sync"]) == {"sync": {"lr": 0.1, "grid": {}, "from": str(path)}}
    assert steady_run(None, path) == run("steady", 0.1)
    with pytest.raises(ConfigError, match="no tuned learning rate for async"):
        tuned_from(path, ["sync", "async"])
    # two runs, none of them steady: whose rates? Neither is taken
    write(path, {"scenarios": {"dynamic": run("dynamic", 0.2), "harsh": run("harsh", 0.3)}})
    with pytest.raises(ConfigError, match="not a fleet report with a tuning section"):
        tuned_from(path, ["sync"])
    assert steady_run(path) is None


def test_a_report_of_one_run_reads_as_its_scenario(tmp_path: Path) -> None:
    """The layout of the reports before (``fleet-dynamic.json``: one run): read, tuned from, merged into."""
    path = tmp_path / "fleet-dynamic.json"
    write(path, run("dynamic", 0.2))
    assert list(read_runs(path)) == ["dynamic"]
    assert tuned_from(path, ["sync"])["sync"]["lr"] == 0.2
    assert list(merged(path, "harsh", run("harsh", 0.3))["scenarios"]) == ["dynamic", "harsh"]


def test_what_is_not_a_fleet_report_is_started_afresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "fleet.json"
    for text in ("{not json", json.dumps({"codecs": []}), json.dumps([1, 2])):
        path.write_text(text)
        assert merged(path, "steady", run("steady", 0.1)) == {"benchmark": "fleet",
                                                              "scenarios": {"steady": run("steady", 0.1)}}
        assert "not a fleet report" in caplog.text
        caplog.clear()
    with pytest.raises(ConfigError, match="not a fleet report"):
        tuned_from(path, ["sync"])
    assert read_runs(tmp_path / "none.json") == {}


def test_the_plot_draws_every_scenario(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "fleet.png"
    report = {"scenarios": {"steady": run("steady", 0.1), "harsh": run("harsh", 0.3)}}
    assert plot(report, png)
    one = tmp_path / "one.png"
    assert plot({"scenarios": {"steady": run("steady", 0.1)}}, one)
    assert png.stat().st_size > one.stat().st_size > 1000


def test_the_shipped_report_holds_every_shipped_scenario() -> None:
    runs = read_runs(REPORTS / "fleet.json")
    assert set(runs) == {"steady", "dynamic", "harsh"}
    assert all(r["scenario"]["scenario"] == name for name, r in runs.items())
