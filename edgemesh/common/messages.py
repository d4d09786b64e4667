"""Every message kind, declared once (DESIGN.md §2-3).

Frozen dataclasses; ``wire`` encodes and decodes them and checks field types, and each
``validate()`` checks ranges. New fields get defaults; a field is never reused for a new meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from edgemesh.common.topics import valid_name
from edgemesh.common.wire import Tensor, message

SyncPolicy = Literal["sync", "async", "ssp", "adaptive"]
SYNC_POLICIES: tuple[str, ...] = ("sync", "async", "ssp", "adaptive")
CodecName = Literal["none", "fp16", "topk", "threshold", "qsgd", "grid"]
Scalar = str | int | float | bool | None

MAX_DEVICES = 10_000
MAX_SHARDS = 4096
MAX_CLUSTER_MEMBERS = 256


def _name(kind: str, value: str) -> None:
    if not valid_name(value):
        raise ValueError(f"invalid {kind} {value!r}")


def _nonneg(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


# --------------------------------------------------------------------------- devices


@message("hello")
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceHello:
    """A device's measured profile, retained on ``device/{id}/hello``."""

    device: str
    incarnation: int
    flops: float
    """Measured float32 multiply-add throughput, FLOP/s."""
    memory_bytes: int
    """Memory the device offers to training."""
    cores: int = 1
    platform: str = ""
    software: str = ""
    can_encode: bool = True
    """False for devices too weak to encode; they send ``grad-raw`` for the compressor gateway."""
    link_rate_bps: float = 0.0
    """Measured or configured uplink rate, bytes/s (0 = unknown)."""
    profile: str = ""
    """Emulated device profile name, empty when real."""
    downlink_rate_bps: float = 0.0
    """Measured or configured downlink rate, bytes/s (0 = unknown: taken as the uplink rate)."""
    latency_s: float = 0.0
    """One-way latency to the broker, seconds (0 = unknown)."""

    def validate(self) -> None:
        _name("device", self.device)
        _nonneg("incarnation", self.incarnation)
        _nonneg("downlink_rate_bps", self.downlink_rate_bps)
        _nonneg("latency_s", self.latency_s)
        if self.flops <= 0:
            raise ValueError("flops must be > 0")
        if self.memory_bytes <= 0:
            raise ValueError("memory_bytes must be > 0")
        if self.cores < 1:
            raise ValueError("cores must be >= 1")
        _nonneg("link_rate_bps", self.link_rate_bps)


@message("status")
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceStatus:
    """Liveness, retained on ``device/{id}/status``; ``offline`` is also the MQTT will."""

    device: str
    state: Literal["online", "offline"]
    incarnation: int = 0
    time: float = 0.0
    refused_plan: int = 0
    """Version of a plan whose share this device refused (it does not fit its memory); 0 = none."""
    reason: str = ""
    """Why it refused, for operators (``needs 812 MiB for batch 128, has 700 MiB``)."""

    def validate(self) -> None:
        _name("device", self.device)
        _nonneg("refused_plan", self.refused_plan)


@message("stats")
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceStats:
    """Periodic measurements a device publishes on ``device/{id}/stats``."""

    device: str
    incarnation: int = 0
    time: float = 0.0
    steps: int = 0
    step_time_s: float = 0.0
    """Mean compute time of one training step."""
    comm_time_s: float = 0.0
    """Mean time from publishing an update to its ack."""
    delay_index: float = 0.0
    link_rate_bps: float = 0.0
    """Uplink rate, bytes/s: declared (``worker.link_rate_bps``) or measured (0 = unknown)."""
    rss_bytes: int = 0
    cpu_temp_c: float | None = None
    model_version: int = 0
    loss: float | None = None
    batch_size: int = 0
    bytes_sent: int = 0
    gradient_bytes: int = 0
    """Size of one full gradient of this device's share of the model in float32, bytes (0 = unknown)."""
    upload_time_s: float = 0.0
    """Mean time to hand one update to the broker (publish to PUBACK), seconds (0 = unknown)."""
    compute_flops: float = 0.0
    """Training FLOP/s this device reached computing its share (waits for other members left out), 0 = unknown."""
    mesh_layer_busy_s: dict[str, float] = field(default_factory=dict)
    """Model-parallel members: median seconds per step each layer kept this member busy, forward and
    backward: computing its units, and its link moving the layer's slices (the bytes it sent and
    received for the layer's exchanges at its uplink and downlink rates); waits for the others left out."""

    def validate(self) -> None:
        _name("device", self.device)
        for name in ("steps", "step_time_s", "comm_time_s", "delay_index", "link_rate_bps", "rss_bytes",
                     "gradient_bytes", "upload_time_s", "compute_flops"):
            _nonneg(name, getattr(self, name))
        if len(self.mesh_layer_busy_s) > MAX_SHARDS:
            raise ValueError("too many layers")
        for layer, seconds in self.mesh_layer_busy_s.items():
            if not layer or len(layer) > 256 or not seconds >= 0:
                raise ValueError(f"bad layer busy time {layer!r}: {seconds!r}")


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanDevice:
    device: str
    cluster: str
    shard_index: int
    shard_count: int
    batch_size: int

    def validate(self) -> None:
        _name("device", self.device)
        _name("cluster", self.cluster)
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
        _name("cluster", self.cluster)
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
        _nonneg("predicted_iteration_s", self.predicted_iteration_s)

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
    batching: Literal["uniform", "balanced"] = "uniform"
    """How batch sizes were chosen: ``training.batch_size`` for all, or sized to each device's speed."""
    round_time_s: float = 0.0
    """Balanced plans: the iteration time the batch sizes aim at, seconds (0 = not predicted)."""

    def validate(self) -> None:
        _nonneg("version", self.version)
        _nonneg("round_time_s", self.round_time_s)
        if len(self.drained) > MAX_DEVICES:
            raise ValueError("too many drained devices")
        for name in self.drained:
            _name("device", name)
        if len(self.devices) > MAX_DEVICES:
            raise ValueError("too many devices")
        _nonneg("staleness_bound", self.staleness_bound)
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


# --------------------------------------------------------------------------- synchronization state


@message("sync_state")
@dataclass(frozen=True, slots=True, kw_only=True)
class SyncState:
    """The parameter server's synchronization state, retained on ``sync``.

    The planner sizes batches from it (``adaptive``: slow devices get smaller ones) and
    operators read it; it changes when the policy or bound is switched and as delay indices move.
    """

    policy: SyncPolicy
    version: int
    """Model version when this state was published."""
    bound: int
    """Delay bound in force: the adapted D under ``adaptive``, ``training.staleness_bound`` otherwise."""
    deadline_s: float = 0.0
    """``adaptive``: the current round deadline τ, seconds (0 under other policies)."""
    delay_indices: dict[str, float] = field(default_factory=dict)
    """``adaptive``: the delay index (moving average of delays, in versions) of each live device."""
    slow: tuple[str, ...] = ()
    """``adaptive``: devices far behind the fleet, to be given a smaller batch and harder compression."""
    time: float = 0.0

    def validate(self) -> None:
        _nonneg("version", self.version)
        _nonneg("bound", self.bound)
        _nonneg("deadline_s", self.deadline_s)
        if len(self.delay_indices) > MAX_DEVICES or len(self.slow) > MAX_DEVICES:
            raise ValueError("too many devices")
        for name, index in self.delay_indices.items():
            _name("device", name)
            _nonneg(f"delay index of {name}", index)
        for name in self.slow:
            _name("device", name)


# --------------------------------------------------------------------------- codec policy


@message("codec_policy")
@dataclass(frozen=True, slots=True, kw_only=True)
class CodecPolicy:
    """The codec a device must use, retained on ``codec/{device}``."""

    device: str
    codec: CodecName
    density: float = 1.0
    """Share of gradient entries kept by sparsifying codecs (0, 1]."""
    grid_levels: int = 0
    version: int = 0
    gateway: bool = False
    """True: the device sends ``grad-raw`` and the compressor encodes for it."""
    reason: str = ""

    def validate(self) -> None:
        _name("device", self.device)
        if not 0.0 < self.density <= 1.0:
            raise ValueError("density must be in (0, 1]")
        _nonneg("grid_levels", self.grid_levels)


# --------------------------------------------------------------------------- gradients, model, acks


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardUpdate:
    """An encoded gradient for ``param[start:stop]`` along dim 0."""

    param: str
    start: int
    stop: int
    codec: CodecName
    data: bytes

    def validate(self) -> None:
        if not self.param or len(self.param) > 256:
            raise ValueError("param name length out of range")
        if not 0 <= self.start < self.stop:
            raise ValueError(f"shard [{self.start}:{self.stop}] invalid")


@message("gradient")
@dataclass(frozen=True, slots=True, kw_only=True)
class GradientUpdate:
    """A worker's gradient, on ``grad/{cluster}/{device}``; ``(device, incarnation, seq)`` is unique."""

    device: str
    cluster: str
    incarnation: int
    seq: int
    base_version: int
    """Model version the gradient was computed on."""
    samples: int
    shards: tuple[ShardUpdate, ...]
    loss: float = 0.0
    step_time_s: float = 0.0
    sent_at: float = 0.0
    need_snapshot: bool = False
    """The sender missed a model delta and asks for a full snapshot."""
    mesh_step: int = 0
    """Model-parallel clusters: the cluster step these shards belong to (the PS joins the members'
    updates of one step into the cluster's update); 0 for a single-device cluster."""
    plan_version: int = 0
    """The plan the update was computed under (0: not said); for a model-parallel cluster, the one
    whose filter division the shards follow."""

    def validate(self) -> None:
        _name("device", self.device)
        _name("cluster", self.cluster)
        _nonneg("incarnation", self.incarnation)
        _nonneg("seq", self.seq)
        _nonneg("base_version", self.base_version)
        _nonneg("mesh_step", self.mesh_step)
        _nonneg("plan_version", self.plan_version)
        if self.samples < 1:
            raise ValueError("samples must be >= 1")
        if not 0 < len(self.shards) <= MAX_SHARDS:
            raise ValueError("shard count out of range")


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

    def validate(self) -> None:
        _name("cluster", self.cluster)
        _name("device", self.device)
        _nonneg("plan_version", self.plan_version)


@message("mesh_begin")
@dataclass(frozen=True, slots=True, kw_only=True)
class MeshBegin:
    """A model-parallel cluster's first member starts ``step`` on ``model_version``, on
    ``mesh/{cluster}/step/begin/{device}``; the others follow with the same batch."""

    cluster: str
    device: str
    plan_version: int
    step: int
    model_version: int

    def validate(self) -> None:
        _name("cluster", self.cluster)
        _name("device", self.device)
        _nonneg("plan_version", self.plan_version)
        if self.step < 1:
            raise ValueError("step must be >= 1")
        _nonneg("model_version", self.model_version)


@message("mesh_slice")
@dataclass(frozen=True, slots=True, kw_only=True)
class MeshSlice:
    """One member's slice within a model-parallel step (DESIGN.md §4).

    ``fwd``: its output slice of ``layer``, on ``mesh/{cluster}/{layer}/fwd/{sender}``, for all members.
    ``bwd``: the receiver's channels of its partial input gradient of ``layer``, on
    ``mesh/{cluster}/{layer}/bwd/{receiver}``.
    """

    cluster: str
    plan_version: int
    step: int
    layer: str
    phase: Literal["fwd", "bwd"]
    sender: int
    """Member index of the sender in the cluster."""
    tensor: Tensor

    def validate(self) -> None:
        _name("cluster", self.cluster)
        _name("layer", self.layer)
        _nonneg("plan_version", self.plan_version)
        if self.step < 1:
            raise ValueError("step must be >= 1")
        if self.phase not in ("fwd", "bwd"):
            raise ValueError(f"phase {self.phase!r} is not fwd or bwd")
        if not 0 <= self.sender < MAX_CLUSTER_MEMBERS:
            raise ValueError("sender index out of range")
        if self.tensor.dtype not in ("float32", "float16"):
            raise ValueError(f"mesh tensors are float32 or float16, not {self.tensor.dtype}")


@message("model")
@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSnapshot:
    """The full global model, retained on ``model``."""

    version: int
    model_spec: str
    tensors: dict[str, Tensor]
    created: float = 0.0
    sync_policy: SyncPolicy = "ssp"

    def validate(self) -> None:
        _nonneg("version", self.version)
        if not self.tensors:
            raise ValueError("snapshot holds no tensors")


@message("model_delta")
@dataclass(frozen=True, slots=True, kw_only=True)
class ModelDelta:
    """The change from ``base_version`` to ``version``, encoded per shard, on ``model/delta``.

    Applying it to the model at ``base_version`` (a snapshot plus the deltas since) gives
    the model the PS broadcasts at ``version``; anything else is a gap: wait for a snapshot.
    """

    version: int
    base_version: int
    model_spec: str
    shards: tuple[ShardUpdate, ...]
    created: float = 0.0

    def validate(self) -> None:
        _nonneg("base_version", self.base_version)
        if self.version <= self.base_version:
            raise ValueError("a delta must lead to a later version")
        if not 0 < len(self.shards) <= MAX_SHARDS:
            raise ValueError("shard count out of range")


AckStatus = Literal["accepted", "discarded", "duplicate"]


@message("ack")
@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateAck:
    """The PS's answer to one update, on ``ack/{device}``."""

    device: str
    incarnation: int
    seq: int
    status: AckStatus
    reason: str = ""
    """Why it was discarded: ``stale``, ``shape``, ``unknown_device``, ``codec``, ``paused``..."""
    version: int = 0
    """The PS version after handling the update."""
    delay: int = 0
    resync: bool = False
    """True: fetch the latest model before computing the next update."""

    def validate(self) -> None:
        _name("device", self.device)


# --------------------------------------------------------------------------- operations


@message("control")
@dataclass(frozen=True, slots=True, kw_only=True)
class ControlCommand:
    """An operator's command on ``control/{target}``; also accepted as a UTF-8 JSON body."""

    command: str
    value: Scalar = None
    device: str = ""
    request_id: str = ""
    requester: str = "operator"
    reply_to: str = ""
    """Topic for the ControlReply; default ``control-reply/{requester}``."""
    expires_at: float = 0.0
    """Unix time after which the command is ignored (0 = never)."""

    def validate(self) -> None:
        if not self.command or len(self.command) > 64:
            raise ValueError("command length out of range")
        _name("requester", self.requester)
        if self.device:
            _name("device", self.device)


@message("control_reply")
@dataclass(frozen=True, slots=True, kw_only=True)
class ControlReply:
    request_id: str
    source: str
    command: str
    ok: bool
    message: str = ""
    result: dict[str, Scalar] = field(default_factory=dict)


@message("event")
@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """An audit-trail entry on ``events``: replans, rejections, control actions, evaluations."""

    kind: str
    source: str
    time: float
    message: str = ""
    data: dict[str, Scalar] = field(default_factory=dict)
