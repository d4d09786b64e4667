"""What a device tells the compressor and the planner about itself (``DeviceStats``): its recent steps (time,
batch size, loss, FLOPs per second), the delays its updates were applied with, and its link (uplink, downlink
and latency, ``link``), with the link figures on gauges too; the time to an ack, its gradient's size, the
model's version, its memory and the host's temperature and throttling as last read.

The stats go out after the first acked update (the compressor needs the step time and gradient size to choose a
codec at once), then every ``worker.stats_interval_s``; the latency is measured by link probes every interval,
from the start (``Report``). From them the compressor picks this device's codec and the planner its batch and
its share of a model-parallel cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import Any

import numpy as np

from edgemesh.common.bus import Bus
from edgemesh.common.config import WorkerConfig
from edgemesh.common.health import HealthReading
from edgemesh.common.messages import DeviceStats, LinkProbe
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.worker import profile as prof
from edgemesh.services.worker.board import Board
from edgemesh.services.worker.link import DownlinkMeter, LatencyMeter, LinkMeter, keep_probing
from edgemesh.services.worker.mesh.session import MeshSession, Wait
from edgemesh.services.worker.sender import Sender
from edgemesh.services.worker.trainer import Trainer

AVERAGE_WINDOW = 20
"""Steps over which step times and delays are averaged for stats."""
PROBES_PER_INTERVAL = 2
"""Link probes timed every ``worker.stats_interval_s`` (the latency is the shortest recent round trip)."""


class Recent:
    """A device's recent steps and link measurements."""

    def __init__(self, config: WorkerConfig, topics: Topics, metrics: ServiceMetrics) -> None:
        self.topics = topics
        self.link = LinkMeter(config.link_rate_bps)
        """Uplink rate: ``worker.link_rate_bps`` if set, else measured."""
        self.downlink = DownlinkMeter()
        """Downlink rate, measured from chunked messages received."""
        self.latency = LatencyMeter()
        """Latency to the broker, measured by link probes."""
        self.step_times: deque[float] = deque(maxlen=AVERAGE_WINDOW)
        self.batch_size = 0
        """Batch size of the steps in ``step_times``."""
        self.delays: deque[int] = deque(maxlen=AVERAGE_WINDOW)
        self.work: deque[tuple[float, float]] = deque(maxlen=AVERAGE_WINDOW)
        """(training FLOPs, compute seconds) of recent steps: the measured speed."""
        self.loss: float | None = None
        self.m_link = metrics.gauge("link_rate_bytes_per_second", "Uplink rate reported in stats (declared or "
                                    "measured)")
        self.m_downlink = metrics.gauge("downlink_rate_bytes_per_second", "Downlink rate measured from chunked "
                                        "messages received (0 = not measured yet)")
        self.m_latency = metrics.gauge("latency_seconds", "One-way latency to the broker: half the shortest recent "
                                       "round trip of a link probe (0 = not measured yet)")

    def stepped(self, batch_size: int, seconds: float, loss: float) -> None:
        if batch_size != self.batch_size:  # stats report the step time of the batch size in use
            self.step_times.clear()
            self.batch_size = batch_size
        self.step_times.append(seconds)
        self.loss = loss

    @property
    def compute_flops(self) -> float:
        seconds = sum(t for _, t in self.work)
        return sum(f for f, _ in self.work) / seconds if seconds > 0 else 0.0

    def on_joined(self, topic: str, nbytes: int, seconds: float) -> None:
        """A model snapshot or delta of several chunks is a downlink sample (``link``); a mesh slice is not: it
        came at its sender's pace."""
        rest = topic.removeprefix(self.topics.root + "/")
        if rest.startswith("shard/"):  # a parameter server shard's
            rest = rest.split("/", 2)[-1]
        if rest == "model" or rest.startswith("model/delta"):
            self.downlink.observe(nbytes, seconds)

    def figures(self) -> dict[str, Any]:
        """The ``DeviceStats`` fields these make, their gauges set."""
        self.m_link.set(self.link.rate_bps)
        self.m_downlink.set(self.downlink.rate_bps)
        self.m_latency.set(self.latency.latency_s)
        return {"step_time_s": mean(self.step_times), "delay_index": mean(self.delays), "loss": self.loss,
                "batch_size": self.batch_size, "link_rate_bps": self.link.rate_bps,
                "downlink_rate_bps": self.downlink.rate_bps, "latency_s": self.latency.latency_s,
                "upload_time_s": self.link.upload_s, "compute_flops": self.compute_flops}


class Report:
    """This device's stats, from its components' figures, and the link probes they carry the latency of."""

    def __init__(self, *, device: str, incarnation: int, topics: Topics, config: WorkerConfig, recent: Recent,
                 sender: Sender, trainer: Trainer, board: Board, mesh: MeshSession, metrics: ServiceMetrics) -> None:
        self.device, self.incarnation, self.topics = device, incarnation, topics
        self.interval_s = config.stats_interval_s
        self.recent, self.sender, self.trainer, self.board, self.mesh = recent, sender, trainer, board, mesh
        self.metrics = metrics

    async def keep_publishing(self, bus: Bus, wait: Wait) -> None:
        """The stats after the first acked update (``wait`` until then), then every interval."""
        sender = self.sender
        await wait("the first update", lambda: len(sender.comm_times) > 0)
        while True:
            if bus.is_connected:
                stats = self.stats()
                with contextlib.suppress(Exception):
                    await bus.publish(self.topics.stats(self.device), stats)
            await asyncio.sleep(self.interval_s)

    async def keep_probing(self, bus: Bus) -> None:
        """The latency to the broker, measured from the start (``link.keep_probing``)."""
        await keep_probing(bus, self.topics.probe(self.device), lambda: LinkProbe(
            device=self.device, incarnation=self.incarnation, time=time.time()), self.recent.latency,
            per_interval=PROBES_PER_INTERVAL, interval_s=self.interval_s)

    def stats(self) -> DeviceStats:
        """The stats as of now (the board's readings sampled first)."""
        self.board.sample()
        m = self.metrics
        health = m.health.latest if m.health is not None else HealthReading()
        return DeviceStats(
            device=self.device, incarnation=self.incarnation, time=time.time(),
            steps=int(m.value("edgemesh_worker_steps_total")), comm_time_s=mean(self.sender.comm_times),
            rss_bytes=prof.rss_bytes(), cpu_temp_c=health.temperature_c, throttled_bits=health.throttled_bits,
            model_version=max(self.trainer.model_version, 0),
            bytes_sent=int(m.value("edgemesh_worker_published_bytes_total")),
            gradient_bytes=self.trainer.gradient_bytes, **self.recent.figures(),
            mesh_layer_busy_s=self.mesh.layer_busy_s() if self.mesh.active else {})


def mean(values: deque[Any]) -> float:
    return float(np.mean(values)) if values else 0.0
