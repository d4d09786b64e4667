"""A parameter server's shard role: its part of the model and of deciding the steps, chosen once at construction.

* :class:`Solo` (``ps.shards = 1``): the whole model in one process.
* :class:`Leader` (shard 0 of ``ps.shards``): its rows of the model; it runs the policy for every shard and
  publishes the steps it takes and the updates it discards (``leader``), evaluates the whole model and publishes
  the sync state.
* :class:`Follower` (every other shard): its rows; its scheduler takes shard 0's steps whatever the policy, and it
  tells shard 0 its part of each update's norm and distances under ``clip`` and ``krum`` (``follower``).

Were each shard to run the policy on its own, the same updates reaching two shards in another order would be judged
differently: under ``async`` and ``ssp`` one shard would apply A then B and the other B then A, with other delays,
weights and verdicts; under ``adaptive`` a round's deadline would close on other updates at each shard. So shard 0
decides and the others follow (docs/scale.md#a-sharded-parameter-server). The service calls the role's seams
(``role.ShardRole``: the model's part, the scheduler, the bus, an update, a step, the checkpoint) and never asks
which role it holds.
"""

from __future__ import annotations

from collections.abc import Callable

from edgemesh.common.config import ParameterServerConfig
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.parameter_server.scheduler import Clock
from edgemesh.services.parameter_server.shards.follower import Follower, FollowerScheduler
from edgemesh.services.parameter_server.shards.leader import Leader
from edgemesh.services.parameter_server.shards.role import SchedulerFactory, ShardRole
from edgemesh.services.parameter_server.shards.solo import Solo

__all__ = ["Follower", "FollowerScheduler", "Leader", "SchedulerFactory", "ShardRole", "Solo", "role_for"]


def role_for(job: str, ps: ParameterServerConfig, metrics: ServiceMetrics, clock: Clock,
             wake: Callable[[], None]) -> ShardRole:
    """The role of shard ``ps.shard`` of ``ps.shards`` in ``job`` (``wake``: the step loop's, for what comes from
    the other shards; ``clock``: the version clock a follower's scheduler advances)."""
    topics = Topics(job)
    if ps.shards == 1:
        return Solo(topics)
    if ps.shard == 0:
        return Leader(topics, wake, ps.shards, ps.shard_wait_s, metrics)
    return Follower(topics, wake, ps.shard, ps.shards, ps.shard_wait_s, metrics, clock)
