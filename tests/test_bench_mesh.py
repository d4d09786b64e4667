"""``edgemesh bench mesh --job FILE``: a user's model (the MobileNetV2-style example) on image folders, one board,
data parallelism and Edge Mesh on emulated boards; and a model no Pi 3 trains alone, killed by the kernel on one
Pi 3 and tried on a mesh of three. Nothing here asserts a speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from edgemesh.bench.mesh import Run
from edgemesh.bench.mesh_jobs import accuracy_figures

pytestmark = pytest.mark.timeout(900)
"""A quick run starts eight fleets of processes one after another (three Pi 3s under their CPU quota among them)."""

JOB = Path(__file__).resolve().parents[1] / "examples" / "mobilenetv2-32.toml"
CLASSES = 5
QUICK_FLEET = ["pi4-0", "jetson-nano-0"]
BATCH = 16
"""The example's ``training.batch_size``: an iteration is that many samples per device of the fleet."""


def run_quick(tmp_path: Path, *flags: str) -> dict[str, Any]:
    report = tmp_path / "mesh.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "mesh", "--job", str(JOB), "--quick", *flags,
         "--report", str(report)], capture_output=True, text=True, timeout=850, check=False)
    data: dict[str, Any] = json.loads(report.read_text()) if report.exists() else {}
    data["returncode"], data["stderr"] = result.returncode, result.stderr[-4000:]
    assert report.with_suffix(".png").stat().st_size > 1000
    return data


def test_bench_mesh_quick_on_a_users_job_reports_time_memory_accuracy_and_a_board_killed_for_memory(
        tmp_path: Path) -> None:
    """One quick run (the suite's time): the three modes on the user's job, then the model no Pi 3 trains alone. The
    boards' CPU quota is off (tests/test_emulation_limits.py covers it): under it every fleet's start took longer than
    its runs; the memory limits, what this test is about, stay."""
    data = run_quick(tmp_path, "--oom", "--set", "worker.emulation_cpu_quota=false")
    assert data["job"] == "mobilenetv2-32" and [d["device"] for d in data["fleet"]] == QUICK_FLEET
    samples = BATCH * len(QUICK_FLEET)
    assert data["settings"]["samples_per_iteration"] == samples
    # each device holds a different folder (a class mix of its own); the single board holds them all
    mixes = data["data"]["devices"]
    assert mixes[QUICK_FLEET[0]] != mixes[QUICK_FLEET[1]] and len(mixes[QUICK_FLEET[1]]) == CLASSES - 1
    pooled = {c: sum(mixes[d].get(c, 0) for d in QUICK_FLEET) for c in data["data"]["classes"]}
    assert data["data"]["single_board"] == pooled
    assert set(data["modes"]) == {"single", "data_parallel", "edge_mesh"}
    assert data["limits"] and set(data["limits"]) <= {"cgroup-v1", "stretched"}
    for name, entry in data["modes"].items():
        assert entry["failure"] is None and entry["accuracy_failure"] is None, name
        assert entry["avg_iteration_delay_s"] > 0 and entry["predicted_iteration_s"] > 0, name
        assert entry["samples_per_iteration"] == samples == entry["accuracy_samples_per_iteration"], name
        devices = ["pi4-0"] if name == "single" else QUICK_FLEET
        assert sorted(entry["peak_rss_mb_by_device"]) == sorted(devices), name
        assert all(rss > 50 for rss in entry["peak_rss_mb_by_device"].values()), name
        assert 0 <= entry["final_accuracy"] <= 1 and len(entry["accuracy_curve"]) >= 2, name
        assert sorted(m for c in entry["layout"] for m in c) == sorted(devices), name
    assert data["modes"]["data_parallel"]["layout"] == [[d] for d in sorted(QUICK_FLEET)]
    # the accuracy run of Edge Mesh trained in one model-parallel cluster of every device, as the report says
    mesh = data["modes"]["edge_mesh"]
    assert [sorted(c) for c in mesh["accuracy_layout"]] == [sorted(QUICK_FLEET)]
    assert mesh["accuracy_forced"] == f"planner.min_batch = {samples}"
    ratios = data["ratios"]
    assert ratios["single_over_edge_mesh_delay"] > 0 and ratios["data_parallel_over_edge_mesh_delay"] > 0
    assert set(ratios["claims"]) == {"edge_mesh_3.2x_below_single", "edge_mesh_below_data_parallel",
                                     "edge_mesh_rss_43pct_below_data_parallel", "accuracy_within_2pt_no_collapse"}
    # the most any layout can gain over the single board: the fleet's training rate over the board's
    rates = {d["device"]: d["train_gflops"] for d in data["fleet"]}
    assert ratios["compute_ceiling_single_over_fleet"] == pytest.approx(sum(rates.values()) / rates["pi4-0"], abs=1e-3)
    # the model no Pi 3 trains alone: the kernel kills the board, and the fleet hears it left for memory
    oom = data["oom"]
    if "skipped" in oom:  # a host that cannot enforce memory limits says why
        assert oom["skipped"].startswith("the host cannot enforce memory limits")
        return
    single = oom["single"]
    assert single["killed_for_memory"] is True and single["cgroup_oom_kills"] >= 1, single
    assert single["limit_mib"] == 566.0 and "left for memory" in single["failure"]
    assert {"event": "device_left", "device": "pi3-0", "reason": "out_of_memory"}.items() <= next(
        p for p in single["published"] if p.get("event")).items()
    assert any(p.get("status") == "left" for p in single["published"])
    # a mesh of three Pi 3s trains it, each member holding its own maps under the same limit
    mesh_run = oom["mesh"]
    assert mesh_run["layout"] == [["pi3-0", "pi3-1", "pi3-2"]] and mesh_run["limits"] == "cgroup-v1"
    assert mesh_run["failure"] is None and mesh_run["killed_for_memory"] == [], mesh_run
    assert mesh_run["versions"] >= 3 and sorted(mesh_run["peak_rss_mb_by_device"]) == ["pi3-0", "pi3-1", "pi3-2"]
    assert data["returncode"] == 0, data["stderr"]


def test_bench_mesh_refuses_a_job_it_cannot_draw_images_for(tmp_path: Path) -> None:
    digits = JOB.parent / "digits.toml"
    for args, message in ((["--job", str(digits)], 'must be format = "image-folder"'),
                          (["--job", str(JOB), "--batch", "48"], "--batch does not go with --job"),
                          (["--oom"], "--quick and --oom go with --job FILE")):
        result = subprocess.run([sys.executable, "-m", "edgemesh", "bench", "mesh",
                                 "--report", str(tmp_path / "x.json"), *args],
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_run_that_ends_at_chance_collapsed_and_one_that_dipped_and_recovered_did_not() -> None:
    """``collapsed`` is a model that learned and ended at chance (the mesh job that answered one class for 6,500
    versions); a batch-normalized model that answers one class at an early evaluation and recovers is counted in
    ``dips_to_chance`` instead."""
    def run_of(accuracies: list[float]) -> Run:
        run = Run()
        run.evaluations = [(float(i), 5 * (i + 1) - 1, a) for i, a in enumerate(accuracies)]
        return run

    learned_then_chance = [0.2, 0.5, 0.7, *[0.2] * 10]
    dipped = [0.2, 0.5, 0.2, 0.7, 0.21, *[0.95] * 10]
    ended = accuracy_figures(run_of(learned_then_chance), versions=1000, classes=CLASSES)
    assert ended["collapsed"] is True and ended["final_accuracy"] == 0.2 and ended["best_accuracy"] == 0.7
    recovered = accuracy_figures(run_of(dipped), versions=1000, classes=CLASSES)
    assert recovered["collapsed"] is False and recovered["dips_to_chance"] == 2
    assert recovered["final_accuracy"] == 0.95 and recovered["min_final_accuracy"] == 0.95
    never = accuracy_figures(run_of([0.2] * 12), versions=1000, classes=CLASSES)
    assert never["collapsed"] is False and never["dips_to_chance"] == 0  # never learned: no collapse to speak of
    assert accuracy_figures(run_of(dipped), versions=24, classes=CLASSES)["final_accuracy"] == pytest.approx(
        (0.2 + 0.5 + 0.2 + 0.7 + 0.21) / 5, abs=1e-4)  # only the evaluations up to the run's versions
