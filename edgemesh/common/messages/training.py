"""What training exchanges: codec policies, gradient updates and their acks, the model (snapshots
and deltas) and the parameter server's synchronization state."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgemesh.common.messages.checks import MAX_DEVICES, MAX_SHARDS, check_name, nonneg
from edgemesh.common.vocabulary import AckReason, AckStatus, AggregationRule, CodecName, SyncPolicy
from edgemesh.common.wire import message
from edgemesh.common.wire.tensors import Tensor


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
        check_name("device", self.device)
        if not 0.0 < self.density <= 1.0:
            raise ValueError("density must be in (0, 1]")
        nonneg("grid_levels", self.grid_levels)


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
    buffers: tuple[ShardUpdate, ...] = ()
    """The change the step made to the model's buffers (batch norm's running statistics and counter), by shard,
    float32 (codec ``none``): not gradients, so no codec, gateway or robust rule touches them; a buffer that did
    not move is left out."""

    def validate(self) -> None:
        check_name("device", self.device)
        check_name("cluster", self.cluster)
        nonneg("incarnation", self.incarnation)
        nonneg("seq", self.seq)
        nonneg("base_version", self.base_version)
        nonneg("mesh_step", self.mesh_step)
        nonneg("plan_version", self.plan_version)
        if self.samples < 1:
            raise ValueError("samples must be >= 1")
        # a model-parallel member's part for a parameter server shard where it has no rows is empty
        if not (0 if self.mesh_step else 1) <= len(self.shards) <= MAX_SHARDS:
            raise ValueError("shard count out of range")
        for shard in self.shards:
            shard.validate()
        if len(self.buffers) > MAX_SHARDS:
            raise ValueError("buffer shard count out of range")
        for shard in self.buffers:
            shard.validate()
            if shard.codec != "none":
                raise ValueError(f"buffer {shard.param!r} is {shard.codec!r}: buffers travel as float32 ('none')")


@message("ack")
@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateAck:
    """The PS's answer to one update, on ``ack/{device}``."""

    device: str
    incarnation: int
    seq: int
    status: AckStatus
    reason: AckReason = ""
    """Why it was discarded (``vocabulary.DiscardReason``); empty otherwise."""
    version: int = 0
    """The PS version after handling the update."""
    delay: int = 0
    resync: bool = False
    """True: fetch the latest model before computing the next update."""

    def validate(self) -> None:
        check_name("device", self.device)


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
        nonneg("version", self.version)
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
        nonneg("base_version", self.base_version)
        if self.version <= self.base_version:
            raise ValueError("a delta must lead to a later version")
        if not 0 <= len(self.shards) <= MAX_SHARDS:  # empty: a member's part of a shard holding none of its rows
            raise ValueError("shard count out of range")
        for shard in self.shards:
            shard.validate()


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
        nonneg("version", self.version)
        nonneg("bound", self.bound)
        nonneg("deadline_s", self.deadline_s)
        if len(self.delay_indices) > MAX_DEVICES or len(self.slow) > MAX_DEVICES:
            raise ValueError("too many devices")
        for name, index in self.delay_indices.items():
            check_name("device", name)
            nonneg(f"delay index of {name}", index)
        for name in self.slow:
            check_name("device", name)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPart:
    """One update a step of shard 0 applied, and its weight in the step."""

    device: str
    incarnation: int
    seq: int
    weight: float
    excluded: bool = False
    """Under ``krum``: the step left this update out of its average (it was still taken, and its weight counts in
    the step's total)."""

    def validate(self) -> None:
        check_name("device", self.device)
        nonneg("incarnation", self.incarnation)
        nonneg("seq", self.seq)
        nonneg("weight", self.weight)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDiscard:
    """An update shard 0 discarded (or refused), and why."""

    device: str
    incarnation: int
    seq: int
    reason: AckReason
    delay: int = 0

    def validate(self) -> None:
        check_name("device", self.device)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One step of shard 0: the version it made and the updates it took."""

    version: int
    parts: tuple[StepPart, ...]
    rule: AggregationRule = "mean"
    """The rule shard 0 combined the step's updates with, which the other shards combine with too. ``clip``: the
    weights include each update's clip scale (from the norm of the whole update), and the others sum with them as
    they are. ``krum``: shard 0 scored the updates by their distances over every shard's rows, and the others
    average the parts it did not mark ``excluded``."""

    def validate(self) -> None:
        if self.version < 1:
            raise ValueError("a step makes version 1 or later")
        if not 0 < len(self.parts) <= MAX_DEVICES:
            raise ValueError("a step takes 1 to 10,000 updates")
        for part in self.parts:
            part.validate()


@message("shard_steps")
@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSteps:
    """What shard 0 of a sharded parameter server decided, on ``shard/0/steps``: the steps (oldest first) and the
    discards new since its last message, or (``whole``, retained) every step and discard it keeps. The other
    shards apply exactly these steps, with these weights, and answer these discards."""

    version: int
    """Shard 0's version when this went out."""
    policy: SyncPolicy
    steps: tuple[StepRecord, ...] = ()
    discards: tuple[StepDiscard, ...] = ()
    whole: bool = True
    """True: every step and discard shard 0 keeps (retained); False: news, what is new since its last message."""

    def validate(self) -> None:
        nonneg("version", self.version)
        if len(self.steps) > MAX_KEPT_STEPS or len(self.discards) > MAX_DEVICES:
            raise ValueError("too many steps or discards")
        for step in self.steps:
            step.validate()
            if step.version > self.version:
                raise ValueError(f"step {step.version} is past version {self.version}")
        if any(a.version >= b.version for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise ValueError("steps out of order")
        for discard in self.discards:
            discard.validate()


@dataclass(frozen=True, slots=True, kw_only=True)
class PairPart:
    """The squared distance between an update and another this shard holds, over this shard's rows."""

    device: str
    incarnation: int
    seq: int
    squared: float

    def validate(self) -> None:
        check_name("device", self.device)
        nonneg("squared", self.squared)


@dataclass(frozen=True, slots=True, kw_only=True)
class NormPart:
    device: str
    incarnation: int
    seq: int
    squared: float
    """Squared L2 norm of the update's rows this shard holds."""
    pairs: tuple[PairPart, ...] = ()
    """Under ``krum``: its squared distance to each update this shard received before it and has not stepped."""

    def validate(self) -> None:
        check_name("device", self.device)
        nonneg("squared", self.squared)
        for pair in self.pairs:
            pair.validate()


@message("shard_norms")
@dataclass(frozen=True, slots=True, kw_only=True)
class ShardNorms:
    """A shard's part of updates' norms, on ``shard/{i}/norms``: under ``clip`` shard 0 clips each update by the
    norm of the whole of it; under ``krum`` it scores updates by their distances over the whole model."""

    shard: int
    parts: tuple[NormPart, ...]

    def validate(self) -> None:
        nonneg("shard", self.shard)
        if not 0 < len(self.parts) <= MAX_DEVICES:
            raise ValueError("1 to 10,000 norms")
        if sum(len(part.pairs) for part in self.parts) > MAX_DEVICES:
            raise ValueError("at most 10,000 distances")
        for part in self.parts:
            part.validate()


MAX_KEPT_STEPS = 1024
"""Most steps one ``ShardSteps`` may carry."""
