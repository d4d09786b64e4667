"""The fleet a running job has, as its devices measured themselves (``edgemesh simulate --live JOB``).

Each device's retained hello (what the planner plans with) and, within the wait, its stats become a board of the
simulation:

* a device that emulates a board (``worker.emulate``) is that board's profile, as the emulator runs it;
* any other device is a board of its own, named after it: its training rate is what its stats measured
  (``compute_flops``, a training step's FLOPs over its time) or, before its first stats, what its hello declared
  at the planner's efficiency (``flops x costs.TRAIN_EFFICIENCY``, the planner's assumption); its links and latency
  are its hello's (declared) or its stats' (measured), else ``UNKNOWN_LINK_BPS`` and no latency; it neither
  disconnects nor throttles except as the chosen scenario says of every board.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from edgemesh.common import costs
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.emulation.profiles import DeviceProfile
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import DeviceHello, DeviceStats
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics

UNKNOWN_LINK_BPS = 1.25e6
"""A link neither declared nor measured yet: 10 Mbit/s, a slow Wi-Fi (bytes/s)."""


@dataclass
class Heard:
    """What the job's topics said about its devices within the wait."""

    hello: dict[str, DeviceHello] = field(default_factory=dict)
    stats: dict[str, DeviceStats] = field(default_factory=dict)


async def listen(config: Config, wait_s: float) -> Heard:
    """The job's retained hellos, and the stats its devices publish within ``wait_s``."""
    topics, heard = Topics(config.job), Heard()

    async def hello(message: DeviceHello, match: TopicMatch) -> None:
        heard.hello[match.device] = message

    async def stats(message: DeviceStats, match: TopicMatch) -> None:
        heard.stats[match.device] = message

    bus = Bus(config.broker, client_id=f"edgemesh-simulate-{uuid.uuid4().hex[:8]}",
              metrics=ServiceMetrics("operator"))
    bus.route(topics.hello_filter(), DeviceHello, hello)
    bus.route(topics.stats_filter(), DeviceStats, stats)
    async with bus:
        await asyncio.sleep(wait_s)  # retained hellos come at once; stats every worker.stats_interval_s
    return heard


def boards(heard: Heard, shipped: Mapping[str, DeviceProfile]) -> dict[str, DeviceProfile]:
    """Every device heard of, as a board (module docstring); ConfigError if none was."""
    if not heard.hello:
        raise ConfigError("no device of the job has said hello on the broker (is the job's name right, and is "
                          "a worker of it running?)")
    out = {}
    for name, h in sorted(heard.hello.items()):
        if h.profile and h.profile in shipped:
            out[name] = shipped[h.profile]
            continue
        s = heard.stats.get(name)
        measured = s.compute_flops if s is not None and s.compute_flops > 0 else 0.0
        rate = measured or h.flops * costs.TRAIN_EFFICIENCY
        up = h.link_rate_bps or (s.link_rate_bps if s else 0.0) or UNKNOWN_LINK_BPS
        down = h.downlink_rate_bps or (s.downlink_rate_bps if s else 0.0) or up
        out[name] = DeviceProfile(
            name=name, description=f"{name} as measured ({h.platform or 'unknown platform'})", cores=1,
            gflops=rate / costs.TRAIN_EFFICIENCY / 1e9, memory_bytes=h.memory_bytes, uplink_bps=up,
            downlink_bps=down, latency_s=h.latency_s or (s.latency_s if s else 0.0), disconnects_per_hour=0.0,
            outage_s=0.0, sources={"measured": "the device's hello and stats"})
    return out
