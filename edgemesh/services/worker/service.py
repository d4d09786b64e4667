"""The worker: one device training its shard and pushing encoded gradients.

Backbone, top to bottom:
1. profile the device (FLOPS, memory);
2. connect with an ``offline`` will; publish ``online`` status and the hello (retained);
3. wait for a plan that names this device, a codec policy and a model snapshot;
4. loop: compute a gradient on the next batch (in a thread), encode it with the device's
   codec and error feedback, publish it with ``(device, incarnation, seq)``, and wait for its
   ack, resending after a timeout or a reconnect; follow resync requests and new model versions;
5. every ``worker.stats_interval_s``, publish stats: step time, delay index, and the uplink
   rate (``worker.link_rate_bps``, or measured: see ``link``) with the float32 size of one
   gradient, from which the compressor picks this device's codec and density.

A plan share whose estimated memory (``costs.training_memory_bytes``) exceeds what the device
offers is refused: the retained status names the refused plan and why, and the worker waits
for a plan that gives it less.

With ``worker.emulate = PROFILE`` (``--emulate``) the device stands in for a board of
``edgemesh.common.emulation``: its hello reports the profile's speed, memory and links, every
training step (or piece of a model-parallel step) is held until it would have ended on that
board (its training FLOPs at ``costs.TRAIN_EFFICIENCY`` of the board's rate: the planner's cost
model, whatever the load of the host; models without cost figures use the calibrated host step
times the board's slowness), and its MQTT connection goes through an :class:`EmulatedLink` with
the board's rates, latency and disconnects. Off by default.

The codec policy is read afresh for every update, so a new codec or density applies from the
next one; error feedback is keyed by parameter and survives such changes. A policy with
``gateway = true`` (the device said ``can_encode = false``) makes the worker send raw float32
(``none``) on ``grad-raw/{cluster}/{device}``, for the compressor to encode and forward; a
device that cannot encode but has no gateway policy sends ``none`` on ``grad/...`` directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import logging
import os
import socket
import time
from collections import deque
from dataclasses import replace
from typing import Any

import numpy as np

from edgemesh.common import costs, models
from edgemesh.common.bus import Bus, Incoming
from edgemesh.common.codecs import ErrorFeedback, codec_for, get_codec
from edgemesh.common.config import BrokerConfig, Config
from edgemesh.common.data import BatchIterator, Dataset, batch_at, load_dataset, shard
from edgemesh.common.emulation.compute import ComputeStretch, measure_host_gflops
from edgemesh.common.emulation.link import EmulatedLink
from edgemesh.common.emulation.profiles import DeviceProfile, get_profile
from edgemesh.common.errors import BusError, ConfigError, ModelError, WireError
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    DeviceHello,
    DeviceStats,
    DeviceStatus,
    GradientUpdate,
    MeshBegin,
    MeshReady,
    MeshSlice,
    ModelDelta,
    ModelSnapshot,
    Plan,
    PlanCluster,
    PlanDevice,
    Scalar,
    ShardUpdate,
    UpdateAck,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.common.wire import encode
from edgemesh.services.operations import ControlResult, Operations, consume
from edgemesh.services.runtime import client_id, install_stop_signals, supervise
from edgemesh.services.worker import profile as prof
from edgemesh.services.worker.link import LinkMeter
from edgemesh.services.worker.mesh import BusExchange, MeshMember
from edgemesh.services.worker.view import ModelView

logger = logging.getLogger(__name__)

SERVICE = "worker"
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
WAIT_LOG_INTERVAL_S = 10.0
"""How often a worker waiting for a plan, model or ack says so."""
AVERAGE_WINDOW = 20
"""Steps over which step and communication times are averaged for stats."""
MIN_MEASURED_SHARE = 0.1
"""Model-parallel members doing less than this share of the model's work report no measured speed."""
FP32_BYTES = 4
"""Bytes of one float32 gradient value (``DeviceStats.gradient_bytes`` counts these)."""


def _software() -> str:
    try:
        return "edgemesh " + importlib.metadata.version("edgemesh")
    except importlib.metadata.PackageNotFoundError:
        return "edgemesh"


class Worker:
    """One device. ``run()`` until ``stop`` is set or ``worker.max_steps`` updates were accepted."""

    def __init__(self, config: Config, *, stop: asyncio.Event | None = None) -> None:
        self.cfg = config
        self.device = config.worker.device or socket.gethostname().split(".")[0]
        Topics(config.job)  # validates the job name
        self.topics = Topics(config.job)
        self.stop = stop or asyncio.Event()
        self.incarnation = time.time_ns() // 1000
        self.seq = 0
        self.plan: Plan | None = None
        self.me: PlanDevice | None = None
        self.policy: CodecPolicy | None = None
        self.view = ModelView()
        self.accepted = 0
        self.pending: GradientUpdate | None = None
        self._pending_payload: bytes | None = None
        self._pending_topic = ""
        self.link = LinkMeter(config.worker.link_rate_bps)
        """Uplink rate reported in stats: ``worker.link_rate_bps`` if set, else measured."""
        self._gradient_bytes = 0
        self._acks: dict[int, asyncio.Future[UpdateAck]] = {}
        self._changed = asyncio.Condition()
        self._model: Any = None
        self._model_version = -1
        self._layout: dict[str, tuple[tuple[int, ...], str]] = {}
        self._batches: BatchIterator | None = None
        self._shard_key: tuple[Any, ...] | None = None
        self._feedback = ErrorFeedback()
        self._step_times: deque[float] = deque(maxlen=AVERAGE_WINDOW)
        self._stepped_batch = 0
        """Batch size of the steps in ``_step_times``."""
        self._comm_times: deque[float] = deque(maxlen=AVERAGE_WINDOW)
        self._delays: deque[int] = deque(maxlen=AVERAGE_WINDOW)
        self._last_loss: float | None = None
        self.profile: prof.Profile | None = None
        self.bus: Bus | None = None
        self.emulated: DeviceProfile | None = None
        """The board this worker emulates (``worker.emulate``), or None for a real device."""
        if config.worker.emulate:
            self.emulated = get_profile(config.worker.emulate, config.worker.emulation_profiles or None).dilated(
                config.worker.emulation_dilation)
            if config.broker.tls:
                raise ConfigError("worker.emulate: the emulated link relays plain TCP; use mqtt://, not mqtts://")
            if not config.worker.link_rate_bps:
                self.link.declare(self.emulated.uplink_bps)
        self.stretch: ComputeStretch | None = None
        self.emulated_link: EmulatedLink | None = None
        self._refused = 0
        """Version of the last plan whose share did not fit this device's memory (0 = none)."""
        self._mesh: MeshMember | None = None
        """This device's part of a model-parallel cluster (None in a single-device cluster)."""
        self._mesh_key: tuple[Any, ...] | None = None
        self._exchange: BusExchange | None = None
        self._mesh_topics: list[str] = []
        self._mesh_data: Dataset | None = None
        self._mesh_data_key: tuple[Any, ...] | None = None
        self._begin: MeshBegin | None = None
        """The latest step start announced by this device's cluster leader."""
        self._ready: dict[tuple[str, str], int] = {}
        """(cluster, member) -> the latest plan version that member is ready under."""
        self._ready_sent: tuple[str, int] | None = None
        """(cluster, plan version) this device last announced itself ready for."""
        self._mesh_step = 0
        """The last step this device took part in, in the current exchange (0 = none yet)."""
        self._mesh_started = asyncio.Event()

        self._work: deque[tuple[float, float]] = deque(maxlen=AVERAGE_WINDOW)
        """(training FLOPs, compute seconds) of recent steps: the measured speed in stats."""
        self._layer_busy: dict[str, deque[float]] = {}
        self._refusal = ""

        m = self.metrics = ServiceMetrics(SERVICE)
        self.m_steps = m.counter("steps", "Training steps computed")
        self.m_step = m.histogram("step_seconds", "Compute time of one training step", STEP_BUCKETS)
        self.m_updates = m.counter("updates", "Updates by the PS's answer", ["status", "reason"])
        self.m_resends = m.counter("resends", "Updates sent again after an ack timeout or a reconnect")
        self.m_grad_bytes = m.counter("gradient_bytes", "Encoded gradient bytes sent", ["codec"])
        self.m_link = m.gauge("link_rate_bytes_per_second", "Uplink rate reported in stats (declared or measured)")
        self.m_version = m.gauge("model_version", "Version of the model this worker trains on")
        self.m_ack = m.histogram("ack_seconds", "Time from publishing an update to its ack", STEP_BUCKETS)
        self.m_loss = m.gauge("loss", "Training loss of the last batch")
        self.m_refused = m.counter("refused_shares", "Plan shares refused because they do not fit in memory")
        self.m_overruns = m.counter("emulation_overruns", "Emulated steps the host could not compute in the "
                                    "emulated time (the device then ran at the host's pace)")
        self.m_mesh_steps = m.counter("mesh_steps", "Model-parallel steps by outcome", ["outcome"])
        self.m_mesh_wait = m.histogram("mesh_wait_seconds", "Time of a model-parallel step spent waiting for "
                                       "other members", STEP_BUCKETS)
        self.m_link_cuts = m.gauge("emulation_link_disconnects", "Emulated link: connections cut (spontaneous "
                                   "or forced) so far")

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        import torch  # heavy: only the training processes pay for it

        torch.set_num_threads(self.cfg.worker.threads)
        self.profile = await asyncio.to_thread(self._measure)
        logger.info("%s: %.2f GFLOP/s, %.0f MiB available%s", self.device, self.profile.flops / 1e9,
                    self.profile.memory_bytes / 2**20,
                    f" (emulating {self.emulated.name}: steps {self.stretch.ratio:.1f}x the host's)"
                    if self.emulated is not None and self.stretch is not None else "")
        will = encode(DeviceStatus(device=self.device, state="offline", incarnation=self.incarnation))
        async with contextlib.AsyncExitStack() as stack:
            self.metrics.serve(self.cfg.metrics.address, self.cfg.metrics.port_file)
            stack.callback(self.metrics.close)
            broker = self.cfg.broker
            if self.emulated is not None:
                broker = await self._enter_emulated_link(stack, broker)
            self.bus = await stack.enter_async_context(Bus(
                broker,
                client_id=client_id(SERVICE, self.cfg, self.device),
                metrics=self.metrics,
                subscriptions=[
                    self.topics.plan(), self.topics.codec(self.device), self.topics.model(), self.topics.model_delta(),
                    self.topics.ack(self.device), self.topics.control(f"device/{self.device}"),
                    self.topics.control("all"),
                ],
                will=(self.topics.status(self.device), will),
                on_connect=self._on_connect,
            ))
            self.ops = Operations(source=f"device/{self.device}", bus=self.bus, topics=self.topics,
                                  metrics=self.metrics, stop=self.stop)
            self.metrics.up.set(1)
            try:
                await supervise(self.stop, consume(self.bus, self.metrics, self._dispatch), self._train(),
                                self._report())
            finally:
                self.metrics.up.set(0)
                if self.bus.is_connected:
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(self.cfg.broker.connect_timeout_s):
                            await self.bus.publish(self.topics.status(self.device), DeviceStatus(
                                device=self.device, state="offline", incarnation=self.incarnation,
                                time=time.time()), retain=True)

    def _measure(self) -> prof.Profile:
        """The device's profile: measured, or the emulated board's (in a thread: it benchmarks)."""
        w = self.cfg.worker
        if self.emulated is None:
            return prof.measure(w.profile_seconds, w.memory_bytes)
        host = w.emulation_host_gflops or measure_host_gflops(w.threads)
        self.stretch = ComputeStretch.for_device(host, self.emulated.train_gflops)
        if self.stretch.ratio < 1:
            logger.warning("%s: this host (%.1f GFLOP/s) is slower than an emulated %s (%.1f): steps run at the "
                           "host's pace", self.device, host, self.emulated.name, self.emulated.train_gflops)
        return prof.Profile(flops=self.emulated.train_gflops * 1e9,
                            memory_bytes=w.memory_bytes or self.emulated.memory_bytes,
                            cores=os.cpu_count() or 1, platform=f"emulated-{self.emulated.name}")

    async def _enter_emulated_link(self, stack: contextlib.AsyncExitStack, broker: BrokerConfig) -> BrokerConfig:
        """Start the emulated link in front of the broker; the bus connects to it instead."""
        assert self.emulated is not None
        w = self.cfg.worker
        seed = int.from_bytes(hashlib.sha256(f"{w.emulation_seed}/{self.device}".encode()).digest()[:4], "big")
        self.emulated_link = await stack.enter_async_context(EmulatedLink(
            self.emulated.link(), upstream_host=broker.host, upstream_port=broker.port, seed=seed, name=self.device,
            max_outage_s=w.emulation_max_outage_s or None))
        link = self.emulated_link
        logger.info("%s: emulated link %s:%d -> %s (%s)", self.device, link.host, link.port, broker.url,
                    self.emulated.description or self.emulated.name)
        return replace(broker, url=f"mqtt://{link.host}:{link.port}")

    async def _on_connect(self) -> None:
        """(Re)announce the device; resend the update still waiting for its ack."""
        assert self.bus is not None and self.profile is not None
        await self._publish_status()
        await self.bus.publish(self.topics.hello(self.device), DeviceHello(
            device=self.device, incarnation=self.incarnation, flops=self.profile.flops,
            memory_bytes=self.profile.memory_bytes, cores=self.profile.cores, platform=self.profile.platform,
            software=_software(), can_encode=self.cfg.worker.can_encode,
            link_rate_bps=self.link.declared_bps, profile=self.emulated.name if self.emulated else "",
            downlink_rate_bps=self.emulated.downlink_bps if self.emulated else 0.0,
            latency_s=self.emulated.latency_s if self.emulated else 0.0), retain=True)
        if self.pending is not None and self._pending_payload is not None and self.bus.connections > 1:
            self.m_resends.inc()
            logger.info("%s: resending update %d after reconnect", self.device, self.pending.seq)
            await self.bus.publish(self._pending_topic, self._pending_payload, kind="gradient")

    async def _publish_status(self) -> None:
        """The retained ``online`` status, naming the plan this device refused if it did."""
        assert self.bus is not None
        await self.bus.publish(self.topics.status(self.device), DeviceStatus(
            device=self.device, state="online", incarnation=self.incarnation, time=time.time(),
            refused_plan=self._refused, reason=self._refusal), retain=True)

    # ------------------------------------------------------------------ consuming
    async def _dispatch(self, msg: Incoming) -> None:
        parts = self.topics.relative(msg.topic)
        if parts[0] == "mesh" and len(parts) == 5:
            self._on_mesh(parts, msg)
            return
        match parts:
            case ["plan"]:
                plan = msg.decode(Plan)
                if self.plan is None or plan.version >= self.plan.version:
                    self.plan = plan
                    self.me = plan.device(self.device)
                    if self._exchange is not None and self._exchange.plan_version != plan.version:
                        self._exchange.abort(f"plan version {plan.version} replaced {self._exchange.plan_version}")
                    self._mesh_started.set()
            case ["codec", _]:
                policy = msg.decode(CodecPolicy)
                if policy.device != self.device:
                    raise WireError(f"codec policy for {policy.device} on my topic", "topic")
                if not policy.gateway:
                    get_codec(policy.codec)  # refuse a codec this build cannot encode
                if self.policy is None or (policy.codec, policy.density, policy.gateway) != (
                        self.policy.codec, self.policy.density, self.policy.gateway):
                    logger.info("%s: codec %s, density %g%s (policy version %d)", self.device, policy.codec,
                                policy.density, ", via the gateway" if policy.gateway else "", policy.version)
                self.policy = policy
            case ["model"]:
                snap = msg.decode(ModelSnapshot)
                self._check_snapshot(snap)
                self.view.load(snap)
            case ["model", "delta"] | ["model", "delta", _]:  # the broadcast, or this member's part of it
                delta = msg.decode(ModelDelta)
                if delta.model_spec == self._spec():
                    self.view.apply(delta)
            case ["ack", _]:
                ack = msg.decode(UpdateAck)
                future = self._acks.get(ack.seq)
                if ack.incarnation == self.incarnation and future is not None and not future.done():
                    future.set_result(ack)
            case ["control", *_]:
                cmd = msg.decode(ControlCommand)
                if not cmd.device or cmd.device == self.device:  # on control/all, others' commands
                    await self.ops.control(cmd, self._apply_control)
                return
            case _:
                raise WireError(f"no handler for topic {msg.topic}", "topic")
        self.metrics.received_messages.labels(kind=msg.kind).inc()
        async with self._changed:
            self._changed.notify_all()

    def _on_mesh(self, parts: list[str], msg: Incoming) -> None:
        """A step start, a member's readiness or a slice from another member of this device's cluster."""
        _, cluster, layer, phase, _device = parts
        if layer == "step" and phase == "ready":
            ready = msg.decode(MeshReady)
            if ready.cluster != cluster or ready.device != _device:
                raise WireError("readiness for another cluster or member on this topic", "topic")
            self._ready[(cluster, ready.device)] = ready.plan_version
            self.metrics.received_messages.labels(kind=msg.kind).inc()
            self._mesh_started.set()
            return
        if layer == "step" and phase == "begin":
            begin = msg.decode(MeshBegin)
            if begin.cluster != cluster:
                raise WireError("step start for another cluster on this topic", "topic")
            self._begin = begin
            self.metrics.received_messages.labels(kind=msg.kind).inc()
            self._mesh_started.set()
            return
        piece = msg.decode(MeshSlice)
        if piece.cluster != cluster or piece.layer != layer or piece.phase != phase:
            raise WireError("mesh slice disagrees with its topic", "topic")
        if self._exchange is not None and self._exchange.deliver(piece):
            self.metrics.received_messages.labels(kind=msg.kind).inc()

    def _spec(self) -> str:
        return self.plan.model_spec if self.plan else self.cfg.training.model_spec

    def _check_snapshot(self, snap: ModelSnapshot) -> None:
        if snap.model_spec != self._spec():
            raise WireError(f"snapshot is for model {snap.model_spec}", "shape")
        if self._layout:
            for name, (shape, _) in self._layout.items():
                t = snap.tensors.get(name)
                if t is None or t.shape != shape:
                    raise WireError(f"snapshot tensor {name} missing or misshapen", "shape")
            if len(snap.tensors) != len(self._layout):
                raise WireError("snapshot has extra tensors", "shape")

    async def _apply_control(self, cmd: ControlCommand) -> ControlResult:
        result: dict[str, Scalar] = {"accepted": self.accepted, "version": self._model_version}
        match cmd.command:
            case "stop":
                logger.info("%s: stop requested by %s", self.device, cmd.requester)
                return True, "stopping", result
            case "status":
                return True, f"accepted {self.accepted} updates, model version {self._model_version}", result
        return False, f"unknown command {cmd.command!r} for a worker (stop, status)", {}

    async def _wait_for(self, what: str, predicate: Any) -> None:
        """Wait until ``predicate()`` holds, saying so every WAIT_LOG_INTERVAL_S."""
        async with self._changed:
            while not predicate():
                try:
                    async with asyncio.timeout(WAIT_LOG_INTERVAL_S):
                        await self._changed.wait()
                except TimeoutError:
                    logger.info("%s: waiting for %s", self.device, what)

    # ------------------------------------------------------------------ training
    def _prepare(self, plan: Plan, me: PlanDevice) -> None:
        """Build the model and this device's shard for ``plan`` (in the training thread)."""
        if self._model is None:
            self._model = models.build_model(plan.model_spec, seed=plan.seed)
            self._layout = models.param_layout(self._model)
            if self.stretch is not None and plan.model_spec not in costs.COSTS:
                self._calibrate(self.stretch, plan.model_spec)  # no cost figures: emulate from host steps
        weights = _shard_weights(plan)
        key = (plan.dataset, plan.partition, plan.partition_alpha, plan.seed, me.shard_index, me.shard_count, weights)
        if key != self._shard_key:
            train, _ = load_dataset(plan.dataset, self.cfg.training.dataset_path or None, seed=plan.seed)
            mine = shard(train, me.shard_index, me.shard_count, scheme=plan.partition, alpha=plan.partition_alpha,
                         seed=plan.seed, weights=weights)
            self._batches = BatchIterator(mine, me.batch_size, seed=plan.seed + me.shard_index)
            self._shard_key = key
            logger.info("%s: shard %d/%d of %s, %d samples, batch %d", self.device, me.shard_index, me.shard_count,
                        plan.dataset, len(mine), me.batch_size)
        assert self._batches is not None
        if self._batches.batch_size != me.batch_size:
            logger.info("%s: batch %d -> %d (plan version %d)", self.device, self._batches.batch_size,
                        me.batch_size, plan.version)
            self._batches.batch_size = me.batch_size

    def _calibrate(self, stretch: ComputeStretch, model_spec: str) -> None:
        """Time real steps of this model on random inputs: the host's step time by batch size."""
        spec = models.get_spec(model_spec)
        rng = np.random.default_rng(0)

        def step(batch: int) -> float:
            x = rng.random((batch, *spec.input_shape), dtype=np.float32)
            y = rng.integers(0, spec.num_classes, size=batch)
            started = time.perf_counter()
            models.compute_gradients(self._model, x, y)
            return time.perf_counter() - started

        overhead, per_sample = stretch.calibrate(step)
        logger.info("%s: host step %.2f ms + %.4f ms/sample, emulated x%.1f", self.device, overhead * 1e3,
                    per_sample * 1e3, stretch.ratio)

    def _raw(self, policy: CodecPolicy | None) -> bool:
        """Whether updates go raw (float32) to the compressor gateway."""
        return policy is not None and policy.gateway

    def _compute(
        self, plan: Plan, me: PlanDevice, params: dict[str, np.ndarray], version: int, policy: CodecPolicy | None
    ) -> tuple[list[ShardUpdate], int, float, float]:
        """Follow the plan, load the model if newer, take a batch, compute and encode the gradient
        (in a thread: one hop per step).

        Encodes with ``none`` when the policy routes through the gateway, when there is no policy
        yet, and on a device that cannot encode.
        """
        self._prepare(plan, me)
        assert self._batches is not None
        if version != self._model_version:
            models.set_params(self._model, params)
            self._model_version = version
        started = time.perf_counter()
        x, y = next(self._batches)
        loss, grads = models.compute_gradients(self._model, x, y)
        elapsed = time.perf_counter() - started
        codec_name = "none"
        if policy is not None and not policy.gateway and self.cfg.worker.can_encode:
            codec_name = policy.codec
        self._gradient_bytes = sum(int(g.size) for g in grads.values()) * FP32_BYTES
        shards = []
        for name, g in grads.items():
            codec = codec_for(codec_name, g.size)
            data = self._feedback.encode(name, g, codec, policy)
            shards.append(ShardUpdate(param=name, start=0, stop=int(g.shape[0]), codec=codec.name,  # type: ignore[arg-type]
                                      data=data))
        return shards, len(y), loss, elapsed

    async def _train(self) -> None:
        assert self.bus is not None
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
            assert self.plan is not None
            refusal = self._share_refusal()
            if refusal:
                await self._refuse(refusal)
                continue
            await self._wait_for(f"model version {min_version}",
                                 lambda v=min_version: self.view.ready and (self.view.version >= v or self.view.gap))
            assert self.view.params is not None and self.me is not None
            params, version, gap = self.view.params, self.view.version, self.view.gap
            plan, me, policy = self.plan, self.me, self.policy
            cluster = me.cluster
            mesh_cluster = plan.cluster(cluster)
            mesh_step = 0
            if mesh_cluster is not None and len(mesh_cluster.members) > 1:
                result = await self._mesh_compute(plan, me, mesh_cluster, policy)
                if result is None:
                    continue  # abandoned: a member left or lags; the planner re-plans
                shards, samples, loss, elapsed, version, gap, mesh_step = result
            else:
                if self._mesh is not None:  # a model-parallel member until this plan: its view held its rows
                    await self._leave_mesh()
                    continue  # start over with the whole model
                shards, samples, loss, elapsed = await asyncio.to_thread(self._compute, plan, me, params, version,
                                                                         policy)
                if self.stretch is not None:
                    hold = self._hold_s(plan.model_spec, samples, elapsed)
                    await asyncio.sleep(hold)  # the rest of the step, at the emulated board's speed
                    elapsed += hold
                with contextlib.suppress(ModelError):  # no cost figures: no measured speed
                    self._work.append((costs.cost(plan.model_spec).train_flops_per_sample * samples, elapsed))
            if me.batch_size != self._stepped_batch:  # stats report the step time of the batch size in use
                self._step_times.clear()
                self._stepped_batch = me.batch_size
            self.m_steps.inc()
            self.m_step.observe(elapsed)
            self.m_loss.set(loss)
            self.m_version.set(version)
            self._step_times.append(elapsed)
            self._last_loss = loss
            self.seq += 1
            update = GradientUpdate(device=self.device, cluster=cluster, incarnation=self.incarnation,
                                    seq=self.seq, base_version=version, samples=samples, need_snapshot=gap,
                                    shards=tuple(shards), loss=loss, step_time_s=elapsed, sent_at=time.time(),
                                    mesh_step=mesh_step, plan_version=plan.version)
            for s in shards:
                self.m_grad_bytes.labels(codec=s.codec).inc(len(s.data))
            topic = (self.topics.grad_raw if self._raw(policy) else self.topics.grad)(cluster, self.device)
            ack = await self._send(update, topic)
            self.m_updates.labels(status=ack.status, reason=ack.reason).inc()
            self._delays.append(ack.delay)
            min_version = ack.version if ack.resync else 0
            if ack.status in ("accepted", "duplicate"):
                self.accepted += 1
                if self.cfg.worker.max_steps and self.accepted >= self.cfg.worker.max_steps:
                    logger.info("%s: reached worker.max_steps=%d", self.device, self.accepted)
                    self.stop.set()
                    return
            elif ack.reason == "unknown_device":
                async with self._changed:
                    self.me = None  # wait for a plan that names us again
            elif ack.reason not in ("stale", "round_full", "future", "replanned"):
                logger.warning("%s: update %d discarded: %s", self.device, update.seq, ack.reason)

    # ------------------------------------------------------------------ model parallelism
    async def _join_mesh(self, plan: Plan, me: PlanDevice, cluster: PlanCluster) -> None:
        """Be member ``me`` of model-parallel ``cluster`` under ``plan``: its slices, topics and data."""
        assert self.bus is not None
        index = cluster.members.index(self.device)
        key = (plan.model_spec, plan.seed, cluster.cluster, index, tuple(sorted(cluster.counts.items())))
        if key != self._mesh_key:
            self._mesh = await asyncio.to_thread(MeshMember, plan.model_spec, cluster.counts, index, seed=plan.seed)
            self._mesh_key = key
            self._layer_busy.clear()
            if not self.view.restrict(self._mesh.rows()):  # keep this member's rows of the model only
                await self._refresh_model()
            logger.info("%s: member %d of %s (%s), %d parameters", self.device, index, cluster.cluster,
                        ", ".join(f"{k} {v[index]}/{sum(v)}" for k, v in cluster.counts.items()),
                        self._mesh.param_count)
        if not self._layout:
            await asyncio.to_thread(self._mesh_layout, plan.model_spec, plan.seed)
        # its part of every model delta replaces the broadcast (subscribed first: no delta falls between)
        topics = [*self.topics.mesh_member(cluster.cluster, self.device, cluster.members),
                  self.topics.model_delta_for(self.device)]
        if topics != self._mesh_topics:
            await self.bus.subscribe([t for t in topics if t not in self._mesh_topics])
            await self.bus.unsubscribe([t for t in self._mesh_topics if t not in topics]
                                       + ([] if self._mesh_topics else [self.topics.model_delta()]))
            self._mesh_topics = topics
        if self._exchange is None or (self._exchange.plan_version, self._exchange.cluster) != (plan.version,
                                                                                              cluster.cluster):
            assert self._mesh is not None
            if self._exchange is not None:
                self._exchange.abort(f"plan version {plan.version} replaced {self._exchange.plan_version}")
            self._mesh_step = 0  # step numbers belong to one leader and plan
            self._exchange = BusExchange(self.bus, self.topics, cluster=cluster.cluster, device=self.device,
                                         members=cluster.members, counts=cluster.counts, order=self._mesh.order,
                                         plan_version=plan.version, timeout_s=self.cfg.worker.mesh_timeout_s,
                                         dtype=self.cfg.worker.mesh_dtype)
        weights = _shard_weights(plan)
        data_key = (plan.dataset, plan.partition, plan.partition_alpha, plan.seed, me.shard_index, me.shard_count,
                    weights)
        if data_key != self._mesh_data_key:
            train, _ = await asyncio.to_thread(load_dataset, plan.dataset, self.cfg.training.dataset_path or None,
                                               seed=plan.seed)
            self._mesh_data = shard(train, me.shard_index, me.shard_count, scheme=plan.partition,
                                    alpha=plan.partition_alpha, seed=plan.seed, weights=weights)
            self._mesh_data_key = data_key

    def _hold_s(self, model_spec: str, samples: int, real_s: float) -> float:
        """How long an emulated board's step of ``samples`` still runs after ``real_s`` on the host.

        With the model's cost figures the step lasts what the planner's cost model says it lasts on
        the board (its training FLOPs at ``costs.TRAIN_EFFICIENCY`` of the board's rate), whatever
        the host's load; otherwise the calibrated host step times the board's slowness."""
        assert self.stretch is not None and self.emulated is not None
        try:
            flops = costs.cost(model_spec).train_flops_per_sample * samples
        except ModelError:
            overruns = self.stretch.overruns
            hold = self.stretch.hold_s(samples, real_s)
            self.m_overruns.inc(self.stretch.overruns - overruns)
            return hold
        target = flops / (costs.TRAIN_EFFICIENCY * self.emulated.train_gflops * 1e9)
        if real_s > target:
            self.m_overruns.inc()
        return max(target - real_s, 0.0)

    def _link_rates(self) -> tuple[float, float]:
        """Uplink and downlink bytes/s (0 = unknown): the emulated board's, else the measured uplink
        for both (the cost model's convention for an unknown downlink)."""
        if self.emulated is not None:
            return self.emulated.uplink_bps, self.emulated.downlink_bps
        return self.link.rate_bps, self.link.rate_bps

    def _mesh_layout(self, model_spec: str, seed: int) -> None:
        """The model's parameter layout, to check snapshots against (the model is built for this and dropped)."""
        self._layout = models.param_layout(models.build_model(model_spec, seed=seed))

    async def _refresh_model(self) -> None:
        """Get a whole snapshot again: the view lacks rows it now needs. Subscribing anew makes the
        broker send the retained one; the parameter server publishes a newer one if that is old."""
        assert self.bus is not None
        logger.info("%s: the new division needs other rows of the model: fetching a snapshot", self.device)
        await self.bus.unsubscribe([self.topics.model()])
        await self.bus.subscribe([self.topics.model()])
        with contextlib.suppress(BusError):
            await self.bus.publish(self.topics.control("ps"), ControlCommand(
                command="snapshot", requester=self.device, request_id=f"{self.device}-{time.time_ns()}"))

    async def _leave_mesh(self) -> None:
        """Back to training the whole model: the view needs every row again (a snapshot)."""
        if self._mesh is not None and not self.view.restrict(None):
            await self._refresh_model()
        if self._mesh_topics and self.bus is not None:
            await self.bus.subscribe([self.topics.model_delta()])
            await self.bus.unsubscribe(self._mesh_topics)
        self._mesh_topics, self._mesh, self._mesh_key, self._exchange = [], None, None, None
        self._layer_busy.clear()

    async def _mesh_start(self, plan: Plan, cluster: PlanCluster) -> tuple[int, int] | None:
        """Agree on the step and model version with the cluster: the first member announces them,
        the others wait for the announcement and that model. None if none came in time."""
        assert self.bus is not None
        timeout = self.cfg.worker.mesh_timeout_s
        if cluster.members[0] == self.device:
            if not self._mesh_step and not await self._members_ready(plan, cluster):
                return None  # a new plan came meanwhile
            # milliseconds since the epoch at the first step: a restarted leader never reuses a step number
            step = self._mesh_step + 1 if self._mesh_step else time.time_ns() // 1_000_000
            version = self.view.version
            await self.bus.publish(self.topics.mesh(cluster.cluster, "step", "begin", self.device), MeshBegin(
                cluster=cluster.cluster, device=self.device, plan_version=plan.version, step=step,
                model_version=version))
            return step, version

        if self._ready_sent != (cluster.cluster, plan.version):  # subscribed and holding the model: ready
            await self.bus.publish(self.topics.mesh(cluster.cluster, "step", "ready", self.device), MeshReady(
                cluster=cluster.cluster, device=self.device, plan_version=plan.version), retain=True)
            self._ready_sent = (cluster.cluster, plan.version)

        def announced() -> MeshBegin | None:
            b = self._begin
            ok = b is not None and b.cluster == cluster.cluster and b.plan_version == plan.version and (
                b.step > self._mesh_step)
            return b if ok else None

        try:
            async with asyncio.timeout(timeout):
                while announced() is None:
                    if self.plan is not None and self.plan.version != plan.version:
                        return None  # a new plan: start over with it
                    self._mesh_started.clear()
                    await self._mesh_started.wait()
                begin = announced()
                assert begin is not None
                await self._wait_for(f"model version {begin.model_version}",
                                     lambda: self.view.version >= begin.model_version or self.view.gap)
        except TimeoutError:
            logger.info("%s: no step start from %s within %.0fs", self.device, cluster.members[0], timeout)
            return None
        return begin.step, begin.model_version

    async def _members_ready(self, plan: Plan, cluster: PlanCluster) -> bool:
        """The first member, before a plan's first step: wait until every other member is ready under
        ``plan`` (its retained ``MeshReady``), at most ``worker.mesh_timeout_s`` (then the step
        starts anyway, and a member still not listening times it out). False if a new plan came."""
        others = [m for m in cluster.members if m != self.device]

        def waiting() -> list[str]:
            return [m for m in others if self._ready.get((cluster.cluster, m), -1) != plan.version]

        try:
            async with asyncio.timeout(self.cfg.worker.mesh_timeout_s):
                while waiting():
                    if self.plan is not None and self.plan.version != plan.version:
                        return False
                    self._mesh_started.clear()
                    await self._mesh_started.wait()
        except TimeoutError:
            logger.info("%s: %s not ready within %.0fs; starting the step anyway", self.device,
                        ", ".join(waiting()), self.cfg.worker.mesh_timeout_s)
        return True

    async def _mesh_runner(self, fn: Any, *args: Any, flops: float = 0.0) -> Any:
        """Run one piece of a model-parallel step in a thread; on an emulated board, hold it until it
        would have ended there: ``flops`` at ``costs.TRAIN_EFFICIENCY`` of the board's rate, the
        planner's cost model (a host busier than the board could be shows as overruns). Its reported
        seconds become the emulated ones."""
        result = await asyncio.to_thread(fn, *args)
        if self.emulated is None:
            return result
        took = result[-1]
        target = flops / (costs.TRAIN_EFFICIENCY * self.emulated.train_gflops * 1e9)
        if took > target and flops:
            self.m_overruns.inc()
        await asyncio.sleep(max(target - took, 0.0))
        return (*result[:-1], max(took, target))

    async def _mesh_compute(self, plan: Plan, me: PlanDevice, cluster: PlanCluster, policy: CodecPolicy | None,
                            ) -> tuple[list[ShardUpdate], int, float, float, int, bool, int] | None:
        """One step of this device's slice with the rest of its cluster; None if it was abandoned."""
        await self._join_mesh(plan, me, cluster)
        member, exchange, data = self._mesh, self._exchange, self._mesh_data
        assert member is not None and exchange is not None and data is not None
        await self._wait_for("a model snapshot", lambda: self.view.ready)
        started = time.perf_counter()
        agreed = await self._mesh_start(plan, cluster)
        if agreed is None:
            self.m_mesh_steps.labels(outcome="no_start").inc()
            return None
        step, _ = agreed
        self._mesh_step = step
        assert self.view.params is not None
        params, version, gap = self.view.params, self.view.version, self.view.gap
        if member.version != version:
            await asyncio.to_thread(member.load, params, version)
        x, y = batch_at(data, me.batch_size, seed=plan.seed + me.shard_index, step=step)
        exchange.begin(step, len(y))
        try:
            result = await member.step(step, x, y, exchange, run=self._mesh_runner)
        except ModelError as exc:  # a member timed out, or sent what does not fit
            self.m_mesh_steps.labels(outcome="abandoned").inc()
            logger.warning("%s: model-parallel step abandoned: %s", self.device, exc)
            return None
        elapsed = time.perf_counter() - started
        self.m_mesh_steps.labels(outcome="done").inc()
        compute = result.compute_s  # emulated seconds on an emulated board (see _mesh_runner)
        self.m_mesh_wait.observe(max(elapsed - compute, 0.0))
        with contextlib.suppress(ModelError):  # a small share's speed is its per-call overhead: not reported
            if member.flops_per_sample() >= MIN_MEASURED_SHARE * costs.cost(plan.model_spec).train_flops_per_sample:
                self._work.append((member.flops_per_sample() * len(y), compute))
        up, down = self._link_rates()
        for layer, seconds in result.layer_s.items():  # busy: computing, or its link moving the layer's slices
            sent, received = exchange.layer_bytes.get(layer, (0, 0))
            busy = seconds + (sent / up if up else 0.0) + (received / down if down else 0.0)
            self._layer_busy.setdefault(layer, deque(maxlen=AVERAGE_WINDOW)).append(busy)
        shards = await asyncio.to_thread(self._encode_slices, result.grads, policy)
        return shards, len(y), result.loss, elapsed, version, gap, step

    def _encode_slices(self, grads: dict[str, tuple[int, int, np.ndarray]],
                       policy: CodecPolicy | None) -> list[ShardUpdate]:
        codec_name = "none"
        if policy is not None and not policy.gateway and self.cfg.worker.can_encode:
            codec_name = policy.codec
        self._gradient_bytes = sum(int(g.size) for _, _, g in grads.values()) * FP32_BYTES
        shards = []
        for name, (start, stop, g) in grads.items():
            codec = codec_for(codec_name, g.size)
            data = self._feedback.encode(f"{name}[{start}:{stop}]", g, codec, policy)
            shards.append(ShardUpdate(param=name, start=start, stop=stop, codec=codec.name,  # type: ignore[arg-type]
                                      data=data))
        return shards

    def _has_share(self) -> bool:
        """A plan names this device, and it is newer than the last one it refused."""
        return self.me is not None and self.plan is not None and self.plan.version > self._refused

    def _share_refusal(self) -> str:
        """Why this device's share of the current plan does not fit its memory ('' if it fits)."""
        assert self.plan is not None and self.me is not None and self.profile is not None
        cluster = self.plan.cluster(self.me.cluster)
        try:
            if cluster is not None and len(cluster.members) > 1:  # its share of a model-parallel cluster
                index = cluster.members.index(self.device)
                layers = costs.layers(self.plan.model_spec)
                counts = cluster.counts
                if set(counts) != {la.name for la in layers}:
                    return f"the filter division of {cluster.cluster} does not match {self.plan.model_spec}"
                need = costs.member_memory_bytes(layers, [counts[la.name][index] for la in layers],
                                                 self.me.batch_size)
            else:
                need = costs.training_memory_bytes(self.plan.model_spec, self.me.batch_size)
        except ModelError:
            return ""  # no cost figures for this model: nothing to check against
        if need <= self.profile.memory_bytes:
            return ""
        return (f"needs {need / 2**20:.0f} MiB for batch {self.me.batch_size} of {self.plan.model_spec}, "
                f"has {self.profile.memory_bytes / 2**20:.0f} MiB")

    async def _refuse(self, reason: str) -> None:
        """Refuse the current plan's share: say so in the retained status and an event; wait for another plan."""
        assert self.plan is not None
        self._refused, self._refusal = self.plan.version, reason
        self.m_refused.inc()
        logger.warning("%s: refusing my share of plan version %d: %s", self.device, self.plan.version, reason)
        with contextlib.suppress(BusError):
            await self._publish_status()
            await self.ops.event("share_refused", f"{self.device} refused plan version {self.plan.version}: {reason}",
                                 device=self.device, plan_version=self.plan.version)

    async def _send(self, update: GradientUpdate, topic: str) -> UpdateAck:
        """Publish ``update`` on ``topic`` and wait for its ack, resending on timeout (the PS applies
        it at most once). The first publish, if the connection held throughout, is a link sample."""
        assert self.bus is not None
        payload = encode(update)
        future: asyncio.Future[UpdateAck] = asyncio.get_running_loop().create_future()
        self._acks[update.seq] = future
        self.pending, self._pending_payload, self._pending_topic = update, payload, topic
        started = time.perf_counter()
        try:
            attempt = 0
            while True:
                if attempt:
                    self.m_resends.inc()
                    logger.info("%s: no ack for update %d after %.1fs; resending", self.device, update.seq,
                                self.cfg.worker.ack_timeout_s)
                connection = self.bus.connections if self.bus.is_connected else -1
                publish_started = time.perf_counter()
                try:
                    sent = await self.bus.publish(topic, payload, kind="gradient")
                except BusError as exc:  # a long outage: keep the update and try again
                    logger.warning("%s: update %d not sent yet (%s); still trying", self.device, update.seq, exc)
                    attempt += 1
                    continue
                if not attempt and connection == self.bus.connections and self.bus.is_connected:
                    self.link.observe(sent, time.perf_counter() - publish_started)
                attempt += 1
                try:
                    async with asyncio.timeout(self.cfg.worker.ack_timeout_s):
                        ack = await asyncio.shield(future)
                    break
                except TimeoutError:
                    continue
        finally:
            self._acks.pop(update.seq, None)
            self.pending, self._pending_payload, self._pending_topic = None, None, ""
        rtt = time.perf_counter() - started
        self._comm_times.append(rtt)
        self.m_ack.observe(rtt)
        return ack

    # ------------------------------------------------------------------ reporting
    def _compute_flops(self) -> float:
        seconds = sum(t for _, t in self._work)
        return sum(f for f, _ in self._work) / seconds if seconds > 0 else 0.0

    async def _report(self) -> None:
        """Stats after the first update (the compressor needs step time and gradient size to
        choose a codec at once), then every ``worker.stats_interval_s``."""
        assert self.bus is not None
        await self._wait_for("the first update", lambda: len(self._comm_times) > 0)
        while True:
            if not self.bus.is_connected:
                await asyncio.sleep(self.cfg.worker.stats_interval_s)
                continue
            self.m_link.set(self.link.rate_bps)
            stats = DeviceStats(
                device=self.device, incarnation=self.incarnation, time=time.time(),
                steps=int(self.metrics.value("edgemesh_worker_steps_total")),
                step_time_s=float(np.mean(self._step_times)) if self._step_times else 0.0,
                comm_time_s=float(np.mean(self._comm_times)) if self._comm_times else 0.0,
                delay_index=float(np.mean(self._delays)) if self._delays else 0.0,
                rss_bytes=prof.rss_bytes(), cpu_temp_c=prof.cpu_temperature(),
                model_version=max(self._model_version, 0), loss=self._last_loss,
                batch_size=self._stepped_batch,
                bytes_sent=int(self.metrics.value("edgemesh_worker_published_bytes_total")),
                link_rate_bps=self.link.rate_bps, gradient_bytes=self._gradient_bytes,
                upload_time_s=self.link.upload_s,
                compute_flops=self._compute_flops(),
                mesh_layer_busy_s={k: float(np.median(v)) for k, v in self._layer_busy.items() if v}
                if self._mesh is not None else {},
            )
            if self.emulated_link is not None:
                self.m_link_cuts.set(self.emulated_link.disconnects)
            with contextlib.suppress(Exception):
                await self.bus.publish(self.topics.stats(self.device), stats)
            await asyncio.sleep(self.cfg.worker.stats_interval_s)


def _shard_weights(plan: Plan) -> tuple[int, ...] | None:
    """Each data shard's samples per iteration, when they differ (balanced batches, a training grid):
    shards then hold data in proportion, so every sample is drawn about as often; None when even."""
    batches: dict[int, int] = {d.shard_index: d.batch_size for d in plan.devices}
    count = plan.devices[0].shard_count if plan.devices else 0
    if len(batches) != count or len(set(batches.values())) <= 1:
        return None
    return tuple(batches[i] for i in range(count))


async def run(config: Config, *, stop: asyncio.Event | None = None) -> None:
    """Run one worker until ``stop`` is set, SIGINT or SIGTERM."""
    stop = stop or asyncio.Event()
    install_stop_signals(stop)
    await Worker(config, stop=stop).run()
