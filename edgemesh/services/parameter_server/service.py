"""The parameter server: the wiring of its components, and the step loop (docs/synchronization.md).

Backbone, top to bottom:
1. ``prepare``: the shard role takes its part of the model (``shards``), and the model resumes from checkpoint and
   log (``step.Stepper.load`` on ``recovery``), in a thread;
2. ``attach``: consume the plan and the gradients; on every connect, publish the retained snapshot and sync state
   again;
3. a gradient (``intake``): checked against the plan and the model, a model-parallel member's part joined with its
   cluster's (``assembly``), then queued;
4. the step loop (``_step``): the queued updates go to the policy's scheduler (``scheduler``); the steps it forms
   are applied, logged and broadcast (``step``); then the model goes out, and the acks (``acks``) after it; then an
   evaluation (``evaluation``, judged by the divergence ``guard``) and a checkpoint when due;
5. the retained ``sync`` state (policy, bound and, under ``adaptive``, deadline, delay indices and slow devices)
   for the planner, which gives slow devices smaller batches (``sync_state``).

Sharded (``edgemesh ps --shard i/n``), the server is the same with another shard role (``shards``): it keeps its
rows of the model, and shard 0 decides the steps every other shard takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from edgemesh.common.broadcast import Broadcaster
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.errors import WireError
from edgemesh.common.jobs import JobSpec
from edgemesh.common.messages import ControlCommand, GradientUpdate, Plan, SnapshotRequest
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.shards import Division
from edgemesh.common.topics import TopicMatch
from edgemesh.common.vocabulary import SyncPolicy
from edgemesh.services.parameter_server.acks import Acks
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay, compensated_momentum
from edgemesh.services.parameter_server.divergence import Divergence
from edgemesh.services.parameter_server.evaluation import Evaluator
from edgemesh.services.parameter_server.guard import Guard
from edgemesh.services.parameter_server.intake import Intake
from edgemesh.services.parameter_server.ledger import Ledger
from edgemesh.services.parameter_server.optimizer import ModelState
from edgemesh.services.parameter_server.recovery import Optimizer, Recovery
from edgemesh.services.parameter_server.robust import Aggregator
from edgemesh.services.parameter_server.scheduler import Candidate, Clock, Fleet, Scheduler, make_scheduler
from edgemesh.services.parameter_server.settings import COMMANDS, SETTINGS_COMMANDS, OperatorSettings, Settings
from edgemesh.services.parameter_server.shards import role_for
from edgemesh.services.parameter_server.step import Stepper, StepSettings
from edgemesh.services.parameter_server.sync_state import SyncAnnouncer
from edgemesh.services.runtime import ControlResult, Endpoint, Events, Job, serve

logger = logging.getLogger(__name__)

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)


class ParameterServer:
    """One parameter server process. ``run()`` until ``stop`` is set."""

    name = "ps"
    control_target = "ps"

    def __init__(self, config: Config, *, stop: asyncio.Event | None = None, job: JobSpec | None = None) -> None:
        self.cfg, t, p = config, config.training, config.ps
        self.stop = stop or asyncio.Event()
        self.bus: Bus | None = None
        self.events: Events | None = None
        self._wake = asyncio.Event()
        m = self.metrics = ServiceMetrics(self.name)
        self.settings = Settings(t, m)
        """The policy, bound, learning rate and pause in force (``settings``)."""
        self.clock = Clock()
        self.rule = AdaptiveDelay(p.adaptive)
        """The adaptive policy's delay indices and arrival times (kept across policy switches)."""
        self.role = role_for(config.job, p, m, self.clock, self._wake.set)
        self.topics = self.role.topics
        state_dir = self.role.state_dir(Path(p.state_dir))
        self.recovery, self.ledger = Recovery(state_dir, fsync=p.fsync), Ledger(state_dir, fsync=p.fsync)
        self.broadcast = Broadcaster(p, t.model_spec)
        self.evaluator = Evaluator(config, job)
        self.aggregator = Aggregator(p, m)
        """How a step's contributions combine (``robust``): the rule in force and the recent norms clip uses."""
        self.acks = Acks(self.topics, m, watch=self.role.answered)
        self.stepper = Stepper(self.role, self.clock, m, recovery=self.recovery, ledger=self.ledger, acks=self.acks,
                               broadcast=self.broadcast, aggregator=self.aggregator, wake=self._wake.set)
        self.intake = Intake(p, m, role=self.role, stepper=self.stepper, acks=self.acks, aggregator=self.aggregator,
                             wake=self._queued)
        self.scheduler = self.role.scheduler(self.policy, (), self._scheduler_of)
        self.sync_out = SyncAnnouncer(self.topics, p.sync_state_interval_s, m)
        self.guard = Guard(replace(p.guard, enabled=p.guard.enabled and self.role.alone))
        """The divergence guard: rolls the model back to its best evaluated state (not the shards of a server)."""
        self.divergence = Divergence(self.guard, p.guard.lr_factor, m, evaluator=self.evaluator, stepper=self.stepper,
                                     settings=self.settings, kept=self._kept)
        self.m_step = m.histogram("step_seconds", "Time to apply one batch of updates", STEP_BUCKETS)
        self.m_pending = m.gauge("pending_updates", "Updates queued, in an open round or held by SSP")

    @property
    def version(self) -> int:
        return self.clock.version

    @property
    def policy(self) -> SyncPolicy:
        return self.settings.policy

    @property
    def bound(self) -> int:
        return self.settings.bound

    @property
    def lr(self) -> float:
        return self.settings.lr

    @property
    def paused(self) -> bool:
        return self.settings.paused

    @property
    def state(self) -> ModelState | None:
        return self.stepper.state

    @property
    def plan(self) -> Plan | None:
        return self.intake.plan

    @property
    def division(self) -> Division | None:
        """Sharded: the rows of the model this process keeps (known once the model is built)."""
        return self.role.division

    @property
    def last_accuracy(self) -> float | None:
        return self.evaluator.last_accuracy

    async def run(self, *, signals: bool = False) -> None:
        await serve(self, self.cfg, signals=signals)

    # ------------------------------------------------------------------ the runtime's seams
    async def prepare(self, stack: contextlib.AsyncExitStack) -> Endpoint:
        await asyncio.to_thread(self._load)
        stack.callback(self.recovery.close)
        stack.callback(self.ledger.close)
        logger.info("parameter server up: model %s, version %d, policy %s, bound %d, aggregation %s",
                    self.cfg.training.model_spec, self.version, self.policy, self.bound, self.aggregator.rule)
        return Endpoint(self.cfg.broker, name=self.role.client_name)

    def _load(self) -> None:
        initial = self.role.take_part(self.evaluator.load(), broadcast=self.broadcast, assembly=self.intake.assembly,
                                      evaluator=self.evaluator, plan=lambda: self.plan)
        self.guard.chance = self.evaluator.chance
        resumed = self.stepper.load(self.role.label(self.cfg.training.model_spec), initial,
                                    self.evaluator.buffers, self.evaluator.momenta)
        self._restore(OperatorSettings.of(resumed.settings))
        self.role.resume(resumed.settings, resumed.steps)
        self.ledger.open()  # after the log's replay: the ledger takes any logged step it lacks
        self.intake.assembly.rows = {name: int(p.shape[0]) for name, p in resumed.state.params.items()  # what a
                                     if name not in resumed.state.buffers}  # cluster's members' gradients tile

    def _restore(self, kept: OperatorSettings) -> None:
        """Settings the checkpoint kept (a restart keeps what ``pause`` and the ``set-...`` commands set, the
        delay indices, the clusters' cycles and clip's norms), or one an operator's command sets; a None setting
        stays as it is."""
        self.rule.indices.update(kept.delay_indices)
        self.rule.restore_arrivals(kept.cycles)  # the round deadline as it was learned, not max_deadline_s at once
        self.aggregator.norms.extend(kept.norms)
        self.aggregator.rule = kept.aggregation or self.aggregator.rule
        if self.settings.take(kept):  # an open round's updates are judged again under the new policy, not dropped
            self.scheduler = self.role.scheduler(self.policy, self.scheduler.pending(), self._scheduler_of)
        self.aggregator.warn_if_idle(self.policy)

    def _kept(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the model: the operator's settings and what the role keeps."""
        return OperatorSettings(
            policy=self.policy, bound=self.bound, lr=self.lr, paused=self.paused, aggregation=self.aggregator.rule,
            delay_indices=dict(self.rule.indices), cycles={c: list(a) for c, a in self.rule.arrivals.items()},
            norms=list(self.aggregator.norms)).kept() | self.role.kept()

    def _scheduler_of(self, policy: SyncPolicy, carry: Sequence[Candidate]) -> Scheduler:
        p = self.cfg.ps
        return make_scheduler(policy, self.clock, self.rule, carry=carry, staleness_weighting=p.staleness_weighting,
                              round_scaling=p.round_scaling, staleness_rule=p.staleness_rule,
                              round_warmup=p.round_warmup)

    def attach(self, bus: Bus, events: Events) -> None:
        self.bus = self.acks.bus = self.stepper.bus = bus
        self.events = self.divergence.events = events
        bus.route(self.topics.plan_filter(), Plan, self._on_plan)
        bus.route(self.topics.grad_filter(), GradientUpdate, self.intake.on_gradient)
        self.evaluator.attach(bus, self.topics, version=lambda: self.version, report=self.divergence.evaluated)
        bus.route(self.topics.snapshot_request_filter(), SnapshotRequest, self._on_snapshot_request)
        self.role.attach(bus)
        bus.on_connect(self._on_connect)

    def jobs(self) -> list[Job]:
        return [self._step_loop(), self.evaluator.run(self.divergence.evaluated)]

    async def close(self) -> None:
        await self.acks.drain()  # the acks of the last steps go out before the connection closes, if it holds
        await asyncio.to_thread(self._checkpoint)

    async def _on_connect(self) -> None:
        self.stepper.request_snapshot()  # the first, or a restarted broker has lost the retained model
        self.sync_out.forget()  # and the retained sync state

    # ------------------------------------------------------------------ consuming
    async def _on_plan(self, plan: Plan, _: TopicMatch) -> None:
        if self.plan is not None and plan.version < self.plan.version:
            raise WireError(f"plan version {plan.version} is older than {self.plan.version}", "replayed")
        self.intake.plan = plan
        self.role.planned(plan)
        self.evaluator.replanned(plan)
        if plan.devices and self.broadcast.skipped:
            self.stepper.request_snapshot()  # the model moved while no plan named a device: nothing went out
        self.rule.retain((d.device for d in plan.devices), plan.cluster_names)
        await self.intake.settle(self.intake.assembly.replanned(plan.version))
        self._wake.set()  # a cluster may have left: an open round may now be complete

    async def _on_snapshot_request(self, request: SnapshotRequest, _: TopicMatch) -> None:
        """A member of the plan needs the whole model (a new division): a snapshot, unless the last is current."""
        if self.plan is None or self.plan.device(request.device) is None:
            raise WireError(f"a snapshot request from {request.device}, which the plan does not name",
                            "unknown_device")
        self.stepper.request_snapshot(unless_current=True)

    # ------------------------------------------------------------------ stepping
    def _fleet(self) -> Fleet:
        return Fleet.of(self.plan, self.bound, time.monotonic(), lr_batch=self.cfg.training.batch_size)

    def _settings(self, plan: Plan | None) -> StepSettings:
        """What the next steps apply with: under ``async`` and ``ssp`` with ``ps.async_momentum = "compensated"``,
        ``training.momentum`` less the momentum the asynchrony of the plan's clusters adds."""
        t, momentum = self.cfg.training, self.cfg.training.momentum
        if self.cfg.ps.async_momentum == "compensated" and self.policy in ("async", "ssp") and plan is not None:
            momentum = compensated_momentum(momentum, len({d.cluster for d in plan.devices}))
        return StepSettings(Optimizer(self.lr, momentum, t.weight_decay), self.policy)

    async def _step_loop(self) -> None:
        while True:
            fleet = self._fleet()
            timeouts = [t for t in (None if self.paused else self.scheduler.timeout(fleet),
                                    self.intake.assembly.timeout(fleet.now)) if t is not None]
            with contextlib.suppress(TimeoutError):  # an adaptive round's deadline, or a model-parallel step's
                async with asyncio.timeout(min(timeouts) if timeouts else None):
                    await self._wake.wait()
            self._wake.clear()
            plan_version = self.plan.version if self.plan else 0
            await self.intake.settle(self.intake.assembly.expire(time.monotonic(), plan_version))
            if self.stepper.snapshot_owed:
                await self.stepper.publish_snapshot(self.policy)
            if self.sync_out.owed:
                await self._publish_sync_state()
            if self.paused:
                continue
            progressed = await self._step(self.intake.batch(self.cfg.ps.max_batch))
            # more queued, or a step moved the clocks so an update SSP held may now go
            if self.intake.queue or (progressed and self.scheduler.deferred):
                self._wake.set()

    async def _step(self, batch: list[Candidate]) -> bool:
        """One batch, in order: judged by the scheduler; its steps applied, logged and broadcast (``Stepper.step``:
        acks wait for the log); shard 0's steps and discards to the other shards, once in its log; the sync state
        when the scheduler's rule moved; the model, then the acks (``Stepper.publish``); then an evaluation and a
        checkpoint when due. True if the model moved."""
        started = time.perf_counter()
        fleet, plan = self._fleet(), self.plan  # a plan arriving while the steps apply: theirs reach its members
        decision = self.scheduler.take(batch, fleet)
        self.intake.judged(decision.acks)
        steps = decision.steps
        message = await self.stepper.step(steps, plan, self._settings(plan)) if steps else None
        self.role.publish(self.version, self.policy)
        if self.scheduler.adapts:
            self.sync_out.gauges(self.rule, fleet, self.scheduler.live(fleet))
            await self._publish_sync_state()
        self._count_pending()
        await self.stepper.publish(message, decision.acks)
        if message is not None:
            self.scheduler.model_published(time.monotonic())
        if steps:
            assert self.state is not None
            self.m_step.observe(time.perf_counter() - started)
            self.evaluator.offer(self.version, self.state.params)
            if self.stepper.since_checkpoint >= self.cfg.ps.checkpoint_every:
                await asyncio.to_thread(self._checkpoint)
        return bool(steps)

    def _checkpoint(self) -> None:
        """Write a checkpoint and start a fresh log (in a thread, never during a step)."""
        self.stepper.checkpoint(self._kept)

    def _queued(self) -> None:
        """Something for the step loop: an update queued (a paused server holds it: the gauge says so), or a
        model-parallel step to time out."""
        self._count_pending()
        self._wake.set()

    def _count_pending(self) -> None:
        self.m_pending.set(len(self.intake.queue) + len(self.scheduler.pending()))

    # ------------------------------------------------------------------ publishing
    async def whole_model(self) -> tuple[int, dict[str, np.ndarray]] | None:
        """The version and a copy of the whole model as it stands (a job's end); a sharded server's shard 0 adds
        the other shards' rows from their broadcasts once they reach its version (None if one does not)."""
        version, params = await asyncio.to_thread(self.stepper.copy)
        whole = await self.role.whole_model(version, params)
        return None if whole is None else (version, whole)

    async def _publish_sync_state(self) -> None:
        assert self.bus is not None
        if self.role.decides:  # shard 0 speaks for every shard
            await self.sync_out.publish(self.bus, self.scheduler.sync_state(self._fleet(), bound=self.bound,
                                                                            time=time.time()))

    # ------------------------------------------------------------------ control
    async def control(self, cmd: ControlCommand) -> ControlResult:
        self._wake.set()  # a resume, or a new policy or bound, may release queued updates
        match cmd.command:
            case "status" | "stop":
                pass  # the runtime stops the service once the reply is out
            case "pause" | "resume" | "set-sync-policy" | "set-bound" | "set-lr" | "set-aggregation":
                wanted = OperatorSettings.command(cmd.command, cmd.value)
                if isinstance(wanted, str):
                    return False, wanted, {}
                self._restore(wanted)
            case "snapshot":  # a device whose view lacks rows (a new filter division), or an operator
                self.stepper.request_snapshot(unless_current=True)
            case _:
                return False, f"unknown command {cmd.command!r} ({COMMANDS})", {}
        fleet = self._fleet()
        self.sync_out.gauges(self.rule, fleet, self.scheduler.live(fleet))
        if cmd.command in ("set-sync-policy", "set-bound"):
            self.sync_out.forget()  # the step loop publishes the new state (woken above)
        if cmd.command in SETTINGS_COMMANDS:
            await asyncio.to_thread(self._checkpoint)
        return True, "ok", {"version": self.version, "policy": self.policy, "bound": self.bound, "lr": self.lr,
                            "paused": self.paused, "aggregation": self.aggregator.rule, "accuracy": self.last_accuracy,
                            "adaptive_bound": self.rule.bound(),
                            "adaptive_deadline_s": self.rule.deadline(self.scheduler.live(fleet)),
                            "slow_devices": ",".join(self.rule.slow_devices())}
