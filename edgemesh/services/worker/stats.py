"""What a device tells the compressor and the planner about itself (``DeviceStats``): its recent steps (time,
batch size, loss, FLOPs per second), the delays its updates were applied with, and its link (uplink, downlink
and latency, ``link``), with the link figures on gauges too."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from edgemesh.common.config import WorkerConfig
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.worker.link import DownlinkMeter, LatencyMeter, LinkMeter

AVERAGE_WINDOW = 20
"""Steps over which step times and delays are averaged for stats."""


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


def mean(values: deque[Any]) -> float:
    return float(np.mean(values)) if values else 0.0
