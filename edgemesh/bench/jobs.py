"""``edgemesh bench jobs``: users' jobs on a running fleet, one after another, on the same processes.

A local fleet (the planner, the parameter server, the compressor and ``--workers`` workers, started once
with no job, as systemd runs them) gets two jobs submitted as ``edgemesh job submit`` does:

* ``shapes``: a layer-list CNN on image folders that live on each device (PNG files of circles, squares
  and triangles this benchmark draws; the last device lacks one class), evaluated on a held-out folder on
  the parameter server's host;
* ``vibration``: an entry-point MLP on CSV files of sensor windows on each device, evaluated where the
  data lives (each device's validation share, combined by sample count).

Per job the report gives the time from submission to running, the time it trained (from running to
ended: ``training_s``), that time again as ``time_to_target_s`` if it reached its target accuracy (None
if it ended at ``job.max_versions`` short of it), the model versions, the final accuracy, the gradient
bytes the PS received, the bytes the services published for it, and how far its final model exported to
ONNX is from torch (the largest logit difference); and whether the services were the same processes
throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from edgemesh import cli
from edgemesh.bench.job_fleet import Watch, local_broker, pids, spawn_fleet, submit_and_follow
from edgemesh.bench.reporting import finish, pyplot, save
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config, load_config
from edgemesh.common.messages import JobState
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import all_job_states_filter
from edgemesh.local.processes import LocalCluster

SHAPES = ("circle", "square", "triangle")
STATES = ("idle", "normal", "worn")
FEATURES = 8
JOB_TIMEOUT_S = 300.0
"""Longest a job may run before the benchmark gives up on it."""

SHAPES_JOB = """
[job]
name = "shapes"
target_accuracy = {target}
max_versions = 3000

[model]
input_shape = [3, 24, 24]
classes = ["circle", "square", "triangle"]
layers = [{{conv2d = 8, kernel = 3, padding = 1}}, "relu", {{maxpool2d = 2}},
          {{conv2d = 16, kernel = 3, padding = 1}}, "relu", {{maxpool2d = 2}},
          "flatten", {{linear = 32}}, "relu", {{linear = 3}}]

[data]
format = "image-folder"
path = "shapes"
mean = [0.5]
std = [0.3]

[evaluation]
path = "shapes-eval"
every = 5

[training]
sync_policy = "async"
lr = 0.02
batch_size = 16
"""

VIBRATION_JOB = """
[job]
name = "vibration"
target_accuracy = {target}
max_versions = 3000

[model]
input_shape = [8]
classes = ["idle", "normal", "worn"]
entry_point = "vibration_net:build"
module_path = "{module_path}"

[data]
format = "csv"
path = "vibration.csv"
label_column = "state"

[evaluation]
local_share = 0.25
every = 5

[training]
sync_policy = "async"
lr = 0.05
batch_size = 16
"""

VIBRATION_NET = '''"""A small MLP for windows of sensor features (the vibration job's entry point)."""

from torch import nn


def build(input_shape, num_classes):
    return nn.Sequential(nn.Linear(input_shape[0], 32), nn.ReLU(), nn.Linear(32, num_classes))
'''


# --------------------------------------------------------------------------- data on the devices


def draw_shapes(root: Path, classes: tuple[str, ...] | list[str], count: int, *, seed: int, size: int = 24) -> None:
    """``count`` PNG images per class under ``root/<class>/``: a circle, square or triangle of random colour,
    size and place on a noisy background (what a device's camera might have saved)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    for name in classes:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image = Image.fromarray(rng.integers(0, 70, (size, size, 3), dtype=np.uint8))
            draw = ImageDraw.Draw(image)
            r = int(rng.integers(size // 5, size // 3))
            cx, cy = (int(v) for v in rng.integers(r + 1, size - r - 1, 2))
            colour = tuple(int(v) for v in rng.integers(120, 256, 3))
            if name == "circle":
                draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
            elif name == "square":
                draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
            else:
                draw.polygon(((cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)), fill=colour)
            image.save(folder / f"{name}-{i}.png")


def write_sensor_csv(path: Path, rows: int, *, seed: int) -> None:
    """A CSV of ``FEATURES`` feature columns and a ``state`` column: three noisy clusters of sensor windows."""
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(99).normal(0.0, 1.0, (len(STATES), FEATURES))
    lines = [",".join([f"f{i}" for i in range(FEATURES)] + ["state"])]
    for r in range(rows):
        label = r % len(STATES)
        features = centers[label] + rng.normal(0.0, 0.35, FEATURES)
        lines.append(",".join(f"{v:.5f}" for v in features) + f",{STATES[label]}")
    path.write_text("\n".join(lines) + "\n")


# --------------------------------------------------------------------------- the run


def prepare_fleet(workdir: Path, workers: int) -> list[str]:
    """Each device's data under ``workdir/<device>``, the held-out images under ``workdir/ps``; device names."""
    devices = [f"w{i}" for i in range(workers)]
    for i, device in enumerate(devices):
        classes = SHAPES if i < workers - 1 or workers == 1 else SHAPES[:2]
        draw_shapes(workdir / device / "shapes", classes, 40, seed=i)
        write_sensor_csv(workdir / device / "vibration.csv", 240, seed=i)
    draw_shapes(workdir / "ps" / "shapes-eval", SHAPES, 30, seed=100)
    (workdir / "models").mkdir(exist_ok=True)
    (workdir / "models" / "vibration_net.py").write_text(VIBRATION_NET)
    return devices


async def run_jobs(config: Config, workdir: Path, devices: list[str], target: float,
                   progress: Any) -> dict[str, Any]:
    cluster = LocalCluster(config, workdir, serve_jobs=True)
    watch = Watch()
    bus = Bus(config.broker, client_id=f"edgemesh-bench-jobs-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("bench"))
    bus.route(all_job_states_filter(), JobState, watch.keep)
    result: dict[str, Any] = {"jobs": {}, "failure": None}
    try:
        started = spawn_fleet(cluster, workdir, devices)
        async with bus:
            for text in (SHAPES_JOB.format(target=target),
                         VIBRATION_JOB.format(target=target, module_path=workdir / "models")):
                run = await submit_and_follow(config, watch, text, search_path=[str(workdir / "models")],
                                              timeout_s=JOB_TIMEOUT_S, progress=progress)
                await asyncio.to_thread(cluster.scrape_all)
                if run.final is None:
                    result["failure"] = run.failure
                    break
                name = run.spec.name
                result["jobs"][name] = job_figures(watch, name, run.submitted, run.final, cluster)
                result["jobs"][name]["onnx_max_abs_error"] = await onnx_error(config, name, workdir)
                progress(f"  {name}: {run.final.state} ({run.final.reason})")
                failure = cluster.failure()
                if failure is not None:
                    result["failure"] = failure
                    break
        result["same_processes"] = pids(cluster) == started
    finally:
        cluster.stop()
    return result


def job_figures(watch: Watch, name: str, submitted: float, final: JobState, cluster: LocalCluster) -> dict[str, Any]:
    """One job's figures from its states and the processes' metrics."""
    seen = watch.states[name]
    running = next((t for t, s in seen if s.state == "running"), submitted)
    ended = next((t for t, s in seen if s.ended), seen[-1][0])
    reached = final.state == "finished" and final.accuracy is not None and final.accuracy >= final.target_accuracy
    return {
        "state": final.state,
        "reason": final.reason,
        "reached_target": reached,
        "target_accuracy": final.target_accuracy,
        "final_accuracy": final.accuracy,
        "model_version": final.version,
        "seconds_to_running": round(running - submitted, 2),
        "time_to_target_s": round(ended - running, 2) if reached else None,
        "training_s": round(ended - running, 2),
        "gradient_bytes_received": final.bytes_received,
        "bytes_published_by_services": cluster.over_services("_published_bytes_total"),
        "devices": list(final.devices),
        "device_errors": final.device_errors,
        "curve": [(round(t - running, 2), s.version, s.accuracy) for t, s in seen
                  if s.active and s.accuracy is not None],
    }


async def onnx_error(config: Config, name: str, workdir: Path) -> float | None:
    """The job's final model exported to ONNX as ``edgemesh job export --trust-code`` does (the entry point is the
    benchmark's own): the largest difference between onnxruntime's logits and torch's on random inputs (None without
    the ``export`` extra)."""
    from edgemesh.common import models
    from edgemesh.common.errors import ExportError
    from edgemesh.operator.export import check_onnx, export_model, trusted_model_spec
    from edgemesh.operator.job import fetch_model

    spec, snapshot, _ = await fetch_model(config, name, timeout_s=10.0)
    trusted_model_spec(spec, trust_code=True, search_path=[str(workdir / "models")], where=f"job {name!r}",
                       otherwise="")
    module = models.build_model(spec.model_key)
    models.set_params(module, {k: t.to_numpy() for k, t in snapshot.tensors.items()})
    try:
        path = export_model(module, spec.model.input_shape, "onnx", workdir / f"{name}.onnx")
        return check_onnx(module, spec.model.input_shape, path)
    except ExportError:
        return None


def plot(result: dict[str, Any], png: Path) -> bool:
    plt = pyplot()
    if plt is None or not result["jobs"]:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, job in result["jobs"].items():
        curve = job["curve"]
        if curve:
            ax.plot([c[0] for c in curve], [c[2] for c in curve], marker=".", label=name)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("accuracy")
    ax.set_title(f"jobs on one running fleet of {result['workers']} workers")
    ax.legend()
    return save(fig, png)


def run(report: Path, config: Config, *, workers: int, target: float, external_broker: bool, keep_logs: bool,
        progress: Any) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-jobs-"))
    started = time.monotonic()
    with local_broker(config, external=external_broker) as (config, broker):
        devices = prepare_fleet(workdir, workers)
        result = asyncio.run(run_jobs(replace(config, job="bench-jobs"), workdir, devices, target, progress))
    result.update(workers=workers, broker=broker, wall_seconds=round(time.monotonic() - started, 1))
    finish(report, result, plot, progress, workdir, keep_logs=keep_logs or bool(result["failure"]))
    return 0 if not result["failure"] and all(j["reached_target"] for j in result["jobs"].values()) else 1


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench jobs``."""
    parser.add_argument("--report", default="bench/reports/jobs.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--workers", type=int, default=3, help="worker processes (devices)")
    parser.add_argument("--target", type=float, default=0.9, help="target accuracy of both jobs")
    parser.add_argument("--broker", help="an external broker URL (default: a Mosquitto or embedded broker of its own)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    overrides = {"broker.url": args.broker} if args.broker else {}
    config = load_config(env={}, overrides=overrides)
    return run(Path(args.report), config, workers=args.workers, target=args.target,
               external_broker=args.broker is not None, keep_logs=args.keep_logs,
               progress=lambda line: print(line, file=sys.stderr, flush=True))
