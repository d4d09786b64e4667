"""The interface of a parameter server's shard role: what the server does differently as one process alone, as
shard 0 of several or as another shard (the package's docstring says how they differ)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from edgemesh.common.messages import GradientUpdate, Plan, StepRecord
from edgemesh.common.shards import Division
from edgemesh.common.topics import Topics
from edgemesh.common.vocabulary import AggregationRule, SyncPolicy
from edgemesh.services.parameter_server.optimizer import ShardGrad
from edgemesh.services.parameter_server.robust import Combined
from edgemesh.services.parameter_server.scheduler import Ack, Candidate, Scheduler, Step

if TYPE_CHECKING:
    from edgemesh.common.broadcast import Broadcaster
    from edgemesh.common.bus import Bus
    from edgemesh.services.parameter_server.assembly import Assembly
    from edgemesh.services.parameter_server.evaluation import Evaluator

SchedulerFactory = Callable[[SyncPolicy, Sequence[Candidate]], Scheduler]
"""``make(policy, carry)``: the scheduler of ``policy``, judging again the updates the last one held."""


class ShardRole(ABC):
    """One parameter server's part of the model, chosen once at construction (``shards.role_for``). The service
    calls these seams in the order of a server's life and never asks which role it holds."""

    decides: ClassVar[bool]
    """Whether this process runs the policy for every shard: it evaluates the model and publishes the sync state."""
    alone: ClassVar[bool]
    """Whether this process holds the whole model: the divergence guard may roll it back alone."""

    topics: Topics
    """This process's topics (a shard's gradients, acks and broadcast on its own)."""
    division: Division | None
    """The rows of the model this process keeps (None: all of them), once ``take_part`` had the model."""

    # ------------------------------------------------------------------ construction and start
    @abstractmethod
    def state_dir(self, base: Path) -> Path:
        """Where this process keeps its checkpoint, write-ahead log and ledger under ``ps.state_dir``."""

    @property
    @abstractmethod
    def client_name(self) -> str:
        """This process's MQTT client name ("": the service's own)."""

    @abstractmethod
    def take_part(self, model: dict[str, np.ndarray], *, broadcast: Broadcaster, assembly: Assembly,
                  evaluator: Evaluator, plan: Callable[[], Plan | None]) -> dict[str, np.ndarray]:
        """This process's part of the initial ``model``, and the components set for it: whose rows the broadcast
        tells model-parallel members of, whose parts a cluster's step waits for, what is evaluated."""

    @abstractmethod
    def label(self, model_spec: str) -> str:
        """What the checkpoint says it holds: the model, and which part of it."""

    @abstractmethod
    def scheduler(self, policy: SyncPolicy, carry: Sequence[Candidate], make: SchedulerFactory) -> Scheduler:
        """The scheduler under ``policy`` (at start, and when an operator or the checkpoint sets another)."""

    @abstractmethod
    def resume(self, kept: Mapping[str, Any], replayed: Sequence[StepRecord]) -> None:
        """The checkpoint's settings as ``kept`` left them, and the steps replayed from the log after it."""

    @abstractmethod
    def kept(self) -> dict[str, Any]:
        """What the checkpoint keeps for this role (beside the operator's settings)."""

    # ------------------------------------------------------------------ the bus
    @abstractmethod
    def attach(self, bus: Bus) -> None:
        """Consume and publish what this role needs on ``bus``."""

    # ------------------------------------------------------------------ an update
    @abstractmethod
    def localize(self, update: GradientUpdate) -> GradientUpdate:
        """An arriving gradient's shards in this process's own rows (WireError ``shape``: rows it does not keep)."""

    @abstractmethod
    def planned(self, plan: Plan) -> None:
        """A plan came (before the waiting model-parallel steps are settled against it)."""

    @abstractmethod
    async def arrived(self, update: GradientUpdate, grads: Sequence[ShardGrad], rule: AggregationRule) -> None:
        """A decoded update (a model-parallel cluster's once joined), before it is queued."""

    @abstractmethod
    async def resent(self, update: GradientUpdate, rule: AggregationRule) -> None:
        """A resend of an update this process holds (its ack is owed: the first copy's answers it)."""

    @abstractmethod
    def answered(self, ack: Ack) -> None:
        """Every ack this process sends, as it goes out."""

    # ------------------------------------------------------------------ a step
    @abstractmethod
    async def elsewhere(self, steps: Sequence[Step], rule: AggregationRule) -> list[list[float]]:
        """What ``rule`` judges ``steps``' whole updates by beyond this process's rows (``Aggregator.combine``'s
        ``elsewhere``, per step); empty lists: nothing."""

    @abstractmethod
    def stepped(self, steps: Sequence[Step], combined: Sequence[Combined]) -> None:
        """``steps`` are durable in the log, combined as ``combined`` (in the step's thread, under its lock)."""

    @abstractmethod
    def publish(self, version: int, policy: SyncPolicy) -> None:
        """After every batch of the step loop, before the model and the acks: tell others what this role owes."""

    @abstractmethod
    async def whole_model(self, version: int, params: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The whole model at ``version`` from this process's ``params`` (None: not to be had now)."""
