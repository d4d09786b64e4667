"""One parameter server holding the whole model (``ps.shards = 1``): it runs the policy, evaluates, may roll back,
and has no other shard to tell or to hear from."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgemesh.common.messages import GradientUpdate, Plan, StepRecord
from edgemesh.common.topics import Topics
from edgemesh.common.vocabulary import AggregationRule, SyncPolicy
from edgemesh.services.parameter_server.optimizer import ShardGrad
from edgemesh.services.parameter_server.robust import Combined
from edgemesh.services.parameter_server.scheduler import Ack, Candidate, Scheduler, Step
from edgemesh.services.parameter_server.shards.role import SchedulerFactory, ShardRole

if TYPE_CHECKING:
    from edgemesh.common.broadcast import Broadcaster
    from edgemesh.common.bus import Bus
    from edgemesh.services.parameter_server.assembly import Assembly
    from edgemesh.services.parameter_server.evaluation import Evaluator


class Solo(ShardRole):
    """The whole model in one process."""

    decides = True
    alone = True

    def __init__(self, topics: Topics) -> None:
        self.topics = topics
        self.division = None

    def state_dir(self, base: Path) -> Path:
        return base

    @property
    def client_name(self) -> str:
        return ""

    def take_part(self, model: dict[str, np.ndarray], *, broadcast: Broadcaster, assembly: Assembly,
                  evaluator: Evaluator, plan: Callable[[], Plan | None]) -> dict[str, np.ndarray]:
        return model

    def label(self, model_spec: str) -> str:
        return model_spec

    def scheduler(self, policy: SyncPolicy, carry: Sequence[Candidate], make: SchedulerFactory) -> Scheduler:
        return make(policy, carry)

    def resume(self, kept: Mapping[str, Any], replayed: Sequence[StepRecord]) -> None:
        pass

    def kept(self) -> dict[str, Any]:
        return {}

    def attach(self, bus: Bus) -> None:
        pass

    def localize(self, update: GradientUpdate) -> GradientUpdate:
        return update

    def planned(self, plan: Plan) -> None:
        pass  # one process: a cluster's step waits for its rows, not for every member

    async def arrived(self, update: GradientUpdate, grads: Sequence[ShardGrad], rule: AggregationRule) -> None:
        pass

    async def resent(self, update: GradientUpdate, rule: AggregationRule) -> None:
        pass

    def answered(self, ack: Ack) -> None:
        pass

    async def elsewhere(self, steps: Sequence[Step], rule: AggregationRule) -> list[list[float]]:
        return [[] for _ in steps]

    def stepped(self, steps: Sequence[Step], combined: Sequence[Combined]) -> None:
        pass

    def publish(self, version: int, policy: SyncPolicy) -> None:
        pass

    async def whole_model(self, version: int, params: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        return params
