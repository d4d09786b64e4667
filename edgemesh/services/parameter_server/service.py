"""The parameter server: the global model, its version clock, synchronization and durability.

Backbone (docs/synchronization.md), top to bottom:
1. ``prepare``: build the model and resume from checkpoint and log (``recovery``), in a thread;
2. ``attach``: consume the plan and the gradients; on every connect, publish the retained
   snapshot and sync state again;
3. a gradient: checked against the plan and the model (unknown device, wrong shard, codec error,
   NaN: a counted rejection and a ``discarded`` ack), a model-parallel member's part joined with
   its cluster's (``assembly``), then queued;
4. the step loop: the queued updates go to the policy's scheduler (``scheduler``); the steps it forms are
   applied (``optimizer``) and logged durably (``recovery``) in one thread hop; the model goes out
   (``broadcast``), then the acks (``acks``); then an evaluation (``evaluation``) and a checkpoint when due;
5. the retained ``sync`` state (policy, bound and, under ``adaptive``, deadline, delay indices and
   slow devices) for the planner, which gives slow devices smaller batches.

Sharded (``edgemesh ps --shard i/n``, ``shards``): this process keeps its rows of the model alone, takes
gradients (a model-parallel step once every member's part is in), acks and broadcasts on its shard's topics,
checkpoints in a directory of its own, and is otherwise the same server; shard 0 alone runs the policy and
publishes its steps, which the others take (``shard_steps``), and it evaluates the model put together from every
shard's broadcast and publishes the sync state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

import numpy as np

from edgemesh.common.broadcast import Broadcaster, ModelMessage
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import quick_to_decode
from edgemesh.common.config import Config
from edgemesh.common.errors import WireError
from edgemesh.common.jobs import JobSpec
from edgemesh.common.messages import (
    ControlCommand,
    DeviceStatus,
    GradientUpdate,
    LocalEvaluation,
    Plan,
    SnapshotRequest,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.shards import Division
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.common.vocabulary import SYNC_POLICIES, SyncPolicy, payload_reason
from edgemesh.services.parameter_server.acks import Acks
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay, compensated_momentum
from edgemesh.services.parameter_server.assembly import Assembly, Outcome, members_in
from edgemesh.services.parameter_server.evaluation import Evaluator
from edgemesh.services.parameter_server.guard import Evaluated, Guard, Rollback
from edgemesh.services.parameter_server.ledger import Ledger
from edgemesh.services.parameter_server.optimizer import ModelState
from edgemesh.services.parameter_server.peers import Peers
from edgemesh.services.parameter_server.recovery import SETTING_COMMANDS, OperatorSettings, Optimizer, Recovery
from edgemesh.services.parameter_server.robust import Aggregator
from edgemesh.services.parameter_server.scheduler import (
    Ack,
    AdaptiveScheduler,
    Candidate,
    Clock,
    Fleet,
    Step,
    make_scheduler,
)
from edgemesh.services.parameter_server.shard_steps import Follower, Leader
from edgemesh.services.parameter_server.sync_state import SyncAnnouncer
from edgemesh.services.runtime import ControlResult, Endpoint, Events, Job, serve

logger = logging.getLogger(__name__)

DELAY_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)
COMMANDS = "status, pause, resume, set-sync-policy, set-bound, set-lr, set-aggregation, snapshot, stop"
SETTINGS_COMMANDS = ("pause", "resume", *SETTING_COMMANDS)
"""Commands that change what the checkpoint keeps: a checkpoint is written at once, so a crash keeps them."""


class ParameterServer:
    """One parameter server process. ``run()`` until ``stop`` is set."""

    name = "ps"
    control_target = "ps"

    def __init__(self, config: Config, *, stop: asyncio.Event | None = None, job: JobSpec | None = None) -> None:
        self.cfg = config
        t, p = config.training, config.ps
        self.sharded = p.shards > 1
        self.topics = Topics(config.job, p.shard if self.sharded else None)
        self.stop = stop or asyncio.Event()
        self.division: Division | None = None
        """Sharded: the rows of the model this process keeps (known once the model is built)."""
        state_dir = Path(p.state_dir) / f"shard-{p.shard}-of-{p.shards}" if self.sharded else Path(p.state_dir)
        self.policy: SyncPolicy = t.sync_policy
        self.bound = t.staleness_bound
        self.lr = t.lr
        self.paused = False
        self.plan: Plan | None = None
        self.rule = AdaptiveDelay(p.adaptive)
        """The adaptive policy's delay indices and arrival times (kept across policy switches)."""
        self.clock = Clock()
        self.recovery = Recovery(state_dir, fsync=p.fsync)
        self.ledger = Ledger(state_dir, fsync=p.fsync)
        self.broadcast = Broadcaster(p, t.model_spec)
        self.evaluator = Evaluator(config, job)
        self.peers = Peers(p.shards) if self.sharded and p.shard == 0 else None
        """Shard 0: every other shard's broadcast, to evaluate the whole model."""
        self._label = t.model_spec
        """What the checkpoint says it holds: the model, and which shard of it."""
        self.state: ModelState | None = None
        self.assembly = Assembly({}, p.mesh_assembly_timeout_s)
        self.bus: Bus | None = None
        self.events: Events | None = None
        self._queue: deque[Candidate] = deque()
        self._wake = asyncio.Event()
        self._state_lock = threading.Lock()
        """Held by the thread that steps and logs and by the one that checkpoints: a step of a step loop
        cancelled at shutdown still runs in its thread while the final checkpoint is written."""
        self._since_checkpoint = 0
        self._snapshot_requested = False

        m = self.metrics = ServiceMetrics(self.name)
        self.m_version = m.gauge("model_version", "Current global model version")
        self.acks = Acks(self.topics, m)
        self.scheduler = (Follower(self.clock, p.shard_wait_s, m) if self.sharded and p.shard else
                          make_scheduler(self.policy, self.clock, self.rule, staleness_weighting=p.staleness_weighting,
                                         round_scaling=p.round_scaling, staleness_rule=p.staleness_rule,
                                         round_warmup=p.round_warmup))
        self.leader = Leader(self.topics, self._wake.set, p.shards, p.shard_wait_s, m) if self.sharded and not p.shard \
            else None
        """Shard 0: the steps and discards every other shard follows (a follower's scheduler is a ``Follower``)."""
        self.acks.watch = self.leader.answered if self.leader else getattr(self.scheduler, "answered", None)
        self.m_assembling = m.gauge("mesh_assembling_steps", "Model-parallel steps waiting for members' shards")
        self.m_delay = m.histogram("update_delay_versions", "Delay of accepted updates in versions", DELAY_BUCKETS)
        self.m_step = m.histogram("step_seconds", "Time to apply one batch of updates", STEP_BUCKETS)
        self.m_accuracy = m.gauge("eval_accuracy_ratio", "Held-out accuracy of the current model")
        self.m_loss = m.gauge("eval_loss", "Held-out loss of the current model")
        self.m_wal = m.counter("wal_bytes", "Bytes appended to the write-ahead log")
        self.m_checkpoints = m.counter("checkpoints", "Checkpoints written")
        self.m_pending = m.gauge("pending_updates", "Updates queued, in an open round or held by SSP")
        self.m_policy = m.gauge("sync_policy_info", "1 for the active synchronization policy", ["policy"])
        self.m_paused = m.gauge("paused", "1 while paused by an operator")
        self.m_codec_bytes = m.counter("received_gradient_bytes", "Encoded gradient bytes received", ["codec"])
        self.sync_out = SyncAnnouncer(self.topics, p.sync_state_interval_s, m)
        self.aggregator = Aggregator(p, m)
        """How a step's contributions combine (``robust``): the rule in force and the recent norms clip uses."""
        self.guard = Guard(replace(p.guard, enabled=p.guard.enabled and not self.sharded))
        """The divergence guard (``guard``): rolls the model back to its best evaluated state. Not on a sharded
        server, whose shards would have to go back together."""
        self.m_rollbacks = m.counter("guard_rollbacks", "Rollbacks of the model to its best evaluated version")
        self._set_policy_gauge()

    @property
    def version(self) -> int:
        return self.clock.version

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
        # each shard its own MQTT client id: two with one id would take turns throwing each other off
        return Endpoint(self.cfg.broker, name=f"ps-{self.cfg.ps.shard}" if self.sharded else "")

    def _load(self) -> None:
        initial = self.evaluator.load()
        label = self.cfg.training.model_spec
        if self.sharded:
            p = self.cfg.ps
            shapes = {name: v.shape for name, v in initial.items()}
            self.division = Division.of(shapes, p.shard, p.shards)
            initial = self.division.take(initial)
            self.broadcast.own = self.division.local_rows  # a model-parallel member hears of its rows here
            self.assembly.members = lambda cluster, version: members_in(self.plan, cluster, version)
            label = f"{label} (shard {p.shard} of {p.shards})"
            if self.peers is not None:
                self.peers.know(shapes)
            else:
                self.evaluator.enabled = False  # shard 0 evaluates the whole model
        self._label = label
        resumed = self.recovery.resume(label, initial, self.clock, buffers=self.evaluator.buffers)
        self.state = resumed.state
        self._restore(OperatorSettings.of(resumed.settings))
        if self.leader is not None:
            self.leader.resume(resumed.settings.get("shard_steps"), resumed.steps)
        self.ledger.open()  # after the log's replay: the ledger takes any logged step it lacks
        self.assembly.rows = {name: int(p.shape[0]) for name, p in self.state.params.items()  # the parameters:
                              if name not in self.state.buffers}  # what a cluster's members' gradients tile
        self.m_version.set(self.version)

    def _restore(self, kept: OperatorSettings) -> None:
        """Settings the checkpoint kept (a restart keeps what ``pause`` and the ``set-...`` commands set, the
        delay indices, the clusters' cycles and clip's norms), or one an operator's command sets; a None setting
        stays as it is."""
        self.rule.indices.update(kept.delay_indices)
        self.rule.restore_arrivals(kept.cycles)  # the round deadline as it was learned, not max_deadline_s at once
        self.aggregator.norms.extend(kept.norms)
        if kept.policy is not None and kept.policy != self.policy:
            self.policy = kept.policy
            self._set_policy_gauge()
            if not isinstance(self.scheduler, Follower):  # a follower takes shard 0's steps, whatever the policy
                # an open round's updates are judged again under the new policy, not dropped
                self.scheduler = make_scheduler(kept.policy, self.clock, self.rule, carry=self.scheduler.pending(),
                                                staleness_weighting=self.cfg.ps.staleness_weighting,
                                                round_scaling=self.cfg.ps.round_scaling,
                                                staleness_rule=self.cfg.ps.staleness_rule,
                                                round_warmup=self.cfg.ps.round_warmup)
        self.bound = kept.bound if kept.bound is not None else self.bound
        self.lr = kept.lr if kept.lr is not None else self.lr
        self.paused = kept.paused if kept.paused is not None else self.paused
        self.aggregator.rule = kept.aggregation or self.aggregator.rule
        self.aggregator.warn_if_idle(self.policy)
        self.m_paused.set(1 if self.paused else 0)

    def attach(self, bus: Bus, events: Events) -> None:
        self.bus, self.events = bus, events
        self.acks.bus = bus
        bus.route(self.topics.plan_filter(), Plan, self._on_plan)
        bus.route(self.topics.grad_filter(), GradientUpdate, self._on_gradient)
        if self.evaluator.local:  # the devices' statuses bound their reports (their validation shares' samples)
            bus.route(self.topics.status_filter(), DeviceStatus, self._on_status)
            bus.route(self.topics.evaluation_filter(), LocalEvaluation, self._on_local_evaluation)
        if self.peers is not None:
            self.peers.attach(bus, self.topics)
            self.evaluator.assemble = self.peers.whole_model
        bus.route(self.topics.snapshot_request_filter(), SnapshotRequest, self._on_snapshot_request)
        if isinstance(self.scheduler, Follower):
            self.scheduler.attach(bus, self.topics, self._wake.set)
        elif self.leader is not None:
            self.leader.attach(bus)
        bus.on_connect(self._on_connect)

    def jobs(self) -> list[Job]:
        return [self._step_loop(), self.evaluator.run(self._evaluated)]

    async def close(self) -> None:
        await self.acks.drain()  # the acks of the last steps go out before the connection closes, if it holds
        await asyncio.to_thread(self._checkpoint)

    async def _on_connect(self) -> None:
        self._request_snapshot()  # the first, or a restarted broker has lost the retained model
        self.sync_out.forget()  # and the retained sync state

    # ------------------------------------------------------------------ consuming
    async def _on_plan(self, plan: Plan, _: TopicMatch) -> None:
        if self.plan is not None and plan.version < self.plan.version:
            raise WireError(f"plan version {plan.version} is older than {self.plan.version}", "replayed")
        self.plan = plan
        self.evaluator.replanned(plan)
        if plan.devices and self.broadcast.skipped:
            self._request_snapshot()  # the model moved while no plan named a device: nothing went out
        self.rule.retain((d.device for d in plan.devices), plan.cluster_names)
        await self._settle(self.assembly.replanned(plan.version))
        self._wake.set()  # a cluster may have left: an open round may now be complete

    async def _on_status(self, status: DeviceStatus, _: TopicMatch) -> None:
        self.evaluator.know(status)

    async def _on_local_evaluation(self, report: LocalEvaluation, _: TopicMatch) -> None:
        """A device's accuracy on its own validation share: combined with the others' by sample count (a report that
        may not count raises WireError: counted and logged by the bus)."""
        combined = self.evaluator.combine(report, self.version)
        if combined is not None:
            await self._evaluated(*combined)

    async def _on_snapshot_request(self, request: SnapshotRequest, _: TopicMatch) -> None:
        """A member of the plan needs the whole model (a new division): a snapshot, unless the last is current."""
        if self.plan is None or self.plan.device(request.device) is None:
            raise WireError(f"a snapshot request from {request.device}, which the plan does not name",
                            "unknown_device")
        if self.broadcast.last_full != self.version:
            self._request_snapshot()

    async def _on_gradient(self, update: GradientUpdate, match: TopicMatch) -> None:
        """Check an update against plan and model; queue it, or discard it with an ack."""
        assert self.state is not None
        where = self.topics.grad(match.cluster, match.device)
        resent = self.assembly.taken(update, self.clock) if update.mesh_step else self.acks.owes(update)
        if resent:
            self.metrics.reject("queued", where, f"{update.device} seq {update.seq} is queued already", route="grad")
            if isinstance(self.scheduler, Follower):  # shard 0 may have lost what this shard told it of the update
                await self.scheduler.remeasured(update, self.aggregator.rule)
            return  # the queued copy's ack answers this resend too
        if self.plan is not None and self.plan.device(update.device) is None:
            self.metrics.reject("unknown_device", where, update.device, route="grad")
            await self.acks.send(Ack(update, "discarded", "unknown_device"), self.version)
            return
        try:
            if self.division is not None:
                update = replace(update, shards=self.division.localize(update.shards),
                                 buffers=self.division.localize(update.buffers))
            shards = update.shards
            grads = self.state.decode(shards) if quick_to_decode(shards) else \
                await asyncio.to_thread(self.state.decode, shards)
            buffers = self.state.decode(update.buffers, buffers=True)  # float32, a few values per channel
            if isinstance(self.scheduler, Follower) and not update.mesh_step:  # shard 0 judges the whole update
                await self.scheduler.measured(update, grads, self.aggregator.rule)  # (clip, krum)
        except WireError as exc:
            self.metrics.reject(exc.reason, where, exc, route="grad")
            await self.acks.send(Ack(update, "discarded", payload_reason(exc.reason)), self.version)
            return
        for shard in (*update.shards, *update.buffers):
            self.m_codec_bytes.labels(codec=shard.codec).inc(len(shard.data))
        if update.need_snapshot and self.cfg.ps.broadcast == "delta" and self.broadcast.last_full != self.version:
            self._request_snapshot()  # the sender missed a delta
        item = Candidate(update, grads, time.monotonic(), buffers=buffers)
        if update.mesh_step:
            await self._settle(self.assembly.add(item, self.clock, self.plan.version if self.plan else 0,
                                                 time.monotonic()))
            self._wake.set()  # a model-parallel step to time out
            return
        self.acks.owe(update)
        self._queue.append(item)
        self._count_pending()  # a paused server holds it: the gauge says so
        self._wake.set()

    async def _settle(self, outcome: Outcome) -> None:
        """An assembly outcome: the clusters' joined updates queued, the acks sent (rejected parts counted)."""
        self.m_assembling.set(len(self.assembly))
        for joined in outcome.joined:
            if isinstance(self.scheduler, Follower):  # shard 0 judges the cluster's update (clip, krum)
                await self.scheduler.measured(joined.update, joined.grads, self.aggregator.rule)
            self._queue.append(joined)
        if outcome.joined:
            self._count_pending()
            self._wake.set()
        for ack in outcome.rejected:
            u = ack.update
            self.metrics.reject(ack.reason, self.topics.grad(u.cluster, u.device),
                                f"step {u.mesh_step} of {u.cluster}: {ack.reason}", route="grad")
        await asyncio.gather(*(self.acks.send(ack, self.version) for ack in [*outcome.rejected, *outcome.acks]))

    # ------------------------------------------------------------------ stepping
    def _fleet(self) -> Fleet:
        return Fleet.of(self.plan, self.bound, time.monotonic())

    def _momentum(self, plan: Plan | None) -> float:
        """The momentum of the next steps: ``training.momentum``, less under ``async`` and ``ssp`` by the momentum
        the asynchrony of the plan's clusters adds with ``ps.async_momentum = "compensated"``."""
        momentum = self.cfg.training.momentum
        if self.cfg.ps.async_momentum != "compensated" or self.policy not in ("async", "ssp") or plan is None:
            return momentum
        return compensated_momentum(momentum, len({d.cluster for d in plan.devices}))

    async def _step_loop(self) -> None:
        while True:
            fleet = self._fleet()
            timeouts = [t for t in (None if self.paused else self.scheduler.timeout(fleet),
                                    self.assembly.timeout(fleet.now)) if t is not None]
            with contextlib.suppress(TimeoutError):  # an adaptive round's deadline, or a model-parallel step's
                async with asyncio.timeout(min(timeouts) if timeouts else None):
                    await self._wake.wait()
            self._wake.clear()
            await self._settle(self.assembly.expire(time.monotonic()))
            if self._snapshot_requested:
                self._snapshot_requested = False
                await self._publish_snapshot()
            if self.sync_out.owed:
                await self._publish_sync_state()
            if self.paused:
                continue
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.cfg.ps.max_batch))]
            progressed = await self._process(batch)
            # more queued, or a step moved the clocks so an update SSP held may now go
            if self._queue or (progressed and self.scheduler.deferred):
                self._wake.set()

    async def _process(self, batch: list[Candidate]) -> bool:
        """Judge, apply, log, publish, ack; True if the model moved. Acks go out only after the log is durable."""
        started = time.perf_counter()
        fleet, plan = self._fleet(), self.plan  # a plan arriving while the steps apply: theirs reach its members
        decision = self.scheduler.take(batch, fleet)
        for ack in decision.acks:
            if ack.status == "discarded" and ack.reason:
                self.assembly.discarded(ack.update, ack.reason)
        steps = decision.steps
        elsewhere = await self.leader.elsewhere(steps, self.aggregator.rule) if self.leader and steps else []
        message = await asyncio.to_thread(self._apply, steps, elsewhere, plan) if steps else None
        if self.leader is not None:  # the others take these steps once they are in the log
            self.leader.publish(self.version, self.policy)
        for step in steps:
            for item in step.items:
                self.m_delay.observe(step.delay(item))
        if isinstance(self.scheduler, AdaptiveScheduler):
            self.sync_out.gauges(self.rule, fleet, self.scheduler.live(fleet))
            await self._publish_sync_state()
        self._count_pending()
        if message is not None:  # the model goes out before the acks, so a worker acked for version v usually has v
            await self.acks.send_after(functools.partial(self.acks.publish_model, message), decision.acks, self.version)
            self.scheduler.model_published(time.monotonic())
        else:  # acks go to different devices: out at once, the next batch taken while their PUBACKs come back
            self.acks.send_batch(decision.acks, self.version)
        if steps:
            assert self.state is not None
            self.m_step.observe(time.perf_counter() - started)
            self.evaluator.offer(self.version, self.state.params)
            self._since_checkpoint += len(steps)
            if self._since_checkpoint >= self.cfg.ps.checkpoint_every:
                await asyncio.to_thread(self._checkpoint)
        return bool(steps)

    def _apply(self, steps: list[Step], elsewhere: list[list[float]], plan: Plan | None) -> ModelMessage | None:
        """Sum ``steps``' gradients; log the sums while they are applied and the model is encoded for whoever
        listens under ``plan``, the one they were judged under (one thread hop for all)."""
        assert self.state is not None
        t, state, version = self.cfg.training, self.state, steps[-1].version
        momentum = self._momentum(plan)
        with self._state_lock:
            combined = [self.aggregator.combine(step.contributions(), rule=step.rule, elsewhere=far,  # the rule's
                                                chosen=step.chosen)  # gradients
                        for step, far in zip(steps, elsewhere or [[]] * len(steps), strict=True)]
            sums = [state.sum(c.contributions, step.buffer_contributions()) for c, step in zip(combined, steps,
                                                                                              strict=True)]

            def apply_and_encode() -> ModelMessage | None:
                for step, summed, c in zip(steps, sums, combined, strict=True):
                    refused = state.apply(summed, lr=self.lr, momentum=momentum, weight_decay=t.weight_decay)
                    if refused is not None:  # the model stays as it was: the version moves on, nothing else
                        self.aggregator.step_refused(step.version, refused, c)
                return self.broadcast.to_plan(state.params, version, self.policy, plan)

            written, message = self.recovery.log_beside(steps, Optimizer(self.lr, momentum, t.weight_decay),
                                                        combined, [s.grads for s in sums], apply_and_encode)
            self.m_wal.inc(written)
            self.ledger.record(steps)  # before any of their acks
            if self.leader is not None:  # the other shards take them next, clipped or chosen as here
                self.leader.stepped(steps, combined)
            self.clock.version = version
            self.m_version.set(self.version)
        return message

    def _checkpoint(self) -> None:
        """Write a checkpoint and start a fresh log (in a thread, never during a step)."""
        if self.state is None:
            return
        with self._state_lock:
            self._checkpoint_held()

    def _checkpoint_held(self) -> None:
        """``_checkpoint`` with the state lock held."""
        assert self.state is not None
        self.ledger.sync()  # the log about to be emptied is what backs its entries up to now
        self.recovery.checkpoint(self._label, self.state, self.clock, {
            "policy": self.policy, "bound": self.bound, "lr": self.lr, "paused": self.paused,
            "delay_indices": dict(self.rule.indices), "cycles": {c: list(a) for c, a in self.rule.arrivals.items()},
            **self.aggregator.kept(),
            **({"shard_steps": self.leader.kept()} if self.leader else {})})
        self._since_checkpoint = 0
        self.m_checkpoints.inc()

    # ------------------------------------------------------------------ publishing
    def _request_snapshot(self) -> None:
        """Have the step loop publish a snapshot: model publishing is serialized with stepping."""
        self._snapshot_requested = True
        self._wake.set()

    async def _publish_snapshot(self) -> None:
        assert self.bus is not None and self.state is not None
        state = self.state
        payload = await asyncio.to_thread(self.broadcast.snapshot, state.params, self.version, self.policy)
        await self.bus.publish(self.topics.model(), payload, retain=True, kind="model")

    async def whole_model(self) -> tuple[int, dict[str, np.ndarray]] | None:
        """The version and a copy of the whole model as it stands (a job's end); a sharded server's shard 0 adds
        the other shards' rows from their broadcasts once they reach its version (None if one does not)."""
        version, params = await asyncio.to_thread(self._copy_params)
        whole = params if self.peers is None else await self.peers.whole_model(version, params)
        return None if whole is None else (version, whole)

    def _copy_params(self) -> tuple[int, dict[str, np.ndarray]]:
        """The version and a copy of the weights, taken between steps (in a thread)."""
        assert self.state is not None
        with self._state_lock:
            return self.version, {k: v.copy() for k, v in self.state.params.items()}

    async def _publish_sync_state(self) -> None:
        assert self.bus is not None
        if not self.cfg.ps.shard:  # shard 0 speaks for every shard
            await self.sync_out.publish(self.bus, self.scheduler.sync_state(self._fleet(), bound=self.bound,
                                                                            time=time.time()))

    async def _evaluated(self, version: int, loss: float, accuracy: float) -> None:
        """An evaluation during training: reported, then judged by the divergence guard."""
        await self.report_evaluation(version, loss, accuracy)
        if self.evaluator.last is None or self.evaluator.last.version != version or version < self.clock.floor:
            return  # not judged: an evaluation of a model a rollback already left behind
        rollback = self.guard.judge(self.evaluator.last)
        if rollback is not None:
            await self._roll_back(rollback)

    async def _roll_back(self, rollback: Rollback) -> None:
        """Go back to the best evaluated state (weights and buffers; momentum cleared) as a new version, durably,
        with a lower learning rate, and send the model out whole."""
        assert self.events is not None
        before = self.lr
        version = await asyncio.to_thread(self._go_back, rollback.to)
        self.guard.rolled_back()
        self.m_rollbacks.inc()
        self._request_snapshot()
        logger.warning("divergence guard: %s; the model goes back to version %d (accuracy %.4f) as version %d, "
                       "learning rate %g -> %g", rollback.reason, rollback.to.version, rollback.to.accuracy, version,
                       before, self.lr)
        await self.events.emit("rollback", f"{rollback.reason}: back to version {rollback.to.version} (accuracy "
                               f"{rollback.to.accuracy:.4f}) as version {version}; lr {before:g} -> {self.lr:g}",
                               version=version, restored=rollback.to.version, accuracy=rollback.to.accuracy,
                               lr=self.lr)

    def _go_back(self, best: Evaluated) -> int:
        """``best``'s state in place of the model, as the next version, and a checkpoint of it (in a thread, one
        hold of the state lock: no step lands between, and a crash finds one or the other); the new version."""
        assert self.state is not None and best.params is not None
        with self._state_lock:
            for name, value in best.params.items():
                self.state.params[name][...] = value
            for buf in self.state.momentum.values():
                buf.fill(0.0)
            self.clock.version += 1
            self.clock.floor = self.clock.version  # what was computed on the model left behind is not applied
            self.lr *= self.cfg.ps.guard.lr_factor
            self.m_version.set(self.version)
            self._checkpoint_held()
        return self.version

    async def report_evaluation(self, version: int, loss: float, accuracy: float) -> None:
        assert self.events is not None
        self.m_accuracy.set(accuracy)
        self.m_loss.set(loss)
        await self.events.emit("evaluation", f"version {version}: accuracy {accuracy:.4f}, loss {loss:.4f}",
                               version=version, accuracy=accuracy, loss=loss)

    def _count_pending(self) -> None:
        self.m_pending.set(len(self._queue) + len(self.scheduler.pending()))

    def _set_policy_gauge(self) -> None:
        for p in SYNC_POLICIES:
            self.m_policy.labels(policy=p).set(1 if p == self.policy else 0)

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
                if self.broadcast.last_full != self.version:
                    self._request_snapshot()
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
