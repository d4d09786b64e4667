"""The planner's device registry: what every device said of itself, and which devices a plan may hold.

A device is *live* when its latest status is ``online`` and its hello has been seen with the same
incarnation (any hello when the status carries incarnation 0). Incarnations grow with every worker
start, so a status, hello or stats older than the one known (a late will of a previous run) is
ignored. A live device is *plannable* unless an operator drained it, it refused its share of a plan
(its status names the plan), or its memory holds no batch of the model; the last two are left out
until the device restarts with a new incarnation.

What devices measure is kept as it came (``stats``, ``speeds``) and smoothed (``smoothed``: the medians of each
device's last ``planner.smoothing_window`` measurements, what the training grid plans with).

Pure state, no I/O and no torch: the planner service feeds it the messages it routes.
"""

from __future__ import annotations

import logging

from edgemesh.common import costs
from edgemesh.common.errors import ModelError
from edgemesh.common.messages import DeviceHello, DeviceStats, DeviceStatus
from edgemesh.services.planner.batching import SpeedTracker
from edgemesh.services.planner.stability import Smoother

logger = logging.getLogger(__name__)


class Registry:
    """The devices of one job, by name."""

    def __init__(self, *, smoothing_window: int = 9) -> None:
        self.hellos: dict[str, DeviceHello] = {}
        self.statuses: dict[str, DeviceStatus] = {}
        self.stats: dict[str, DeviceStats] = {}
        """Latest measurements per device."""
        self.speeds = SpeedTracker()
        """Step times and uploads each device reported, for balanced batches."""
        self.smoother = Smoother(smoothing_window)
        """Each device's recent speed and link measurements, for the training grid."""
        self.drained: set[str] = set()
        """Devices an operator drained out of the plan."""
        self.unfit: dict[str, int] = {}
        """Devices left out because their memory holds no batch, with the incarnation that said so."""

    # ------------------------------------------------------------------ what devices say
    def hello(self, hello: DeviceHello) -> bool:
        """Take a hello; True if it changed whether (or as which incarnation) the device is plannable."""
        before = self.plannable_incarnation(hello.device)
        known = self.hellos.get(hello.device)
        if known is not None and hello.incarnation < known.incarnation:
            logger.debug("ignoring hello of %s from old incarnation %d", hello.device, hello.incarnation)
        else:
            self.hellos[hello.device] = hello
        return self.plannable_incarnation(hello.device) != before

    def status(self, status: DeviceStatus) -> bool:
        """Take a status; True if it changed whether (or as which incarnation) the device is plannable."""
        before = self.plannable_incarnation(status.device)
        known = self.statuses.get(status.device)
        if known is not None and 0 < status.incarnation < known.incarnation:
            logger.debug("ignoring %s status of %s from old incarnation %d", status.state, status.device,
                         status.incarnation)
        else:
            self.statuses[status.device] = status
        return self.plannable_incarnation(status.device) != before

    def measured(self, stats: DeviceStats) -> bool:
        """Take stats (unless a previous run's); True if taken."""
        hello = self.hellos.get(stats.device)
        if hello is not None and 0 < stats.incarnation < hello.incarnation:
            return False
        self.stats[stats.device] = stats
        self.smoother.observe(stats)
        self.speeds.observe(stats.device, stats.batch_size, stats.step_time_s, stats.upload_time_s)
        return True

    def smoothed(self, name: str, quantile: float = 0.5) -> DeviceStats | None:
        """The device's latest stats with its speed and link figures smoothed (``stability.Smoother``)."""
        return self.smoother.smoothed(name, quantile)

    # ------------------------------------------------------------------ who is there
    def live_hello(self, name: str) -> DeviceHello | None:
        """The hello of ``name`` if the device is live (online, hello of the same incarnation)."""
        status, hello = self.statuses.get(name), self.hellos.get(name)
        if status is None or hello is None or status.state != "online":
            return None
        if status.incarnation and status.incarnation != hello.incarnation:
            return None
        return hello

    def live(self) -> dict[str, DeviceHello]:
        """Live devices, drained ones included, by name."""
        return {name: hello for name in self.statuses if (hello := self.live_hello(name)) is not None}

    def plannable(self) -> dict[str, DeviceHello]:
        return {name: hello for name, hello in self.live().items()
                if name not in self.drained and not self.excluded(name, hello)}

    def plannable_incarnation(self, name: str) -> int | None:
        hello = self.live_hello(name)
        return None if hello is None or name in self.drained or self.excluded(name, hello) else hello.incarnation

    def excluded(self, name: str, hello: DeviceHello) -> bool:
        """Whether a live device is left out: it refused a share, or its memory holds no batch."""
        status = self.statuses.get(name)
        if status is not None and status.refused_plan:
            return True
        return self.unfit.get(name) == hello.incarnation

    def refusals(self) -> list[str]:
        """Live devices that refused their share of a plan."""
        return sorted(name for name, status in self.statuses.items()
                      if status.refused_plan and self.live_hello(name) is not None)

    def excluded_count(self) -> int:
        return sum(1 for name, hello in self.live().items() if self.excluded(name, hello))

    def check_memory(self, spec: str) -> None:
        """Mark live devices whose memory holds no batch of ``spec`` (they are left out of plans)."""
        for name, hello in self.live().items():
            if self.unfit.get(name) == hello.incarnation:
                continue
            try:
                fits = costs.max_batch_for_memory(spec, hello.memory_bytes) >= 1
            except ModelError:
                return  # a model without cost figures: nothing to check against
            if not fits:
                logger.warning("%s: %.0f MiB cannot hold a batch of %s (one sample needs %.0f MiB); leaving it out",
                               name, hello.memory_bytes / 2**20, spec, costs.training_memory_bytes(spec, 1) / 2**20)
                self.unfit[name] = hello.incarnation
