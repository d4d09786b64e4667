"""A device's link to the broker, as it reports it in stats: uplink and downlink rates and latency.

* **Uplink** (``LinkMeter``): declared by the operator, or measured from gradient publishes: the bytes of one
  gradient message (envelope included, all chunks) divided by the time from the start of its publish to the
  broker's PUBACK of its last chunk (QoS 1: the bus publish returns only then). That is the device-to-broker leg
  alone, which is what the device's codec can change; the time to the PS's ack would add the PS's queueing and,
  under ``sync``, the wait for the slowest cluster.
* **Downlink** (``DownlinkMeter``): from what the device receives. A model snapshot or delta of several chunks
  (above ``broker.chunk_bytes``) is a sample: the bytes read off the connection from its first chunk's first byte
  (or its arrival, where that is not known) to its last chunk's arrival (other messages in between included: the
  link carried them too), over the time between them
  (``Bus.on_joined``). It measures the link at the pace the parameter server and the broker kept, so it is a
  lower bound when they were slower than the link. So is one of at least ``broker.chunk_bytes`` that came whole
  (the sender's chunks grew to the broker's limit on its fast link): its bytes over the time from its packet's
  first byte to its last. Mesh slices are left out: they come at their sender's pace, a slow member's uplink,
  which says nothing of this device's downlink. A model smaller than ``broker.chunk_bytes`` gives no sample:
  the downlink stays unknown (the planner takes it as the uplink).
* **Latency** (``LatencyMeter``): a few bytes published at QoS 1 on the device's own ``probe`` topic, timed to
  the broker's PUBACK (``probe_round_trip``), every stats interval; the one-way latency is half the round trip.

Rates are exponential moving averages, so one slow transfer moves them only by ``smoothing``. The latency is the
shortest of the last few round trips instead: a probe that queued behind an update or a model delta measured
the queue, not the link, and a queue only ever adds time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

from edgemesh.common.bus import Bus
from edgemesh.common.errors import BusError

LINK_SMOOTHING = 0.3
"""Weight of a new sample in the moving average of a measured rate."""
PROBE_WINDOW = 8
"""Round trips the latency is the shortest of: at two probes per stats interval, the last four intervals."""


class Ema:
    """An exponential moving average (0 until the first sample)."""

    def __init__(self, smoothing: float = LINK_SMOOTHING) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        self.smoothing = smoothing
        self.value = 0.0
        self.samples = 0

    def add(self, sample: float) -> None:
        self.value = sample if self.samples == 0 else self.value + self.smoothing * (sample - self.value)
        self.samples += 1


class LinkMeter:
    """Uplink rate in bytes/s (0 = not known yet)."""

    def __init__(self, declared_bps: float = 0.0, smoothing: float = LINK_SMOOTHING) -> None:
        if declared_bps < 0:
            raise ValueError("declared link rate must be >= 0")
        self.declared_bps = declared_bps
        self._rate = Ema(smoothing)
        self._upload = Ema(smoothing)

    @property
    def measured_bps(self) -> float:
        return self._rate.value

    @property
    def upload_s(self) -> float:
        """Moving average of the time from publish to PUBACK of one update, seconds (0 = none yet)."""
        return self._upload.value

    @property
    def samples(self) -> int:
        return self._rate.samples

    def declare(self, rate_bps: float) -> None:
        """Report ``rate_bps`` from now on (0 = go back to the measured rate)."""
        if rate_bps < 0:
            raise ValueError("declared link rate must be >= 0")
        self.declared_bps = rate_bps

    def observe(self, nbytes: int, seconds: float) -> None:
        """One publish of ``nbytes`` that took ``seconds`` until its PUBACK."""
        if nbytes <= 0 or seconds <= 0:
            return
        self._rate.add(nbytes / seconds)
        self._upload.add(seconds)

    @property
    def rate_bps(self) -> float:
        """The declared rate if any, else the measured average."""
        return self.declared_bps or self.measured_bps


class DownlinkMeter:
    """Downlink rate in bytes/s (0 = not measured yet), from messages that arrived in several chunks: the moving
    average of their bytes over that of their durations, so that a sample weighs by its length. A message whose
    chunks were read in one go (the event loop was busy while they arrived) spans little time and so moves the
    rate little, where an average of rates would take its burst for the link."""

    def __init__(self, smoothing: float = LINK_SMOOTHING) -> None:
        self._bytes = Ema(smoothing)
        self._seconds = Ema(smoothing)

    def observe(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` read off the connection in ``seconds``, between a message's first and last chunk."""
        if nbytes > 0 and seconds > 0:
            self._bytes.add(nbytes)
            self._seconds.add(seconds)

    @property
    def rate_bps(self) -> float:
        return self._bytes.value / self._seconds.value if self._seconds.value > 0 else 0.0

    @property
    def samples(self) -> int:
        return self._seconds.samples


class LatencyMeter:
    """One-way latency to the broker, seconds (0 = not measured yet): half the shortest of the last ``window``
    round trips, so that a longer latency shows once the shorter round trips before it have left the window."""

    def __init__(self, window: int = PROBE_WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._round_trips: deque[float] = deque(maxlen=window)

    def observe(self, round_trip_s: float) -> None:
        if round_trip_s > 0:
            self._round_trips.append(round_trip_s)

    @property
    def round_trip_s(self) -> float:
        return min(self._round_trips, default=0.0)

    @property
    def latency_s(self) -> float:
        return self.round_trip_s / 2

    @property
    def samples(self) -> int:
        return len(self._round_trips)


async def probe_round_trip(bus: Bus, topic: str, probe: object) -> float | None:
    """Seconds from publishing ``probe`` at QoS 1 on ``topic`` to the broker's PUBACK: one round trip to the
    broker. None when it is no sample: the bus was not connected, the publish failed, or the connection changed
    on the way (the time then includes a reconnect)."""
    if not bus.is_connected:
        return None
    connection = bus.connections
    started = time.perf_counter()
    try:
        await bus.publish(topic, probe)
    except BusError:
        return None
    seconds = time.perf_counter() - started
    return seconds if bus.connections == connection and bus.is_connected else None


async def keep_probing(bus: Bus, topic: str, probe: Callable[[], object], meter: LatencyMeter, *, per_interval: int,
                       interval_s: float) -> None:
    """Time ``per_interval`` probes (``probe()`` makes each) every ``interval_s`` into ``meter``, until cancelled,
    from the start (the first stats carry a latency): a changed latency shows within the meter's window."""
    while True:
        with contextlib.suppress(TimeoutError):
            await bus.wait_connected()
        for _ in range(per_interval):
            round_trip = await probe_round_trip(bus, topic, probe())
            if round_trip is not None:
                meter.observe(round_trip)
        await asyncio.sleep(interval_s)
