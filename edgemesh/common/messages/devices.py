"""What devices say about themselves: hello (retained profile), status (liveness, the MQTT will), stats, and the
link probes they time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from edgemesh.common.messages.checks import MAX_SHARDS, check_name, nonneg
from edgemesh.common.wire import message


@message("hello")
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceHello:
    """A device's measured profile, retained on ``device/{id}/hello``."""

    device: str
    incarnation: int
    flops: float
    """Measured float32 multiply-add throughput, FLOP/s."""
    memory_bytes: int
    """Memory the device offers to training."""
    cores: int = 1
    platform: str = ""
    software: str = ""
    can_encode: bool = True
    """False for devices too weak to encode; they send ``grad-raw`` for the compressor gateway."""
    link_rate_bps: float = 0.0
    """Measured or configured uplink rate, bytes/s (0 = unknown)."""
    profile: str = ""
    """Emulated device profile name, empty when real."""
    downlink_rate_bps: float = 0.0
    """Measured or configured downlink rate, bytes/s (0 = unknown: taken as the uplink rate)."""
    latency_s: float = 0.0
    """One-way latency to the broker, seconds (0 = unknown)."""

    def validate(self) -> None:
        check_name("device", self.device)
        nonneg("incarnation", self.incarnation)
        nonneg("downlink_rate_bps", self.downlink_rate_bps)
        nonneg("latency_s", self.latency_s)
        if self.flops <= 0:
            raise ValueError("flops must be > 0")
        if self.memory_bytes <= 0:
            raise ValueError("memory_bytes must be > 0")
        if self.cores < 1:
            raise ValueError("cores must be >= 1")
        nonneg("link_rate_bps", self.link_rate_bps)


@message("status")
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceStatus:
    """Liveness, retained on ``device/{id}/status``; ``offline`` is also the MQTT will. ``left``: the device
    left this job (its data is missing or broken: ``reason`` says why) and trains no more in it."""

    device: str
    state: Literal["online", "offline", "left"]
    incarnation: int = 0
    time: float = 0.0
    refused_plan: int = 0
    """Version of a plan whose share this device refused (it does not fit its memory); 0 = none."""
    reason: str = ""
    """Why it refused, for operators (``needs 812 MiB for batch 128, has 700 MiB``)."""
    validation_samples: int = 0
    """Samples of the job's validation share this device holds (``evaluation.local_share``), once it loaded the
    job's data; 0 = none (or a sender from before this field). The parameter server refuses an evaluation report
    claiming more."""

    def validate(self) -> None:
        check_name("device", self.device)
        nonneg("refused_plan", self.refused_plan)
        nonneg("validation_samples", self.validation_samples)


@message("stats")
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceStats:
    """Periodic measurements a device publishes on ``device/{id}/stats``."""

    device: str
    incarnation: int = 0
    time: float = 0.0
    steps: int = 0
    step_time_s: float = 0.0
    """Mean compute time of one training step."""
    comm_time_s: float = 0.0
    """Mean time from publishing an update to its ack."""
    delay_index: float = 0.0
    link_rate_bps: float = 0.0
    """Uplink rate, bytes/s: declared (``worker.link_rate_bps``) or measured (0 = unknown)."""
    downlink_rate_bps: float = 0.0
    """Measured downlink rate, bytes/s: received bytes over the time a chunked message took to arrive (0 = not
    measured yet)."""
    latency_s: float = 0.0
    """Measured one-way latency to the broker, seconds: half the shortest recent round trip of a link probe
    (0 = not measured yet)."""
    rss_bytes: int = 0
    cpu_temp_c: float | None = None
    """CPU temperature, °C (None = the device cannot tell: ``edgemesh.common.health``)."""
    throttled_bits: int | None = None
    """The Raspberry Pi firmware's ``vcgencmd get_throttled`` mask: bits 0-3 under-voltage, ARM frequency
    capped, throttled, soft temperature limit now; bits 16-19 the same since boot (None = not a Pi)."""
    model_version: int = 0
    loss: float | None = None
    batch_size: int = 0
    bytes_sent: int = 0
    gradient_bytes: int = 0
    """Size of one full gradient of this device's share of the model in float32, bytes (0 = unknown)."""
    upload_time_s: float = 0.0
    """Mean time to hand one update to the broker (publish to PUBACK), seconds (0 = unknown)."""
    compute_flops: float = 0.0
    """Training FLOP/s this device reached computing its share (waits for other members left out), 0 = unknown."""
    mesh_layer_busy_s: dict[str, float] = field(default_factory=dict)
    """Model-parallel members: median seconds per step each layer kept this member busy, forward and
    backward: computing its units, and its link moving the layer's slices (the bytes it sent and
    received for the layer's exchanges at its uplink and downlink rates); waits for the others left out."""

    def validate(self) -> None:
        check_name("device", self.device)
        for name in ("steps", "step_time_s", "comm_time_s", "delay_index", "link_rate_bps", "downlink_rate_bps",
                     "latency_s", "rss_bytes", "gradient_bytes", "upload_time_s", "compute_flops"):
            nonneg(name, getattr(self, name))
        if self.throttled_bits is not None and not 0 <= self.throttled_bits < 2**32:
            raise ValueError(f"throttled_bits must be a 32-bit mask, got {self.throttled_bits}")
        if len(self.mesh_layer_busy_s) > MAX_SHARDS:
            raise ValueError("too many layers")
        for layer, seconds in self.mesh_layer_busy_s.items():
            if not layer or len(layer) > 256 or not seconds >= 0:
                raise ValueError(f"bad layer busy time {layer!r}: {seconds!r}")


@message("link_probe")
@dataclass(frozen=True, slots=True, kw_only=True)
class LinkProbe:
    """A few bytes a device publishes at QoS 1 on its own ``device/{id}/probe``, timed from publish to the broker's
    PUBACK: one round trip to the broker, from which the device reports its latency. Nobody subscribes."""

    device: str
    incarnation: int = 0
    time: float = 0.0

    def validate(self) -> None:
        check_name("device", self.device)
        nonneg("incarnation", self.incarnation)
