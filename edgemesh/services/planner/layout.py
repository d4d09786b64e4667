"""The mesh layout: which devices form which cluster, and which data shard each one trains on.

Pure functions, no I/O: the planner service wires them to the bus, tests and benchmarks call
them directly.

Two layouts (DESIGN.md §4): plain data parallelism (``plan_data_parallel``: every device is its
own cluster and one data-parallel replica, with the batch size ``batching`` chose for it), and
the hybrid training grid (``plan_mesh``: the clusters ``mesh.training_grid`` chose, each a
data-parallel replica whose members divide the model's filters by ``mesh.divide_filters``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from edgemesh.common.config import TrainingConfig
from edgemesh.common.messages import DeviceHello, LayerDivision, Plan, PlanCluster, PlanDevice

if TYPE_CHECKING:
    from edgemesh.services.planner.mesh import Grid

CLUSTER_PREFIX = "c-"
"""A single-device cluster is named ``c-<device>``."""
MAX_NAME = 64
"""Longest cluster name (``topics.valid_name``)."""
NAME_HASH_CHARS = 8
"""Hex digits of the hash that keeps a shortened cluster name unique."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceInfo:
    """What the planner knows about one live device."""

    device: str
    flops: float
    """Measured float32 multiply-add throughput, FLOP/s."""
    memory_bytes: int
    """Memory the device offers to training."""
    link_rate_bps: float = 0.0
    """Measured uplink rate, bytes/s (0 = unknown)."""
    downlink_rate_bps: float = 0.0
    """Measured downlink rate, bytes/s (0 = unknown: taken as the uplink rate)."""
    latency_s: float = 0.0
    """One-way latency to the broker, seconds (0 = unknown)."""

    @classmethod
    def from_hello(cls, hello: DeviceHello) -> DeviceInfo:
        return cls(device=hello.device, flops=hello.flops, memory_bytes=hello.memory_bytes,
                   link_rate_bps=hello.link_rate_bps, downlink_rate_bps=hello.downlink_rate_bps,
                   latency_s=hello.latency_s)


def cluster_name(device: str) -> str:
    """The name of the single-device cluster of ``device``: ``c-<device>``.

    A device name too long for the prefix (over 62 characters) is shortened and suffixed
    with a hash of the full name, so the cluster name stays valid and unique.
    """
    name = f"{CLUSTER_PREFIX}{device}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(device.encode()).hexdigest()[:NAME_HASH_CHARS]
    return f"{name[:MAX_NAME - NAME_HASH_CHARS - 1]}-{digest}"


def plan_data_parallel(
    devices: Sequence[DeviceInfo],
    *,
    version: int,
    training: TrainingConfig,
    reason: str,
    created: float = 0.0,
    batches: Mapping[str, int] | None = None,
    batching: Literal["uniform", "balanced"] = "uniform",
    round_time_s: float = 0.0,
    sync_policy: str | None = None,
) -> Plan:
    """A data-parallel plan: one cluster per device, one data shard per device.

    Devices are ordered by name, so the same live set always yields the same layout:
    the device at position *i* gets ``shard_index`` *i* of ``shard_count`` *n* and
    cluster ``c-<device>``. Each device gets its size from ``batches`` (see ``batching``),
    else ``training.batch_size``. An empty ``devices`` gives a plan with no devices and no
    clusters (everyone left). ``created`` is the plan's timestamp, passed in to keep this pure;
    ``sync_policy`` is the policy in force at the parameter server (default: the configured one).

    Raises ValueError if a device name appears twice.
    """
    ordered = sorted(devices, key=lambda d: d.device)
    names = [d.device for d in ordered]
    if len(set(names)) != len(names):
        raise ValueError(f"a device appears twice in {names}")
    count = len(ordered)
    members = tuple(
        PlanDevice(device=d.device, cluster=cluster_name(d.device), shard_index=i, shard_count=count,
                   batch_size=(batches or {}).get(d.device, training.batch_size))
        for i, d in enumerate(ordered)
    )
    clusters = tuple(PlanCluster(cluster=cluster_name(d.device), members=(d.device,)) for d in ordered)
    return _plan(training, version=version, created=created, sync_policy=sync_policy, devices=members,
                 clusters=clusters, reason=reason, batching=batching, round_time_s=round_time_s)


def _plan(training: TrainingConfig, *, version: int, created: float, sync_policy: str | None,
          devices: tuple[PlanDevice, ...], clusters: tuple[PlanCluster, ...], reason: str,
          batching: Literal["uniform", "balanced"] = "uniform", round_time_s: float = 0.0) -> Plan:
    """A validated plan of ``devices`` in ``clusters`` with the training settings of ``training``."""
    plan = Plan(
        version=version,
        created=created,
        model_spec=training.model_spec,
        dataset=training.dataset,
        partition=training.partition,
        partition_alpha=training.partition_alpha,
        seed=training.seed,
        sync_policy=sync_policy or training.sync_policy,  # type: ignore[arg-type]
        staleness_bound=training.staleness_bound,
        devices=devices,
        clusters=clusters,
        reason=reason,
        batching=batching,
        round_time_s=round_time_s,
    )
    for member in devices:
        member.validate()
    plan.validate()  # validates the clusters too
    return plan


def plan_mesh(
    grid: Grid,
    *,
    version: int,
    training: TrainingConfig,
    reason: str,
    created: float = 0.0,
    sync_policy: str | None = None,
) -> Plan:
    """The plan of a training grid: one data shard per cluster, every member of a cluster on the
    cluster's shard with the cluster's share of the iteration's batch (they train the same samples
    together), and the filter division and predicted iteration time of every cluster.

    Clusters are ordered by name (the grid's order); the cluster at position *i* trains data
    shard *i* of *K*. Excluded devices are not in the plan.
    """
    count = len(grid.clusters)
    devices = []
    clusters = []
    for i, c in enumerate(grid.clusters):
        devices += [PlanDevice(device=m, cluster=c.name, shard_index=i, shard_count=count,
                               batch_size=c.batch) for m in c.members]
        division = tuple(LayerDivision(layer=layer, counts=tuple(n)) for layer, n in c.division.counts.items()) \
            if len(c.members) > 1 else ()
        clusters.append(PlanCluster(cluster=c.name, members=tuple(c.members), division=division,
                                    predicted_iteration_s=round(c.predicted_s, 6)))
    return _plan(training, version=version, created=created, sync_policy=sync_policy, devices=tuple(devices),
                 clusters=tuple(clusters), reason=reason, round_time_s=round(grid.predicted_iteration_s, 6))
