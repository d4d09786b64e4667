"""How the link between one device and the broker behaves, pure: its shape (:class:`LinkShape`), when the bytes
sent over one direction arrive (:class:`LinkClock`) and when it drops (:func:`outage_schedule`). The relay that
applies them is ``link.EmulatedLink``."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0
"""Converts :attr:`LinkShape.disconnects_per_hour` to a rate per second."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkShape:
    """How the link between one device and the broker behaves."""

    uplink_bps: float = 0.0
    """Bytes/s from the device to the broker; 0 = unlimited."""
    downlink_bps: float = 0.0
    """Bytes/s from the broker to the device; 0 = unlimited."""
    latency_s: float = 0.0
    """One-way propagation delay, seconds, added in each direction."""
    disconnects_per_hour: float = 0.0
    """Mean rate of spontaneous drops (a Poisson process); 0 = none."""
    outage_s: float = 0.0
    """Mean length of a spontaneous drop, seconds (exponential); must be > 0 when drops are on."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{field.name}: expected a finite number >= 0, got {value!r}")
        if self.disconnects_per_hour > 0 and self.outage_s <= 0:
            raise ValueError(f"outage_s: must be > 0 when disconnects_per_hour > 0, got {self.outage_s!r}")

    @property
    def off(self) -> bool:
        """True when the link shapes nothing: no rate limit, no latency, no drops."""
        return not (self.uplink_bps or self.downlink_bps or self.latency_s or self.disconnects_per_hour)


class LinkClock:
    """When the chunks sent over one direction of a link arrive (pure: no I/O, no clock of its own).

    A chunk of ``size`` bytes handed over at ``now`` starts when the radio is free,
    occupies it for ``size / rate_bps`` and arrives ``latency_s`` after that.
    """

    __slots__ = ("rate_bps", "latency_s", "free_at", "busy_s", "stalled_until")

    def __init__(self, rate_bps: float, latency_s: float) -> None:
        self.rate_bps = rate_bps
        """Bytes/s; 0 = unlimited."""
        self.latency_s = latency_s
        """Propagation delay, seconds."""
        self.free_at = -math.inf
        """When the radio has sent everything handed to it so far."""
        self.busy_s = 0.0
        """Seconds the radio has been booked for so far: how long it was (or will be) busy sending."""
        self.stalled_until = -math.inf
        """Until when the radio moves nothing (a stall: the connection stays up, the bytes wait)."""

    def deliver_at(self, size: int, now: float) -> float:
        """The time a chunk of ``size`` bytes handed over at ``now`` arrives; books the radio for it."""
        start = max(now, self.free_at, self.stalled_until)
        self.free_at = start + size / self.rate_bps if self.rate_bps > 0 else start
        self.busy_s += self.free_at - start
        return self.free_at + self.latency_s

    def reset(self) -> None:
        """Forget what was booked: the bytes in flight were dropped."""
        self.free_at = -math.inf


def outage_schedule(
    shape: LinkShape, seed: int, count: int | None = None, *, max_outage_s: float | None = None
) -> Iterator[tuple[float, float]]:
    """The spontaneous drops of a link: ``(wait, length)`` pairs in seconds, the same for the same seed.

    ``wait`` is the time the link stays up before the drop (exponential with rate
    ``disconnects_per_hour``), ``length`` how long it stays down (exponential with mean
    ``outage_s``, capped at ``max_outage_s``). Yields ``count`` pairs (all of them when
    ``None``), none when drops are off.
    """
    if shape.disconnects_per_hour <= 0:
        return
    rng = random.Random(seed)
    rate_per_s = shape.disconnects_per_hour / SECONDS_PER_HOUR
    drawn = 0
    while count is None or drawn < count:
        wait = rng.expovariate(rate_per_s)
        length = rng.expovariate(1.0 / shape.outage_s)
        if max_outage_s is not None:
            length = min(length, max_outage_s)
        yield wait, length
        drawn += 1
