"""What a device measures about itself (throughput, memory, resident size), and whether a plan's share fits it."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import time
from dataclasses import dataclass

import numpy as np

from edgemesh.common import costs
from edgemesh.common.errors import ModelError
from edgemesh.common.messages import Plan, PlanDevice

MATMUL_N = 256
"""Side of the square float32 matrices of the FLOPS benchmark."""


@dataclass(frozen=True, slots=True)
class Profile:
    flops: float
    memory_bytes: int
    cores: int
    platform: str


def software() -> str:
    """This build, as a hello names it."""
    try:
        return "edgemesh " + importlib.metadata.version("edgemesh")
    except importlib.metadata.PackageNotFoundError:
        return "edgemesh"


def measure_flops(seconds: float, n: int = MATMUL_N) -> float:
    """float32 matrix-multiply throughput in FLOP/s, measured for about ``seconds``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # warm up BLAS
    runs = 0
    start = time.perf_counter()
    while True:
        a @ b
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * n**3 * runs / elapsed


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, else physical memory."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def measure(seconds: float, memory_override: int = 0) -> Profile:
    """The device as it is: FLOPS, and the memory training may use (what is free plus what this
    process already holds, since the memory estimate of a share counts the process itself)."""
    return Profile(
        flops=measure_flops(seconds),
        memory_bytes=memory_override or available_memory() + rss_bytes(),
        cores=os.cpu_count() or 1,
        platform=f"{platform.system()}-{platform.machine()}",
    )


def share_refusal(plan: Plan, me: PlanDevice, memory_bytes: int) -> str:
    """Why device ``me``'s share of ``plan`` does not fit ``memory_bytes`` ('' if it fits, or if the model has no
    cost figures to check against)."""
    cluster = plan.cluster(me.cluster)
    try:
        if cluster is not None and len(cluster.members) > 1:  # its share of a model-parallel cluster
            index = cluster.members.index(me.device)
            layers = costs.layers(plan.model_spec)
            counts = cluster.counts
            if set(counts) != {la.name for la in layers}:
                return f"the filter division of {cluster.cluster} does not match {plan.model_spec}"
            need = costs.member_memory_bytes(layers, [counts[la.name][index] for la in layers], me.batch_size)
        else:
            need = costs.training_memory_bytes(plan.model_spec, me.batch_size)
            with contextlib.suppress(ModelError):  # no layer figures (an entry-point model): the first estimate
                # the mesh planner sizes a lone member with the per-layer accounting of a cluster's members,
                # which comes out a little lower: a share it planned must not be refused
                layers = costs.layers(plan.model_spec)
                need = min(need, costs.member_memory_bytes(layers, [la.units for la in layers], me.batch_size))
    except ModelError:
        return ""
    if need <= memory_bytes:
        return ""
    return (f"needs {need / 2**20:.0f} MiB for batch {me.batch_size} of {plan.model_spec}, "
            f"has {memory_bytes / 2**20:.0f} MiB")
