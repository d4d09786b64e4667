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
   raw float32 updates, which the ``gateway`` encodes with the device's policy and forwards to the PS
   (which acks the device directly);
5. control: status, set-codec, stop.

An operator's ``set-codec`` is stored in the policy's ``reason`` (``operator``), so a restarted
compressor restores it from the retained policies; ``set-codec`` with the value ``default``
hands the device back to the configuration.

This module must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from collections.abc import Iterable

from edgemesh.common.bus import Bus
from edgemesh.common.codecs import available_codecs
from edgemesh.common.config import Config
from edgemesh.common.errors import BusError, ConfigError, WireError
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    DeviceHello,
    DeviceStats,
    GradientUpdate,
    Scalar,
)
from edgemesh.common.messages.operations import SERVICE_COMMANDS, listing
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics, valid_name
from edgemesh.common.vocabulary import CODECS, CodecName
from edgemesh.services.compressor.gateway import Gateway
from edgemesh.services.compressor.policy import REASON_OPERATOR, change_kind, choose_policy
from edgemesh.services.runtime import ControlResult, Endpoint, Events, Job, serve

logger = logging.getLogger(__name__)

RETAINED_SETTLE_S = 0.2
"""After connecting, wait this long for retained policies and hellos before publishing any policy."""
DEFAULT_VALUE = "default"
"""``set-codec`` value that removes an operator's choice for a device."""
COMMANDS = SERVICE_COMMANDS["compressor"]
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
        self.gateway = Gateway(m)
        """Devices that cannot encode, whose raw updates it encodes and forwards."""
        for codec in available_codecs():
            self.m_published.labels(codec=codec)
            self.m_codec_devices.labels(codec=codec)

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
        self.gateway.hello(hello)
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
                             stats=self.stats.get(device), operator=self.operator,
                             gateway=device in self.gateway.devices, reference_delay=self._reference_delay())

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
        payload = await self.gateway.encode(update, self.incarnations.get(device),
                                            lambda: self.policies.get(device) or self._choose(device))
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
            "gateway_devices": len(self.gateway.devices & set(devices)),
            "policies": listing(entries),
            "operator_overrides": len(self.operator),
        }


def _describe(policy: CodecPolicy) -> str:
    """``codec@version``, with ``/density`` for a sparsifying density and ``+gw`` for gateway devices."""
    density = f"/{policy.density:g}" if policy.density < 1.0 else ""
    return f"{policy.codec}{density}{'+gw' if policy.gateway else ''}@{policy.version}"
