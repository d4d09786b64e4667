"""Every message kind, declared once (docs/wire.md), by what it is about.

Frozen dataclasses; ``wire`` encodes and decodes them and checks field types, and each
``validate()`` checks ranges. New fields get defaults; a field is never reused for a new meaning.

* ``devices``: DeviceHello, DeviceStatus, DeviceStats, LinkProbe
* ``plan``: Plan and its PlanDevice, PlanCluster, LayerDivision
* ``training``: CodecPolicy, ShardUpdate, GradientUpdate, UpdateAck, ModelSnapshot, ModelDelta, SyncState,
  ShardSteps (shard 0's steps, for the other shards), ShardNorms (the others' part of updates' norms and
  distances)
* ``mesh``: MeshReady, MeshBegin, MeshSlice, SnapshotRequest
* ``operations``: ControlCommand, ControlReply, Event
* ``jobs``: JobSubmission, JobState, LocalEvaluation
"""

from edgemesh.common.messages.devices import DeviceHello, DeviceStats, DeviceStatus, LinkProbe
from edgemesh.common.messages.jobs import JobState, JobSubmission, LocalEvaluation
from edgemesh.common.messages.mesh import MeshBegin, MeshReady, MeshSlice, SnapshotRequest
from edgemesh.common.messages.operations import ControlCommand, ControlReply, Event, Scalar
from edgemesh.common.messages.plan import LayerDivision, Plan, PlanCluster, PlanDevice
from edgemesh.common.messages.training import (
    CodecPolicy,
    GradientUpdate,
    ModelDelta,
    ModelSnapshot,
    NormPart,
    PairPart,
    ShardNorms,
    ShardSteps,
    ShardUpdate,
    StepDiscard,
    StepPart,
    StepRecord,
    SyncState,
    UpdateAck,
)

__all__ = [
    "CodecPolicy", "ControlCommand", "ControlReply", "DeviceHello", "DeviceStats", "DeviceStatus", "Event",
    "GradientUpdate", "JobState", "JobSubmission", "LayerDivision", "LinkProbe", "LocalEvaluation", "MeshBegin",
    "MeshReady", "MeshSlice", "ModelDelta", "ModelSnapshot", "NormPart", "PairPart", "Plan", "PlanCluster",
    "PlanDevice", "Scalar", "ShardNorms", "ShardSteps", "ShardUpdate", "SnapshotRequest", "StepDiscard", "StepPart",
    "StepRecord", "SyncState", "UpdateAck",
]
