"""``edgemesh bench models``: does the fleet train my model as well as one plain PyTorch process would?

A local fleet (the planner, the parameter server, the compressor and ``--workers`` workers, started once with no
job, as systemd runs them) gets one job per cell of a matrix of models (:mod:`edgemesh.bench.model_jobs`: a
plain CNN, a batch-norm CNN, the MobileNetV2-style and ResNet-8 examples, an entry-point module) x sync policies x
seeds, submitted as ``edgemesh job submit`` does, one after another on the same processes. Each device holds an
image folder of drawn glyphs (:mod:`edgemesh.bench.glyphs`: five classes, a different mix per device, the last
lacking one class); the held-out folder sits on the parameter server's host. Every job trains on the same budget of
samples (``--samples``): the benchmark stops it (``edgemesh job stop``, as an operator would) once the updates the
PS accepted carry that many, so that no cell ends where its own curve happened to first touch the target (with no
budget, a job stops at ``--target``); ``--max-minutes`` and ``--max-versions`` cap it.

Per cell and seed the report gives the job's reported accuracy (``JobState.accuracy``, of the model kept on
``job/model``), the held-out accuracy of that model exported with ``edgemesh job export --format onnx`` and run
in onnxruntime (as a user would), the time to the target (the job's first evaluation at or above ``--target``), the
versions, the samples the fleet trained on, the gradient bytes the PS received and the bytes the services published.

**Samples seen.** The PS's ledger records no sample counts, so the benchmark counts them on the bus: every
``accepted`` ack of the job, times the batch its device had in the job's latest plan (a device's last batch of an
epoch may be smaller: an over-count of at most one short batch per device per epoch). The PS's own count of
accepted updates (``edgemesh_ps_updates_total``) is reported beside the acks counted, as a check.

**The reference** (:mod:`edgemesh.bench.reference`): per model and seed, one process trains the job's own model
(same spec, same initial weights, same normalization) with ``torch.optim.SGD`` (the job's learning rate, momentum
0.9, batch size) on the pooled training images of every device, for as many samples as the most any policy's cell
of that model and seed saw, and is evaluated on the held-out folder, in eval mode, exactly when its samples reach
those of each of the cell's evaluations (the samples of the updates up to the version evaluated) and the cell's
samples seen (and every ``1/REFERENCE_EVALUATIONS`` of the run).

**The gap.** A job exports the best model its evaluations saw (docs/jobs.md), so the reference is given the same
choice: its best accuracy at the samples of the cell's own evaluations (``reference_best_accuracy``), as many picks
at the same points. ``gap_pt`` is the exported accuracy minus that, in points. ``gap_last_pt`` compares the ends
instead: the job's last evaluation against the reference after the cell's samples seen (``reference_accuracy``).

The report (and its PNG, a heat map of the median gap per cell) is written after every cell and reference, so a
run cut short keeps what it measured (``complete`` says whether it ran to the end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from edgemesh import cli
from edgemesh.bench import model_jobs, models_report, reference
from edgemesh.bench.glyphs import GLYPHS, device_mixes, draw_glyphs
from edgemesh.bench.job_fleet import (
    Submitted,
    Watch,
    host_total,
    job_total,
    local_broker,
    pids,
    spawn_fleet,
    submit_and_follow,
)
from edgemesh.bench.reporting import finish, write_report
from edgemesh.bench.runs import names
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config, load_config
from edgemesh.common.data import Dataset, load_local
from edgemesh.common.errors import EdgeMeshError
from edgemesh.common.messages import ControlCommand, JobState, Plan, UpdateAck
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import PREFIX, Filter, TopicMatch, Topics, all_job_states_filter
from edgemesh.common.vocabulary import ROUND_POLICIES
from edgemesh.local.processes import LocalCluster
from edgemesh.operator.job import COMMAND_TTL_S

POLICIES = ("sync", "async", "adaptive")
EXPORT_TIMEOUT_S = 180.0
"""Longest ``edgemesh job export`` may take."""
JOB_MARGIN_S = 180.0
"""How long past its ``max_minutes`` a job may take to end before its cell is given up."""
UNCAPPED_JOB_S = 3600.0
"""How long a job capped by versions alone may take to end."""
REFERENCE_EVALUATIONS = 20
"""Evaluations of a reference run besides those at the cells' sample counts, evenly spaced."""
BUDGET_SOURCE = ("the bench stops a job (edgemesh job stop) once its accepted updates carry --samples samples; the "
                 "updates in flight then still land, so a cell may see a few batches more")
SAMPLES_SOURCE = ("accepted acks of the job counted on the bus, each times its device's batch in the job's latest "
                  "plan (the PS's ledger records no samples)")
REFERENCE_MATCH = ("per model and seed, one run trained to the most samples any policy's cell saw, evaluated exactly "
                   "at the samples of each cell's evaluations and at each cell's samples seen")
ROUND_REFERENCE = ("round_batch_reference_best_accuracy (sync and adaptive cells): one process at the round's batch "
                   "(workers x the job's batch) and the linearly scaled rate (workers x the job's lr), best at the "
                   "cell's evaluations, as reference_best_accuracy; gap_round_batch_pt: exported - that")
GAP = ("gap_pt: exported accuracy (the best model the job's evaluations saw) - the reference's best at the samples of "
       "the cell's evaluations; gap_last_pt: the job's last evaluation - the reference at the cell's samples seen; "
       "points")


@dataclass(frozen=True, slots=True)
class Settings:
    """What a run trains, on what, until when."""

    models: tuple[str, ...]
    policies: tuple[str, ...]
    seeds: int
    workers: int
    per_class: int
    """Images of a device's two main classes (its others get half)."""
    held_out_per_class: int
    target: float
    max_minutes: float
    max_versions: int
    samples: int = 0
    """The budget: a job is stopped once its accepted updates carry this many samples (0: at ``target``)."""
    quick: bool = False
    first_seed: int = 0
    """The run trains seeds ``first_seed`` to ``first_seed + seeds - 1`` (another run's seeds: ``--merge``)."""
    split_batch: bool = False
    """Each device trains on the model's batch over ``workers`` at its rate over ``workers`` (``fleet_entry``): a
    round of the fleet is then one batch of the reference, and takes the reference's step."""

    @property
    def seed_range(self) -> range:
        return range(self.first_seed, self.first_seed + self.seeds)

    @property
    def job_timeout_s(self) -> float:
        return self.max_minutes * 60 + JOB_MARGIN_S if self.max_minutes else UNCAPPED_JOB_S


def fleet_entry(entry: model_jobs.BenchModel, settings: Settings) -> model_jobs.BenchModel:
    """The model as the fleet's jobs train it: as the reference does, or with ``--split-batch`` each device's batch
    and rate the reference's over the workers (the linear scaling rule keeps the rate per sample)."""
    if not settings.split_batch:
        return entry
    batch = max(1, entry.batch_size // settings.workers)
    return replace(entry, batch_size=batch, lr=entry.lr * batch / entry.batch_size)


FULL = {"models": "plain-cnn,bn-cnn,mobilenetv2,resnet8,entry-point", "policies": ",".join(POLICIES), "seeds": 3,
        "workers": 4, "per_class": 80, "held_out_per_class": 60, "max_minutes": 10.0, "samples": 48000}
"""The defaults of a full run (every model but ``gn-cnn``, which ``bench ideal`` measures on devices whose cameras
differ: ``--models gn-cnn`` runs it here). 48,000 samples: where one process has long reached
its plateau on these glyphs (0.8 after 3,600-6,300), so that ``gap_pt`` asks whether the fleet trains the model as
well as one process; how fast it gets there per sample is ``samples_to_target``'s. At 12,000 the gap measured the
early curve (the one process still climbing), which data parallel on non-IID devices climbs more slowly."""
QUICK = {"models": "plain-cnn", "policies": "async", "seeds": 1, "workers": 3, "per_class": 24,
         "held_out_per_class": 16, "max_minutes": 1.0, "samples": 3200}
"""``--quick``: one small model, one policy, one seed, tiny data; 3,200 samples (at 1,600 plain-cnn under async ended
at 0.34-0.39 on 5 classes, once at chance: too thin a margin for its test)."""


# --------------------------------------------------------------------------- what the bus says


@dataclass(slots=True)
class Tally:
    """Every accepted update of every job seen on the bus, with the batch its device had in the job's latest plan."""

    batches: dict[str, dict[str, int]] = field(default_factory=dict)
    """Job -> device -> batch size in the job's latest plan."""
    accepted: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Job -> (version after the update, samples) of each accepted update."""
    budget: int = 0
    """Samples after which a job has had its budget (0: none)."""
    default_batch: int = 0
    """The batch counted for a device not yet in a plan seen."""
    spent: dict[str, asyncio.Event] = field(default_factory=dict)
    """Job -> set once its accepted updates carry ``budget`` samples."""

    def routes(self) -> list[tuple[Filter, type, Any]]:
        return [(Filter(f"{PREFIX}/+/plan", "plan"), Plan, self.on_plan),
                (Filter(f"{PREFIX}/+/ack/+", "ack"), UpdateAck, self.on_ack)]

    async def on_plan(self, plan: Plan, where: TopicMatch) -> None:
        self.batches[where.job] = {d.device: d.batch_size for d in plan.devices}

    async def on_ack(self, ack: UpdateAck, where: TopicMatch) -> None:
        if ack.status == "accepted":
            batch = self.batches.get(where.job, {}).get(ack.device, 0)
            self.accepted.setdefault(where.job, []).append((ack.version, batch))
            if self.budget and self.samples(where.job, default_batch=self.default_batch) >= self.budget:
                self.spent_event(where.job).set()

    def spent_event(self, job: str) -> asyncio.Event:
        return self.spent.setdefault(job, asyncio.Event())

    def samples(self, job: str, *, upto: int | None = None, default_batch: int) -> int:
        """Samples of the job's accepted updates (up to version ``upto``), a device not yet in a plan seen counted
        with ``default_batch``."""
        return sum(batch or default_batch for version, batch in self.accepted.get(job, [])
                   if upto is None or version <= upto)


def evaluations(watch: Watch, job: str) -> list[tuple[float, int, float]]:
    """Every evaluation the job's states carried, once each: (time, version, accuracy), in time order."""
    seen: dict[int, tuple[float, int, float]] = {}
    for _, state in watch.states.get(job, []):
        for e in state.evaluations:
            seen[e.version] = (e.time, e.version, e.accuracy)
    return sorted(seen.values())


# --------------------------------------------------------------------------- the data


def prepare_data(workdir: Path, settings: Settings) -> tuple[list[str], dict[str, Any]]:
    """Each device's glyph folder under ``workdir/<device>``, the held-out one under ``workdir/ps``; the device
    names and what each folder holds."""
    devices = [f"w{i}" for i in range(settings.workers)]
    mixes = device_mixes(devices, settings.per_class)
    for i, device in enumerate(devices):
        draw_glyphs(workdir / device / model_jobs.DATA_PATH, mixes[device], seed=i)
    held_out = {name: settings.held_out_per_class for name in GLYPHS}
    draw_glyphs(workdir / "ps" / model_jobs.EVAL_PATH, held_out, seed=1000)
    return devices, {"classes": list(GLYPHS), "image_size": [3, 32, 32], "devices": mixes, "held_out": held_out}


def load_folder(path: Path) -> Dataset:
    return load_local("image-folder", path, input_shape=(3, 32, 32), classes=GLYPHS).train


def pooled(workdir: Path, devices: list[str]) -> Dataset:
    """Every device's training images in one set (the reference's)."""
    parts = [load_folder(workdir / d / model_jobs.DATA_PATH) for d in devices]
    return Dataset("pooled", np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]), len(GLYPHS))


# --------------------------------------------------------------------------- one cell


@dataclass(slots=True)
class Fleet:
    """The running fleet and what the benchmark watches of it."""

    config: Config
    cluster: LocalCluster
    workdir: Path
    watch: Watch
    tally: Tally
    module_path: Path
    held_out: Dataset
    progress: Callable[[str], None]
    bus: Bus


async def run_cell(fleet: Fleet, entry: model_jobs.BenchModel, policy: str, seed: int,
                   settings: Settings) -> dict[str, Any]:
    """Submit one cell's job, follow it to its end, export its model and score it; the cell's figures."""
    entry = fleet_entry(entry, settings)
    text = model_jobs.job_text(entry, policy=policy, seed=seed, target=0.0 if settings.samples else settings.target,
                               max_minutes=settings.max_minutes, max_versions=settings.max_versions,
                               module_path=fleet.module_path)
    cluster = fleet.cluster
    await asyncio.to_thread(cluster.scrape_all)
    host_published = host_total(cluster, "_published_bytes_total")
    fleet.tally.default_batch = entry.batch_size
    stopper = asyncio.create_task(stop_when_spent(fleet, model_jobs.job_name(entry.name, policy, seed)))
    try:
        run = await submit_and_follow(fleet.config, fleet.watch, text, search_path=[str(fleet.module_path)],
                                      timeout_s=settings.job_timeout_s, progress=fleet.progress)
    finally:
        stopper.cancel()
    await asyncio.to_thread(cluster.scrape_all)
    cell = figures(fleet, run, entry, settings)
    since = run.submitted_at or time.time()
    cell["ps_accepted_updates"] = int(job_total(cluster, "updates_total", since, "ps", status="accepted"))
    cell["bytes_published_by_services"] = int(job_total(cluster, "published_bytes_total", since)
                                              + host_total(cluster, "_published_bytes_total") - host_published)
    if run.final is not None and run.final.state != "failed":
        cell.update(await exported(fleet, run.spec.name))
    if cell["failure"] is None and cell.get("export_error"):
        cell["failure"] = f"export: {cell['export_error']}"
    fleet.progress(f"  {run.spec.name}: {cell['state']} ({cell['reason']}); reported {cell['reported_accuracy']}, "
                   f"exported {cell.get('exported_accuracy')}, {cell['samples_seen']} samples")
    return cell


async def stop_when_spent(fleet: Fleet, job: str) -> None:
    """Stop ``job`` as ``edgemesh job stop`` would (the same command on the job's control topic, from the bench's
    own connection, already up: a new one would let more updates land) once its accepted updates carry the run's
    budget of samples."""
    if not fleet.tally.budget:
        return
    await fleet.tally.spent_event(job).wait()
    await fleet.bus.publish(Topics(job).control("job"), ControlCommand(
        command="stop", request_id=uuid.uuid4().hex, requester=f"bench-{uuid.uuid4().hex[:8]}",
        expires_at=time.time() + COMMAND_TTL_S))


def figures(fleet: Fleet, run: Submitted, entry: model_jobs.BenchModel, settings: Settings) -> dict[str, Any]:
    """A cell's figures from its job's states and the acks counted."""
    final, name = run.final, run.spec.name
    cell: dict[str, Any] = {"job": name, "params": run.params, "failure": run.failure, "state": None, "reason": None,
                            "reported_accuracy": None, "model_version": None, "versions": None,
                            "time_to_target_s": None, "reached_target": False, "training_s": None}
    samples = fleet.tally.samples(name, default_batch=entry.batch_size)
    cell.update(samples_seen=samples, accepted_updates=len(fleet.tally.accepted.get(name, [])))
    if final is None:
        return cell
    if final.state == "failed":
        cell["failure"] = f"the job failed: {final.reason}"
    evaluated = evaluations(fleet.watch, name)
    reached = next(((t, v) for t, v, accuracy in evaluated if accuracy >= settings.target), None)
    cell.update(
        state=final.state, reason=final.reason, reported_accuracy=final.accuracy, model_version=final.model_version,
        versions=final.version, reached_target=reached is not None,
        time_to_target_s=round(reached[0] - final.started_at, 2) if reached is not None else None,
        samples_to_target=(fleet.tally.samples(name, upto=reached[1], default_batch=entry.batch_size)
                           if reached is not None else None),
        samples_to_kept_model=fleet.tally.samples(name, upto=final.model_version, default_batch=entry.batch_size),
        training_s=round(final.ended_at - final.started_at, 2) if final.ended_at and final.started_at else None,
        gradient_bytes_received=final.bytes_received, devices=list(final.devices), device_errors=final.device_errors,
        evaluations=[(round(t - final.started_at, 2), v, round(a, 4)) for t, v, a in evaluated],
        evaluation_samples=[fleet.tally.samples(name, upto=v, default_batch=entry.batch_size) for _, v, _ in evaluated],
        last_evaluated_accuracy=round(evaluated[-1][2], 4) if evaluated else None)
    return cell


async def exported(fleet: Fleet, job: str) -> dict[str, Any]:
    """The job's model exported to ONNX by ``edgemesh job export`` and its accuracy on the held-out folder in
    onnxruntime; or why the export failed."""
    out = fleet.workdir / "export" / f"{job}.onnx"
    command = [sys.executable, "-m", "edgemesh", "job", "export", job, "--format", "onnx", "--out", str(out),
               "--broker", fleet.config.broker.url, "--module-path", str(fleet.module_path), "--trust-code"]
    proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(EXPORT_TIMEOUT_S):
            _, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return {"export_error": f"edgemesh job export did not finish within {EXPORT_TIMEOUT_S:.0f}s"}
    if proc.returncode != 0:
        return {"export_error": err.decode(errors="replace").strip()[-2000:] or f"exit code {proc.returncode}"}
    card = json.loads(out.with_name(out.name + ".card.json").read_text())
    accuracy = await asyncio.to_thread(onnx_accuracy, out, fleet.held_out)
    return {"exported_accuracy": round(accuracy, 4), "exported_version": card.get("version"), "export_error": None}


def onnx_accuracy(model_file: Path, data: Dataset) -> float:
    """Accuracy of an exported ONNX model on ``data``, in onnxruntime."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: data.x.astype(np.float32)})[0]
    return float((logits.argmax(axis=1) == data.y).mean())


# --------------------------------------------------------------------------- the reference


def run_reference(entry: model_jobs.BenchModel, seed: int, cells: dict[str, dict[str, Any]], data: Dataset,
                  held_out: Dataset, module_path: Path, settings: Settings) -> dict[str, Any]:
    """The reference run of one model and seed, matched to the samples each policy's cell (``cells``) saw; sets
    each cell's reference figures and gaps."""
    from edgemesh.common import models
    from edgemesh.common.jobs import model_spec, parse_job

    counts = {policy: cell["samples_seen"] for policy, cell in cells.items() if cell.get("samples_seen")}
    evaluated = {policy: [s for s in cells[policy].get("evaluation_samples", []) if s] for policy in counts}
    if not counts:
        return {"failure": "no cell of this model and seed trained on any sample"}
    spec = parse_job(model_jobs.job_text(entry, policy=settings.policies[0], seed=seed, target=settings.target,
                                         max_minutes=settings.max_minutes, max_versions=settings.max_versions,
                                         module_path=module_path))
    try:
        model_spec(spec, allowed=(model_jobs.ENTRY_POINT_MODULE,), search_path=[str(module_path)])
        module = models.build_model(spec.model_key, seed=seed)
    except EdgeMeshError as exc:
        return {"failure": f"the model does not build: {exc}"}
    spacing = max(entry.batch_size, max(counts.values()) // REFERENCE_EVALUATIONS)
    training = spec.settings.get("training", {})
    curve = reference.train(module, data, held_out, lr=entry.lr, momentum=float(training.get("momentum", 0.9)),
                            weight_decay=float(training.get("weight_decay", 0.0)), batch_size=entry.batch_size,
                            seed=seed,
                            at=reference.checkpoints([*counts.values(), *chain(*evaluated.values())], spacing))
    # a round of ``workers`` batches at ``workers`` times the rate (``ps.round_scaling = linear``) is one large-batch
    # SGD step, ``workers`` times fewer at equal samples than the reference's: the round-batch reference takes it
    rounds = [policy for policy in counts if policy in ROUND_POLICIES]
    fleets = fleet_entry(entry, settings)
    round_curve = reference.train(
        models.build_model(spec.model_key, seed=seed), data, held_out, lr=fleets.lr * settings.workers,
        momentum=float(training.get("momentum", 0.9)), weight_decay=float(training.get("weight_decay", 0.0)),
        batch_size=fleets.batch_size * settings.workers, seed=seed,
        at=reference.checkpoints([*(counts[p] for p in rounds), *chain(*(evaluated[p] for p in rounds))], spacing),
    ) if rounds else None
    for policy, samples in counts.items():
        cell = cells[policy]
        if round_curve is not None and policy in rounds:
            cell["round_batch_reference_best_accuracy"] = round_curve.best_at(evaluated[policy] or [samples])
            cell["gap_round_batch_pt"] = models_report.gap_pt(cell.get("exported_accuracy"),
                                                              cell["round_batch_reference_best_accuracy"])
        cell["reference_accuracy"] = curve.at(samples)
        cell["reference_best_accuracy"] = curve.best_at(evaluated[policy] or [samples])
        cell["reference_samples_to_target"] = curve.reaching(settings.target)
        cell["gap_pt"] = models_report.gap_pt(cell.get("exported_accuracy"), cell["reference_best_accuracy"])
        cell["gap_last_pt"] = models_report.gap_pt(cell.get("last_evaluated_accuracy"), cell["reference_accuracy"])
    return {"samples": max(counts.values()), "seconds": curve.seconds, "failure": None,
            "curve": [(s, round(a, 4)) for s, a in curve.points],
            "round_batch_curve": [(s, round(a, 4)) for s, a in round_curve.points] if round_curve else None}


# --------------------------------------------------------------------------- the run


async def run_matrix(config: Config, workdir: Path, devices: list[str], settings: Settings, result: dict[str, Any],
                     save: Callable[[], None], progress: Callable[[str], None]) -> None:
    """Every cell on one fleet, a reference after each model and seed; ``result`` filled and ``save``d as it goes."""
    catalogue = model_jobs.catalogue()
    module_path = model_jobs.write_entry_point(workdir / "models")
    held_out = load_folder(workdir / "ps" / model_jobs.EVAL_PATH)
    data = pooled(workdir, devices)
    cluster = LocalCluster(config, workdir, serve_jobs=True)
    bus = Bus(config.broker, client_id=f"edgemesh-bench-models-{uuid.uuid4().hex[:8]}",
              metrics=ServiceMetrics("bench"))
    fleet = Fleet(config, cluster, workdir, Watch(), Tally(budget=settings.samples), module_path, held_out, progress,
                  bus)
    bus.route(all_job_states_filter(), JobState, fleet.watch.keep)
    for route in fleet.tally.routes():
        bus.route(*route)
    try:
        started = spawn_fleet(cluster, workdir, devices)
        async with bus:
            for seed in settings.seed_range:
                for name in settings.models:
                    entry = catalogue[name]
                    cells: dict[str, dict[str, Any]] = {}
                    for policy in settings.policies:
                        cells[policy] = await run_cell(fleet, entry, policy, seed, settings)
                        keep(result, name, policy, seed, cells[policy])
                        save()
                        if (failure := cluster.failure()) is not None:
                            result["failure"] = failure
                            return
                    progress(f"  reference of {name}, seed {seed}")
                    ref = await asyncio.to_thread(run_reference, entry, seed, cells, data, held_out, module_path,
                                                  settings)
                    result["references"].setdefault(name, {})[str(seed)] = ref
                    for policy, cell in cells.items():
                        keep(result, name, policy, seed, cell)
                    save()
        result["same_processes"] = pids(cluster) == started
        result["complete"] = True
    finally:
        cluster.stop()


def keep(result: dict[str, Any], model: str, policy: str, seed: int, cell: dict[str, Any]) -> None:
    """``cell`` as the figures of ``seed`` in its model and policy's cell; the cell's median and the summary anew."""
    entry = result["cells"].setdefault(model, {}).setdefault(policy, {"median": {}, "seeds": {}})
    entry["seeds"][str(seed)] = cell
    entry["median"] = models_report.cell_median(entry["seeds"])
    result["summary"] = models_report.summary(result["cells"], len(GLYPHS))


def host() -> dict[str, Any]:
    """What the run ran on."""
    import torch

    from edgemesh.common.emulation.compute import measure_host_gflops

    return {"cores": os.cpu_count(), "gflops_per_thread": round(measure_host_gflops(1), 2),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}


def run(report: Path, config: Config, settings: Settings, *, command: str, overrides: dict[str, str],
        external_broker: bool, keep_logs: bool, progress: Callable[[str], None]) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-models-"))
    started = time.monotonic()
    result: dict[str, Any] = {
        "command": command, "host": host(),
        "settings": {"models": list(settings.models), "policies": list(settings.policies), "seeds": settings.seeds,
                     "first_seed": settings.first_seed,
                     "workers": settings.workers, "per_class": settings.per_class,
                     "held_out_per_class": settings.held_out_per_class, "target_accuracy": settings.target,
                     "max_minutes": settings.max_minutes, "max_versions": settings.max_versions,
                     "quick": settings.quick, "eval_every": model_jobs.EVAL_EVERY, "overrides": overrides,
                     "split_batch": settings.split_batch,
                     "samples_budget": settings.samples, "budget": BUDGET_SOURCE if settings.samples else None,
                     "samples_seen": SAMPLES_SOURCE, "reference": REFERENCE_MATCH,
                     "reference_optimizer": "torch.optim.SGD, the job's lr, momentum 0.9, batch size; pooled data",
                     "gap": GAP, "round_batch_reference": ROUND_REFERENCE},
        "models": {},
        "data": {}, "cells": {}, "references": {}, "summary": {}, "failure": None, "complete": False,
    }

    def save() -> None:
        result["wall_seconds"] = round(time.monotonic() - started, 1)
        write_report(report, result, models_report.plot, lambda _: None)

    catalogue = model_jobs.catalogue()
    result["models"] = {name: {"description": catalogue[name].description, "lr": catalogue[name].lr,
                               "batch_size": catalogue[name].batch_size,
                               "device_lr": fleet_entry(catalogue[name], settings).lr,
                               "device_batch_size": fleet_entry(catalogue[name], settings).batch_size}
                        for name in settings.models}
    with local_broker(config, external=external_broker) as (served, broker):
        result["broker"] = broker
        devices, result["data"] = prepare_data(workdir, settings)
        progress(f"{len(settings.models)} model(s) x {len(settings.policies)} policies x {settings.seeds} seed(s) on "
                 f"{len(devices)} devices; data in {workdir}")
        try:
            asyncio.run(run_matrix(replace(served, job="bench-models"), workdir, devices, settings, result, save,
                                   progress))
        except (EdgeMeshError, OSError) as exc:
            result["failure"] = f"{type(exc).__name__}: {exc}"
            progress(f"FAILED: {result['failure']}")
    result["wall_seconds"] = round(time.monotonic() - started, 1)
    failed = bool(result["failure"]) or bool(result["summary"].get("failed"))
    finish(report, result, models_report.plot, progress, workdir, keep_logs=keep_logs or failed)
    return 1 if failed or not result["complete"] else 0


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench models``."""
    parser.add_argument("--report", default="bench/reports/models.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--quick", action="store_true",
                        help="one small model, one policy, one seed, tiny data (what the tests run)")
    parser.add_argument("--models", help="comma-separated subset of " + ", ".join(model_jobs.catalogue()))
    parser.add_argument("--policies", help=f"comma-separated subset of {', '.join(POLICIES)} (default: all)")
    parser.add_argument("--seeds", type=int, help=f"seeds per cell (default {FULL['seeds']})")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="the first seed (default 0): a run of other seeds, to --merge with another run's report")
    parser.add_argument("--workers", type=int,
                        help=f"worker processes (devices), at least 2 (default {FULL['workers']})")
    parser.add_argument("--per-class", type=int, help="images of a device's two main classes; its others get half "
                                                      f"(default {FULL['per_class']})")
    parser.add_argument("--held-out-per-class", type=int,
                        help=f"held-out images per class (default {FULL['held_out_per_class']})")
    parser.add_argument("--target", type=float, default=0.8,
                        help="target accuracy: the time and samples to it are reported (with --samples 0, a job ends "
                             "when it reaches it)")
    parser.add_argument("--samples", type=int, help="the budget: each job is stopped once its accepted updates carry "
                                                    f"this many samples; 0: none (default {FULL['samples']})")
    parser.add_argument("--max-minutes", type=float,
                        help=f"cap: a job ends after this many minutes of training (default {FULL['max_minutes']})")
    parser.add_argument("--max-versions", type=int, default=0, help="cap: a job ends at this model version (0: none)")
    parser.add_argument("--broker", help="an external broker URL (default: a Mosquitto or embedded broker of its own)")
    parser.add_argument("--split-batch", action="store_true",
                        help="each device trains on the model's batch over the workers, at its rate over the workers "
                             "(a round of the fleet is one batch of the reference); default: each device the whole "
                             "batch, as the reference")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting of the fleet's services")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (failed runs always do)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="REPORT",
                        help="train nothing: one report (--report) of these runs of other seeds (--first-seed) of "
                             "the same matrix, each cell's median over all their seeds")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
    parser.set_defaults(func=main)


def settings_of(args: argparse.Namespace) -> Settings:
    """The run's settings: the flags given, else ``--quick``'s or a full run's defaults; ValueError naming a bad
    one."""
    defaults = QUICK if args.quick else FULL
    catalogue = model_jobs.catalogue()

    def given(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    chosen = names(given("models") or ",".join(catalogue))
    policies = names(given("policies"))
    unknown = [m for m in chosen if m not in catalogue] + [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown model(s) or policy(ies): {', '.join(unknown)}; models: {', '.join(catalogue)}; "
                         f"policies: {', '.join(POLICIES)}")
    settings = Settings(models=tuple(chosen), policies=tuple(policies), seeds=given("seeds"),
                        workers=given("workers"), per_class=given("per_class"),
                        held_out_per_class=given("held_out_per_class"), target=args.target,
                        max_minutes=given("max_minutes"), max_versions=args.max_versions, samples=given("samples"),
                        quick=args.quick, first_seed=args.first_seed, split_batch=args.split_batch)
    if not settings.models or not settings.policies or settings.seeds < 1 or settings.workers < 2:
        raise ValueError("give at least one model, one policy, one seed and two workers")
    if settings.first_seed < 0:
        raise ValueError("--first-seed >= 0")
    if settings.per_class < 2 or settings.held_out_per_class < 1 or not 0 < settings.target <= 1:
        raise ValueError("--per-class >= 2, --held-out-per-class >= 1, --target in (0, 1]")
    if settings.samples < 0:
        raise ValueError("--samples >= 0")
    if settings.max_minutes < 0 or settings.max_versions < 0 or not (settings.max_minutes or settings.max_versions):
        raise ValueError("give a cap: --max-minutes > 0 or --max-versions > 0")
    return settings


def merge_reports(paths: list[Path], report: Path, command: str) -> int:
    """``--merge``: the reports at ``paths`` as one at ``report``; 2 when one cannot be read or they do not merge."""
    try:
        parts = [json.loads(path.read_text()) for path in paths]
        result = models_report.merge(parts, classes=len(GLYPHS), command=command)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"edgemesh bench models: --merge: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    write_report(report, result, models_report.plot, lambda line: print(line, file=sys.stderr, flush=True))
    return 0 if result["complete"] and not result["failure"] else 1


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    if args.merge:
        return merge_reports(args.merge, Path(args.report), " ".join(["edgemesh", *sys.argv[1:]]))
    try:
        settings = settings_of(args)
        overrides = cli.overrides(args)
        config = load_config(env={}, overrides=overrides)
    except (ValueError, EdgeMeshError) as exc:
        print(f"edgemesh bench models: {exc}", file=sys.stderr)
        return 2
    return run(Path(args.report), config, settings, command=" ".join(["edgemesh", *sys.argv[1:]]),
               overrides=overrides, external_broker=args.broker is not None, keep_logs=args.keep_logs,
               progress=lambda line: print(line, file=sys.stderr, flush=True))
