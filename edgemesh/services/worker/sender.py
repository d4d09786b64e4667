"""Sending updates: publish one, wait for its ack, resend it until the parameter server answers.

The PS applies an update at most once (``(device, incarnation, seq)``), so resending is safe: when no ack came
within the ack timeout (``AckTimer``, one per parameter server shard: at least ``worker.ack_timeout_s``, longer when
the acks take longer, doubled after each timeout), and at once after a reconnect. The first publish of an update,
if the connection held throughout, is a sample of the uplink rate (``LinkMeter``). With a sharded parameter server
a step is one update per shard, each sent and acked on its shard's topics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from pathlib import Path

from edgemesh.common.bus import Bus
from edgemesh.common.config import WorkerConfig
from edgemesh.common.errors import BusError
from edgemesh.common.messages import GradientUpdate, UpdateAck
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch
from edgemesh.common.vocabulary import AckStatus
from edgemesh.services.worker.link import LinkMeter

logger = logging.getLogger(__name__)

ACK_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
AVERAGE_WINDOW = 20
"""Updates over which the time to an ack is averaged for stats."""
APPLIED: tuple[AckStatus, ...] = ("accepted", "duplicate")
"""Ack statuses of an update the parameter server applied."""
MAX_ACK_WAIT_S = 60.0
"""Longest the ack timeout grows to (unless ``worker.ack_timeout_s`` is longer)."""


class AckTimer:
    """How long to wait for an ack before resending: TCP's retransmission timer (RFC 6298) over the times updates
    took to be acked, floored at ``worker.ack_timeout_s``.

    An ack usually comes within milliseconds, but a ``sync`` or ``adaptive`` round holds its acks until it closes,
    which a slow device can hold past the configured timeout; each resend then carries a whole gradient over the
    device's uplink for nothing (the parameter server holds the copy it has). So the wait follows the acks: the
    smoothed time to an ack plus four times its variation, at least the configured timeout; each timeout doubles
    it (up to ``MAX_ACK_WAIT_S``), and it stays doubled until an ack measures it again. Only an update acked
    without a resend is a sample (Karn's rule: the ack of a resent update may answer either copy)."""

    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self.ceiling_s = max(floor_s, MAX_ACK_WAIT_S)
        self.wait_s = floor_s
        """The wait for the next ack."""
        self.smoothed_s: float | None = None
        self.variation_s = 0.0

    def acked(self, seconds: float) -> None:
        """An update acked ``seconds`` after its only publish."""
        if self.smoothed_s is None:
            self.smoothed_s, self.variation_s = seconds, seconds / 2
        else:
            self.variation_s = 0.75 * self.variation_s + 0.25 * abs(self.smoothed_s - seconds)
            self.smoothed_s = 0.875 * self.smoothed_s + 0.125 * seconds
        self.wait_s = min(self.ceiling_s, max(self.floor_s, self.smoothed_s + 4 * self.variation_s))

    def timed_out(self) -> None:
        """No ack within ``wait_s``: back off."""
        self.wait_s = min(self.ceiling_s, 2 * self.wait_s)


class Sender:
    """One device's updates to the parameter server and their acks."""

    def __init__(self, *, device: str, incarnation: int, config: WorkerConfig, link: LinkMeter,
                 metrics: ServiceMetrics) -> None:
        self.bus: Bus | None = None
        """Set when the runtime attaches the worker to its bus."""
        self.device, self.incarnation = device, incarnation
        self.ack_timeout_s = config.ack_timeout_s
        self._timers: dict[int, AckTimer] = {}
        """Parameter server shard -> its ack timer (each shard holds and answers its own steps)."""
        self.link = link
        self.ack_log = Path(config.ack_log) if config.ack_log else None
        """Where every update acked applied is written down (``worker.ack_log``), for audits against the PS's
        ledger: a line ``incarnation seq status version`` per ack."""
        self.comm_times: deque[float] = deque(maxlen=AVERAGE_WINDOW)
        """Seconds from publishing an update to its ack, latest first out."""
        self._acks: dict[tuple[int, int], asyncio.Future[UpdateAck]] = {}
        """(parameter server shard, seq) -> the ack waited for."""
        self._pending: dict[int, tuple[str, GradientUpdate]] = {}
        """Shard -> the update waiting for its ack, and its topic."""
        self.m_resends = metrics.counter("resends", "Updates sent again after an ack timeout or a reconnect")
        self.m_ack = metrics.histogram("ack_seconds", "Time from publishing an update to its ack", ACK_BUCKETS)
        self.m_wait = metrics.gauge("ack_timeout_seconds", "How long the worker waits for an ack before resending "
                                    "(the longest of its parameter server shards')")
        self.m_wait.set(self.ack_timeout_s)

    def timer(self, shard: int = 0) -> AckTimer:
        """The ack timer of parameter server shard ``shard``."""
        if shard not in self._timers:
            self._timers[shard] = AckTimer(self.ack_timeout_s)
        return self._timers[shard]

    def _waits_changed(self) -> None:
        self.m_wait.set(max(t.wait_s for t in self._timers.values()))

    async def send(self, update: GradientUpdate, topic: str, shard: int = 0) -> UpdateAck:
        """Publish ``update`` on ``topic`` (parameter server shard ``shard``'s) and wait for its ack, resending
        on timeout."""
        assert self.bus is not None
        timer = self.timer(shard)
        future: asyncio.Future[UpdateAck] = asyncio.get_running_loop().create_future()
        self._acks[shard, update.seq] = future
        self._pending[shard] = (topic, update)
        started = time.perf_counter()
        try:
            attempt = 0
            while True:
                if attempt:
                    self.m_resends.inc()
                    logger.info("%s: no ack for update %d after %.1f s; resending", self.device, update.seq,
                                time.perf_counter() - started)
                connection = self.bus.connections if self.bus.is_connected else -1
                publish_started = time.perf_counter()
                try:
                    sent = await self.bus.publish(topic, update)
                except BusError as exc:  # a long outage: keep the update and try again
                    logger.warning("%s: update %d not sent yet (%s); still trying", self.device, update.seq, exc)
                    attempt += 1
                    continue
                if not attempt and connection == self.bus.connections and self.bus.is_connected:
                    self.link.observe(sent, time.perf_counter() - publish_started)
                attempt += 1
                try:
                    async with asyncio.timeout(timer.wait_s):
                        ack = await asyncio.shield(future)
                    break
                except TimeoutError:
                    timer.timed_out()
                    self._waits_changed()
                    continue
        finally:
            self._acks.pop((shard, update.seq), None)
            self._pending.pop(shard, None)
        if self.ack_log is not None and ack.status in APPLIED:
            await asyncio.to_thread(_append, self.ack_log, f"{update.incarnation} {update.seq} {ack.status} "
                                                           f"{ack.version}\n")
        rtt = time.perf_counter() - started
        self.comm_times.append(rtt)
        self.m_ack.observe(rtt)
        if attempt == 1 and connection == self.bus.connections:  # one publish, no reconnect since: a sample
            timer.acked(rtt)
            self._waits_changed()
        return ack

    async def on_ack(self, ack: UpdateAck, match: TopicMatch) -> None:
        """An ack on ``ack/{device}`` (of a shard): it settles the update of this incarnation it names, if still
        waited for."""
        future = self._acks.get((max(match.shard, 0), ack.seq))
        if ack.incarnation == self.incarnation and future is not None and not future.done():
            future.set_result(ack)

    async def on_connect(self) -> None:
        """After a reconnect, resend the updates still waiting for their acks (the PS may never have got them)."""
        assert self.bus is not None
        if self.bus.connections <= 1:
            return
        for topic, update in list(self._pending.values()):
            self.m_resends.inc()
            logger.info("%s: resending update %d after reconnect", self.device, update.seq)
            await self.bus.publish(topic, update)


def _append(path: Path, line: str) -> None:
    with open(path, "a") as fh:
        fh.write(line)
