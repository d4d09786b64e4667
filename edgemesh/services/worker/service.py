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
``edgemesh.common.emulation``: its hello reports the profile's speed, memory and uplink, every
training step is held until it would have ended on that board, and its MQTT connection goes
through an :class:`EmulatedLink` with the board's rates, latency and disconnects. Off by default.

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
from edgemesh.common.data import BatchIterator, load_dataset, shard
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
    ModelDelta,
    ModelSnapshot,
    Plan,
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
from edgemesh.services.worker.view import ModelView

logger = logging.getLogger(__name__)

SERVICE = "worker"
STEP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
WAIT_LOG_INTERVAL_S = 10.0
"""How often a worker waiting for a plan, model or ack says so."""
AVERAGE_WINDOW = 20
"""Steps over which step and communication times are averaged for stats."""
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
            self.emulated = get_profile(config.worker.emulate, config.worker.emulation_profiles or None)
            if config.broker.tls:
                raise ConfigError("worker.emulate: the emulated link relays plain TCP; use mqtt://, not mqtts://")
            if not config.worker.link_rate_bps:
                self.link.declare(self.emulated.uplink_bps)
        self.stretch: ComputeStretch | None = None
        self.emulated_link: EmulatedLink | None = None
        self._refused = 0
        """Version of the last plan whose share did not fit this device's memory (0 = none)."""
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
            link_rate_bps=self.link.declared_bps, profile=self.emulated.name if self.emulated else ""), retain=True)
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
        match parts:
            case ["plan"]:
                plan = msg.decode(Plan)
                if self.plan is None or plan.version >= self.plan.version:
                    self.plan = plan
                    self.me = plan.device(self.device)
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
            case ["model", "delta"]:
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
            if self.stretch is not None:
                self._calibrate(self.stretch, plan.model_spec)
        key = (plan.dataset, plan.partition, plan.partition_alpha, plan.seed, me.shard_index, me.shard_count)
        if key != self._shard_key:
            train, _ = load_dataset(plan.dataset, self.cfg.training.dataset_path or None, seed=plan.seed)
            mine = shard(train, me.shard_index, me.shard_count, scheme=plan.partition, alpha=plan.partition_alpha,
                         seed=plan.seed)
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
            shards, samples, loss, elapsed = await asyncio.to_thread(self._compute, plan, me, params, version, policy)
            cluster = me.cluster
            if self.stretch is not None:
                overruns = self.stretch.overruns
                hold = self.stretch.hold_s(samples, elapsed)
                self.m_overruns.inc(self.stretch.overruns - overruns)
                await asyncio.sleep(hold)  # the rest of the step, at the emulated board's speed
                elapsed += hold
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
                                    shards=tuple(shards), loss=loss, step_time_s=elapsed, sent_at=time.time())
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
            elif ack.reason not in ("stale", "round_full", "future"):
                logger.warning("%s: update %d discarded: %s", self.device, update.seq, ack.reason)

    def _has_share(self) -> bool:
        """A plan names this device, and it is newer than the last one it refused."""
        return self.me is not None and self.plan is not None and self.plan.version > self._refused

    def _share_refusal(self) -> str:
        """Why this device's share of the current plan does not fit its memory ('' if it fits)."""
        assert self.plan is not None and self.me is not None and self.profile is not None
        try:
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
            )
            if self.emulated_link is not None:
                self.m_link_cuts.set(self.emulated_link.disconnects)
            with contextlib.suppress(Exception):
                await self.bus.publish(self.topics.stats(self.device), stats)
            await asyncio.sleep(self.cfg.worker.stats_interval_s)


async def run(config: Config, *, stop: asyncio.Event | None = None) -> None:
    """Run one worker until ``stop`` is set, SIGINT or SIGTERM."""
    stop = stop or asyncio.Event()
    install_stop_signals(stop)
    await Worker(config, stop=stop).run()
