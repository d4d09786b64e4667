"""The mesh layout: which devices form which cluster, and which data shard each one trains on.

Pure functions, no I/O: the planner service wires them to the bus, tests and benchmarks call
them directly.

Two layouts (docs/mesh.md): plain data parallelism (``plan_data_parallel``: every device is its
own cluster and one data-parallel replica, with the batch size ``batching`` chose for it), and
the hybrid training grid (``plan_mesh``: the clusters ``mesh.training_grid`` chose, each a
data-parallel replica whose members divide the model's filters by ``mesh.divide_filters``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from edgemesh.common.config import TrainingConfig
from edgemesh.common.messages import LayerDivision, Plan, PlanCluster, PlanDevice
from edgemesh.common.vocabulary import Batching, SyncPolicy
from edgemesh.services.planner.mesh.devices import DeviceInfo, cluster_name
from edgemesh.services.planner.mesh.grid import Grid


def plan_data_parallel(
    devices: Sequence[DeviceInfo],
    *,
    version: int,
    training: TrainingConfig,
    reason: str,
    created: float = 0.0,
    batches: Mapping[str, int] | None = None,
    batching: Batching = "uniform",
    round_time_s: float = 0.0,
    sync_policy: SyncPolicy | None = None,
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
        PlanDevice(device=d.device, cluster=cluster_name([d.device]), shard_index=i, shard_count=count,
                   batch_size=(batches or {}).get(d.device, training.batch_size))
        for i, d in enumerate(ordered)
    )
    clusters = tuple(PlanCluster(cluster=cluster_name([d.device]), members=(d.device,)) for d in ordered)
    return _plan(training, version=version, created=created, sync_policy=sync_policy, devices=members,
                 clusters=clusters, reason=reason, batching=batching, round_time_s=round_time_s)


def _plan(training: TrainingConfig, *, version: int, created: float, sync_policy: SyncPolicy | None,
          devices: tuple[PlanDevice, ...], clusters: tuple[PlanCluster, ...], reason: str,
          batching: Batching = "uniform", round_time_s: float = 0.0) -> Plan:
    """A validated plan of ``devices`` in ``clusters`` with the training settings of ``training``."""
    plan = Plan(
        version=version,
        created=created,
        model_spec=training.model_spec,
        dataset=training.dataset,
        partition=training.partition,
        partition_alpha=training.partition_alpha,
        seed=training.seed,
        sync_policy=sync_policy or training.sync_policy,
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
    sync_policy: SyncPolicy | None = None,
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


def same_members(a: Plan, b: Plan) -> bool:
    return [d.device for d in a.devices] == [d.device for d in b.devices]


def batch_sizes(plan: Plan) -> dict[str, int]:
    return {d.device: d.batch_size for d in plan.devices}


def same_layout(new: Plan, old: Plan | None) -> bool:
    """Whether two plans say the same thing, ignoring version, timestamp and reason."""
    if old is None:
        return False
    return dataclasses.replace(new, version=0, created=0.0, reason="") == dataclasses.replace(
        old, version=0, created=0.0, reason=""
    )
