"""``edgemesh worker``: its flags, the device's name, and which worker runs: the job of the configuration, or,
with no job named, one for every submitted job this device has the data for (``host``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

from edgemesh import cli
from edgemesh.common.config import Config
from edgemesh.common.data import load_local
from edgemesh.common.jobs import host_model_spec
from edgemesh.services.worker.service import Worker, device_name

if TYPE_CHECKING:
    from edgemesh.services.host import ActiveJob

logger = logging.getLogger(__name__)


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh worker``: the configuration flags and its own."""
    parser.add_argument("--device", help="device name (default: host name)")
    parser.add_argument("--emulate", metavar="PROFILE", help="emulate a device profile (pi3, pi4, pi5, jetson-nano, "
                        "laptop): its speed, memory and link; off by default")
    cli.service_command(parser, run, {"device": "worker.device", "emulate": "worker.emulate"})


async def run(config: Config) -> None:
    """Run one worker until stopped (SIGINT, SIGTERM, a ``stop`` command or ``worker.max_steps``): the job
    of the configuration, or without one every job submitted that this device has the data for."""
    import torch

    from edgemesh.services.host import serve_or_host

    # before any torch work: a thread that ran a torch op keeps the thread count it started with
    torch.set_num_threads(config.worker.threads)
    await serve_or_host("worker", config, Worker, device=device_name(config), factory=for_job)


async def for_job(active: ActiveJob) -> Worker:
    """This device's worker in a submitted job: the model built from the job file and the device's own data
    read first, so a device whose data is missing or broken says why and stays out (DataError, ModelError)."""
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
