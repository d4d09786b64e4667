"""The worker: one device training its share of the model and pushing encoded gradients.

Backbone, top to bottom:
1. ``prepare``: the board (real, or emulated: ``board``) measures its profile and says where to connect;
2. ``attach``: consume the plan, this device's codec policy, the model (snapshots and deltas, into
   the ``ModelView``: ``broadcast``) and its acks; on every connect, announce the device (``online``
   status, then the hello, both retained; ``offline`` is the will) and resend an unacked update;
3. the training loop: wait for a plan naming this device, a codec policy and the model; then
   compute a gradient on the next batch, in a thread (``trainer``; a model-parallel member with
   the rest of its cluster: ``mesh.session``), held to the board's speed, encoded with the
   device's codec and error feedback, published with ``(device, incarnation, seq)`` and waited
   for until acked (``sender``); follow resync requests and new model versions;
4. every ``worker.stats_interval_s``: stats (step time, delay index, uplink and downlink rates and latency to
   the broker (``link``), gradient size, and the host's temperature and throttling as last read), from which the
   compressor picks this device's codec and the planner its batch and its share of a model-parallel cluster;
   the latency is measured by link probes every interval, from the start.

A plan share whose estimated memory (``profile.share_refusal``: by the accounting the planner sized it
with) exceeds what the device offers is refused: the retained status names the refused plan and why,
and the worker waits for a plan that gives it less. A policy with ``gateway = true`` makes the worker send
raw float32 on ``grad-raw/{cluster}/{device}`` for the compressor to encode.

With a sharded parameter server (``ps.shards`` > 1) the model is assembled from every shard's broadcast
and a step sends each shard the gradient of its rows, waiting for every shard's ack (``sharded``); a
model-parallel member does so with its rows of every shard's (``mesh.session``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from edgemesh.common import wire
from edgemesh.common.broadcast import ModelView
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import get_codec
from edgemesh.common.config import Config
from edgemesh.common.data import Dataset, LocalData
from edgemesh.common.errors import BusError, WireError
from edgemesh.common.health import HealthReading
from edgemesh.common.jobs import JobSpec
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    DeviceHello,
    DeviceStats,
    DeviceStatus,
    GradientUpdate,
    LinkProbe,
    LocalEvaluation,
    ModelDelta,
    ModelSnapshot,
    Plan,
    PlanDevice,
    Scalar,
    ShardUpdate,
    SnapshotRequest,
    UpdateAck,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.services.runtime import ControlResult, Endpoint, Events, Job, serve
from edgemesh.services.worker import profile as prof
from edgemesh.services.worker.board import board_for
from edgemesh.services.worker.incarnation import next_incarnation
from edgemesh.services.worker.link import keep_probing
from edgemesh.services.worker.mesh.session import MeshSession
from edgemesh.services.worker.sender import Sender
from edgemesh.services.worker.sharded import ShardedModel
from edgemesh.services.worker.stats import Recent, mean
from edgemesh.services.worker.trainer import Trainer

logger = logging.getLogger(__name__)

STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
WAIT_LOG_INTERVAL_S = 10.0
"""How often a worker waiting for a plan, model or ack says so."""
QUIET_DISCARDS = ("stale", "round_full", "future", "replanned")
"""Discards that are part of training (a late or superseded update), not worth a warning."""
PROBES_PER_INTERVAL = 2
"""Link probes timed every ``worker.stats_interval_s`` (the latency is the shortest recent round trip)."""


class Worker:
    """One device. ``run()`` until ``stop`` is set or ``worker.max_steps`` updates were accepted."""

    name = "worker"

    def __init__(self, config: Config, *, stop: asyncio.Event | None = None, job: JobSpec | None = None,
                 local: LocalData | None = None) -> None:
        self.cfg = config
        self.device = device_name(config)
        self.control_target = f"device/{self.device}"
        self.topics = Topics(config.job)
        self.stop = stop or asyncio.Event()
        self.incarnation = next_incarnation(config.worker.state_dir)
        self.seq = 0
        self.accepted = 0
        self.plan: Plan | None = None
        self.me: PlanDevice | None = None
        self.policy: CodecPolicy | None = None
        self.view = ModelView()
        self.sharded = ShardedModel(config.ps.shards, self.topics, self.device) if config.ps.shards > 1 else None
        """With a sharded parameter server: the model put together from every shard's broadcast."""
        m = self.metrics = ServiceMetrics(self.name)
        self.recent = Recent(config.worker, self.topics, m)
        """Recent steps, delays and link figures: the stats."""
        self.link = self.recent.link
        self.board = board_for(config.worker, self.device, self.link, m, config.broker)
        self.trainer = Trainer(config, self.device, self.board, local=local.train if local is not None else None)
        self.validation: Dataset | None = local.validation if local is not None else None
        """A submitted job's local validation share: this device reports its accuracy on it."""
        self._eval_every = job.evaluation.every if job is not None else 0
        self._evaluated = -1
        """``version // eval_every`` of the last local evaluation."""
        self.profile: prof.Profile | None = None
        self.bus: Bus | None = None
        self.events: Events | None = None
        self.sender = Sender(device=self.device, incarnation=self.incarnation, config=config.worker, link=self.link,
                             metrics=m)
        self.mesh = MeshSession(topics=self.topics, device=self.device, config=config.worker,
                                view=self.sharded.view if self.sharded else self.view, board=self.board,
                                trainer=self.trainer, metrics=m, current_plan=lambda: self.plan, wait=self._wait_for,
                                on_delta=self._on_shard_delta if self.sharded else self._on_delta,
                                ask_for_model=self._ask_for_snapshot)
        self._changed = asyncio.Condition()
        self._refused = 0
        """Version of the last plan whose share did not fit this device's memory (0 = none)."""
        self._refusal = ""

        self.m_steps = m.counter("steps", "Training steps computed")
        self.m_step = m.histogram("step_seconds", "Compute time of one training step", STEP_BUCKETS)
        self.m_updates = m.counter("updates", "Updates by the PS's answer", ["status", "reason"])
        self.m_grad_bytes = m.counter("gradient_bytes", "Encoded gradient bytes sent", ["codec"])
        self.m_version = m.gauge("model_version", "Version of the model this worker trains on")
        self.m_loss = m.gauge("loss", "Training loss of the last batch")
        self.m_refused = m.counter("refused_shares", "Plan shares refused because they do not fit in memory")

    async def run(self, *, signals: bool = False) -> None:
        await serve(self, self.cfg, signals=signals)

    # ------------------------------------------------------------------ the runtime's seams
    async def prepare(self, stack: contextlib.AsyncExitStack) -> Endpoint:
        import torch  # heavy: only the training processes pay for it

        torch.set_num_threads(self.cfg.worker.threads)
        self.profile = await asyncio.to_thread(self.board.measure)
        logger.info("%s: %.2f GFLOP/s, %.0f MiB available%s", self.device, self.profile.flops / 1e9,
                    self.profile.memory_bytes / 2**20, self.board.describe())
        broker = await self.board.connect(stack, self.cfg.broker)
        will = wire.encode(DeviceStatus(device=self.device, state="offline", incarnation=self.incarnation))
        return Endpoint(broker, name=self.device, will=(self.topics.status(self.device), will))

    def attach(self, bus: Bus, events: Events) -> None:
        self.bus, self.events = bus, events
        t = self.topics
        self.sender.bus = bus
        bus.route(t.plan_filter(), Plan, self._on_plan)
        bus.route(t.codec_filter(self.device), CodecPolicy, self._on_policy)
        models = [bus.route(t.model_filter(), ModelSnapshot, self._on_snapshot)]
        broadcasts = [bus.route(t.delta_filter(), ModelDelta, self._on_delta)]
        bus.route(t.ack_filter(self.device), UpdateAck, self.sender.on_ack)
        if self.sharded is not None:  # the mesh session swaps these for a member's part of each shard's deltas
            shards = [t.for_shard(shard) for shard in range(self.sharded.count)]
            models = [bus.route(st.model_filter(), ModelSnapshot, self._on_shard_snapshot) for st in shards]
            broadcasts = [bus.route(st.delta_filter(), ModelDelta, self._on_shard_delta) for st in shards]
            for st in shards:
                bus.route(st.ack_filter(self.device), UpdateAck, self.sender.on_ack)
        bus.on_connect(self._announce)
        bus.on_connect(self.sender.on_connect)
        bus.on_joined(self.recent.on_joined)
        self.mesh.attach(bus, models, broadcasts)

    def jobs(self) -> list[Job]:
        return [self._train(), self._report(), self._probe_links()]

    async def close(self) -> None:
        if self.bus is not None and self.bus.is_connected:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.cfg.broker.connect_timeout_s):
                    await self.bus.publish(self.topics.status(self.device), DeviceStatus(
                        device=self.device, state="offline", incarnation=self.incarnation, time=time.time()),
                        retain=True)

    async def _announce(self) -> None:
        """(Re)announce the device: its ``online`` status, then its hello (both retained)."""
        assert self.bus is not None and self.profile is not None
        await self._publish_status()
        b = self.board
        await self.bus.publish(self.topics.hello(self.device), DeviceHello(
            device=self.device, incarnation=self.incarnation, flops=self.profile.flops,
            memory_bytes=self.profile.memory_bytes, cores=self.profile.cores, platform=self.profile.platform,
            software=prof.software(), can_encode=self.cfg.worker.can_encode, link_rate_bps=self.link.declared_bps,
            profile=b.profile_name, downlink_rate_bps=b.downlink_bps, latency_s=b.latency_s), retain=True)

    async def _publish_status(self) -> None:
        """The retained ``online`` status, naming the plan this device refused if it did, and the samples of its
        validation share (the parameter server bounds this device's evaluation reports by them)."""
        assert self.bus is not None
        await self.bus.publish(self.topics.status(self.device), DeviceStatus(
            device=self.device, state="online", incarnation=self.incarnation, time=time.time(),
            refused_plan=self._refused, reason=self._refusal,
            validation_samples=len(self.validation) if self.validation is not None else 0), retain=True)

    # ------------------------------------------------------------------ consuming
    async def _on_plan(self, plan: Plan, _: TopicMatch) -> None:
        if self.plan is not None and plan.version < self.plan.version:
            raise WireError(f"plan version {plan.version} is older than {self.plan.version}", "replayed")
        self.plan, self.me = plan, plan.device(self.device)
        if self.me is not None:
            self.board.begin()  # an emulated scenario's clock starts with the first plan naming the device
        self.mesh.new_plan(plan)
        await self._notify()

    async def _on_policy(self, policy: CodecPolicy, _: TopicMatch) -> None:
        if self.policy is not None and policy.version < self.policy.version:
            raise WireError(f"policy version {policy.version} is older than {self.policy.version}", "replayed")
        if not policy.gateway:
            get_codec(policy.codec)  # refuse a codec this build cannot encode
        old = self.policy
        if old is None or (policy.codec, policy.density, policy.gateway) != (old.codec, old.density, old.gateway):
            logger.info("%s: codec %s, density %g%s (policy version %d)", self.device, policy.codec, policy.density,
                        ", via the gateway" if policy.gateway else "", policy.version)
        self.policy = policy
        await self._notify()

    async def _on_snapshot(self, snap: ModelSnapshot, _: TopicMatch) -> None:
        if not self.trainer.layout and snap.model_spec == self._spec():  # its shapes, before it trained
            await asyncio.to_thread(self.trainer.know_model, snap.model_spec, self.cfg.training.seed)
        self._check_snapshot(snap)
        self.view.load(snap)
        await self._notify()

    async def _on_delta(self, delta: ModelDelta, _: TopicMatch) -> None:
        """The broadcast, or this member's part of it: decoded off the event loop."""
        if delta.model_spec != self._spec():
            raise WireError(f"delta is for model {delta.model_spec}", "shape")
        await self.view.receive(delta)
        await self._notify()

    async def _on_shard_snapshot(self, snap: ModelSnapshot, match: TopicMatch) -> None:
        """A parameter server shard's rows of the model."""
        assert self.sharded is not None
        if snap.model_spec != self._spec():
            raise WireError(f"snapshot is for model {snap.model_spec}", "shape")
        if not self.trainer.layout:
            await asyncio.to_thread(self.trainer.know_model, snap.model_spec, self.cfg.training.seed)
        self.sharded.load(snap, match.shard, self.trainer.layout)
        await self._notify()

    async def _on_shard_delta(self, delta: ModelDelta, match: TopicMatch) -> None:
        assert self.sharded is not None
        if delta.model_spec != self._spec():
            raise WireError(f"delta is for model {delta.model_spec}", "shape")
        await self.sharded.receive(delta, match.shard)
        await self._notify()

    def _spec(self) -> str:
        return self.plan.model_spec if self.plan else self.cfg.training.model_spec

    def _check_snapshot(self, snap: ModelSnapshot) -> None:
        if snap.model_spec != self._spec():
            raise WireError(f"snapshot is for model {snap.model_spec}", "shape")
        layout = self.trainer.layout
        if layout:
            for name, (shape, _) in layout.items():
                t = snap.tensors.get(name)
                if t is None or t.shape != shape:
                    raise WireError(f"snapshot tensor {name} missing or misshapen", "shape")
            if len(snap.tensors) != len(layout):
                raise WireError("snapshot has extra tensors", "shape")

    async def control(self, cmd: ControlCommand) -> ControlResult:
        result: dict[str, Scalar] = {"accepted": self.accepted, "version": self.trainer.model_version}
        match cmd.command:
            case "stop":
                logger.info("%s: stop requested by %s", self.device, cmd.requester)
                return True, "stopping", result
            case "status":
                return True, f"accepted {self.accepted} updates, model version {self.trainer.model_version}", result
        return False, f"unknown command {cmd.command!r} for a worker (stop, status)", {}

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait_for(self, what: str, predicate: Callable[[], bool], *, every: float = WAIT_LOG_INTERVAL_S,
                        stalled: Callable[[], Awaitable[None]] | None = None) -> None:
        """Wait until ``predicate()`` holds, saying so (and calling ``stalled``) every ``every`` seconds."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with self._changed, asyncio.timeout(every):
                    await self._changed.wait_for(predicate)
                    return
            logger.info("%s: waiting for %s", self.device, what)
            if stalled is not None:
                await stalled()

    async def _ask_for_snapshot(self) -> None:
        """Ask for the model: a version an ack named has not come, or a new division needs rows the view lacks."""
        assert self.bus is not None
        held = self.view.version if self.sharded is None else self.sharded.view.version
        with contextlib.suppress(BusError):  # every shard of a sharded parameter server hears it
            await self.bus.publish(self.topics.snapshot_request(self.device),
                                   SnapshotRequest(device=self.device, version=held))

    # ------------------------------------------------------------------ training
    async def _train(self) -> None:
        await self._wait_for("a plan naming this device", lambda: self.me is not None)
        if self.policy is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.cfg.worker.codec_wait_s):
                    await self._wait_for("a codec policy", lambda: self.policy is not None)
            if self.policy is None:
                logger.info("%s: no codec policy yet; sending uncompressed", self.device)
        min_version = 0
        while True:
            await self._wait_for("a plan naming this device", self._has_share)
            assert self.plan is not None and self.me is not None and self.profile is not None
            refusal = prof.share_refusal(self.plan, self.me, self.profile.memory_bytes)
            if refusal:
                await self._refuse(refusal)
                continue
            if self.sharded is not None:
                what, holds, behind = "every parameter server shard's model", self.sharded.holds, self.sharded.resyncing
            else:
                what, holds, behind = f"model version {min_version}", self._holds_model(min_version), min_version > 0
            await self._wait_for(what, holds, every=self.cfg.worker.ack_timeout_s,  # behind: ask, every ack timeout
                                 stalled=self._ask_for_snapshot if behind else None)
            update = await self._compute()
            if update is None:
                continue  # abandoned (a member left or lags; the planner re-plans), or left a mesh
            for s in update.shards:
                self.m_grad_bytes.labels(codec=s.codec).inc(len(s.data))
            ack = await self._send(update)
            await self._notify()  # the stats loop waits for the first ack
            self.recent.delays.append(ack.delay)
            min_version = ack.version if ack.resync else 0
            if ack.status in ("accepted", "duplicate"):
                self.accepted += 1
                await self._evaluate_locally()
                if self.cfg.worker.max_steps and self.accepted >= self.cfg.worker.max_steps:
                    logger.info("%s: reached worker.max_steps=%d", self.device, self.accepted)
                    self.stop.set()
                    return
            elif ack.reason == "unknown_device":
                async with self._changed:
                    self.me = None  # wait for a plan that names us again
            elif ack.reason not in QUIET_DISCARDS:
                logger.warning("%s: update %d discarded: %s", self.device, update.seq, ack.reason)

    async def _send(self, update: GradientUpdate) -> UpdateAck:
        """Send ``update`` and wait for its ack; to a sharded parameter server, each shard its rows (the ack
        that counts is the worst answer; a resync waits for each shard's version)."""
        if self.sharded is None:
            raw = self.policy is not None and self.policy.gateway
            topic = (self.topics.grad_raw if raw else self.topics.grad)(update.cluster, self.device)
            ack = await self.sender.send(update, topic)
            self.m_updates.labels(status=ack.status, reason=ack.reason).inc()
            return ack
        answer, acks = await self.sharded.send(self.sender, update)
        for ack in acks:
            self.m_updates.labels(status=ack.status, reason=ack.reason).inc()
        return answer

    async def _compute(self) -> GradientUpdate | None:
        """One step under the current plan: this device's update, or None when there is none to send."""
        assert self.plan is not None and self.me is not None
        plan, me, policy = self.plan, self.me, self.policy
        cluster = plan.cluster(me.cluster)
        mesh = cluster is not None and len(cluster.members) > 1
        if self.sharded is not None and not mesh and self.mesh.member is None:
            return await self._compute_sharded()
        mesh_step = 0
        shards: list[ShardUpdate]
        buffers: list[ShardUpdate]
        if mesh:
            assert cluster is not None
            result = await self.mesh.step(plan, me, cluster, policy, self.board.link_rates())
            if result is None:
                return None
            shards, buffers, samples, loss = result.shards, [], result.samples, result.loss
            elapsed = result.elapsed_s
            version, gap, mesh_step = result.version, result.gap, result.step
            if result.work is not None:
                self.recent.work.append(result.work)
        else:
            if self.mesh.member is not None:  # a model-parallel member until this plan: its view held its rows
                await self.mesh.leave()
                return None  # start over with the whole model
            params, version, gap = self.view.params, self.view.version, self.view.gap
            assert params is not None
            step = await asyncio.to_thread(self.trainer.step, plan, me, params, version, policy)
            shards, buffers, samples, loss = step.shards, step.buffers, step.samples, step.loss
            elapsed = await self.board.hold(step.seconds, step.flops, samples)
            if step.flops is not None:  # no cost figures: no measured speed
                self.recent.work.append((step.flops, elapsed))
        return self._stepped(plan, me, shards, buffers, samples, loss, elapsed, version, gap, mesh_step)

    async def _compute_sharded(self) -> GradientUpdate:
        """A step on the model assembled from every shard, its gradient cut at the shards' rows."""
        assert self.plan is not None and self.me is not None and self.sharded is not None
        view, plan, me = self.sharded.view, self.plan, self.me
        params, versions = view.params, view.versions
        assert params is not None
        step = await asyncio.to_thread(self.trainer.step, plan, me, params, min(versions), self.policy,
                                       spans=view.spans, stamp=sum(versions))
        elapsed = await self.board.hold(step.seconds, step.flops, step.samples)
        if step.flops is not None:
            self.recent.work.append((step.flops, elapsed))
        return self._stepped(plan, me, step.shards, step.buffers, step.samples, step.loss, elapsed, min(versions),
                             view.gap, 0)

    def _stepped(self, plan: Plan, me: PlanDevice, shards: list[ShardUpdate], buffers: list[ShardUpdate],
                 samples: int, loss: float, elapsed: float, version: int, gap: bool,
                 mesh_step: int) -> GradientUpdate:
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

    def _holds_model(self, version: int) -> Callable[[], bool]:
        """A predicate: the view holds the model at ``version`` or later, or knows it missed a delta."""
        return lambda: self.view.ready and (self.view.version >= version or self.view.gap)

    def _has_share(self) -> bool:
        """A plan names this device, and it is newer than the last one it refused."""
        return self.me is not None and self.plan is not None and self.plan.version > self._refused

    async def _refuse(self, reason: str) -> None:
        """Refuse the current plan's share: say so in the retained status and an event; wait for another plan."""
        assert self.plan is not None and self.events is not None
        self._refused, self._refusal = self.plan.version, reason
        self.m_refused.inc()
        logger.warning("%s: refusing my share of plan version %d: %s", self.device, self.plan.version, reason)
        with contextlib.suppress(BusError):
            await self._publish_status()
            await self.events.emit("share_refused", f"{self.device} refused plan version {self.plan.version}: "
                                   f"{reason}", device=self.device, plan_version=self.plan.version)

    async def _evaluate_locally(self) -> None:
        """Every ``evaluation.every`` versions, the model's accuracy on this device's validation share, for the
        parameter server to combine (a job whose data may not leave the devices)."""
        if self.validation is None or self.bus is None or not self.view.ready or self.mesh.active:
            return
        params, version = self.view.params, self.view.version
        if params is None or version // self._eval_every <= self._evaluated:
            return
        self._evaluated = version // self._eval_every
        loss, accuracy = await asyncio.to_thread(self.trainer.evaluate, self.validation, params, version)
        samples = len(self.validation)
        with contextlib.suppress(BusError):
            await self.bus.publish(self.topics.evaluation(self.device), LocalEvaluation(
                device=self.device, version=version, samples=samples, correct=round(accuracy * samples),
                loss_sum=loss * samples))

    # ------------------------------------------------------------------ reporting
    async def _report(self) -> None:
        """Stats after the first update (the compressor needs step time and gradient size to
        choose a codec at once), then every ``worker.stats_interval_s``."""
        assert self.bus is not None
        sender = self.sender
        await self._wait_for("the first update", lambda: len(sender.comm_times) > 0)
        while True:
            if self.bus.is_connected:
                await self._publish_stats()
            await asyncio.sleep(self.cfg.worker.stats_interval_s)

    async def _probe_links(self) -> None:
        """The latency to the broker, measured from the start (``link.keep_probing``)."""
        assert self.bus is not None
        await keep_probing(self.bus, self.topics.probe(self.device), lambda: LinkProbe(
            device=self.device, incarnation=self.incarnation, time=time.time()), self.recent.latency,
            per_interval=PROBES_PER_INTERVAL, interval_s=self.cfg.worker.stats_interval_s)

    async def _publish_stats(self) -> None:
        assert self.bus is not None
        self.board.sample()
        health = self.metrics.health.latest if self.metrics.health is not None else HealthReading()
        stats = DeviceStats(
            device=self.device, incarnation=self.incarnation, time=time.time(),
            steps=int(self.metrics.value("edgemesh_worker_steps_total")),
            comm_time_s=mean(self.sender.comm_times), rss_bytes=prof.rss_bytes(), cpu_temp_c=health.temperature_c,
            throttled_bits=health.throttled_bits, model_version=max(self.trainer.model_version, 0),
            bytes_sent=int(self.metrics.value("edgemesh_worker_published_bytes_total")),
            gradient_bytes=self.trainer.gradient_bytes, **self.recent.figures(),
            mesh_layer_busy_s=self.mesh.layer_busy_s() if self.mesh.active else {})
        with contextlib.suppress(Exception):
            await self.bus.publish(self.topics.stats(self.device), stats)


def device_name(config: Config) -> str:
    """The device's name: ``worker.device``, else the host name."""
    return config.worker.device or socket.gethostname().split(".")[0]
