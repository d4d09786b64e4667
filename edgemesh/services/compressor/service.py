"""The compressor: one retained codec policy per device, and the gateway (docs/compression.md).

Backbone, top to bottom:
1. check that every configured codec is built in; connect; consume the retained codec policies
   (to continue their versions after a restart), hellos, stats and ``grad-raw``;
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

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import statistics
from collections.abc import Iterable

from edgemesh import cli
from edgemesh.common import wire
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import ErrorFeedback, available_codecs, codec_for, get_codec
from edgemesh.common.config import Config
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
from edgemesh.common.messages.operations import listing
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics, valid_name
from edgemesh.common.vocabulary import CODECS, CodecName
from edgemesh.services.compressor.policy import FP32_BYTES, REASON_OPERATOR, change_kind, choose_policy
from edgemesh.services.runtime import ControlResult, Endpoint, Events, Job, serve

logger = logging.getLogger(__name__)

RETAINED_SETTLE_S = 0.2
"""After connecting, wait this long for retained policies and hellos before publishing any policy."""
DEFAULT_VALUE = "default"
"""``set-codec`` value that removes an operator's choice for a device."""
COMMANDS = ("status", "set-codec", "stop")
RAW_CODEC = "none"
"""The only codec accepted on ``grad-raw``: float32 as is."""
DENSITY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""Buckets of the published-density histogram."""


def check_codecs(codecs: Iterable[CodecName], where: str) -> None:
    """ConfigError unless every codec is built in (named in config *and* implemented)."""
    available = available_codecs()
    for codec in codecs:
        if codec not in available:
            raise ConfigError(
                f"{where}: codec {codec!r} is not implemented in this build (available: {', '.join(available)})"
            )


class Compressor:
    """One compressor process. ``run()`` until ``stop`` is set."""

    name = "compressor"
    control_target = "compressor"

    def __init__(self, config: Config, *, stop: asyncio.Event | None = None) -> None:
        self.cfg = config
        self.topics = Topics(config.job)
        self.stop = stop or asyncio.Event()
        self.bus: Bus | None = None
        c = config.compressor
        check_codecs([c.default_codec], "compressor.default_codec")
        for device, codec in c.overrides.items():
            check_codecs([codec], f"compressor.overrides.{device}")
        if c.mode == "adaptive":
            check_codecs([c.adaptive_codec], "compressor.adaptive_codec")

        self.incarnations: dict[str, int] = {}
        """Devices that said hello, with their latest incarnation."""
        self.policies: dict[str, CodecPolicy] = {}
        """Current policy per device: the last one published, or the retained one adopted."""
        self.stats: dict[str, DeviceStats] = {}
        self.operator: dict[str, CodecName] = {}
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

        m = self.metrics = ServiceMetrics(self.name)
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

    async def run(self, *, signals: bool = False) -> None:
        await serve(self, self.cfg, signals=signals)

    # ------------------------------------------------------------------ the runtime's seams
    async def prepare(self, stack: contextlib.AsyncExitStack) -> Endpoint:
        c = self.cfg.compressor
        logger.info("compressor up: job %s, %s mode, default codec %s%s, %d override(s)", self.cfg.job, c.mode,
                    c.default_codec, f", adaptive codec {c.adaptive_codec}" if c.mode == "adaptive" else "",
                    len(c.overrides))
        return Endpoint(self.cfg.broker)

    def attach(self, bus: Bus, events: Events) -> None:
        self.bus = bus
        t = self.topics
        bus.route(t.codec_filter(), CodecPolicy, self._on_policy)
        bus.route(t.hello_filter(), DeviceHello, self._on_hello)
        bus.route(t.stats_filter(), DeviceStats, self._on_stats)
        bus.route(t.grad_raw_filter(), GradientUpdate, self._forward)
        bus.on_connect(self._on_connect)

    def jobs(self) -> list[Job]:
        return [self._start()]

    async def close(self) -> None:
        pass

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
    async def _on_stats(self, stats: DeviceStats, _: TopicMatch) -> None:
        known = self.incarnations.get(stats.device)
        if known is None:
            raise WireError(f"stats of {stats.device}, which has not said hello", "unknown_device")
        if 0 < stats.incarnation < known:
            return  # a previous run's, still on its way (the planner ignores them too)
        self.stats[stats.device] = stats
        if self._started:
            await self._reconcile(stats.device, announce=False)

    async def _on_hello(self, hello: DeviceHello, _: TopicMatch) -> None:
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

    async def _on_policy(self, policy: CodecPolicy, _: TopicMatch) -> None:
        """A policy on a codec topic: our own echo, or the retained one of a previous run."""
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
        return choose_policy(device, self.cfg.compressor, previous=self.policies.get(device),
                             stats=self.stats.get(device), operator=self.operator, gateway=device in self.gateway,
                             reference_delay=self._reference_delay())

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
    async def _forward(self, update: GradientUpdate, _: TopicMatch) -> None:
        """Encode a raw update with its device's policy and forward it to the PS."""
        assert self.bus is not None
        device = update.device
        if device not in self.gateway:
            raise WireError(f"raw update of {device}, whose hello does not ask for the gateway", "unknown_device")
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
            encoded = await asyncio.to_thread(encode_raw, update, policy, feedback[1])
            self.m_gateway_seconds.observe(asyncio.get_running_loop().time() - started)
            payload = wire.encode(encoded)
            out_bytes = sum(len(s.data) for s in encoded.shards)
            self._forwarded[device] = (key, payload, out_bytes)
            self.m_gateway_updates.labels(codec=policy.codec).inc()
        self.m_gateway_bytes.labels(direction="in").inc(raw_bytes)
        self.m_gateway_bytes.labels(direction="out").inc(out_bytes)
        await self.bus.publish(self.topics.grad(update.cluster, device), payload, kind="gradient")

    # ------------------------------------------------------------------ control
    async def control(self, cmd: ControlCommand) -> ControlResult:
        match cmd.command:
            case "status":
                return True, "ok", self._status()
            case "set-codec":
                return await self._set_codec(cmd)
            case "stop":
                return True, "stopping", self._status()
            case _:
                return False, f"unknown command {cmd.command!r} ({', '.join(COMMANDS)})", {}

    async def _set_codec(self, cmd: ControlCommand) -> ControlResult:
        device, value = cmd.device, cmd.value
        if not device or not valid_name(device):
            return False, "set-codec needs the device in 'device' and the codec in 'value'", {}
        if not isinstance(value, str):
            return False, f"set-codec needs a codec name in 'value' ({', '.join(CODECS)}, or {DEFAULT_VALUE})", {}
        codec = next((c for c in CODECS if c == value), None)
        if value == DEFAULT_VALUE:
            self.operator.pop(device, None)
        elif codec is None:
            return False, f"unknown codec {value!r} (known: {', '.join(CODECS)}, or {DEFAULT_VALUE})", {}
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
        entries = [f"{d}={_describe(p)}" if (p := self.policies.get(d)) is not None else f"{d}=-" for d in devices]
        return {
            "devices": len(devices),
            "mode": self.cfg.compressor.mode,
            "default_codec": self.cfg.compressor.default_codec,
            "gateway_devices": len(self.gateway & set(devices)),
            "policies": listing(entries),
            "operator_overrides": len(self.operator),
        }


def _describe(policy: CodecPolicy) -> str:
    """``codec@version``, with ``/density`` for a sparsifying density and ``+gw`` for gateway devices."""
    density = f"/{policy.density:g}" if policy.density < 1.0 else ""
    return f"{policy.codec}{density}{'+gw' if policy.gateway else ''}@{policy.version}"


def encode_raw(update: GradientUpdate, policy: CodecPolicy, feedback: ErrorFeedback) -> GradientUpdate:
    """``update`` with every raw float32 shard encoded per ``policy`` (in a thread); its buffers' changes, which
    are not gradients, pass as they are."""
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
        shards.append(ShardUpdate(param=s.param, start=s.start, stop=s.stop, codec=codec.name,
                                  data=feedback.encode(f"{s.param}[{s.start}:{s.stop}]", values, codec, policy)))
    return dataclasses.replace(update, shards=tuple(shards))


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh compressor``: the configuration flags."""
    cli.service_command(parser, run)


async def run(config: Config) -> None:
    """Run the compressor: the job of the configuration, or without one the jobs operators submit."""
    from edgemesh.services.host import serve_or_host

    await serve_or_host("compressor", config, Compressor)
