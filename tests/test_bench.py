"""The benchmarks' quick runs: each writes its report layout and a PNG beside it, with figures that show
training learns (digits has 10 classes: chance is 0.1). Nothing here asserts a speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgemesh import cli
from edgemesh.bench.glyphs import device_mixes
from edgemesh.bench.job_fleet import Watch
from edgemesh.bench.jobs import job_figures
from edgemesh.bench.models_report import cell_median, gap_pt
from edgemesh.bench.models_report import summary as models_summary
from edgemesh.bench.reference import Curve, checkpoints
from edgemesh.bench.soak import growth, windows
from edgemesh.common.codecs import available_codecs
from edgemesh.common.messages import JobState

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


MESH_KEYS = {"avg_iteration_delay_s", "peak_rss_mb_per_device", "param_optimizer_activation_bytes_per_device",
             "final_accuracy", "load_imbalance", "predicted_iteration_s", "measured_iteration_s"}


def test_bench_mesh_report_layout(tmp_path: Path) -> None:
    """A short run of two modes on two boards: the layout the issue fixes, measured figures, a plot. No accuracy run
    (the suite's time): ``bench mesh --job``'s quick test trains each mode to an accuracy."""
    report = tmp_path / "mesh.json"
    result = subprocess.run(
        [sys.executable, "-m", "edgemesh", "bench", "mesh", "--report", str(report),
         "--fleet", "pi5,laptop", "--modes", "single,edge_mesh", "--batch", "8", "--iterations", "2",
         "--accuracy-iterations", "0", "--dilation", "1"],
        capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(report.read_text())
    assert set(data["modes"]) == {"single", "edge_mesh"}
    assert 0 < data["planner_1000_devices_s"] < 60
    assert [d["profile"] for d in data["fleet"]] == ["pi5", "laptop"]
    for name, entry in data["modes"].items():
        assert MESH_KEYS - {"final_accuracy"} <= entry.keys(), name
        assert entry["failure"] is None and entry.get("accuracy_failure") is None
        assert entry["avg_iteration_delay_s"] > 0 and entry["predicted_iteration_s"] > 0
        assert entry["param_optimizer_activation_bytes_per_device"] > 0 and entry["peak_rss_mb_per_device"] > 0
        assert entry.get("final_accuracy") is None, name  # no accuracy run asked for
        assert entry["samples_per_iteration"] == 8  # every mode trains the same batch per iteration
    assert "single_over_edge_mesh_delay" in data["ratios"]
    assert report.with_suffix(".png").stat().st_size > 1000


def test_bench_mesh_refuses_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in ((["--fleet", "pi3,pi9"], "unknown device profile(s) pi9"),
                          (["--modes", "single,bogus"], "unknown mode(s) bogus"),
                          (["--batch", "12"], "a multiple of the fleet's 8 devices")):
        code = cli.main(["bench", "mesh", "--report", str(tmp_path / "x.json"), *args])  # refused before any run
        err = capsys.readouterr().err
        assert code == 2 and message in err, err


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


class Published:
    """What ``job_figures`` reads of a local cluster: the bytes its services published, summed."""

    def over_services(self, suffix: str) -> float:
        assert suffix == "_published_bytes_total"
        return 5e6


@pytest.mark.parametrize(("accuracy", "reached"), [(0.62, False), (0.85, True)], ids=["short", "reached"])
def test_bench_jobs_gives_a_time_to_target_only_to_a_job_that_reached_it(accuracy: float, reached: bool) -> None:
    """A job ended at ``job.max_versions`` short of its target (0.8) has trained 9 s and taken no time to a target
    it never reached; one that reached it took those 9 s to it."""
    common = {"name": "shapes", "target_accuracy": 0.8, "max_versions": 40}
    final = JobState(state="finished", version=40, accuracy=accuracy, **common)
    watch = Watch(states={"shapes": [(100.0, JobState(state="queued", **common)),
                                     (101.5, JobState(state="running", version=1, **common)),
                                     (106.0, JobState(state="running", version=20, accuracy=0.55, **common)),
                                     (110.5, final)]})
    figures = job_figures(watch, "shapes", 100.0, final, Published())
    assert figures["reached_target"] is reached and figures["final_accuracy"] == accuracy
    assert figures["seconds_to_running"] == 1.5 and figures["training_s"] == 9.0
    assert figures["time_to_target_s"] == (9.0 if reached else None)
    assert figures["curve"] == [(4.5, 20, 0.55)]  # the evaluations while it ran


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
    assert settings["seeds"] == 1 and settings["max_minutes"] > 0 and settings["samples_budget"] == 3200
    mixes = list(data["data"]["devices"].values())
    assert len(mixes) == 3 and [len(mix) for mix in mixes] == [5, 5, 4]  # the last device lacks a class
    assert len({tuple(sorted(mix.items())) for mix in mixes}) == 3  # non-IID: a different mix on each

    cell = data["cells"]["plain-cnn"]["async"]
    run = cell["seeds"]["0"]
    assert MODEL_CELL_KEYS <= run.keys()
    assert run["failure"] is None and run["export_error"] is None
    # the bench stopped it at its budget, as an operator would; the updates the PS takes until the stop lands still
    # count (58 more batches once, on a loaded host), and the reference is matched to them
    assert run["state"] == "stopped" and 3200 <= run["samples_seen"] <= 2 * 3200, (run["state"], run["reason"])
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


def test_bench_models_refuses_unknown_models_and_runs_without_a_cap(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for args, message in ((["--models", "plain-cnn,vgg"], "unknown model(s) or policy(ies): vgg"),
                          (["--policies", "ssp2"], "unknown model(s) or policy(ies): ssp2"),
                          (["--max-minutes", "0"], "give a cap")):
        code = cli.main(["bench", "models", "--report", str(tmp_path / "x.json"), *args])  # refused before any run
        err = capsys.readouterr().err
        assert code == 2 and message in err, err
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
    # a round policy's cell is also read against one process at the round's batch (workers x batch, scaled rate)
    rounds = cell(0.93, 0.96)
    rounds["seeds"]["0"] |= {"round_batch_reference_best_accuracy": 0.92, "gap_round_batch_pt": gap_pt(0.93, 0.92)}
    rounds["median"] = cell_median(rounds["seeds"])
    summary = models_summary({"a": {"sync": rounds}}, 5)
    assert summary["below_reference_by_over_2pt"] == ["a/sync"]
    assert summary["round_policies_within_2pt_of_the_round_batch_reference"] == ["a/sync"]
    assert summary["round_policies_below_the_round_batch_reference_by_over_2pt"] == []


def _models_run(first_seed: int, seeds: int, exported: dict[str, float], *, models: tuple[str, ...] = ("a",),
                policies: tuple[str, ...] = ("sync",)) -> dict[str, object]:
    """A ``bench models`` report of seeds ``first_seed``.. (each cell's exported accuracy by seed in ``exported``)
    against a reference at 0.9, as ``run`` writes it."""
    cells: dict[str, dict[str, object]] = {}
    for model in models:
        for policy in policies:
            runs = {str(s): {"exported_accuracy": exported[str(s)], "reported_accuracy": exported[str(s)],
                             "reference_best_accuracy": 0.9, "gap_pt": gap_pt(exported[str(s)], 0.9),
                             "failure": None} for s in range(first_seed, first_seed + seeds)}
            cells.setdefault(model, {})[policy] = {"median": cell_median(runs), "seeds": runs}
    return {"command": f"edgemesh bench models --first-seed {first_seed} --seeds {seeds}", "host": {"cores": 2},
            "settings": {"models": list(models), "policies": list(policies), "seeds": seeds, "first_seed": first_seed,
                         "workers": 4, "per_class": 80, "samples_budget": 48000},
            "models": {m: {"lr": 0.02} for m in models}, "data": {"classes": ["x"]}, "cells": cells,
            "references": {m: {str(s): {"samples": 1} for s in range(first_seed, first_seed + seeds)}
                           for m in models},
            "summary": {}, "failure": None, "complete": True, "wall_seconds": 10.0, "same_processes": True}


def test_bench_models_merges_the_runs_of_other_seeds_into_one_report(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--first-seed`` runs other seeds of the matrix; ``--merge`` makes one report of them, each cell's median over
    every seed; runs of other cells or data, or of the same seed twice, do not merge."""
    accuracy = {"0": 0.80, "1": 0.95, "2": 0.89}
    first, second = tmp_path / "s01.json", tmp_path / "s2.json"
    first.write_text(json.dumps(_models_run(0, 2, accuracy)))
    second.write_text(json.dumps(_models_run(2, 1, accuracy)))
    merged = tmp_path / "models.json"
    assert cli.main(["bench", "models", "--merge", str(first), str(second), "--report", str(merged)]) == 0
    data = json.loads(merged.read_text())
    cell = data["cells"]["a"]["sync"]
    assert list(cell["seeds"]) == ["0", "1", "2"] and cell["median"]["exported_accuracy"] == 0.89
    assert cell["median"]["gap_pt"] == -1.0 and data["summary"]["within_2pt"] == ["a/sync"]
    assert data["settings"]["seeds"] == 3 and data["settings"]["first_seed"] == 0 and data["complete"]
    assert [part["seeds"] for part in data["merged_from"]] == [[0, 1], [2]] and data["wall_seconds"] == 20.0
    assert set(data["references"]["a"]) == {"0", "1", "2"}
    # a run whose reference is missing leaves the merge incomplete: written, exit 1
    partial = tmp_path / "partial.json"
    run = _models_run(3, 1, {"3": 0.9})
    run["references"] = {}
    partial.write_text(json.dumps(run))
    assert cli.main(["bench", "models", "--merge", str(first), str(partial), "--report", str(merged)]) == 1
    assert json.loads(merged.read_text())["complete"] is False
    # runs of other cells, or of the same seed twice, do not merge
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_models_run(3, 1, {"3": 0.9}, policies=("sync", "async"))))
    assert cli.main(["bench", "models", "--merge", str(first), str(other), "--report", str(merged)]) == 2
    assert "the runs differ in policies" in capsys.readouterr().err
    clash = tmp_path / "clash.json"
    clash.write_text(json.dumps(_models_run(1, 1, accuracy)))
    assert cli.main(["bench", "models", "--merge", str(first), str(clash), "--report", str(merged)]) == 2
    assert "seed(s) 1 in two of the runs" in capsys.readouterr().err
    assert cli.main(["bench", "models", "--merge", str(first), "--report", str(merged)]) == 2
    assert "two reports or more" in capsys.readouterr().err


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


def test_a_full_bench_models_run_trains_the_matrix_of_its_report_and_group_norm_when_named() -> None:
    """``gn-cnn`` is in the catalogue (``bench ideal`` measures it) but a full ``bench models`` run trains the five
    models of its committed report unless ``--models`` names it."""
    import argparse

    from edgemesh.bench import model_jobs, models

    parser = argparse.ArgumentParser()
    models.register(parser)
    assert models.settings_of(parser.parse_args([])).models == (
        "plain-cnn", "bn-cnn", "mobilenetv2", "resnet8", "entry-point")
    assert "gn-cnn" in model_jobs.catalogue()
    assert models.settings_of(parser.parse_args(["--models", "gn-cnn"])).models == ("gn-cnn",)


def test_bench_models_split_batch_gives_each_device_the_batch_and_rate_over_the_workers(tmp_path: Path) -> None:
    """``--split-batch``: a round of four devices is one batch of the reference at its rate (16 samples at 0.02),
    so the fleet takes the reference's steps; by default each device trains as the reference does."""
    import argparse
    import tomllib

    from edgemesh.bench import model_jobs, models

    parser = argparse.ArgumentParser()
    models.register(parser)
    entry = model_jobs.catalogue()["plain-cnn"]
    assert models.fleet_entry(entry, models.settings_of(parser.parse_args([]))) is entry
    split = models.fleet_entry(entry, models.settings_of(parser.parse_args(["--split-batch", "--workers", "4"])))
    assert (split.batch_size, split.lr) == (4, pytest.approx(0.005)) and split.model == entry.model
    job = tomllib.loads(model_jobs.job_text(split, policy="sync", seed=0, target=0.8, max_minutes=1, max_versions=0,
                                            module_path=tmp_path))
    assert job["training"]["batch_size"] == 4 and job["training"]["lr"] == pytest.approx(0.005)
    odd = models.fleet_entry(entry, models.settings_of(parser.parse_args(["--split-batch", "--workers", "3"])))
    assert (odd.batch_size, odd.lr) == (5, pytest.approx(0.02 * 5 / 16))  # the rate per sample is the reference's


def test_bench_ideal_takes_each_devices_images_through_a_camera_of_its_own_and_bn_own_keeps_batch_norms_change(
        tmp_path: Path) -> None:
    """``-cameras``: device i's images times its camera's gain plus its offset, the pooled set theirs, each held-out
    image through one of the cameras; ``-bn-own``: the running variance moves by batch norm's own change, where the
    other variants move it as a worker reports it (the mixture's)."""
    import torch

    from edgemesh.bench import ideal, model_jobs

    shards, _ = ideal.prepare(tmp_path / "data", 4, 8, 6)
    taken = ideal.through_cameras(shards, seed=0)
    for i, (device, raw) in enumerate(zip(taken.devices, shards.devices, strict=True)):
        gain, offset = ideal.CAMERAS[i]
        np.testing.assert_allclose(device.x, raw.x * gain + offset, rtol=1e-6, atol=1e-6)
        assert np.array_equal(device.y, raw.y)
    assert np.array_equal(taken.pooled.x, np.concatenate([d.x for d in taken.devices]))
    assert np.array_equal(taken.held_out.y, shards.held_out.y)
    cameras = {min(range(4), key=lambda c: float(np.abs(x - (raw * ideal.CAMERAS[c][0] + ideal.CAMERAS[c][1])).max()))
               for x, raw in zip(taken.held_out.x, shards.held_out.x, strict=True)}
    assert len(cameras) > 1  # the held-out images come through several cameras

    entry = model_jobs.catalogue()["bn-cnn"]
    module = ideal.build(entry, 0, model_jobs.write_entry_point(tmp_path / "models"))
    moved, at = {}, {k: v.detach().clone() for k, v in module.state_dict().items()}
    for variant in ("sync-linear-clip-cameras", "sync-linear-clip-cameras-bn-own"):
        fleet = ideal.Fleet(ideal.VARIANTS[variant], module, taken, lr=0.01, momentum=0.9, batch_size=8, seed=0)
        batches = iter([(taken.devices[1].x[:8], taken.devices[1].y[:8])])
        moved[variant] = fleet.gradient(batches, at)[1]
    names = [name for name in moved["sync-linear-clip-cameras"] if name.endswith("running_var")]
    assert names
    for name in names:
        mean = moved["sync-linear-clip-cameras"][name.replace("var", "mean")]
        extra = moved["sync-linear-clip-cameras"][name] - moved["sync-linear-clip-cameras-bn-own"][name]
        torch.testing.assert_close(extra, 0.9 / 0.1 * mean.double() ** 2)  # momentum 0.1: (1 - m) / m mean^2


def test_bench_ideal_clips_as_the_parameter_server_does_and_deals_iid_shards_of_the_same_sizes(
        tmp_path: Path) -> None:
    """``-clip``: each device's gradient cut to ``ps.clip_factor`` times the median norm, by the server's own
    aggregator; ``-iid``: the pooled images dealt out at random, each device as many as its folder holds."""
    import torch

    from edgemesh.bench import ideal, model_jobs

    shards, _ = ideal.prepare(tmp_path / "data", 4, 8, 6)
    dealt = ideal.dealt(shards, seed=0)
    assert [len(d.y) for d in dealt] == [len(d.y) for d in shards.devices]
    together = np.concatenate([d.x for d in dealt])
    assert sorted(map(bytes, together)) == sorted(map(bytes, shards.pooled.x))  # every image once
    assert [np.bincount(d.y, minlength=5).tolist() for d in dealt] != \
        [np.bincount(d.y, minlength=5).tolist() for d in shards.devices]

    entry = model_jobs.catalogue()["plain-cnn"]
    module = ideal.build(entry, 0, model_jobs.write_entry_point(tmp_path / "models"))
    fleet = ideal.Fleet(ideal.VARIANTS["sync-linear-clip"], module, shards, lr=0.01, momentum=0.9, batch_size=4,
                        seed=0)
    parts = [([torch.full((3,), scale)], {}, 4) for scale in (1.0, 1.0, 1.0, 100.0)]
    cut = [float(torch.linalg.vector_norm(grads[0])) for grads, _, _ in fleet.clipped(parts)]
    median = float(np.median([3 ** 0.5] * 3 + [100 * 3 ** 0.5]))
    assert cut[:3] == pytest.approx([3 ** 0.5] * 3) and cut[3] == pytest.approx(3.0 * median)
    unclipped = ideal.Fleet(ideal.VARIANTS["sync-linear"], module, shards, lr=0.01, momentum=0.9, batch_size=4,
                            seed=0)
    assert unclipped.clipped(parts) is parts


def test_bench_ideal_grid_devices_compute_on_the_model_the_broadcast_leaves_them(tmp_path: Path) -> None:
    """``-grid``: the first version reaches the devices whole; the next ones as the server's own broadcaster
    encodes them (a lossy delta: close to the model, not equal), and a snapshot every ``ps.snapshot_every``."""
    import torch

    from edgemesh.bench import ideal, model_jobs

    shards, _ = ideal.prepare(tmp_path / "data", 4, 8, 6)
    entry = model_jobs.catalogue()["plain-cnn"]
    module = ideal.build(entry, 0, model_jobs.write_entry_point(tmp_path / "models"))
    fleet = ideal.Fleet(ideal.VARIANTS["sync-linear-clip-grid"], module, shards, lr=entry.lr, momentum=0.9,
                        batch_size=4, seed=0)
    first = fleet.state()
    assert all(torch.equal(a, b) for a, b in zip(fleet.held(first).values(), first.values(), strict=True))
    fleet.in_sync()
    now = fleet.state()
    held = fleet.held(now)
    gaps = {k: float(torch.linalg.vector_norm(held[k] - now[k]) / torch.linalg.vector_norm(now[k] - first[k]))
            for k in now if not torch.equal(now[k], first[k])}
    assert gaps and max(gaps.values()) < 1.0  # most of each change went out
    assert any(gap > 0 for gap in gaps.values())  # and not all of it: the devices hold an approximation

    bn = ideal.Fleet(ideal.VARIANTS["sync-linear-clip-grid"], ideal.build(model_jobs.catalogue()["bn-cnn"], 0,
                     tmp_path / "models"), shards, lr=0.05, momentum=0.9, batch_size=4, seed=0)
    for _ in range(3):  # batch norm's scalar count goes out and comes back as the scalar it is
        bn.in_sync()
    held = bn.held(bn.state())
    counts = [k for k in held if k.endswith("num_batches_tracked")]
    assert counts and all(held[k].shape == () and int(held[k]) == 3 for k in counts)
