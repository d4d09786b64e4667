"""The compressor: one retained codec policy per device (DESIGN.md §1, §6).

Backbone, top to bottom:
1. check that every configured codec is built in; connect; subscribe to the retained codec
   policies first (to continue their versions after a restart), then to hellos, stats and
   control;
2. once retained state has settled, give every device that said hello its policy;
3. consume: on a new device or a new incarnation, publish its policy retained on
   ``codec/{device}``; on stats, ask the policy again and publish only what changed
   (``policy.choose_policy``, which ignores stats in this release);
4. control: status, set-codec, stop.

An operator's ``set-codec`` is stored in the policy's ``reason`` (``operator``), so a restarted
compressor restores it from the retained policies; ``set-codec`` with the value ``default``
hands the device back to the configuration.

The gateway (re-encoding ``grad-raw`` for devices too weak to encode) is not part of this
release. This module must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from edgemesh.common.bus import Bus, Incoming
from edgemesh.common.codecs import available_codecs
from edgemesh.common.config import CODECS, Config
from edgemesh.common.errors import BusError, ConfigError, WireError
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    DeviceHello,
    DeviceStats,
    Scalar,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics, valid_name
from edgemesh.services.compressor.policy import REASON_OPERATOR, choose_policy
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

        self.incarnations: dict[str, int] = {}
        """Devices that said hello, with their latest incarnation."""
        self.policies: dict[str, CodecPolicy] = {}
        """Current policy per device: the last one published, or the retained one adopted."""
        self.stats: dict[str, DeviceStats] = {}
        self.operator: dict[str, str] = {}
        """Codecs an operator chose with ``set-codec``, by device."""
        self.ready = asyncio.Event()
        """Set once retained state has settled and every device seen by then has its policy."""
        self._started = False
        self._online = asyncio.Event()

        m = self.metrics = ServiceMetrics(SERVICE)
        self.m_published = m.counter("policies_published", "Codec policies published", ["codec"])
        self.m_devices = m.gauge("devices", "Devices that said hello")
        for codec in available_codecs():
            self.m_published.labels(codec=codec)

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
                    self.topics.all_hello(), self.topics.all_stats(),
                    self.topics.control(SERVICE), self.topics.control("all"),
                ],
                on_connect=self._on_connect,
            ))
            self.ops = Operations(source=SERVICE, bus=self.bus, topics=self.topics, metrics=self.metrics,
                                  stop=self.stop)
            self.metrics.up.set(1)
            logger.info("compressor up: job %s, default codec %s, %d override(s)", self.cfg.job,
                        self.cfg.compressor.default_codec, len(self.cfg.compressor.overrides))
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
                             operator=self.operator)

    async def _reconcile(self, device: str, *, announce: bool) -> CodecPolicy:
        """Publish the device's policy if it changed, or if ``announce`` (new or restarted device)."""
        assert self.bus is not None
        previous = self.policies.get(device)
        policy = self._choose(device)
        if policy is previous and not announce:
            return policy
        self.policies[device] = policy
        self.m_published.labels(codec=policy.codec).inc()
        await self.bus.publish(self.topics.codec(device), policy, retain=True)
        if previous is None or previous.codec != policy.codec:
            logger.info("%s: codec %s (version %d, %s)", device, policy.codec, policy.version, policy.reason)
        return policy

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
            entry = f"{d}={policy.codec}@{policy.version}" if policy is not None else f"{d}=-"
            if size + len(entry) + 1 > LIST_MAX_CHARS:
                listed.append(f"...(+{len(devices) - len(listed)} more)")
                break
            listed.append(entry)
            size += len(entry) + 1
        return {
            "devices": len(devices),
            "default_codec": self.cfg.compressor.default_codec,
            "policies": ",".join(listed),
            "operator_overrides": len(self.operator),
        }


def _check_device(message_device: str, topic_device: str) -> None:
    if message_device != topic_device:
        raise WireError(f"message for {message_device!r} on the topic of {topic_device!r}", "topic")


async def run(config: Config, *, stop: asyncio.Event | None = None) -> None:
    """Run the compressor until ``stop`` is set, SIGINT or SIGTERM."""
    stop = stop or asyncio.Event()
    install_stop_signals(stop)
    await Compressor(config, stop=stop).run()
