"""The planner's plan: clusters, data shards, batch sizes and the filter division of each mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from edgemesh.common.messages.checks import MAX_DEVICES, check_name, nonneg
from edgemesh.common.vocabulary import Batching, SyncPolicy
from edgemesh.common.wire import message


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanDevice:
    device: str
    cluster: str
    shard_index: int
    shard_count: int
    batch_size: int

    def validate(self) -> None:
        check_name("device", self.device)
        check_name("cluster", self.cluster)
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(f"shard {self.shard_index} of {self.shard_count} invalid")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerDivision:
    """How many output units (filters or features) of ``layer`` each cluster member computes, in member order."""

    layer: str
    counts: tuple[int, ...]

    def validate(self) -> None:
        if not self.layer or len(self.layer) > 256:
            raise ValueError("layer name length out of range")
        if any(n < 0 for n in self.counts) or sum(self.counts) < 1:
            raise ValueError(f"division of {self.layer} must be counts >= 0 with a positive sum")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanCluster:
    cluster: str
    members: tuple[str, ...]
    division: tuple[LayerDivision, ...] = ()
    """Model-parallel clusters (more than one member): every divisible layer's filter division."""
    predicted_iteration_s: float = 0.0
    """The planner's predicted time of one iteration of this cluster, seconds (0 = not predicted)."""

    def validate(self) -> None:
        check_name("cluster", self.cluster)
        if not self.members:
            raise ValueError(f"cluster {self.cluster} has no members")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"a device appears twice in cluster {self.cluster}")
        if len(self.members) > 1 and not self.division:
            raise ValueError(f"cluster {self.cluster} has {len(self.members)} members and no filter division")
        for d in self.division:
            d.validate()
            if len(d.counts) != len(self.members):
                raise ValueError(f"division of {d.layer} in {self.cluster} has {len(d.counts)} counts for "
                                 f"{len(self.members)} members")
        nonneg("predicted_iteration_s", self.predicted_iteration_s)

    @property
    def counts(self) -> dict[str, tuple[int, ...]]:
        return {d.layer: d.counts for d in self.division}


@message("plan")
@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The mesh layout, retained on ``plan``. ``version`` grows with every re-plan."""

    version: int
    created: float
    model_spec: str
    dataset: str
    partition: Literal["iid", "dirichlet"] = "iid"
    partition_alpha: float = 0.5
    seed: int = 0
    sync_policy: SyncPolicy = "ssp"
    staleness_bound: int = 8
    devices: tuple[PlanDevice, ...] = ()
    clusters: tuple[PlanCluster, ...] = ()
    reason: str = ""
    drained: tuple[str, ...] = ()
    """Devices an operator drained: kept out of the plan until undrained (survives planner restarts)."""
    batching: Batching = "uniform"
    """How batch sizes were chosen: ``training.batch_size`` for all, or sized to each device's speed."""
    round_time_s: float = 0.0
    """Balanced plans: the iteration time the batch sizes aim at, seconds (0 = not predicted)."""

    def validate(self) -> None:
        nonneg("version", self.version)
        nonneg("round_time_s", self.round_time_s)
        if len(self.drained) > MAX_DEVICES:
            raise ValueError("too many drained devices")
        for name in self.drained:
            check_name("device", name)
        if len(self.devices) > MAX_DEVICES:
            raise ValueError("too many devices")
        nonneg("staleness_bound", self.staleness_bound)
        for d in self.devices:
            d.validate()
        names = [d.device for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError("a device appears twice in the plan")
        clusters = {c.cluster: c for c in self.clusters}
        for d in self.devices:
            c = clusters.get(d.cluster)
            if c is None:
                raise ValueError(f"device {d.device} is in undeclared cluster {d.cluster}")
            if d.device not in c.members:
                raise ValueError(f"device {d.device} is not a member of its cluster {d.cluster}")
        for c in self.clusters:
            c.validate()

    def device(self, name: str) -> PlanDevice | None:
        return next((d for d in self.devices if d.device == name), None)

    def cluster(self, name: str) -> PlanCluster | None:
        return next((c for c in self.clusters if c.cluster == name), None)

    @property
    def cluster_names(self) -> tuple[str, ...]:
        return tuple(c.cluster for c in self.clusters)
