"""What the parameter server tells the planner about synchronization: the retained ``sync`` state, and the
adaptive rule's figures on gauges.

The state goes out when the policy, bound or slow devices change; when only the delay indices moved, at most
every ``ps.sync_state_interval_s`` (they move on nearly every update). A broker restart loses the retained
copy: ``forget`` has the next chance publish it again.
"""

from __future__ import annotations

import time

from edgemesh.common.bus import Bus
from edgemesh.common.messages import SyncState
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay
from edgemesh.services.parameter_server.scheduler import Fleet


class SyncAnnouncer:
    """The last sync state published, and the adaptive gauges."""

    def __init__(self, topics: Topics, interval_s: float, metrics: ServiceMetrics) -> None:
        self.topics, self.interval_s = topics, interval_s
        self._published: tuple[object, ...] | None = None
        """(policy, bound, slow devices, delay indices) of the last published state."""
        self._published_at = -float("inf")
        self.m_bound = metrics.gauge("adaptive_bound_versions", "Adaptive policy: current delay bound D")
        self.m_deadline = metrics.gauge("adaptive_deadline_seconds", "Adaptive policy: current round deadline")
        self.m_slow = metrics.gauge("slow_devices", "Adaptive policy: devices whose delay index is far above the "
                                    "median")

    @property
    def owed(self) -> bool:
        """Nothing published since the last connect or setting change."""
        return self._published is None

    def forget(self) -> None:
        """Publish at the next chance, changed or not (a new connection, a new policy or bound)."""
        self._published = None

    def gauges(self, rule: AdaptiveDelay, fleet: Fleet, live: tuple[str, ...]) -> None:
        """The adaptive rule's bound, deadline (for the ``live`` clusters) and slow devices for ``fleet``."""
        rule.follow(fleet.bound, fleet.devices)
        self.m_bound.set(rule.bound())
        self.m_deadline.set(rule.deadline(live))
        self.m_slow.set(len(rule.slow_devices()))

    async def publish(self, bus: Bus, state: SyncState) -> None:
        """Publish ``state``, retained, if it says something new (see the module's note)."""
        key = (state.policy, state.bound, state.slow)
        now = time.monotonic()
        if self._published is not None and self._published[:3] == key and (
                self._published[3] == state.delay_indices or now - self._published_at < self.interval_s):
            return
        self._published, self._published_at = (*key, state.delay_indices), now
        await bus.publish(self.topics.sync(), state, retain=True)
