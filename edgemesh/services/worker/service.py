"""The worker: one device training its share of the model and pushing encoded gradients.

Backbone, top to bottom:
1. ``prepare``: the board (real, or emulated: ``board``) measures its profile and says where to connect;
2. ``attach``: consume the plan, this device's codec policy, the model (``source``: snapshots and deltas of a
   parameter server of one process, or of every shard of a sharded one) and the acks (``uplink``); on every
   connect, announce the device (``presence``: ``online`` status, then the hello, both retained; ``offline`` is
   the will) and resend an unacked update (``sender``);
3. the training loop: wait for a plan naming this device whose share fits it (else refuse it: ``presence``), a
   codec policy and the model; compute a gradient on the next batch, in a thread (``trainer``; a model-parallel
   member with the rest of its cluster: ``mesh.session``), held to the board's speed, encoded with the device's
   codec and error feedback; send it with ``(device, incarnation, seq)`` through the uplink and wait for the
   answer; the source waits for the versions the acks ask for (asking for a snapshot every ack timeout); a
   job evaluated on the devices gets this device's report on its validation share when due (``validation``);
4. every ``worker.stats_interval_s``: stats (``stats``: step time, delay index, uplink and downlink rates and
   latency to the broker (``link``), gradient size, and the host's temperature and throttling as last read), from
   which the compressor picks this device's codec and the planner its batch and its share of a model-parallel
   cluster; the latency is measured by link probes every interval, from the start.

The parameter server is picked once, from ``ps.shards``: its model source and its uplink are the only parts
that differ (``source``, ``uplink``). A policy with ``gateway = true`` makes the worker send raw float32 on
``grad-raw/{cluster}/{device}`` for the compressor to encode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from edgemesh.common.broadcast import ModelView
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import get_codec
from edgemesh.common.config import Config
from edgemesh.common.data import LocalData
from edgemesh.common.errors import BusError, WireError
from edgemesh.common.jobs import JobSpec
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    GradientUpdate,
    Plan,
    PlanDevice,
    Scalar,
    UpdateAck,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.shards import ShardedView
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.services.runtime import ControlResult, Endpoint, Events, Job, serve
from edgemesh.services.worker import device_name
from edgemesh.services.worker import profile as prof
from edgemesh.services.worker.board import board_for
from edgemesh.services.worker.incarnation import next_incarnation
from edgemesh.services.worker.mesh.session import MeshSession
from edgemesh.services.worker.presence import Presence
from edgemesh.services.worker.sender import APPLIED, Sender
from edgemesh.services.worker.source import ShardedModel, WholeModel
from edgemesh.services.worker.stats import Recent, Report
from edgemesh.services.worker.step import Steps
from edgemesh.services.worker.trainer import Trainer
from edgemesh.services.worker.uplink import ShardedUplink, Uplink, WholeUplink
from edgemesh.services.worker.validation import ValidationShare

logger = logging.getLogger(__name__)

WAIT_LOG_INTERVAL_S = 10.0
"""How often a worker waiting for a plan, model or ack says so."""
QUIET_DISCARDS = ("stale", "round_full", "future", "replanned")
"""Discards that are part of training (a late or superseded update), not worth a warning."""


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
        self.accepted = 0
        self.plan: Plan | None = None
        self.me: PlanDevice | None = None
        self.policy: CodecPolicy | None = None
        m = self.metrics = ServiceMetrics(self.name)
        self.recent = Recent(config.worker, self.topics, m)
        """Recent steps, delays and link figures: the stats."""
        self.link = self.recent.link
        self.board = board_for(config.worker, self.device, self.link, m, config.broker)
        self.trainer = Trainer(config, self.device, self.board, local=local.train if local is not None else None)
        self.validation = None if local is None or local.validation is None else ValidationShare(
            local.validation, every=job.evaluation.every if job is not None else 0, trainer=self.trainer,
            device=self.device)
        """A submitted job's local validation share: this device reports its accuracy on it."""
        self.bus: Bus | None = None
        self.presence = Presence(device=self.device, incarnation=self.incarnation, topics=self.topics,
                                 board=self.board, link=self.link, can_encode=config.worker.can_encode,
                                 validation_samples=len(self.validation or ()),
                                 metrics=m)
        self.sender = Sender(device=self.device, incarnation=self.incarnation, config=config.worker, link=self.link,
                             metrics=m)
        self.source: WholeModel | ShardedModel
        """What this device holds of the model, from the parameter server's broadcasts."""
        self.uplink: Uplink
        """Where its updates go, and their acks come from."""
        self.source, self.uplink = self._parameter_server()
        self.mesh = MeshSession(topics=self.topics, device=self.device, config=config.worker, view=self.source.view,
                                board=self.board, trainer=self.trainer, metrics=m, current_plan=lambda: self.plan,
                                wait=self._wait_for, on_delta=self.source.on_delta, ask_for_model=self.source.ask)
        self.steps = Steps(device=self.device, incarnation=self.incarnation, trainer=self.trainer, board=self.board,
                           source=self.source, mesh=self.mesh, recent=self.recent, metrics=m)
        self.report = Report(device=self.device, incarnation=self.incarnation, topics=self.topics, config=config.worker,
                             recent=self.recent, sender=self.sender, trainer=self.trainer, board=self.board,
                             mesh=self.mesh, metrics=m)
        self._changed = asyncio.Condition()

    def _parameter_server(self) -> tuple[WholeModel | ShardedModel, Uplink]:
        """The model source and the uplink of the parameter server, picked once: one process, or ``ps.shards``."""
        c, t, d = self.cfg, self.topics, self.device
        if c.ps.shards > 1:
            sharded = ShardedModel(ShardedView(c.ps.shards), topics=t, device=d, trainer=self.trainer,
                                   seed=c.training.seed, spec=self._spec, changed=self._notify)
            return sharded, ShardedUplink(self.sender, t, d, self.metrics, view=sharded.view)
        whole = WholeModel(ModelView(), topics=t, device=d, trainer=self.trainer, seed=c.training.seed,
                           spec=self._spec, changed=self._notify)
        return whole, WholeUplink(self.sender, t, d, self.metrics)

    @property
    def view(self) -> ModelView | ShardedView:
        """The model as this device holds it."""
        return self.source.view

    @property
    def seq(self) -> int:
        """The last update's number."""
        return self.steps.seq

    async def run(self, *, signals: bool = False) -> None:
        await serve(self, self.cfg, signals=signals)

    # ------------------------------------------------------------------ the runtime's seams
    async def prepare(self, stack: contextlib.AsyncExitStack) -> Endpoint:
        import torch  # heavy: only the training processes pay for it

        torch.set_num_threads(self.cfg.worker.threads)
        profile = self.presence.profile = await asyncio.to_thread(self.board.measure)
        logger.info("%s: %.2f GFLOP/s, %.0f MiB available%s", self.device, profile.flops / 1e9,
                    profile.memory_bytes / 2**20, self.board.describe())
        broker = await self.board.connect(stack, self.cfg.broker)
        return Endpoint(broker, name=self.device, will=self.presence.will())

    def attach(self, bus: Bus, events: Events) -> None:
        self.bus = self.presence.bus = bus
        self.presence.events = events
        bus.route(self.topics.plan_filter(), Plan, self._on_plan)
        bus.route(self.topics.codec_filter(self.device), CodecPolicy, self._on_policy)
        models, deltas = self.source.route(bus)
        self.uplink.route(bus)
        bus.on_connect(self.presence.announce)
        bus.on_connect(self.sender.on_connect)
        bus.on_joined(self.recent.on_joined)
        self.mesh.attach(bus, models, deltas)  # a member swaps the deltas for its part of each

    def jobs(self) -> list[Job]:
        assert self.bus is not None
        bus, report = self.bus, self.report
        return [self._train(), report.keep_publishing(bus, self._wait_for), report.keep_probing(bus)]

    async def close(self) -> None:
        await self.presence.leave(self.cfg.broker.connect_timeout_s)

    async def control(self, cmd: ControlCommand) -> ControlResult:
        result: dict[str, Scalar] = {"accepted": self.accepted, "version": self.trainer.model_version}
        match cmd.command:
            case "stop":
                logger.info("%s: stop requested by %s", self.device, cmd.requester)
                return True, "stopping", result
            case "status":
                return True, f"accepted {self.accepted} updates, model version {self.trainer.model_version}", result
        return False, f"unknown command {cmd.command!r} for a worker (stop, status)", {}

    # ------------------------------------------------------------------ consuming
    async def _on_plan(self, plan: Plan, _: TopicMatch) -> None:
        if self.plan is not None and plan.version < self.plan.version:
            raise WireError(f"plan version {plan.version} is older than {self.plan.version}", "replayed")
        self.plan, self.me = plan, plan.device(self.device)
        if self.me is not None:
            self.board.begin()  # an emulated scenario's clock starts with the first plan naming the device
            await self._judge_share(plan, self.me)
        self.mesh.new_plan(plan)
        await self._notify()

    async def _judge_share(self, plan: Plan, me: PlanDevice) -> None:
        """Refuse this device's share of ``plan`` if it does not fit in its memory (judged once, as the plan comes)."""
        profile = self.presence.profile
        refusal = prof.share_refusal(plan, me, profile.memory_bytes) if profile is not None else None
        if refusal:
            await self.presence.refuse(plan.version, refusal)

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

    def _spec(self) -> str:
        """The model the plan names (the configuration's before a plan)."""
        return self.plan.model_spec if self.plan else self.cfg.training.model_spec

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

    # ------------------------------------------------------------------ training
    async def _train(self) -> None:
        await self._wait_for("a plan naming this device", lambda: self.me is not None)
        await self._wait_for_policy()
        source = self.source
        while True:
            await self._wait_for("a plan naming this device", self._has_share)
            await self._wait_for(source.waiting_for, source.holds, every=self.cfg.worker.ack_timeout_s,
                                 stalled=source.ask if source.behind else None)  # behind: ask, every ack timeout
            if self.plan is None or self.me is None:
                continue  # a plan that leaves this device out came while it waited for the model
            update = await self.steps.next(self.plan, self.me, self.policy)
            if update is None:
                continue  # abandoned (a member left or lags; the planner re-plans), or left a mesh
            answer = await self.uplink.send(update, self.policy)
            source.resync(answer.acks)
            if await self._answered(update, answer.ack):
                return

    async def _wait_for_policy(self) -> None:
        """A codec policy, for at most ``worker.codec_wait_s``: until one comes, the device sends uncompressed."""
        if self.policy is not None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.cfg.worker.codec_wait_s):
                await self._wait_for("a codec policy", lambda: self.policy is not None)
        if self.policy is None:
            logger.info("%s: no codec policy yet; sending uncompressed", self.device)

    async def _answered(self, update: GradientUpdate, ack: UpdateAck) -> bool:
        """Follow the parameter server's answer to ``update``; True once ``worker.max_steps`` were accepted."""
        await self._notify()  # the stats loop waits for the first ack
        self.recent.delays.append(ack.delay)
        if ack.status in APPLIED:
            self.accepted += 1
            await self._evaluate_locally()
            if self.cfg.worker.max_steps and self.accepted >= self.cfg.worker.max_steps:
                logger.info("%s: reached worker.max_steps=%d", self.device, self.accepted)
                self.stop.set()
                return True
        elif ack.reason == "unknown_device":
            async with self._changed:
                self.me = None  # wait for a plan that names us again
        elif ack.reason not in QUIET_DISCARDS:
            logger.warning("%s: update %d discarded: %s", self.device, update.seq, ack.reason)
        return False

    def _has_share(self) -> bool:
        """A plan names this device, and it is newer than the last one it refused."""
        return self.me is not None and self.plan is not None and self.plan.version > self.presence.refused

    async def _evaluate_locally(self) -> None:
        """This device's accuracy on its validation share, when due (not as a model-parallel member's rows)."""
        model = self.source.for_evaluation()
        if self.validation is None or self.bus is None or self.mesh.active or model is None:
            return
        report = await self.validation.report(model)
        if report is not None:
            with contextlib.suppress(BusError):
                await self.bus.publish(self.topics.evaluation(self.device), report)
