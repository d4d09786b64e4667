"""A worker's membership of a model-parallel cluster: joining, agreeing on each step, leaving (docs/mesh.md).

* **Join** (a plan puts the device in a cluster of several): build this member's slices
  (``MeshMember``), keep only its rows of the model (a new division needs a fresh snapshot), route
  the other members' forward slices and step messages and the backward slices addressed to it,
  and take its part of every model delta (``model/delta/{device}``) instead of the broadcast.
* **A step**: the first member waits, before a plan's first step, until every other member is
  ready (their retained ``MeshReady``, which says how many samples each holds), then announces the step, the
  model version and the step's owner (``MeshBegin``): member ``step % k``, or the next in member order that holds
  data (``owner_of``). The owner draws the batch from its own data (``batch_at``) and sends it to the others as the
  first layer's ``input`` slice; every member computes on it. Each piece of compute runs in a thread and
  is held to the board's speed; gradients leave as the member's shards, the change of its rows of the
  running statistics as exact float32 shards beside them.
* **Leave** (a plan makes it a cluster of one): whole parameters again, the broadcast again.
* **A sharded parameter server** (``ShardedView``): each shard's view keeps the member's rows within that
  shard's, each shard sends the member its part of every delta (empty where it holds none of its rows), and
  the gradient is cut at the shards' rows; the worker sends each shard its part, empty ones too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgemesh.common import costs, models
from edgemesh.common.broadcast import ModelView
from edgemesh.common.bus import Bus, Route
from edgemesh.common.config import WorkerConfig
from edgemesh.common.data import batch_at
from edgemesh.common.errors import DataError, ModelError
from edgemesh.common.messages import (
    CodecPolicy,
    MeshBegin,
    MeshReady,
    MeshSlice,
    ModelDelta,
    Plan,
    PlanCluster,
    PlanDevice,
    ShardUpdate,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.shards import ShardedView
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.services.worker.board import Board
from edgemesh.services.worker.mesh.exchange import BusExchange
from edgemesh.services.worker.mesh.member import Batch, MeshMember, owner_of
from edgemesh.services.worker.trainer import Trainer

logger = logging.getLogger(__name__)

STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
AVERAGE_WINDOW = 20
"""Steps over which per-layer busy times are averaged for stats."""
MIN_MEASURED_SHARE = 0.1
"""Members doing less than this share of the model's work report no measured speed."""
MESH_OUTCOMES = ("done", "abandoned", "no_start")
"""Outcomes of a model-parallel step (``edgemesh_worker_mesh_steps_total``'s label)."""
Wait = Callable[[str, Callable[[], bool]], Awaitable[None]]
"""``wait(what, predicate)``: until ``predicate()`` holds, saying what it waits for."""


@dataclass(frozen=True, slots=True)
class MeshResult:
    """One step of this member: its shards and what the worker reports of it."""

    shards: list[ShardUpdate]
    samples: int
    loss: float
    elapsed_s: float
    version: int
    gap: bool
    step: int
    work: tuple[float, float] | None
    """(training FLOPs, compute seconds), when this member's share is large enough to measure speed by."""
    buffers: list[ShardUpdate] = field(default_factory=list)
    """The change of this member's rows of the running statistics (and, the first member's, of the batch counters)
    as float32 shards, cut as the gradient is."""


class MeshSession:
    """This device's part of a model-parallel cluster (None of it while in a cluster of one)."""

    def __init__(self, *, topics: Topics, device: str, config: WorkerConfig, view: ModelView | ShardedView,
                 board: Board, trainer: Trainer, metrics: ServiceMetrics, current_plan: Callable[[], Plan | None],
                 wait: Wait, on_delta: Callable[[ModelDelta, TopicMatch], Awaitable[None]],
                 ask_for_model: Callable[[], Awaitable[None]]) -> None:
        self.topics, self.device, self.cfg = topics, device, config
        self.view, self.board, self.trainer = view, board, trainer
        self._current_plan, self._wait, self._on_delta = current_plan, wait, on_delta
        self._ask_for_model = ask_for_model
        """Asks the parameter server for a snapshot (the worker's ``SnapshotRequest``)."""
        self._bus: Bus | None = None
        self._model_routes: list[Route[Any]] = []
        self._broadcast_routes: list[Route[Any]] = []
        self.member: MeshMember | None = None
        self._key: tuple[Any, ...] | None = None
        self._exchange: BusExchange | None = None
        self._routes: list[Route[Any]] = []
        self._begin: MeshBegin | None = None
        """The latest step start announced by this device's cluster leader."""
        self._ready: dict[tuple[str, str], int] = {}
        """(cluster, member) -> the latest plan version that member is ready under."""
        self._holding: dict[tuple[str, str], int] = {}
        """(cluster, member) -> the samples that member said it holds when it was last ready (-1: not said)."""
        self._held = -1
        """Samples this device holds under the current plan (0: none, or its data are missing; -1: not known yet)."""
        self._ready_sent: tuple[str, int] | None = None
        """(cluster, plan version) this device last announced itself ready for."""
        self._step = 0
        """The last step this device took part in, in the current exchange (0 = none yet)."""
        self._changed = asyncio.Event()
        self.layer_busy: dict[str, deque[float]] = {}
        """Seconds per step each layer kept this member busy: computing, or its link moving the layer's slices."""
        self.m_steps = metrics.counter("mesh_steps", "Model-parallel steps by outcome", ["outcome"])
        for outcome in MESH_OUTCOMES:  # 0 until one happens, not absent: a dashboard shows "none yet"
            self.m_steps.labels(outcome=outcome)
        self.m_wait = metrics.histogram("mesh_wait_seconds", "Time of a model-parallel step spent waiting for "
                                        "other members", STEP_BUCKETS)

    def attach(self, bus: Bus, model_routes: list[Route[Any]], broadcast_routes: list[Route[Any]]) -> None:
        """The worker's bus, and its routes of snapshots and of broadcast deltas, one of each per parameter
        server shard (a member trades the deltas' for its own part of every delta, and takes them back when it
        leaves)."""
        self._bus, self._model_routes, self._broadcast_routes = bus, model_routes, broadcast_routes

    @property
    def bus(self) -> Bus:
        assert self._bus is not None, "attach() first"
        return self._bus

    @property
    def active(self) -> bool:
        return self.member is not None

    def new_plan(self, plan: Plan) -> None:
        """A plan arrived: a step of an older one is abandoned at once."""
        if self._exchange is not None and self._exchange.plan_version != plan.version:
            self._exchange.abort(f"plan version {plan.version} replaced {self._exchange.plan_version}")
        self._changed.set()

    # ------------------------------------------------------------------ routes
    async def on_slice(self, piece: MeshSlice, where: TopicMatch) -> None:
        if self._exchange is not None:
            self._exchange.deliver(piece, where.device)

    async def on_begin(self, begin: MeshBegin, _: TopicMatch) -> None:
        self._begin = begin
        self._changed.set()

    async def on_ready(self, ready: MeshReady, _: TopicMatch) -> None:
        self._ready[(ready.cluster, ready.device)] = ready.plan_version
        self._holding[(ready.cluster, ready.device)] = ready.samples
        self._changed.set()

    def _member_routes(self, cluster: PlanCluster) -> list[Route[Any]]:
        """What a member consumes: the other members' forward and input slices, step starts and readiness (one
        filter each, so its own do not come back), the backward slices addressed to it, and its part
        of every model delta."""
        t, c = self.topics, cluster.cluster
        others = [m for m in cluster.members if m != self.device]
        shards = self.view.shard_topics(t)
        return [*(Route(t.mesh_filter(c, "+", "fwd", m), MeshSlice, self.on_slice) for m in others),
                *(Route(t.mesh_filter(c, "+", "input", m), MeshSlice, self.on_slice) for m in others),
                *(Route(t.mesh_filter(c, "step", "begin", m), MeshBegin, self.on_begin) for m in others),
                *(Route(t.mesh_filter(c, "step", "ready", m), MeshReady, self.on_ready) for m in others),
                Route(t.backward_filter(c, self.device), MeshSlice, self.on_slice),
                *(Route(st.delta_filter(self.device), ModelDelta, self._on_delta) for st in shards)]

    # ------------------------------------------------------------------ joining and leaving
    async def join(self, plan: Plan, me: PlanDevice, cluster: PlanCluster) -> None:
        """Be member ``me`` of model-parallel ``cluster`` under ``plan``: its slices, routes and exchange."""
        index = cluster.members.index(self.device)
        key = (plan.model_spec, plan.seed, cluster.cluster, index, tuple(sorted(cluster.counts.items())))
        if key != self._key:
            self.member = await asyncio.to_thread(MeshMember, plan.model_spec, cluster.counts, index, seed=plan.seed)
            self._key = key
            self.layer_busy.clear()
            if not self.view.restrict(self.member.rows()):  # keep this member's rows of the model only
                await self.refresh_model()
            logger.info("%s: member %d of %s (%s), %d parameters", self.device, index, cluster.cluster,
                        ", ".join(f"{k} {v[index]}/{sum(v)}" for k, v in cluster.counts.items()),
                        self.member.param_count)
        await asyncio.to_thread(self.trainer.know_model, plan.model_spec, plan.seed)
        # its part of every model delta replaces the broadcast (routed first: no delta falls between)
        routes = self._member_routes(cluster)
        if [r.filter for r in routes] != [r.filter for r in self._routes]:
            new = {r.filter for r in routes}
            await self.bus.subscribe(*(r for r in routes if r.filter not in {o.filter for o in self._routes}))
            await self.bus.unsubscribe(*[r.filter for r in self._routes if r.filter not in new],
                                       *([] if self._routes else [r.filter for r in self._broadcast_routes]))
            self._routes = routes
        if self._exchange is None or (self._exchange.plan_version, self._exchange.cluster) != (plan.version,
                                                                                              cluster.cluster):
            assert self.member is not None
            if self._exchange is not None:
                self._exchange.abort(f"plan version {plan.version} replaced {self._exchange.plan_version}")
            self._step = 0  # step numbers belong to one leader and plan
            spec = models.get_spec(plan.model_spec)
            self._exchange = BusExchange(self.bus, self.topics, cluster=cluster.cluster, device=self.device,
                                         members=cluster.members, counts=cluster.counts, order=self.member.order,
                                         plan_version=plan.version, timeout_s=self.cfg.mesh_timeout_s,
                                         dtype=self.cfg.mesh_dtype, input_shape=spec.input_shape,
                                         classes=spec.num_classes, skips=self.member.skips)
        try:
            self._held = len(await asyncio.to_thread(self.trainer.shard, plan, me))
        except DataError as exc:  # it never owns a step; the others' batches still need its slices
            if self._held != 0:
                logger.warning("%s: no training data (%s): other members' data give every step's batch", self.device,
                               exc)
            self._held = 0

    async def leave(self) -> None:
        """Back to training the whole model: the view needs every row again (a snapshot)."""
        if self.member is not None and not self.view.restrict(None):
            await self.refresh_model()
        if self._routes:
            await self.bus.subscribe(*self._broadcast_routes)
            await self.bus.unsubscribe(*(r.filter for r in self._routes))
        self._routes, self.member, self._key, self._exchange = [], None, None, None
        self.layer_busy.clear()

    async def refresh_model(self) -> None:
        """Get a whole snapshot again: the view lacks rows it now needs. Subscribing again makes the
        broker send the retained one; the parameter server publishes a newer one if that is old."""
        logger.info("%s: the new division needs other rows of the model: fetching a snapshot", self.device)
        await self.bus.subscribe(*self._model_routes)
        await self._ask_for_model()

    # ------------------------------------------------------------------ one step
    async def step(self, plan: Plan, me: PlanDevice, cluster: PlanCluster, policy: CodecPolicy | None,
                   link_rates: tuple[float, float]) -> MeshResult | None:
        """One step of this device's slice with the rest of its cluster; None if it was abandoned."""
        await self.join(plan, me, cluster)
        member, exchange = self.member, self._exchange
        assert member is not None and exchange is not None
        await self._wait("a model snapshot", lambda: self.view.ready)
        started = time.perf_counter()
        agreed = await self._start(plan, cluster)
        if agreed is None:
            self.m_steps.labels(outcome="no_start").inc()
            return None
        step, _, owner = agreed
        self._step = step
        assert self.view.params is not None
        params, version, gap = self.view.params, self.view.version, self.view.gap
        stamp = self.view.stamp
        if member.version != stamp:
            await asyncio.to_thread(member.load, params, stamp)
        mine = owner in (-1, member.index)  # -1: a leader that names no owner; every member draws the batch
        own: Batch | None = batch_at(self.trainer.shard(plan, me), me.batch_size, seed=plan.seed + me.shard_index,
                                     step=step) if mine else None
        exchange.begin(step, len(own[1]) if own is not None else 0, owner)
        try:
            x, y = own if owner < 0 and own is not None else await exchange.inputs(step, owner, own)
            result = await member.step(step, x, y, exchange, run=self._run)
        except ModelError as exc:  # a member timed out, or sent what does not fit
            self.m_steps.labels(outcome="abandoned").inc()
            logger.warning("%s: model-parallel step abandoned: %s", self.device, exc)
            return None
        elapsed = time.perf_counter() - started
        self.m_steps.labels(outcome="done").inc()
        compute = result.compute_s  # board seconds (see _run)
        self.m_wait.observe(max(elapsed - compute, 0.0))
        work = None
        with contextlib.suppress(ModelError):  # a small share's speed is its per-call overhead: not reported
            if member.flops_per_sample() >= MIN_MEASURED_SHARE * costs.cost(plan.model_spec).train_flops_per_sample:
                work = (member.flops_per_sample() * len(y), compute)
        up, down = link_rates
        for layer, seconds in result.layer_s.items():  # busy: computing, or its link moving the layer's slices
            sent, received = exchange.layer_bytes.get(layer, (0, 0))
            busy = seconds + (sent / up if up else 0.0) + (received / down if down else 0.0)
            self.layer_busy.setdefault(layer, deque(maxlen=AVERAGE_WINDOW)).append(busy)
        shards = await asyncio.to_thread(self.trainer.encode, self.view.pieces(result.grads), policy)
        return MeshResult(shards, len(y), result.loss, elapsed, version, gap, step, work,
                          _exact(self.view.pieces(result.buffers)))

    def layer_busy_s(self) -> dict[str, float]:
        """Median busy seconds per layer of recent steps (for stats)."""
        return {k: float(np.median(v)) for k, v in self.layer_busy.items() if v}

    async def _run(self, fn: Any, *args: Any, flops: float = 0.0) -> Any:
        """One piece of a step in a thread, held to the board's speed; its seconds become the board's."""
        result = await asyncio.to_thread(fn, *args)
        took = await self.board.hold(result[-1], flops)
        return (*result[:-1], took)

    def _holders(self, plan: Plan, cluster: PlanCluster) -> list[bool]:
        """Which members hold training data: this device by its own, the others by what they said when ready
        under ``plan`` (a member not ready, or silent about its data, owns no step)."""
        return [self._held > 0 if m == self.device else (
            self._ready.get((cluster.cluster, m)) == plan.version and self._holding.get((cluster.cluster, m), -1) > 0)
            for m in cluster.members]

    async def _start(self, plan: Plan, cluster: PlanCluster) -> tuple[int, int, int] | None:
        """Agree on the step, model version and the step's owner with the cluster: the first member announces
        them, the others wait for the announcement and that model. None if none came in time."""
        timeout = self.cfg.mesh_timeout_s
        if cluster.members[0] == self.device:
            if not self._step and not await self._members_ready(plan, cluster):
                return None  # a new plan came meanwhile
            # milliseconds since the epoch at the first step: a restarted leader never reuses a step number
            step = self._step + 1 if self._step else time.time_ns() // 1_000_000
            owner = owner_of(step, self._holders(plan, cluster))
            if owner is None:  # none yet: wait for a member's readiness (or the timeout) before trying again
                logger.warning("%s: no member of %s holds training data", self.device, cluster.cluster)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        self._changed.clear()
                        await self._changed.wait()
                return None
            version = self.view.version
            await self.bus.publish(self.topics.mesh(cluster.cluster, "step", "begin", self.device), MeshBegin(
                cluster=cluster.cluster, device=self.device, plan_version=plan.version, step=step,
                model_version=version, owner=owner))
            return step, version, owner

        if self._ready_sent != (cluster.cluster, plan.version):  # routed and holding the model: ready
            await self.bus.publish(self.topics.mesh(cluster.cluster, "step", "ready", self.device), MeshReady(
                cluster=cluster.cluster, device=self.device, plan_version=plan.version, samples=self._held),
                retain=True)
            self._ready_sent = (cluster.cluster, plan.version)

        def announced() -> MeshBegin | None:
            b = self._begin
            if b is None or (b.cluster, b.plan_version) != (cluster.cluster, plan.version):
                return None
            return b if b.step > self._step else None

        try:
            async with asyncio.timeout(timeout):
                while announced() is None:
                    if self._replaced(plan):
                        return None  # a new plan: start over with it
                    self._changed.clear()
                    await self._changed.wait()
                begin = announced()
                assert begin is not None
                await self._wait(f"model version {begin.model_version}",
                                 lambda: self.view.version >= begin.model_version or self.view.gap)
        except TimeoutError:
            logger.info("%s: no step start from %s within %.0fs", self.device, cluster.members[0], timeout)
            return None
        return begin.step, begin.model_version, begin.owner

    async def _members_ready(self, plan: Plan, cluster: PlanCluster) -> bool:
        """The first member, before a plan's first step: wait until every other member is ready under
        ``plan`` (its retained ``MeshReady``), at most ``worker.mesh_timeout_s`` (then the step
        starts anyway, and a member still not listening times it out). False if a new plan came."""
        others = [m for m in cluster.members if m != self.device]

        def waiting() -> list[str]:
            return [m for m in others if self._ready.get((cluster.cluster, m), -1) != plan.version]

        try:
            async with asyncio.timeout(self.cfg.mesh_timeout_s):
                while waiting():
                    if self._replaced(plan):
                        return False
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            logger.info("%s: %s not ready within %.0fs; starting the step anyway", self.device,
                        ", ".join(waiting()), self.cfg.mesh_timeout_s)
        return True

    def _replaced(self, plan: Plan) -> bool:
        current = self._current_plan()
        return current is not None and current.version != plan.version


def _exact(pieces: list[tuple[str, int, int, np.ndarray]]) -> list[ShardUpdate]:
    """Buffers' changes as float32 shards, as a data-parallel worker sends them: running statistics are a few values
    per channel, which a lossy codec and its error feedback would bias."""
    return [ShardUpdate(param=param, start=start, stop=stop, codec="none",
                        data=np.ascontiguousarray(change, dtype=np.float32).tobytes())
            for param, start, stop, change in pieces]
