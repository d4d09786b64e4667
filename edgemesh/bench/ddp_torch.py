"""``edgemesh bench ddp``'s other side: torch DistributedDataParallel on the same job (``DdpJob``), its ranks as
spawned processes (``ddp_rank``), run and timed (``run_ddp``, ``ddp_once``). The EdgeMesh side and the
comparison are in ``ddp``."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from edgemesh.bench.runs import GUARD_INTERVAL_S
from edgemesh.common import models
from edgemesh.common.config import Config
from edgemesh.common.data import BatchIterator, load_dataset, shard
from edgemesh.local.broker import free_port

WORKERS = 2
"""Worker processes on each side (EdgeMesh workers, DDP ranks)."""
GLOO_HOST = "127.0.0.1"
GLOO_INTERFACE = "lo"
"""The interface gloo binds to (its default follows the host name, which may not resolve)."""
START_TIMEOUT_S = 180.0
"""Longest wait for the plan to name every worker (EdgeMesh), for the ranks to start (DDP)."""
SECONDS_PER_STEP_LIMIT = 10.0
"""A side that takes longer than this per step (after ``START_TIMEOUT_S``) is called failed."""
DDP_INIT_TIMEOUT_S = 120.0
"""Longest a DDP rank waits for the other (gloo's rendezvous and collectives)."""
FIGURES_DIGITS = 4


def mean_per_version(times: dict[int, float], first: int, last: int) -> tuple[float | None, float | None, int]:
    """(mean, median) seconds per step from step ``first`` to ``last`` (the steps observed nearest inside), and
    the number of steps timed."""
    seen = sorted(v for v in times if first <= v <= last)
    if len(seen) < 2:
        return None, None, 0
    lo, hi = seen[0], seen[-1]
    gaps = [(times[b] - times[a]) / (b - a) for a, b in zip(seen, seen[1:], strict=False)]
    return (round((times[hi] - times[lo]) / (hi - lo), FIGURES_DIGITS), round(statistics.median(gaps), FIGURES_DIGITS),
            hi - lo)



@dataclass(frozen=True, slots=True)
class DdpJob:
    """What every DDP rank trains (picklable: it crosses to the spawned processes)."""

    port: int
    steps: int
    """Steps trained: at least the timed ones, and up to the last version evaluated."""
    warmup: int
    timed_until: int
    """The last timed step (``--steps``)."""
    evaluate_at: tuple[int, ...]
    """Steps after which rank 0 keeps its model for the held-out curve (evaluated after training)."""
    model_spec: str
    dataset: str
    dataset_path: str
    seed: int
    partition: str
    partition_alpha: float
    batch: int
    lr: float
    momentum: float
    weight_decay: float
    threads: int
    out_dir: str
    comm: str = "fp32"
    """``fp16``: the all-reduce in float16 (torch's ``fp16_compress_hook``)."""

    @classmethod
    def of(cls, cfg: Config, *, port: int, steps: int, warmup: int, timed_until: int, evaluate_at: Iterable[int],
           out_dir: Path, comm: str = "fp32") -> DdpJob:
        t = cfg.training
        return cls(port=port, steps=steps, warmup=warmup, timed_until=timed_until,
                   evaluate_at=tuple(sorted(set(evaluate_at))), model_spec=t.model_spec, dataset=t.dataset,
                   dataset_path=t.dataset_path, seed=t.seed, partition=t.partition, partition_alpha=t.partition_alpha,
                   batch=t.batch_size, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay,
                   threads=cfg.worker.threads, out_dir=str(out_dir), comm=comm)


def ddp_rank(rank: int, job: DdpJob) -> None:
    """One DDP rank: its shard as the worker of that shard index draws it, ``job.steps`` SGD steps; its step
    times, CPU seconds and (rank 0) the held-out loss of the kept models go to ``{out_dir}/rank{rank}.json``."""
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(job.threads)  # as a worker does, before any torch work
    os.environ.setdefault("GLOO_SOCKET_IFNAME", GLOO_INTERFACE)
    dist.init_process_group("gloo", init_method=f"tcp://{GLOO_HOST}:{job.port}", rank=rank, world_size=WORKERS,
                            timeout=timedelta(seconds=DDP_INIT_TIMEOUT_S))
    try:
        model = models.build_model(job.model_spec, seed=job.seed)
        ddp = DistributedDataParallel(model)
        if job.comm == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=job.lr, momentum=job.momentum,
                                    weight_decay=job.weight_decay)
        train, test = load_dataset(job.dataset, job.dataset_path or None, seed=job.seed)
        batches = BatchIterator(shard(train, rank, WORKERS, scheme=job.partition, alpha=job.partition_alpha,
                                      seed=job.seed), job.batch, seed=job.seed + rank)
        keep = set(job.evaluate_at) if rank == 0 else set()
        kept: dict[int, dict[str, Any]] = {}
        stamps: list[float] = []
        cpu: dict[int, float] = {}
        dist.barrier()
        stamps.append(time.perf_counter())
        for step in range(1, job.steps + 1):
            x, y = next(batches)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(torch.tensor(x, dtype=torch.float32)), torch.tensor(y, dtype=torch.int64))
            loss.backward()
            optimizer.step()
            stamps.append(time.perf_counter())
            if step in (job.warmup, job.timed_until):
                cpu[step] = time.process_time()
            if step in keep:
                kept[step] = models.get_params(model)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    curve = []
    for step, params in sorted(kept.items()):
        models.set_params(model, params)
        curve.append([step, *models.evaluate(model, test)])
    Path(job.out_dir, f"rank{rank}.json").write_text(json.dumps({
        "stamps": stamps, "cpu_s": (cpu[job.timed_until] - cpu[job.warmup]) / (job.timed_until - job.warmup),
        "curve": curve}))


def run_ddp(job: DdpJob, progress: Callable[[str], None]) -> dict[str, Any]:
    """Spawn the ranks, wait for them (at most ``START_TIMEOUT_S`` plus ``SECONDS_PER_STEP_LIMIT`` per step),
    read what they wrote."""
    import torch.multiprocessing as mp

    failure = exited = None
    context = mp.start_processes(ddp_rank, args=(job,), nprocs=WORKERS, join=False, start_method="spawn")
    limit_s = START_TIMEOUT_S + job.steps * SECONDS_PER_STEP_LIMIT
    deadline = time.monotonic() + limit_s
    try:
        while not context.join(timeout=GUARD_INTERVAL_S):
            if time.monotonic() > deadline:
                failure = f"DDP not done within {limit_s:.0f}s"
                break
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        failure = f"a DDP rank failed: {str(exc).strip().splitlines()[-1]}"
        if isinstance(exc, mp.ProcessExitedException) and _written(job):
            # gloo's threads sometimes abort a rank as it exits ("terminate called without an active
            # exception"), after it wrote what it measured: the training is whole, the exit is noted
            exited, failure = failure, None
            progress(f"ddp: {exited}, after every rank wrote its figures; they are kept")
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join()
    if failure is not None:
        progress(f"ddp: FAILED: {failure}")
        return {"failure": failure}
    ranks = [json.loads(Path(job.out_dir, f"rank{r}.json").read_text()) for r in range(WORKERS)]
    times = dict(enumerate(ranks[0]["stamps"]))
    mean, median, timed = mean_per_version(times, job.warmup, job.timed_until)
    curve = ranks[0]["curve"]
    final = curve[-1] if curve else None
    return {
        "seconds_per_step": mean, "median_seconds_per_step": median, "steps_timed": timed, "steps_trained": job.steps,
        "final_step": final[0] if final else None,
        "final_loss": round(final[1], FIGURES_DIGITS) if final else None,
        "final_accuracy": round(final[2], FIGURES_DIGITS) if final else None,
        "cpu_s_per_step": {f"rank{r}": round(entry["cpu_s"], FIGURES_DIGITS) for r, entry in enumerate(ranks)},
        "cpu_s_per_step_total": round(sum(entry["cpu_s"] for entry in ranks), FIGURES_DIGITS),
        "backend": "gloo", "curve": [[s, round(loss, FIGURES_DIGITS), round(acc, FIGURES_DIGITS)]
                                     for s, loss, acc in curve],
        "failure": None, "rank_exit": exited,
    }


def _written(job: DdpJob) -> bool:
    """Every rank's figures are in its file, whole."""
    try:
        return all(isinstance(json.loads(Path(job.out_dir, f"rank{r}.json").read_text()), dict)
                   for r in range(WORKERS))
    except (OSError, ValueError):
        return False


def ddp_once(job: DdpJob, out_dir: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """One DDP training of ``job`` (on a free port, its ranks' files in ``out_dir``)."""
    out_dir.mkdir(parents=True)
    job = dataclasses.replace(job, port=free_port(GLOO_HOST), out_dir=str(out_dir))
    progress(f"ddp: {WORKERS} ranks, gloo on {GLOO_HOST}:{job.port}, {job.steps} steps, {job.threads} torch "
             "thread(s) each")
    ddp = run_ddp(job, progress)
    progress(f"ddp: {ddp.get('seconds_per_step')} s per step, held-out loss {ddp.get('final_loss')} at step "
             f"{ddp.get('final_step')}")
    return ddp
