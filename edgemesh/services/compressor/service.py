"""The compressor: one retained codec policy per device, and the gateway (DESIGN.md §1, §6).

Backbone, top to bottom:
1. check that every configured codec is built in; connect; subscribe to the retained codec
   policies first (to continue their versions after a restart), then to hellos, stats,
   ``grad-raw`` and control;
2. once retained state has settled, give every device that said hello its policy;
3. consume: on a new device or a new incarnation, publish its policy retained on
   ``codec/{device}``; on stats, ask the policy again (``policy.choose_policy``: in adaptive
   mode codec and density follow the device's link rate, step time and delay index) and
   publish only what changed;
4. gateway: a device whose hello says ``can_encode = false`` gets ``gateway = true`` and sends
   raw float32 updates on ``grad-raw/{cluster}/{device}``; the compressor encodes every shard
   with that device's policy and its own error feedback for the device, and forwards the
   update (same device, incarnation, seq, base version) on ``grad/{cluster}/{device}``. The PS
   acks the device directly. A resent raw update (same incarnation and seq) is forwarded again
   as first encoded, so error feedback is applied once;
5. control: status, set-codec, stop.

An operator's ``set-codec`` is stored in the policy's ``reason`` (``operator``), so a restarted
compressor restores it from the retained policies; ``set-codec`` with the value ``default``
hands the device back to the configuration.

Raw updates are encoded one at a time, in a thread, in arrival order. This module must not
import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import statistics
from collections.abc import Iterable

from edgemesh.common import wire
from edgemesh.common.bus import Bus, Incoming
from edgemesh.common.codecs import ErrorFeedback, available_codecs, codec_for, get_codec
from edgemesh.common.config import CODECS, Config
from edgemesh.common.errors import BusError, ConfigError, WireError
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    DeviceHello,
    DeviceStats,
    GradientUpdate,
    Scalar,
    ShardUpdate,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics, valid_name
from edgemesh.services.compressor.policy import FP32_BYTES, REASON_OPERATOR, Adaptive, change_kind, choose_policy
from edgemesh.services.operations import Operations, consume
from edgemesh.services.runtime import client_id, install_stop_signals, supervise

logger = logging.getLogger(__name__)

SERVICE = "compressor"
RETAINED_SETTLE_S = 0.2
"""After connecting, wait this long for retained policies and hellos before publishing any policy."""
LIST_MAX_CHARS = 2000
"""Longest list of device policies in a ``status`` reply (wire strings are bounded); the devices
that do not fit are counted instead."""
DEFAULT_VALUE = "default"
"""``set-codec`` value that removes an operator's choice for a device."""
COMMANDS = ("status", "set-codec", "stop")
RAW_CODEC = "none"
"""The only codec accepted on ``grad-raw``: float32 as is."""
DENSITY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""Buckets of the published-density histogram."""


def check_codecs(codecs: Iterable[str], where: str) -> None:
    """ConfigError unless every codec is built in (named in config *and* implemented)."""
    available = available_codecs()
    for codec in codecs:
        if codec not in available:
            raise ConfigError(
                f"{where}: codec {codec!r} is not implemented in this build (available: {', '.join(available)})"
            )


class Compressor:
    """One compressor process. ``run()`` until ``stop`` is set."""

    def __init__(self, config: Config, *, stop: asyncio.Event | None = None) -> None:
        self.cfg = config
        self.topics = Topics(config.job)
        self.stop = stop or asyncio.Event()
        self.bus: Bus | None = None
        c = config.compressor
        check_codecs([c.default_codec], "compressor.default_codec")
        for device, codec in c.overrides.items():
            check_codecs([codec], f"compressor.overrides.{device}")
        self.adaptive: Adaptive | None = None
        if c.mode == "adaptive":
            check_codecs([c.adaptive_codec], "compressor.adaptive_codec")
            self.adaptive = Adaptive(codec=c.adaptive_codec, comm_share=c.comm_share, min_density=c.min_density,
                                     max_density=c.max_density, hysteresis=c.density_hysteresis,
                                     delay_pressure=c.delay_pressure)

        self.incarnations: dict[str, int] = {}
        """Devices that said hello, with their latest incarnation."""
        self.policies: dict[str, CodecPolicy] = {}
        """Current policy per device: the last one published, or the retained one adopted."""
        self.stats: dict[str, DeviceStats] = {}
        self.operator: dict[str, str] = {}
        """Codecs an operator chose with ``set-codec``, by device."""
        self.gateway: set[str] = set()
        """Devices whose latest hello says they cannot encode."""
        self._feedback: dict[str, tuple[int, ErrorFeedback]] = {}
        """Gateway error feedback per device, with the incarnation it belongs to."""
        self._forwarded: dict[str, tuple[tuple[int, int], bytes, int]] = {}
        """Per gateway device, the last forwarded update: ((incarnation, seq), envelope, shard bytes)."""
        self.ready = asyncio.Event()
        """Set once retained state has settled and every device seen by then has its policy."""
        self._started = False
        self._online = asyncio.Event()

        m = self.metrics = ServiceMetrics(SERVICE)
        self.m_published = m.counter("policies_published", "Codec policies published", ["codec"])
        self.m_devices = m.gauge("devices", "Devices that said hello")
        self.m_changes = m.counter("policy_changes", "Policies published, by why they were published "
                                   "(new, announce, codec, density, gateway, reason)", ["reason"])
        self.m_density = m.histogram("policy_density", "Density of the policies published", DENSITY_BUCKETS)
        self.m_codec_devices = m.gauge("codec_devices", "Devices whose current policy uses each codec", ["codec"])
        self.m_gateway_bytes = m.counter("gateway_bytes", "Gradient bytes through the gateway: raw in, encoded out",
                                         ["direction"])
        self.m_gateway_updates = m.counter("gateway_updates", "Raw updates encoded and forwarded", ["codec"])
        self.m_gateway_seconds = m.histogram("gateway_encode_seconds", "Time to encode one raw update",
                                             (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0))
        for codec in available_codecs():
            self.m_published.labels(codec=codec)
            self.m_codec_devices.labels(codec=codec)
        for direction in ("in", "out"):
            self.m_gateway_bytes.labels(direction=direction)

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            self.metrics.serve(self.cfg.metrics.address, self.cfg.metrics.port_file)
            stack.callback(self.metrics.close)
            self.bus = await stack.enter_async_context(Bus(
                self.cfg.broker,
                client_id=client_id(SERVICE, self.cfg),
                metrics=self.metrics,
                subscriptions=[
                    self.topics.all_codec(),
                    self.topics.all_hello(), self.topics.all_stats(), self.topics.all_grad_raw(),
                    self.topics.control(SERVICE), self.topics.control("all"),
                ],
                on_connect=self._on_connect,
            ))
            self.ops = Operations(source=SERVICE, bus=self.bus, topics=self.topics, metrics=self.metrics,
                                  stop=self.stop)
            self.metrics.up.set(1)
            c = self.cfg.compressor
            logger.info("compressor up: job %s, %s mode, default codec %s%s, %d override(s)", self.cfg.job,
                        c.mode, c.default_codec, f", adaptive codec {c.adaptive_codec}" if self.adaptive else "",
                        len(c.overrides))
            try:
                await supervise(self.stop, consume(self.bus, self.metrics, self._dispatch), self._start())
            finally:
                self.metrics.up.set(0)

    async def _on_connect(self) -> None:
        """First connect: let start-up proceed. Reconnects: restore the retained policies
        (a broker restarted without persistence has lost them)."""
        assert self.bus is not None
        if self._online.is_set() and self._started:
            with contextlib.suppress(BusError):
                for policy in list(self.policies.values()):
                    await self.bus.publish(self.topics.codec(policy.device), policy, retain=True)
        self._online.set()

    async def _start(self) -> None:
        """Give every device seen while retained state settled its policy."""
        await self._online.wait()
        await asyncio.sleep(RETAINED_SETTLE_S)
        self._started = True
        for device in sorted(self.incarnations):
            await self._reconcile(device, announce=device not in self.policies)
        self.ready.set()

    # ------------------------------------------------------------------ consuming
    async def _dispatch(self, msg: Incoming) -> None:
        parts = self.topics.relative(msg.topic)
        match parts:
            case ["device", device, "hello"]:
                hello = msg.decode(DeviceHello)
                _check_device(hello.device, device)
                await self._on_hello(hello)
            case ["device", device, "stats"]:
                stats = msg.decode(DeviceStats)
                _check_device(stats.device, device)
                self.metrics.received_messages.labels(kind="stats").inc()
                self.stats[device] = stats
                if self._started and device in self.incarnations:
                    await self._reconcile(device, announce=False)
            case ["codec", device]:
                policy = msg.decode(CodecPolicy)
                _check_device(policy.device, device)
                await self._on_policy(policy)
            case ["grad-raw", cluster, device]:
                update = msg.decode(GradientUpdate)
                _check_device(update.device, device)
                if update.cluster != cluster:
                    raise WireError(f"update of cluster {update.cluster!r} on the topic of {cluster!r}", "topic")
                await self._forward(update)
            case ["control", *_]:
                await self.ops.control(msg.decode(ControlCommand), self._apply_control)
            case _:
                raise WireError(f"no handler for topic {msg.topic}", "topic")

    async def _on_hello(self, hello: DeviceHello) -> None:
        self.metrics.received_messages.labels(kind="hello").inc()
        known = self.incarnations.get(hello.device)
        if known is not None and hello.incarnation < known:
            logger.debug("ignoring hello of %s from old incarnation %d", hello.device, hello.incarnation)
            return
        self.incarnations[hello.device] = hello.incarnation
        self.m_devices.set(len(self.incarnations))
        if hello.can_encode:
            self.gateway.discard(hello.device)
        else:
            self.gateway.add(hello.device)
        if self._started:
            await self._reconcile(hello.device, announce=hello.incarnation != known)

    async def _on_policy(self, policy: CodecPolicy) -> None:
        """A policy on a codec topic: our own echo, or the retained one of a previous run."""
        self.metrics.received_messages.labels(kind="codec_policy").inc()
        current = self.policies.get(policy.device)
        if current is not None and policy.version <= current.version:
            return  # our own policy coming back, or an older one
        self.policies[policy.device] = policy
        if (policy.reason == REASON_OPERATOR and policy.device not in self.operator
                and policy.codec in available_codecs()):
            self.operator[policy.device] = policy.codec
            logger.info("restored operator's codec %s for %s", policy.codec, policy.device)
        if self._started and policy.device in self.incarnations:
            await self._reconcile(policy.device, announce=False)

    # ------------------------------------------------------------------ policies
    def _choose(self, device: str) -> CodecPolicy:
        c = self.cfg.compressor
        return choose_policy(device, default_codec=c.default_codec, overrides=c.overrides,
                             previous=self.policies.get(device), stats=self.stats.get(device),
                             operator=self.operator, adaptive=self.adaptive, gateway=device in self.gateway,
                             reference_delay=self._reference_delay(), static_density=c.static_density)

    def _reference_delay(self) -> float:
        """The fleet's median delay index (devices that said hello and sent stats)."""
        delays = [s.delay_index for d, s in self.stats.items() if d in self.incarnations]
        return statistics.median(delays) if delays else 0.0

    async def _reconcile(self, device: str, *, announce: bool) -> CodecPolicy:
        """Publish the device's policy if it changed, or if ``announce`` (new or restarted device)."""
        assert self.bus is not None
        previous = self.policies.get(device)
        policy = self._choose(device)
        if policy is previous and not announce:
            return policy
        change = change_kind(previous, policy)
        self.policies[device] = policy
        self.m_published.labels(codec=policy.codec).inc()
        self.m_changes.labels(reason="announce" if change == "same" else change).inc()
        self.m_density.observe(policy.density)
        self._count_codecs()
        await self.bus.publish(self.topics.codec(device), policy, retain=True)
        if change in ("new", "codec", "gateway", "density"):
            logger.info("%s: codec %s, density %g%s (version %d, %s)", device, policy.codec, policy.density,
                        ", via gateway" if policy.gateway else "", policy.version, policy.reason)
        return policy

    def _count_codecs(self) -> None:
        counts = dict.fromkeys(available_codecs(), 0)
        for device, policy in self.policies.items():
            if device in self.incarnations:
                counts[policy.codec] = counts.get(policy.codec, 0) + 1
        for codec, n in counts.items():
            self.m_codec_devices.labels(codec=codec).set(n)

    # ------------------------------------------------------------------ gateway
    async def _forward(self, update: GradientUpdate) -> None:
        """Encode a raw update with its device's policy and forward it to the PS."""
        assert self.bus is not None
        self.metrics.received_messages.labels(kind="gradient_raw").inc()
        device = update.device
        known = self.incarnations.get(device)
        if known is not None and update.incarnation < known:
            raise WireError(f"raw update of {device} from old incarnation {update.incarnation}", "incarnation")
        raw_bytes = sum(len(s.data) for s in update.shards)
        key = (update.incarnation, update.seq)
        last = self._forwarded.get(device)
        if last is not None and last[0] == key:  # a resend: the same encoding, error feedback untouched
            payload, out_bytes = last[1], last[2]
        else:
            policy = self.policies.get(device) or self._choose(device)
            feedback = self._feedback.get(device)
            if feedback is None or feedback[0] != update.incarnation:
                feedback = (update.incarnation, ErrorFeedback())
                self._feedback[device] = feedback
            started = asyncio.get_running_loop().time()
            encoded = await asyncio.to_thread(_encode, update, policy, feedback[1])
            self.m_gateway_seconds.observe(asyncio.get_running_loop().time() - started)
            payload = wire.encode(encoded)
            out_bytes = sum(len(s.data) for s in encoded.shards)
            self._forwarded[device] = (key, payload, out_bytes)
            self.m_gateway_updates.labels(codec=policy.codec).inc()
        self.m_gateway_bytes.labels(direction="in").inc(raw_bytes)
        self.m_gateway_bytes.labels(direction="out").inc(out_bytes)
        await self.bus.publish(self.topics.grad(update.cluster, device), payload, kind="gradient")

    # ------------------------------------------------------------------ control
    async def _apply_control(self, cmd: ControlCommand) -> tuple[bool, str, dict[str, Scalar]]:
        match cmd.command:
            case "status":
                return True, "ok", self._status()
            case "set-codec":
                return await self._set_codec(cmd)
            case "stop":
                return True, "stopping", self._status()
            case _:
                return False, f"unknown command {cmd.command!r} ({', '.join(COMMANDS)})", {}

    async def _set_codec(self, cmd: ControlCommand) -> tuple[bool, str, dict[str, Scalar]]:
        device, codec = cmd.device, cmd.value
        if not device or not valid_name(device):
            return False, "set-codec needs the device in 'device' and the codec in 'value'", {}
        if not isinstance(codec, str):
            return False, f"set-codec needs a codec name in 'value' ({', '.join(CODECS)}, or {DEFAULT_VALUE})", {}
        if codec == DEFAULT_VALUE:
            self.operator.pop(device, None)
        elif codec not in CODECS:
            return False, f"unknown codec {codec!r} (known: {', '.join(CODECS)}, or {DEFAULT_VALUE})", {}
        elif codec not in available_codecs():
            return False, (f"codec {codec!r} is not implemented in this build yet "
                           f"(available: {', '.join(available_codecs())})"), {}
        else:
            self.operator[device] = codec
        if not self._started or device not in self.incarnations:
            return True, f"{device} has not said hello yet; its policy follows when it does", {"device": device}
        policy = await self._reconcile(device, announce=False)
        return True, f"{device}: codec {policy.codec} (version {policy.version})", {
            "device": device, "codec": policy.codec, "version": policy.version}

    def _status(self) -> dict[str, Scalar]:
        devices = sorted(self.incarnations)
        listed: list[str] = []
        size = 0
        for d in devices:
            policy = self.policies.get(d)
            entry = f"{d}={_describe(policy)}" if policy is not None else f"{d}=-"
            if size + len(entry) + 1 > LIST_MAX_CHARS:
                listed.append(f"...(+{len(devices) - len(listed)} more)")
                break
            listed.append(entry)
            size += len(entry) + 1
        return {
            "devices": len(devices),
            "mode": self.cfg.compressor.mode,
            "default_codec": self.cfg.compressor.default_codec,
            "gateway_devices": len(self.gateway & set(devices)),
            "policies": ",".join(listed),
            "operator_overrides": len(self.operator),
        }


def _describe(policy: CodecPolicy) -> str:
    """``codec@version``, with ``/density`` for a sparsifying density and ``+gw`` for gateway devices."""
    density = f"/{policy.density:g}" if policy.density < 1.0 else ""
    return f"{policy.codec}{density}{'+gw' if policy.gateway else ''}@{policy.version}"


def _encode(update: GradientUpdate, policy: CodecPolicy, feedback: ErrorFeedback) -> GradientUpdate:
    """``update`` with every raw float32 shard encoded per ``policy`` (in a thread)."""
    raw = get_codec(RAW_CODEC)
    decoded = []
    for s in update.shards:  # check every shard before error feedback changes for any
        if s.codec != RAW_CODEC:
            raise WireError(f"grad-raw shard {s.param} is {s.codec!r}, not {RAW_CODEC!r}", "codec")
        if not s.data or len(s.data) % FP32_BYTES:
            raise WireError(f"grad-raw shard {s.param} has {len(s.data)} bytes, not whole float32s", "codec")
        decoded.append((s, raw.decode(s.data, len(s.data) // FP32_BYTES)))
    keys = [(s.param, s.start, s.stop) for s, _ in decoded]
    if len(set(keys)) != len(keys):
        raise WireError("a grad-raw shard appears twice", "shape")
    shards = []
    for s, values in decoded:
        codec = codec_for(policy.codec, values.size)
        shards.append(ShardUpdate(param=s.param, start=s.start, stop=s.stop, codec=codec.name,  # type: ignore[arg-type]
                                  data=feedback.encode(f"{s.param}[{s.start}:{s.stop}]", values, codec, policy)))
    return dataclasses.replace(update, shards=tuple(shards))


def _check_device(message_device: str, topic_device: str) -> None:
    if message_device != topic_device:
        raise WireError(f"message for {message_device!r} on the topic of {topic_device!r}", "topic")


async def run(config: Config, *, stop: asyncio.Event | None = None) -> None:
    """Run the compressor until ``stop`` is set, SIGINT or SIGTERM."""
    stop = stop or asyncio.Event()
    install_stop_signals(stop)
    await Compressor(config, stop=stop).run()
