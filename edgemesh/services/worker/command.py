"""``edgemesh worker``: its flags, the device's name, and which worker runs: the job of the configuration, or,
with no job named, one for every submitted job this device has the data for (``host``).

An emulated board's process enters its board's limits (``emulation.limits``) before it loads torch, so the
memory limit counts what training holds; the worker's modules (torch among them) are imported only then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from edgemesh import cli
from edgemesh.common import allocator
from edgemesh.common.config import Config
from edgemesh.common.emulation import limits
from edgemesh.common.emulation.profiles import get_profile
from edgemesh.services.worker import device_name

if TYPE_CHECKING:
    from edgemesh.services.host import ActiveJob
    from edgemesh.services.worker.service import Worker

logger = logging.getLogger(__name__)


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh worker``: the configuration flags and its own."""
    parser.add_argument("--device", help="device name (default: host name)")
    parser.add_argument("--emulate", metavar="PROFILE", help="emulate a device profile (pi3, pi4, pi5, jetson-nano, "
                        "laptop): its speed, memory and link, under the kernel's memory and CPU limits where "
                        "cgroups allow; off by default")
    cli.service_command(parser, run, {"device": "worker.device", "emulate": "worker.emulate"})


async def run(config: Config) -> None:
    """Run one worker until stopped (SIGINT, SIGTERM, a ``stop`` command or ``worker.max_steps``): the job
    of the configuration, or without one every job submitted that this device has the data for. An emulated
    board runs under its board's limits from before torch is loaded (``board_limits``)."""
    if config.worker.lean_allocator:
        allocator.lean()
    with board_limits(config):
        import torch

        from edgemesh.services.host import serve_or_host
        from edgemesh.services.worker.service import Worker

        # before any torch work: a thread that ran a torch op keeps the thread count it started with
        torch.set_num_threads(config.worker.threads)
        await serve_or_host("worker", config, Worker, device=device_name(config), factory=for_job)


@contextlib.contextmanager
def board_limits(config: Config) -> Iterator[limits.Limits | None]:
    """An emulated board's process under the board's memory in a cgroup of its own while inside (its CPU quota is
    set once the board has measured the host: ``board.EmulatedBoard``), or under stretched compute alone where
    cgroups cannot be used; which, and why, is logged. Its cgroup is removed on the way out. A real device:
    nothing."""
    w = config.worker
    if not w.emulate:
        yield None
        return
    board = get_profile(w.emulate, w.emulation_profiles or None)
    device = device_name(config)
    held = limits.enter(device, w.memory_bytes or board.memory_bytes, root=w.emulation_cgroup_root)
    if held.mode == "stretched":
        logger.warning("%s: emulated %s under stretched compute alone, its memory not enforced: %s", device,
                       board.name, held.reason)
    else:
        logger.info("%s: emulated %s under cgroup-v1 limits: %s", device, board.name, held.reason)
    try:
        yield held
    finally:
        held.close()


async def for_job(active: ActiveJob) -> Worker:
    """This device's worker in a submitted job: the model built from the job file and the device's own data
    read first, so a device whose data is missing or broken says why and stays out (DataError, ModelError)."""
    from edgemesh.common.data import load_local
    from edgemesh.common.jobs import host_model_spec
    from edgemesh.services.worker.service import Worker

    spec = active.spec
    await asyncio.to_thread(host_model_spec, spec, active.config.models)
    local = None
    if spec.data.format != "digits":
        local = await asyncio.to_thread(
            load_local, spec.data.format, spec.data.path, data_dir=active.config.worker.data_dir,
            input_shape=spec.model.input_shape, classes=spec.model.classes,
            validation_share=spec.evaluation.local_share, seed=active.config.training.seed,
            label_column=spec.data.label_column,
            max_samples=spec.data.max_samples)
        logger.info("%s: job %s, %d local samples (%s)%s", device_name(active.config), spec.name, len(local.train),
                    ", ".join(f"{k} {v}" for k, v in local.class_counts.items()),
                    f", {len(local.validation)} for validation" if local.validation is not None else "")
    return Worker(active.config, job=spec, local=local)
