"""One training step of this device under a plan, and the update it makes.

* **Alone** (a cluster of one): in a thread (``trainer``), on the model the source holds, the gradient cut where
  the source says (whole tensors, or a sharded parameter server's rows), then held to the board's speed. A
  model-parallel member whose plan makes it a cluster of one leaves its cluster first and makes no update that
  time (its view held its rows only).
* **With its cluster** (a model-parallel cluster of several, ``mesh.session``): the member's part of the step,
  or none when it was abandoned (a member left or lags; the planner re-plans).

Either way the step is counted (steps, step time, loss, the model's version; the stats' recent steps and
measured speed) and numbered: its update carries ``(device, incarnation, seq)``, the version it was computed on
and whether that model missed a delta (the parameter server then sends a snapshot).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from edgemesh.common.messages import CodecPolicy, GradientUpdate, Plan, PlanCluster, PlanDevice, ShardUpdate
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.services.worker.board import Board
from edgemesh.services.worker.mesh.session import MeshSession
from edgemesh.services.worker.source import ModelSource
from edgemesh.services.worker.stats import Recent
from edgemesh.services.worker.trainer import Trainer

STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Steps:
    """This device's steps: the next one under a plan, and how many updates they made (``seq``)."""

    def __init__(self, *, device: str, incarnation: int, trainer: Trainer, board: Board, source: ModelSource[Any],
                 mesh: MeshSession, recent: Recent, metrics: ServiceMetrics) -> None:
        self.device, self.incarnation = device, incarnation
        self.trainer, self.board, self.source, self.mesh, self.recent = trainer, board, source, mesh, recent
        self.seq = 0
        """The last update's number (this incarnation's)."""
        self.m_steps = metrics.counter("steps", "Training steps computed")
        self.m_step = metrics.histogram("step_seconds", "Compute time of one training step", STEP_BUCKETS)
        self.m_version = metrics.gauge("model_version", "Version of the model this worker trains on")
        self.m_loss = metrics.gauge("loss", "Training loss of the last batch")

    async def next(self, plan: Plan, me: PlanDevice, policy: CodecPolicy | None) -> GradientUpdate | None:
        """One step of device ``me`` under ``plan``, encoded under ``policy``: its update, or None when there is
        none to send."""
        cluster = plan.cluster(me.cluster)
        if cluster is not None and len(cluster.members) > 1:
            return await self._with_cluster(plan, me, cluster, policy)
        if self.mesh.member is not None:  # a model-parallel member until this plan: its view held its rows
            await self.mesh.leave()
            return None  # start over with the whole model
        model = self.source.held()
        step = await asyncio.to_thread(self.trainer.step, plan, me, model.params, model.version, policy,
                                       spans=model.spans, stamp=model.stamp)
        elapsed = await self.board.hold(step.seconds, step.flops, step.samples)
        if step.flops is not None:  # no cost figures: no measured speed
            self.recent.work.append((step.flops, elapsed))
        return self._update(plan, me, step.shards, step.buffers, step.samples, step.loss, elapsed, model.version,
                            model.gap, 0)

    async def _with_cluster(self, plan: Plan, me: PlanDevice, cluster: PlanCluster,
                            policy: CodecPolicy | None) -> GradientUpdate | None:
        """This member's part of a step of its model-parallel cluster, or None if it was abandoned."""
        result = await self.mesh.step(plan, me, cluster, policy, self.board.link_rates())
        if result is None:
            return None
        if result.work is not None:
            self.recent.work.append(result.work)
        return self._update(plan, me, result.shards, result.buffers, result.samples, result.loss, result.elapsed_s,
                            result.version, result.gap, result.step)

    def _update(self, plan: Plan, me: PlanDevice, shards: list[ShardUpdate], buffers: list[ShardUpdate],
                samples: int, loss: float, elapsed: float, version: int, gap: bool, mesh_step: int) -> GradientUpdate:
        """Count a step computed under ``plan`` and make its update."""
        self.recent.stepped(me.batch_size, elapsed, loss)
        self.m_steps.inc()
        self.m_step.observe(elapsed)
        self.m_loss.set(loss)
        self.m_version.set(version)
        self.seq += 1
        return GradientUpdate(device=self.device, cluster=me.cluster, incarnation=self.incarnation, seq=self.seq,
                              base_version=version, samples=samples, need_snapshot=gap, shards=tuple(shards),
                              buffers=tuple(buffers), loss=loss, step_time_s=elapsed, sent_at=time.time(),
                              mesh_step=mesh_step, plan_version=plan.version)
