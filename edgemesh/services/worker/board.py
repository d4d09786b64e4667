"""The device a worker runs on: the real board, or an emulated one (docs/emulation.md).

The worker asks its board the same things whichever it is, and never branches on emulation:

* ``measure()``: the profile its hello announces (speed, memory, cores, platform);
* ``connect(stack, broker)``: where its MQTT client connects;
* ``hold(real_s, flops, samples)``: a piece of training took ``real_s`` on this host; how long it
  takes on the board. An emulated board waits out the rest: ``flops`` (the piece's training FLOPs)
  at ``costs.TRAIN_EFFICIENCY`` of the board's rate, the planner's cost model whatever the host's
  load; a model without cost figures (``flops`` None) is held to the calibrated host step times the
  board's slowness. A piece the host could not finish in time is an overrun;
* ``link_rates()``: uplink and downlink bytes/s;
* ``begin()``: the run's clock starts (the first plan naming the device).

An emulated board (``worker.emulate = PROFILE``) takes the profile's speed, memory and links,
time-dilated by ``worker.emulation_dilation``, and connects through an :class:`EmulatedLink` with
the board's rates, latency and disconnects. Under a scenario (``worker.emulation_scenario``) its
timeline (``emulation.dynamics``) takes over from ``begin()`` on: a throttled spell slows the
compute of the steps it overlaps, and the link stalls, drops out and changes rate on schedule
(the scenario's drop-outs replace the profile's).

Its process runs under the limits ``edgemesh worker`` put it under (``emulation.limits``: ``cgroup-v1``, the
board's memory, or ``stretched``), exported as ``edgemesh_worker_emulation_limits{mode}``. Under cgroups the
board also caps the process at its share of the host's CPU once it has measured the host
(``worker.emulation_cpu_quota``). The quota is a ceiling and ``hold`` the floor: a piece waits only for what its
real time, quota included, fell short of the board's, so the two never slow a piece twice; what measures the
host (its GFLOP/s, the calibration steps) runs with the quota lifted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import replace

from edgemesh.common import costs
from edgemesh.common.config import BrokerConfig, WorkerConfig
from edgemesh.common.emulation import limits
from edgemesh.common.emulation.compute import ComputeStretch, measure_host_gflops
from edgemesh.common.emulation.dynamics import Timeline
from edgemesh.common.emulation.link import EmulatedLink
from edgemesh.common.emulation.profiles import DeviceProfile, get_profile
from edgemesh.common.emulation.scenarios import get_scenario
from edgemesh.common.errors import ConfigError
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.services.worker import profile as prof
from edgemesh.services.worker.link import LinkMeter

logger = logging.getLogger(__name__)


class Board:
    """The real device: measured at start, connected straight to the broker, its steps as long as they take."""

    profile_name = ""
    """The emulated profile's name (empty: a real device)."""
    downlink_bps = 0.0
    latency_s = 0.0

    def __init__(self, config: WorkerConfig, device: str, link: LinkMeter, metrics: ServiceMetrics) -> None:
        self.cfg = config
        self.device = device
        self.link = link
        self.m_overruns = metrics.counter("emulation_overruns", "Emulated steps the host could not compute in the "
                                          "emulated time (the device then ran at the host's pace)")
        self.m_link_cuts = metrics.gauge("emulation_link_disconnects", "Emulated link: connections cut "
                                         "(spontaneous or forced) so far")
        self.m_link_stalls = metrics.gauge("emulation_link_stalls", "Emulated link: stalls so far")
        self.m_link_busy = metrics.gauge("emulation_link_busy_seconds", "Emulated link: seconds each direction "
                                         "has been busy sending so far", ["direction"])
        self.m_speed = metrics.gauge("emulation_speed_ratio", "Emulated board: share of its full compute speed "
                                     "now (below 1 while throttled)")

    def measure(self) -> prof.Profile:
        """The device's profile (in a thread: it benchmarks)."""
        return prof.measure(self.cfg.profile_seconds, self.cfg.memory_bytes)

    async def connect(self, stack: contextlib.AsyncExitStack, broker: BrokerConfig) -> BrokerConfig:
        return broker

    async def hold(self, real_s: float, flops: float | None, samples: int = 0) -> float:
        return real_s

    def calibrate(self, step: Callable[[int], float]) -> None:
        """Time real steps of a model without cost figures (only an emulated board needs them)."""

    def link_rates(self) -> tuple[float, float]:
        """Uplink and downlink bytes/s (0 = unknown): the measured uplink for both (the cost model's
        convention for an unknown downlink)."""
        return self.link.rate_bps, self.link.rate_bps

    def describe(self) -> str:
        return ""

    def begin(self) -> None:
        """The run's clock starts (called with every plan naming the device; only the first counts)."""

    def sample(self) -> None:
        """Bring the board's gauges up to date (stats time)."""


class EmulatedBoard(Board):
    """A board of ``edgemesh.common.emulation``'s profiles, emulated on this host."""

    def __init__(self, config: WorkerConfig, device: str, link: LinkMeter, metrics: ServiceMetrics,
                 broker: BrokerConfig) -> None:
        super().__init__(config, device, link, metrics)
        if broker.tls:
            raise ConfigError("worker.emulate: the emulated link relays plain TCP; use mqtt://, not mqtts://")
        self.board: DeviceProfile = get_profile(config.emulate, config.emulation_profiles or None).dilated(
            config.emulation_dilation)
        self.profile_name = self.board.name
        self.downlink_bps, self.latency_s = self.board.downlink_bps, self.board.latency_s
        if not config.link_rate_bps:
            link.declare(self.board.uplink_bps)
        self.stretch: ComputeStretch | None = None
        self.emulated_link: EmulatedLink | None = None
        self.dilation = config.emulation_dilation
        self.timeline: Timeline | None = None
        if config.emulation_scenario:
            scenario = get_scenario(config.emulation_scenario, config.emulation_scenarios or None)
            self.timeline = Timeline.of(scenario, self.board.name, device, config.emulation_seed)
        self.epoch: float | None = None
        """Loop time the run's clock started (``begin``), None before."""
        self._begun = asyncio.Event()
        self.limits = limits.current() or limits.Limits("stretched", "not started under limits (edgemesh worker)")
        """The kernel's limits this process runs under, or none (``stretched``)."""
        m_mode = metrics.gauge("emulation_limits", "Emulated board: how it is held to the board (1 for the mode in "
                               "force): cgroup-v1 (the kernel's memory limit and CPU quota) or stretched (compute "
                               "held to the board's time alone)", ["mode"])
        for mode in ("cgroup-v1", "stretched"):
            m_mode.labels(mode=mode).set(1 if mode == self.limits.mode else 0)
        metrics.gauge("emulation_memory_limit_bytes", "Emulated board: the kernel's memory limit on this process "
                      "(0 = not enforced)").set(self.limits.memory_bytes)
        self.m_cpus = metrics.gauge("emulation_cpu_quota_cpus", "Emulated board: the kernel's CPU quota on this "
                                    "process, in host CPUs (0 = none)")

    def measure(self) -> prof.Profile:
        with self.limits.cpu_lifted():  # the host's own rate, not the quota's
            host = self.cfg.emulation_host_gflops or measure_host_gflops(self.cfg.threads)
        self.stretch = ComputeStretch.for_device(host, self.board.train_gflops)
        if self.stretch.ratio < 1:
            logger.warning("%s: this host (%.1f GFLOP/s) is slower than an emulated %s (%.1f): steps run at the "
                           "host's pace", self.device, host, self.board.name, self.board.train_gflops)
        if self.cfg.emulation_cpu_quota and self.limits.cpu is not None:
            cpus = limits.cpu_share(self.board.gflops, host, threads=self.cfg.threads)
            if cpus <= limits.MIN_QUOTA_CPUS:
                logger.info("%s: an emulated %s is worth at most %.2f of a host CPU, the quota's floor: the quota no "
                            "longer tells boards apart, and the stretched compute alone holds steps to the board's "
                            "pace (a model slower on this host than its FLOPs say overruns)", self.device,
                            self.board.name, cpus)
            self.m_cpus.set(self.limits.set_cpus(cpus))
        return prof.Profile(flops=self.board.train_gflops * 1e9,
                            memory_bytes=self.cfg.memory_bytes or self.board.memory_bytes,
                            cores=os.cpu_count() or 1, platform=f"emulated-{self.board.name}")

    async def connect(self, stack: contextlib.AsyncExitStack, broker: BrokerConfig) -> BrokerConfig:
        """Start the emulated link in front of the broker; the bus connects to it instead."""
        w = self.cfg
        seed = int.from_bytes(hashlib.sha256(f"{w.emulation_seed}/{self.device}".encode()).digest()[:4], "big")
        shape = self.board.link()
        if self.timeline is not None:  # the scenario's timeline drops the link, not the profile's own rate
            shape = replace(shape, disconnects_per_hour=0.0)
        link = self.emulated_link = await stack.enter_async_context(EmulatedLink(
            shape, upstream_host=broker.host, upstream_port=broker.port, seed=seed, name=self.device,
            max_outage_s=w.emulation_max_outage_s or None))
        if self.timeline is not None:
            driver = asyncio.create_task(self._drive(link, self.timeline), name=f"{self.device}:scenario")

            async def stop_driving() -> None:
                driver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await driver

            stack.push_async_callback(stop_driving)
        logger.info("%s: emulated link %s:%d -> %s (%s)", self.device, link.host, link.port, broker.url,
                    self.board.description or self.board.name)
        return replace(broker, url=f"mqtt://{link.host}:{link.port}")

    def begin(self) -> None:
        if self.epoch is None:
            self.epoch = asyncio.get_running_loop().time()
            self._begun.set()
            if self.timeline is not None:
                logger.info("%s: scenario clock started", self.device)

    def _throttled(self, real_s: float, full_s: float) -> float:
        """How long a piece that takes ``full_s`` at full speed and ended just now, ``real_s`` after it began,
        takes on the board, throttled spells slowing it."""
        if self.timeline is None or self.epoch is None:
            return full_s
        began = (asyncio.get_running_loop().time() - real_s - self.epoch) / self.dilation
        return (self.timeline.work_end(began, full_s / self.dilation) - began) * self.dilation

    async def hold(self, real_s: float, flops: float | None, samples: int = 0) -> float:
        if flops is None:
            assert self.stretch is not None
            overruns = self.stretch.overruns
            emulated = self.stretch.emulated(samples, real_s)
            self.m_overruns.inc(self.stretch.overruns - overruns)
            target = self._throttled(real_s, emulated)
        else:
            full = flops / (costs.TRAIN_EFFICIENCY * self.board.train_gflops * 1e9)
            target = self._throttled(real_s, full)
            if real_s > target and flops:
                self.m_overruns.inc()
        rest = max(target - real_s, 0.0)
        await asyncio.sleep(rest)  # the rest of the piece, at the emulated board's speed
        return real_s + rest

    async def _drive(self, link: EmulatedLink, timeline: Timeline) -> None:
        """Stall, drop and re-rate ``link`` on the timeline's schedule, from ``begin()`` on."""
        await self._begun.wait()
        assert self.epoch is not None
        loop = asyncio.get_running_loop()
        for event in timeline.link_events():
            delay = self.epoch + event.start_s * self.dilation - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            match event.kind:
                case "stall":
                    link.stall(event.length_s * self.dilation)
                case "drop":
                    await link.outage(event.length_s * self.dilation)
                case "bandwidth":
                    link.set_rates(event.value)

    def calibrate(self, step: Callable[[int], float]) -> None:
        assert self.stretch is not None
        with self.limits.cpu_lifted():  # the host's uncontended step, which the stretch multiplies
            overhead, per_sample = self.stretch.calibrate(step)
        logger.info("%s: host step %.2f ms + %.4f ms/sample, emulated x%.1f", self.device, overhead * 1e3,
                    per_sample * 1e3, self.stretch.ratio)

    def link_rates(self) -> tuple[float, float]:
        return self.board.uplink_bps, self.board.downlink_bps

    def sample(self) -> None:
        if self.emulated_link is not None:
            self.m_link_cuts.set(self.emulated_link.disconnects)
            self.m_link_stalls.set(self.emulated_link.stalls)
            up, down = self.emulated_link.busy_s
            self.m_link_busy.labels(direction="up").set(up)
            self.m_link_busy.labels(direction="down").set(down)
        if self.timeline is not None and self.epoch is not None:
            now = (asyncio.get_running_loop().time() - self.epoch) / self.dilation
            self.m_speed.set(self.timeline.speed_at(now))

    def describe(self) -> str:
        ratio = f": steps {self.stretch.ratio:.1f}x the host's" if self.stretch is not None else ""
        held = self.limits
        if held.mode == "cgroup-v1":
            quota = f", {held.cpus:.2f} CPU" if held.cpus else ""
            under = f"; limits cgroup-v1: {held.memory_bytes / 2**20:.0f} MiB{quota}"
        else:
            under = f"; limits stretched: {held.reason}"
        return f" (emulating {self.board.name}{ratio}{under})"


def board_for(config: WorkerConfig, device: str, link: LinkMeter, metrics: ServiceMetrics,
              broker: BrokerConfig) -> Board:
    """The worker's board: emulated when ``worker.emulate`` names a profile."""
    if config.emulate:
        return EmulatedBoard(config, device, link, metrics, broker)
    return Board(config, device, link, metrics)
