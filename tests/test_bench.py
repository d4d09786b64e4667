"""The benchmarks' quick runs: each writes its report layout and a PNG beside it, with figures that show
training learns (digits has 10 classes: chance is 0.1). Nothing here asserts a speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgemesh.bench.glyphs import device_mixes
from edgemesh.bench.models_report import cell_median, gap_pt
from edgemesh.bench.models_report import summary as models_summary
from edgemesh.bench.reference import Curve, checkpoints
from edgemesh.bench.soak import growth, windows
from edgemesh.common.codecs import available_codecs

pytestmark = pytest.mark.timeout(400)
"""Each quick run is a cluster of processes; a loaded CI host, or tests run side by side, make it slower than
the default limit (the subprocesses have their own timeouts)."""

LEARNED = 0.3
"""Held-out accuracy a quick run reaches at the least; measured on this host: codecs 0.68-0.77 after 30 rounds,
fleet 0.85-0.94 after 4 s, mesh 0.49-0.51 over 60 versions (one run each)."""
CODEC_KEYS = {"compression_ratio", "bytes_per_step", "relative_error", "encode_gbps", "decode_gbps",
              "final_accuracy"}


def test_bench_codecs_report_layout(tmp_path: Path) -> None:
    report = tmp_path / "codecs.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "codecs", "--report", str(report),
         "--rounds", "30", "--elements", "200000"],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["memcpy_gbps"] > 0
    assert set(data["codecs"]) == set(available_codecs())
    for name, entry in data["codecs"].items():
        assert CODEC_KEYS <= entry.keys(), name
        assert entry["compression_ratio"] >= 1.0 or name == "qsgd"
        assert LEARNED <= entry["final_accuracy"] <= 1.0, name  # every codec still trains
        assert entry["encode_gbps"] > 0 and entry["decode_gbps"] > 0
    assert data["codecs"]["none"]["relative_error"] == 0.0
    assert data["codecs"]["fp16"]["compression_ratio"] == 2.0
    if {"grid", "threshold"} <= set(available_codecs()):
        same = data["same_density"]
        assert {"density", "grid_bytes", "threshold_bytes"} <= same.keys()
        assert same["grid_bytes"] < same["threshold_bytes"]
    assert report.with_suffix(".png").stat().st_size > 1000


FLEET_KEYS = {"time_to_target_s", "avg_iteration_delay_s", "final_accuracy", "updates_discarded", "bytes_published",
              "emulation_overrun_share", "valid", "lr", "slowest_step_s", "curve"}


def test_bench_fleet_quick_tunes_each_policy_then_runs_the_scenario(tmp_path: Path) -> None:
    """``--quick`` (what the issue asks the suite to run): each policy's learning rate picked from a grid on
    ``steady`` with another seed, then the ``dynamic`` scenario's run at it, in board time, its events listed."""
    report = tmp_path / "fleet.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "fleet", "--quick", "--scenario", "dynamic", "--report",
         str(report)], capture_output=True, text=True, timeout=380, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["scenario"]["scenario"] == "dynamic" and data["time_dilation"] == 2.0 and data["budget_s"] == 6.0
    assert [d["profile"] for d in data["fleet"]] == ["pi5", "laptop"]
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
    # the other scenarios reuse these rates
    again = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "fleet", "--quick", "--scenario", "harsh", "--policies", "single",
         "--lr-from", str(report), "--report", str(tmp_path / "harsh.json")],
        capture_output=True, text=True, timeout=200, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    harsh = json.loads((tmp_path / "harsh.json").read_text())
    assert harsh["policies"]["single"]["lr"] == data["tuning"]["single"]["lr"]
    assert harsh["tuning"]["single"]["from"] == str(report)


def test_bench_fleet_refuses_unknown_profiles_and_policies(tmp_path: Path) -> None:
    for args, message in ((["--fleet", "pi3,pi9"], "unknown device profile(s) pi9"),
                          (["--policies", "sync,bogus"], "unknown polic"),
                          (["--scenario", "stormy"], "unknown scenario 'stormy'"),
                          (["--lrs", "fast"], "--lrs expects numbers"),
                          (["--lr-from", str(tmp_path / "none.json")], "not a fleet report")):
        result = subprocess.run([sys.executable, "-m", "edgemesh", "bench", "fleet",
                                 "--report", str(tmp_path / "x.json"), *args],
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 2 and message in result.stderr, result.stderr


MESH_KEYS = {"avg_iteration_delay_s", "peak_rss_mb_per_device", "param_optimizer_activation_bytes_per_device",
             "final_accuracy", "load_imbalance", "predicted_iteration_s", "measured_iteration_s"}


def test_bench_mesh_report_layout(tmp_path: Path) -> None:
    """A short run of two modes on two boards: the layout the issue fixes, measured figures, a plot."""
    report = tmp_path / "mesh.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "mesh", "--report", str(report),
         "--fleet", "pi5,laptop", "--modes", "single,edge_mesh", "--batch", "8", "--iterations", "2",
         "--accuracy-iterations", "60", "--dilation", "1"],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert set(data["modes"]) == {"single", "edge_mesh"}
    assert 0 < data["planner_1000_devices_s"] < 60
    assert [d["profile"] for d in data["fleet"]] == ["pi5", "laptop"]
    for name, entry in data["modes"].items():
        assert MESH_KEYS <= entry.keys(), name
        assert entry["failure"] is None and entry["accuracy_failure"] is None
        assert entry["avg_iteration_delay_s"] > 0 and entry["predicted_iteration_s"] > 0
        assert entry["param_optimizer_activation_bytes_per_device"] > 0 and entry["peak_rss_mb_per_device"] > 0
        assert LEARNED <= entry["final_accuracy"] <= 1.0, name
        assert entry["samples_per_iteration"] == 8  # every mode trains the same batch per iteration
    assert "single_over_edge_mesh_delay" in data["ratios"]
    assert report.with_suffix(".png").stat().st_size > 1000


def test_bench_mesh_refuses_bad_arguments(tmp_path: Path) -> None:
    for args, message in ((["--fleet", "pi3,pi9"], "unknown device profile(s) pi9"),
                          (["--modes", "single,bogus"], "unknown mode(s) bogus"),
                          (["--batch", "12"], "a multiple of the fleet's 8 devices")):
        result = subprocess.run([sys.executable, "-m", "edgemesh", "bench", "mesh",
                                 "--report", str(tmp_path / "x.json"), *args],
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 2 and message in result.stderr, result.stderr


JOB_KEYS = {"state", "reached_target", "final_accuracy", "model_version", "seconds_to_running", "time_to_target_s",
            "training_s", "gradient_bytes_received", "bytes_published_by_services", "devices", "device_errors", "curve"}


def test_bench_jobs_report_layout(tmp_path: Path) -> None:
    report = tmp_path / "jobs.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "jobs", "--report", str(report), "--workers", "2",
         "--target", "0.8"],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["failure"] is None and data["same_processes"] is True and data["workers"] == 2
    assert set(data["jobs"]) == {"shapes", "vibration"}
    for name, job in data["jobs"].items():
        assert JOB_KEYS <= job.keys(), name
        assert job["state"] == "finished" and job["reached_target"] and job["final_accuracy"] >= 0.8, name
        assert job["time_to_target_s"] == job["training_s"], name  # reached: the training time is the time to it
        assert job["gradient_bytes_received"] > 0 and set(job["devices"]) == {"w0", "w1"}
        assert job["onnx_max_abs_error"] < 1e-4
    assert report.with_suffix(".png").stat().st_size > 1000


MODEL_CELL_KEYS = {"job", "state", "reason", "reported_accuracy", "model_version", "versions", "exported_accuracy",
                   "exported_version", "time_to_target_s", "reached_target", "training_s", "samples_seen",
                   "samples_to_kept_model", "accepted_updates", "ps_accepted_updates", "gradient_bytes_received",
                   "bytes_published_by_services", "reference_accuracy", "reference_best_accuracy", "gap_pt",
                   "gap_last_pt", "evaluations", "evaluation_samples", "last_evaluated_accuracy", "failure"}


def test_bench_models_quick_trains_a_cell_whose_export_scores_what_the_job_reported_beside_its_reference(
        tmp_path: Path) -> None:
    """One job on a fleet of three devices (one lacking a class), exported to ONNX and scored in onnxruntime, beside
    one PyTorch process trained on the pooled images for the samples the fleet saw; the job is stopped at its budget
    of samples."""
    report = tmp_path / "models.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "models", "--quick", "--report", str(report)],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["complete"] and data["failure"] is None and data["same_processes"] is True
    assert data["command"].startswith("edgemesh bench models --quick") and data["host"]["cores"] >= 1
    settings = data["settings"]
    assert settings["quick"] and settings["models"] == ["plain-cnn"] and settings["policies"] == ["async"]
    assert settings["seeds"] == 1 and settings["max_minutes"] > 0 and settings["samples_budget"] == 1600
    mixes = list(data["data"]["devices"].values())
    assert len(mixes) == 3 and [len(mix) for mix in mixes] == [5, 5, 4]  # the last device lacks a class
    assert len({tuple(sorted(mix.items())) for mix in mixes}) == 3  # non-IID: a different mix on each

    cell = data["cells"]["plain-cnn"]["async"]
    run = cell["seeds"]["0"]
    assert MODEL_CELL_KEYS <= run.keys()
    assert run["failure"] is None and run["export_error"] is None
    # the bench stopped it at its budget, as an operator would; the updates the PS takes until the stop lands still
    # count (58 more batches once, on a loaded host), and the reference is matched to them
    assert run["state"] == "stopped" and 1600 <= run["samples_seen"] <= 2 * 1600, (run["state"], run["reason"])
    chance = data["summary"]["chance_accuracy"]
    assert run["exported_accuracy"] > chance  # trained
    # the model exported and run in onnxruntime scores on the held-out folder what the job reported
    assert abs(run["exported_accuracy"] - run["reported_accuracy"]) <= 0.005
    assert run["exported_version"] == run["model_version"] > 0
    # samples seen: the accepted acks counted on the bus (the PS's own count beside), each a batch of the plan's
    assert run["accepted_updates"] > 0 and abs(run["accepted_updates"] - run["ps_accepted_updates"]) <= 2
    assert run["samples_seen"] == run["accepted_updates"] * data["models"]["plain-cnn"]["batch_size"]
    assert 0 < run["samples_to_kept_model"] <= run["samples_seen"]
    assert run["gradient_bytes_received"] > 0 and run["bytes_published_by_services"] > run["gradient_bytes_received"]
    if run["reached_target"]:
        assert run["time_to_target_s"] <= run["training_s"] and run["samples_to_target"] <= run["samples_seen"]
    else:
        assert run["time_to_target_s"] is None

    # the reference trained on as many samples, and its figures are those at the cell's samples
    reference = data["references"]["plain-cnn"]["0"]
    assert reference["failure"] is None and reference["samples"] == run["samples_seen"]
    def at(samples: int) -> float:
        return next(accuracy for seen, accuracy in reference["curve"] if seen >= samples)

    assert run["reference_accuracy"] == at(run["samples_seen"]) > chance
    # the reference picks its best at the samples of the job's own evaluations, as the job picks its exported model
    assert len(run["evaluation_samples"]) == len(run["evaluations"]) > 0
    assert run["evaluation_samples"] == sorted(run["evaluation_samples"])
    assert run["reference_best_accuracy"] == max(at(s) for s in run["evaluation_samples"] if s)
    assert run["gap_pt"] == round(100 * (run["exported_accuracy"] - run["reference_best_accuracy"]), 2)
    assert run["last_evaluated_accuracy"] == run["evaluations"][-1][2]
    assert run["gap_last_pt"] == round(100 * (run["last_evaluated_accuracy"] - run["reference_accuracy"]), 2)
    assert run["reference_samples_to_target"] == next((seen for seen, accuracy in reference["curve"]
                                                       if accuracy >= settings["target_accuracy"]), None)
    assert cell["median"]["gap_pt"] == run["gap_pt"] and cell["median"]["failed"] == 0
    summary = data["summary"]
    assert summary["cells"] == 1 and summary["worst_gap"] == {"cell": "plain-cnn/async", "gap_pt": run["gap_pt"]}
    assert summary["exported_equals_reported"] == "1/1" and summary["failed"] == {}
    assert report.with_suffix(".png").stat().st_size > 1000


def test_bench_models_refuses_unknown_models_and_runs_without_a_cap(tmp_path: Path) -> None:
    for args, message in ((["--models", "plain-cnn,vgg"], "unknown model(s) or policy(ies): vgg"),
                          (["--policies", "ssp2"], "unknown model(s) or policy(ies): ssp2"),
                          (["--max-minutes", "0"], "give a cap")):
        result = subprocess.run([sys.executable, "-m", "edgemesh", "bench", "models",
                                 "--report", str(tmp_path / "x.json"), *args],
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "x.json").exists()


def test_models_reference_is_read_at_each_cells_samples_and_cells_are_summarised() -> None:
    curve = Curve(points=((100, 0.4), (200, 0.7), (304, 0.6), (400, 0.65)), seconds=1.0)
    assert curve.at(200) == 0.7 and curve.at(300) == 0.6 and curve.at(401) is None
    assert curve.best(300) == 0.7 and curve.best(100) == 0.4
    assert curve.best_at([300, 400]) == 0.65 and curve.best_at([150, 401]) == 0.7 and curve.best_at([500]) is None
    assert curve.reaching(0.6) == 200 and curve.reaching(0.9) is None
    assert checkpoints([300, 120], 100) == [100, 120, 200, 300]
    mixes = device_mixes(["w0", "w1", "w2", "w3"], 10)
    assert [sorted(n for n, c in mix.items() if c == 10) for mix in mixes.values()] == [
        ["circle", "square"], ["cross", "triangle"], ["circle", "ring"], ["square", "triangle"]]
    assert "cross" not in mixes["w3"] and all(len(mix) == 5 for d, mix in mixes.items() if d != "w3")

    def cell(exported: float | None, reference: float, failure: str | None = None) -> dict[str, object]:
        run = {"exported_accuracy": exported, "reported_accuracy": exported, "reference_accuracy": reference,
               "gap_pt": gap_pt(exported, reference), "failure": failure}
        return {"median": cell_median({"0": run}), "seeds": {"0": run}}

    summary = models_summary({"a": {"sync": cell(0.81, 0.80), "async": cell(0.70, 0.80)},
                              "b": {"sync": cell(0.22, 0.21), "async": cell(None, 0.5, "the job failed: x")}}, 5)
    assert summary["within_2pt"] == ["a/sync", "b/sync"] and summary["below_reference_by_over_2pt"] == ["a/async"]
    assert summary["at_chance"] == ["b/sync"] and summary["worst_gap"] == {"cell": "a/async", "gap_pt": -10.0}
    assert summary["failed"] == {"b/async/s0": "the job failed: x"} and summary["exported_equals_reported"] == "3/3"


def test_bench_soak_report_layout(tmp_path: Path) -> None:
    """45 s of churn (a kill every 6-10 s): the layout the issue fixes, every process sampled, the audit clean."""
    report = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "soak", "--report", str(report), "--minutes", "0.75",
         "--kill-every-s", "6,10", "--restart-after-s", "1,2"],
        capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["minutes"] == 0.75 and data["failure"] is None
    assert set(data["rss_growth"]) == {"planner", "ps", "compressor", "worker"}
    assert all(ratio > 0 for ratio in data["rss_growth"].values())  # sampled in both windows; no bound on 45 s
    assert data["updates_lost"] == 0 and data["updates_applied_twice"] == 0 and data["versions_back"] == 0
    assert data["updates_acked"] > 0 and data["updates_applied"] >= data["updates_acked"]
    kills = data["kills"]
    assert kills and all(k["device"] != data["steady_worker"] for k in kills)
    assert data["restarts"] >= 1  # a killed worker came back (and its acks are in the audit)
    last = data["samples"][-1]
    assert {"planner", "ps", "compressor", data["steady_worker"]} <= last["rss_mb"].keys()
    assert {"inbox", "pending_updates"} <= last["queues"]["ps"].keys() and "inbox" in last["queues"]["planner"]
    assert max(accuracy for _, _, accuracy in data["curve"]) >= LEARNED
    assert report.with_suffix(".png").stat().st_size > 1000


def test_soak_rss_growth_is_the_last_minute_over_the_first_minute_after_warm_up() -> None:
    assert windows(1800) == ((60, 120), (1740, 1800))
    assert windows(45) == ((15, 30), (30, 45))  # a short run: thirds
    warming = [(float(t), 50.0 if t < 60 else 100.0 if t < 900 else 105.0) for t in range(0, 1801, 10)]
    assert growth(warming, 1800) == 1.05  # the warm-up's 50 MiB left out
    assert growth([(t, 100.0) for t in (0.0, 70.0)], 1800) is None  # never sampled in the last minute


def test_bench_ideal_trains_each_variant_and_its_reference_is_bench_models(tmp_path: Path) -> None:
    """Ideal data parallel in one process: every variant's curve, and its one-process reference the very run
    ``bench models`` compares the fleet with (same model, data, batches and evaluations)."""
    from edgemesh.bench import ideal, model_jobs, reference

    report = tmp_path / "ideal.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "ideal", "--models", "plain-cnn", "--variants",
         "reference,sync-linear,async-inverse", "--samples", "480", "--every", "160", "--per-class", "8",
         "--held-out-per-class", "6", "--report", str(report)],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    runs = data["runs"]["plain-cnn/s0"]
    assert set(runs) == {"reference", "sync-linear", "async-inverse"}
    for run in runs.values():
        samples = [seen for seen, _ in run["curve"]]
        assert samples == sorted(samples) and samples[-1] >= 480 and len(samples) == 3
        assert run["best"] == max(a for _, a in run["curve"]) and run["last"] == run["curve"][-1][1]
    assert report.with_suffix(".png").stat().st_size > 1000

    shards, _ = ideal.prepare(tmp_path / "data", 4, 8, 6)
    module_path = model_jobs.write_entry_point(tmp_path / "models")
    entry = model_jobs.catalogue()["plain-cnn"]
    mine = ideal.train(ideal.VARIANTS["reference"], ideal.build(entry, 0, module_path), shards, lr=entry.lr,
                       momentum=0.9, batch_size=entry.batch_size, seed=0, samples=480, every=160)
    theirs = reference.train(ideal.build(entry, 0, module_path), shards.pooled, shards.held_out, lr=entry.lr,
                             momentum=0.9, weight_decay=0.0, batch_size=entry.batch_size, seed=0, at=[160, 320, 480])
    assert mine == list(theirs.points) == [tuple(point) for point in runs["reference"]["curve"]]
