"""Device profiles for fleet emulation, read from a TOML data file (``profiles.toml`` by default).

Every figure of a profile must name its source or measurement in the profile's ``sources``
table; a file that leaves one out is refused, so the data stays auditable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edgemesh.common.emulation.datafile import read, sourced
from edgemesh.common.emulation.shape import LinkShape
from edgemesh.common.errors import ConfigError

BUILTIN = "profiles.toml"
"""The profiles shipped with EdgeMesh, beside this module."""
MIB = 2**20
MBIT = 1e6 / 8
"""Bytes per second in one Mbit/s."""
FIGURES = ("cores", "gflops", "memory_mib", "uplink_mbit", "downlink_mbit", "latency_ms", "disconnects_per_hour",
           "outage_s")
"""The figures every profile gives, each with a source."""
POSITIVE = ("cores", "gflops", "memory_mib", "uplink_mbit", "downlink_mbit")
"""Figures that must be > 0 (the others may be 0)."""


def parallel_efficiency(cores: int, thread_scaling: float) -> float:
    """Share of ``cores`` cores' combined rate one training process reaches: each doubling of
    threads speeds it up ``thread_scaling`` times (2 would be perfect)."""
    return thread_scaling ** math.log2(cores) / cores


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """One kind of device: its speed, memory and link."""

    name: str
    description: str
    cores: int
    gflops: float
    """Sustained float32 GFLOP/s on all cores (HPL or sgemm)."""
    memory_bytes: int
    """Memory a training process may use."""
    uplink_bps: float
    """Bytes/s from the device to the broker."""
    downlink_bps: float
    """Bytes/s from the broker to the device."""
    latency_s: float
    """One-way latency to the broker."""
    disconnects_per_hour: float
    outage_s: float
    """Mean length of a disconnect."""
    thread_scaling: float = 2.0
    """Speed-up of a training process per doubling of its threads (the file's ``[emulation]`` table)."""
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def train_gflops(self) -> float:
        """The float32 rate a training process of this device reaches, GFLOP/s."""
        return self.gflops * parallel_efficiency(self.cores, self.thread_scaling)

    def dilated(self, factor: float) -> DeviceProfile:
        """The same board with time running ``factor`` times slower: compute and link rates divided,
        latency and outages stretched, disconnects rarer per second (time dilation, Gupta et al.,
        "To infinity and beyond: time-warped network emulation", NSDI 2006). A host slower than the
        fleet it emulates can then keep up; every emulated duration is ``factor`` times the board's."""
        if not factor >= 1:
            raise ValueError("time dilation must be >= 1")
        if factor == 1:
            return self
        return replace(self, gflops=self.gflops / factor, uplink_bps=self.uplink_bps / factor,
                       downlink_bps=self.downlink_bps / factor, latency_s=self.latency_s * factor,
                       disconnects_per_hour=self.disconnects_per_hour / factor, outage_s=self.outage_s * factor)

    def link(self) -> LinkShape:
        return LinkShape(uplink_bps=self.uplink_bps, downlink_bps=self.downlink_bps, latency_s=self.latency_s,
                         disconnects_per_hour=self.disconnects_per_hour, outage_s=self.outage_s)

    def summary(self) -> dict[str, Any]:
        """The profile as plain figures (for reports)."""
        return {"profile": self.name, "description": self.description, "cores": self.cores, "gflops": self.gflops,
                "train_gflops": round(self.train_gflops, 3), "memory_mib": round(self.memory_bytes / MIB),
                "uplink_mbit": round(self.uplink_bps / MBIT, 3), "downlink_mbit": round(self.downlink_bps / MBIT, 3),
                "latency_ms": round(self.latency_s * 1e3, 3), "disconnects_per_hour": self.disconnects_per_hour,
                "outage_s": self.outage_s}


def _number(where: str, key: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}.{key}: expected a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{where}.{key}: must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def parse_profiles(data: dict[str, Any], *, source: str) -> dict[str, DeviceProfile]:
    """Profiles from a parsed TOML document; ConfigError names the file, profile and field at fault."""
    emulation = data.get("emulation", {})
    if not isinstance(emulation, dict):
        raise ConfigError(f"{source}: [emulation] must be a table")
    if "thread_scaling" not in emulation or not str(emulation.get("thread_scaling_source", "")).strip():
        raise ConfigError(f"{source}: [emulation] needs thread_scaling and thread_scaling_source")
    scaling = _number(f"{source}: emulation", "thread_scaling", emulation["thread_scaling"], positive=True)
    if not 1 <= scaling <= 2:
        raise ConfigError(f"{source}: emulation.thread_scaling must be in [1, 2], got {scaling}")
    tables = data.get("profiles")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{source}: no [profiles.NAME] tables")
    out = {}
    for name, table in tables.items():
        where = f"{source}: profiles.{name}"
        sources = sourced(where, table, FIGURES)
        v = {k: _number(where, k, table[k], positive=k in POSITIVE) for k in FIGURES}
        if v["cores"] != int(v["cores"]):
            raise ConfigError(f"{where}.cores: expected a whole number, got {table['cores']!r}")
        if v["disconnects_per_hour"] > 0 and v["outage_s"] <= 0:
            raise ConfigError(f"{where}.outage_s: must be > 0 when disconnects_per_hour > 0")
        out[name] = DeviceProfile(
            name=name, description=str(table.get("description", "")), cores=int(v["cores"]), gflops=v["gflops"],
            memory_bytes=int(v["memory_mib"] * MIB), uplink_bps=v["uplink_mbit"] * MBIT,
            downlink_bps=v["downlink_mbit"] * MBIT, latency_s=v["latency_ms"] / 1e3,
            disconnects_per_hour=v["disconnects_per_hour"], outage_s=v["outage_s"],
            thread_scaling=scaling, sources=sources)
    return out


def load_profiles(path: str | Path | None = None) -> dict[str, DeviceProfile]:
    """The profiles of ``path``, or the built-in ``profiles.toml``."""
    data, source = read(path, BUILTIN, "device profiles")
    return parse_profiles(data, source=source)


def get_profile(name: str, path: str | Path | None = None) -> DeviceProfile:
    profiles = load_profiles(path)
    try:
        return profiles[name]
    except KeyError:
        raise ConfigError(f"unknown device profile {name!r}; known: {', '.join(sorted(profiles))}") from None
