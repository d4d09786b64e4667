"""A device's uplink rate: declared by the operator, or measured from gradient publishes.

What is measured: the bytes of one gradient message (envelope included, all chunks) divided by
the time from the start of its publish to the broker's PUBACK of its last chunk (QoS 1: the bus
publish returns only then). That is the device-to-broker leg alone, which is what the device's
codec can change; the time to the PS's ack would add the PS's queueing and, under ``sync``,
the wait for the slowest cluster. Each sample enters an exponential moving average, so one
slow publish moves the rate only by ``smoothing``.
"""

from __future__ import annotations

LINK_SMOOTHING = 0.3
"""Weight of a new sample in the moving average of the measured rate."""


class LinkMeter:
    """Uplink rate in bytes/s (0 = not known yet)."""

    def __init__(self, declared_bps: float = 0.0, smoothing: float = LINK_SMOOTHING) -> None:
        if declared_bps < 0:
            raise ValueError("declared link rate must be >= 0")
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        self.declared_bps = declared_bps
        self.smoothing = smoothing
        self.measured_bps = 0.0
        self.upload_s = 0.0
        """Moving average of the time from publish to PUBACK of one update, seconds (0 = none yet)."""
        self.samples = 0

    def declare(self, rate_bps: float) -> None:
        """Report ``rate_bps`` from now on (0 = go back to the measured rate)."""
        if rate_bps < 0:
            raise ValueError("declared link rate must be >= 0")
        self.declared_bps = rate_bps

    def observe(self, nbytes: int, seconds: float) -> None:
        """One publish of ``nbytes`` that took ``seconds`` until its PUBACK."""
        if nbytes <= 0 or seconds <= 0:
            return
        sample = nbytes / seconds
        if self.samples == 0:
            self.measured_bps, self.upload_s = sample, seconds
        else:
            self.measured_bps += self.smoothing * (sample - self.measured_bps)
            self.upload_s += self.smoothing * (seconds - self.upload_s)
        self.samples += 1

    @property
    def rate_bps(self) -> float:
        """The declared rate if any, else the measured average."""
        return self.declared_bps or self.measured_bps
