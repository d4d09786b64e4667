"""What the members of a model-parallel cluster exchange within a step (docs/mesh.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from edgemesh.common.messages.checks import MAX_CLUSTER_MEMBERS, check_name, nonneg
from edgemesh.common.wire import message
from edgemesh.common.wire.tensors import Tensor


@message("mesh_ready")
@dataclass(frozen=True, slots=True, kw_only=True)
class MeshReady:
    """A member of a model-parallel cluster is subscribed to its topics and holds the model under
    ``plan_version``: retained on ``mesh/{cluster}/step/ready/{device}``. The first member waits for
    every other one before the first step of a plan, which would otherwise go to members not yet
    listening."""

    cluster: str
    device: str
    plan_version: int
    samples: int = -1
    """Training samples the member holds (0: none, so it never owns a step's batch; -1: not said)."""

    def validate(self) -> None:
        check_name("cluster", self.cluster)
        check_name("device", self.device)
        nonneg("plan_version", self.plan_version)
        if self.samples < -1:
            raise ValueError("samples must be >= -1")


@message("mesh_begin")
@dataclass(frozen=True, slots=True, kw_only=True)
class MeshBegin:
    """A model-parallel cluster's first member starts ``step`` on ``model_version``, on
    ``mesh/{cluster}/step/begin/{device}``; the others follow with the same batch: member ``owner``'s,
    which it sends them as the step's ``input`` slice (docs/mesh.md)."""

    cluster: str
    device: str
    plan_version: int
    step: int
    model_version: int
    owner: int = -1
    """Index of the member whose local data give the step's batch (-1: every member draws the batch itself)."""

    def validate(self) -> None:
        check_name("cluster", self.cluster)
        check_name("device", self.device)
        nonneg("plan_version", self.plan_version)
        if self.step < 1:
            raise ValueError("step must be >= 1")
        nonneg("model_version", self.model_version)
        if not -1 <= self.owner < MAX_CLUSTER_MEMBERS:
            raise ValueError("owner index out of range")


@message("mesh_slice")
@dataclass(frozen=True, slots=True, kw_only=True)
class MeshSlice:
    """One member's slice within a model-parallel step (docs/mesh.md).

    ``fwd``: its output slice of ``layer``, on ``mesh/{cluster}/{layer}/fwd/{sender}``, for all members.
    ``bwd``: the receiver's channels of its partial input gradient of ``layer``, on
    ``mesh/{cluster}/{layer}/bwd/{receiver}``.
    ``input``: the step's batch from its owner's local data, the inputs of the first ``layer`` with their
    ``labels``, on ``mesh/{cluster}/{layer}/input/{sender}``, for all members.
    """

    cluster: str
    plan_version: int
    step: int
    layer: str
    phase: Literal["fwd", "bwd", "input"]
    sender: int
    """Member index of the sender in the cluster."""
    tensor: Tensor
    labels: Tensor | None = None
    """``input``: the batch's class indices (int64, one per sample)."""

    def validate(self) -> None:
        check_name("cluster", self.cluster)
        check_name("layer", self.layer)
        nonneg("plan_version", self.plan_version)
        if self.step < 1:
            raise ValueError("step must be >= 1")
        if self.phase not in ("fwd", "bwd", "input"):
            raise ValueError(f"phase {self.phase!r} is not fwd, bwd or input")
        if (self.labels is not None) != (self.phase == "input"):
            raise ValueError("labels travel with input slices, and only with them")
        if self.labels is not None and (self.labels.dtype not in ("int64", "int32") or len(self.labels.shape) != 1):
            raise ValueError(f"labels are a vector of int64 or int32, not {self.labels.dtype} {self.labels.shape}")
        if not 0 <= self.sender < MAX_CLUSTER_MEMBERS:
            raise ValueError("sender index out of range")
        if self.tensor.dtype not in ("float32", "float16"):
            raise ValueError(f"mesh tensors are float32 or float16, not {self.tensor.dtype}")


@message("snapshot_request")
@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRequest:
    """A device needs the whole model again (a mesh member whose new division needs rows it lacks), on its own
    ``device/{id}/snapshot-request``: the parameter server publishes a snapshot unless its retained one is the
    current version."""

    device: str
    version: int = -1
    """The model version the device holds (-1: none)."""

    def validate(self) -> None:
        check_name("device", self.device)
        if self.version < -1:
            raise ValueError("version must be >= -1")
