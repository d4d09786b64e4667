"""What every shard of a sharded parameter server (``edgemesh ps --shard i/n``) shares, shard 0 or not: its rows of
the model (``common.shards.Division``), its own topics, state directory and MQTT client, and model-parallel steps
that wait for a part from every member of their cluster (docs/scale.md#a-sharded-parameter-server)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgemesh.common.messages import GradientUpdate, Plan
from edgemesh.common.shards import Division
from edgemesh.common.topics import Topics
from edgemesh.services.parameter_server.assembly import members_in
from edgemesh.services.parameter_server.shards.role import ShardRole

if TYPE_CHECKING:
    from edgemesh.common.broadcast import Broadcaster
    from edgemesh.services.parameter_server.assembly import Assembly
    from edgemesh.services.parameter_server.evaluation import Evaluator

KEPT_PLANS = 4
"""Plans whose clusters' members a shard still knows (a step of a replaced plan may still join on a follower)."""


class Sharded(ShardRole):
    """Shard ``shard`` of ``shards``: the rows of the model it keeps, once it has the model."""

    alone = False  # the shards would have to roll back together

    def __init__(self, topics: Topics, shard: int, shards: int) -> None:
        self.topics, self.shard, self.shards = topics.for_shard(shard), shard, shards
        self.division: Division | None = None
        self.plans: OrderedDict[int, Plan] = OrderedDict()
        """The latest plans by version: a follower joins a step of a replaced plan, whose members it must know."""

    def state_dir(self, base: Path) -> Path:
        return base / f"shard-{self.shard}-of-{self.shards}"

    @property
    def client_name(self) -> str:
        return f"ps-{self.shard}"  # two shards with one client id would take turns throwing each other off

    def label(self, model_spec: str) -> str:
        return f"{model_spec} (shard {self.shard} of {self.shards})"

    def take_part(self, model: dict[str, np.ndarray], *, broadcast: Broadcaster, assembly: Assembly,
                  evaluator: Evaluator, plan: Callable[[], Plan | None]) -> dict[str, np.ndarray]:
        """This shard's rows of ``model``: the broadcast tells a model-parallel member of its rows among them, and
        a cluster's step waits for a part from every member the plan names (an empty one where it has none)."""
        self.division = Division.of({name: v.shape for name, v in model.items()}, self.shard, self.shards)
        broadcast.own = self.division.local_rows
        assembly.members = lambda cluster, version: members_in(self.plans.get(version), cluster, version)
        return self.division.take(model)

    def planned(self, plan: Plan) -> None:
        self.plans[plan.version] = plan
        self.plans.move_to_end(plan.version)
        while len(self.plans) > KEPT_PLANS:
            self.plans.popitem(last=False)

    def localize(self, update: GradientUpdate) -> GradientUpdate:
        assert self.division is not None
        return replace(update, shards=self.division.localize(update.shards),
                       buffers=self.division.localize(update.buffers))
