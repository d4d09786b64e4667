"""Edge Mesh planning, the devices: what the planner knows of each, and the names of their clusters.

``DeviceInfo`` holds a live device's measured figures, the cost model's inputs; ``cluster_name``
names a cluster after its members, a single device's as in plain data parallelism. The benchmark
fleet (``FLEET_CLASSES``, ``sample_fleet``) draws random fleets of typical boards for tests and
``bench/``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from edgemesh.common.messages import DeviceHello, DeviceStats

CLUSTER_PREFIX = "c-"
"""A single-device cluster is named ``c-<device>``."""
MESH_PREFIX = "m-"
"""A cluster of several devices is named ``m-<first member>``."""
MAX_NAME = 64
"""Longest cluster name (``topics.valid_name``)."""
NAME_HASH_CHARS = 8
"""Hex digits of the hash that keeps a shortened cluster name unique."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceInfo:
    """What the planner knows about one live device."""

    device: str
    flops: float
    """Measured float32 multiply-add throughput, FLOP/s."""
    memory_bytes: int
    """Memory the device offers to training."""
    link_rate_bps: float = 0.0
    """Measured uplink rate, bytes/s (0 = unknown)."""
    downlink_rate_bps: float = 0.0
    """Measured downlink rate, bytes/s (0 = unknown: taken as the uplink rate)."""
    latency_s: float = 0.0
    """One-way latency to the broker, seconds (0 = unknown)."""

    @classmethod
    def from_hello(cls, hello: DeviceHello) -> DeviceInfo:
        return cls(device=hello.device, flops=hello.flops, memory_bytes=hello.memory_bytes,
                   link_rate_bps=hello.link_rate_bps, downlink_rate_bps=hello.downlink_rate_bps,
                   latency_s=hello.latency_s)

    def with_measured_links(self, stats: DeviceStats) -> DeviceInfo:
        """These figures with the link figures ``stats`` measured where the hello gave none. A figure the hello
        gives is declared (``worker.link_rate_bps``, or an emulated board's profile) and wins: an operator's word
        about a link is meant to override what the device sees, and an emulated board is planned as the board. A
        real device's hello gives 0 for what it was not told, and its measurement replaces that (else the cost
        model's defaults hold: 100 Mbit/s, no latency)."""
        return replace(self, link_rate_bps=self.link_rate_bps or stats.link_rate_bps,
                       downlink_rate_bps=self.downlink_rate_bps or stats.downlink_rate_bps,
                       latency_s=self.latency_s or stats.latency_s)

    @property
    def links(self) -> tuple[float, float, float]:
        """(uplink bytes/s, downlink bytes/s, latency s)."""
        return self.link_rate_bps, self.downlink_rate_bps, self.latency_s

    def describe_links(self) -> str:
        return (f"{self.device} up {self.link_rate_bps / 1e6:.3g} MB/s, down {self.downlink_rate_bps / 1e6:.3g} "
                f"MB/s, latency {self.latency_s * 1e3:.3g} ms")


def check_devices(devices: Sequence[DeviceInfo]) -> None:
    """Raise ValueError unless ``devices`` have distinct names, positive finite flops and finite
    memory, link rates and latencies of at least 0."""
    names = {d.device for d in devices}
    if len(names) != len(devices):
        raise ValueError(f"a device appears twice in {sorted(d.device for d in devices)}")
    for d in devices:
        if not (0 < d.flops < math.inf):
            raise ValueError(f"{d.device}: flops must be a positive number, got {d.flops}")
        if not (d.memory_bytes >= 0 and 0 <= d.link_rate_bps < math.inf and 0 <= d.downlink_rate_bps < math.inf
                and 0 <= d.latency_s < math.inf):
            raise ValueError(f"{d.device}: memory, link rates and latency must be finite numbers >= 0")


def cluster_name(members: Sequence[str]) -> str:
    """The name of the cluster of ``members`` (member order): ``c-<device>`` for a single device,
    ``m-<first member>`` for several.

    A name over ``MAX_NAME`` characters is shortened and suffixed with a hash of the first member's
    name, so that it stays valid and unique (a device is in one cluster at a time). Raises ValueError
    for no members and TypeError for a bare name (a single device's cluster is ``cluster_name([device])``).
    """
    if isinstance(members, str):
        raise TypeError(f"cluster_name takes a sequence of member names, got the string {members!r}")
    if not members:
        raise ValueError("a cluster needs members")
    first = members[0]
    name = f"{CLUSTER_PREFIX if len(members) == 1 else MESH_PREFIX}{first}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(first.encode()).hexdigest()[:NAME_HASH_CHARS]
    return f"{name[:MAX_NAME - NAME_HASH_CHARS - 1]}-{digest}"


# --------------------------------------------------------------------------- benchmark fleet


FLEET_CLASSES: tuple[tuple[str, float, float, float, float], ...] = (
    # name, weight, matmul FLOP/s, memory bytes, uplink bytes/s
    ("pi3", 0.25, 9.2e9, 566 * 2**20, 6.25e6),
    ("pi4", 0.25, 23.8e9, 3.3 * 2**30, 4.8e6),
    ("pi5", 0.2, 60.5e9, 7 * 2**30, 14e6),
    ("laptop", 0.1, 115e9, 8 * 2**30, 25e6),
    ("zero", 0.15, 4e9, 270 * 2**20, 4e6),
    ("tiny", 0.05, 2e9, 262 * 2**20, 2e6),
)
"""Device classes of ``sample_fleet``: Raspberry Pi 3/4/5, a laptop, and two boards too small to
hold ``cifar-cnn`` alone (``tiny`` cannot even hold a useful share of it)."""


def sample_fleet(n: int, seed: int = 0) -> list[DeviceInfo]:
    """``n`` random devices of ``FLEET_CLASSES``, with ±20 % flops, ×0.5-1.5 links and 1-10 ms latency."""
    rng = np.random.default_rng(seed)
    weights = np.array([c[1] for c in FLEET_CLASSES])
    kinds = rng.choice(len(FLEET_CLASSES), size=n, p=weights / weights.sum())
    flops_jitter = rng.uniform(0.8, 1.2, size=n)
    link_jitter = rng.uniform(0.5, 1.5, size=(n, 2))
    latency = rng.uniform(0.001, 0.010, size=n)
    fleet = []
    for i in range(n):
        name, _, flops, memory, up = FLEET_CLASSES[int(kinds[i])]
        fleet.append(DeviceInfo(device=f"{name}-{i:05d}", flops=flops * flops_jitter[i], memory_bytes=int(memory),
                                link_rate_bps=up * link_jitter[i, 0], downlink_rate_bps=up * 2 * link_jitter[i, 1],
                                latency_s=float(latency[i])))
    return fleet
