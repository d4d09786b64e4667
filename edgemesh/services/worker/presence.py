"""What a device says of itself on its own topics: its status and hello, and the plan shares it refuses.

* On every connect the retained ``online`` status, then the retained hello (its measured profile, build, link
  and board): the planner plans the device from them. ``offline`` is the connection's will, and is published
  when the worker stops.
* The status names the last plan whose share this device refused and why (``profile.share_refusal``: the share
  does not fit its memory by the accounting the planner sized it with), and the samples of its validation share
  (the parameter server bounds its evaluation reports by them). A refusal is also a ``share_refused`` event, and
  counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from edgemesh.common import wire
from edgemesh.common.bus import Bus
from edgemesh.common.errors import BusError
from edgemesh.common.messages import DeviceHello, DeviceStatus
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.runtime import Events
from edgemesh.services.worker import profile as prof
from edgemesh.services.worker.board import Board
from edgemesh.services.worker.link import LinkMeter

logger = logging.getLogger(__name__)


class Presence:
    """This device's status, hello and refusals."""

    def __init__(self, *, device: str, incarnation: int, topics: Topics, board: Board, link: LinkMeter,
                 can_encode: bool, validation_samples: int, metrics: ServiceMetrics) -> None:
        self.device, self.incarnation, self.topics = device, incarnation, topics
        self.board, self.link, self.can_encode = board, link, can_encode
        self.validation_samples = validation_samples
        self.bus: Bus | None = None
        self.events: Events | None = None
        """Both set when the runtime attaches the worker to its bus."""
        self.profile: prof.Profile | None = None
        """The device as the board measured it (before it connects)."""
        self.refused = 0
        """Version of the last plan whose share did not fit this device's memory (0 = none)."""
        self._refusal = ""
        self.m_refused = metrics.counter("refused_shares", "Plan shares refused because they do not fit in memory")

    def will(self) -> tuple[str, bytes]:
        """The connection's will: the ``offline`` status."""
        return self.topics.status(self.device), wire.encode(DeviceStatus(device=self.device, state="offline",
                                                                         incarnation=self.incarnation))

    async def announce(self) -> None:
        """(Re)announce the device: its ``online`` status, then its hello (both retained)."""
        assert self.bus is not None and self.profile is not None
        await self._publish_status()
        p, b = self.profile, self.board
        await self.bus.publish(self.topics.hello(self.device), DeviceHello(
            device=self.device, incarnation=self.incarnation, flops=p.flops, memory_bytes=p.memory_bytes,
            cores=p.cores, platform=p.platform, software=prof.software(), can_encode=self.can_encode,
            link_rate_bps=self.link.declared_bps, profile=b.profile_name, downlink_rate_bps=b.downlink_bps,
            latency_s=b.latency_s), retain=True)

    async def refuse(self, plan_version: int, reason: str) -> None:
        """Refuse this device's share of plan ``plan_version``: say so in the retained status and an event."""
        assert self.events is not None
        self.refused, self._refusal = plan_version, reason
        self.m_refused.inc()
        logger.warning("%s: refusing my share of plan version %d: %s", self.device, plan_version, reason)
        with contextlib.suppress(BusError):
            await self._publish_status()
            await self.events.emit("share_refused", f"{self.device} refused plan version {plan_version}: {reason}",
                                   device=self.device, plan_version=plan_version)

    async def leave(self, timeout_s: float) -> None:
        """The retained ``offline`` status, if the connection holds (within ``timeout_s``)."""
        if self.bus is not None and self.bus.is_connected:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(timeout_s):
                    await self.bus.publish(self.topics.status(self.device), DeviceStatus(
                        device=self.device, state="offline", incarnation=self.incarnation, time=time.time()),
                        retain=True)

    async def _publish_status(self) -> None:
        """The retained ``online`` status, naming the plan this device refused if it did."""
        assert self.bus is not None
        await self.bus.publish(self.topics.status(self.device), DeviceStatus(
            device=self.device, state="online", incarnation=self.incarnation, time=time.time(),
            refused_plan=self.refused, reason=self._refusal, validation_samples=self.validation_samples),
            retain=True)
