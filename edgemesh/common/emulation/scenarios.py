"""How emulated devices misbehave over time: scenarios, read from a TOML data file (``scenarios.toml``).

A device profile (``profiles.py``) says how fast a board and its link are; a scenario says how that
changes while it trains: thermal throttling (a speed factor that drops for a while), link stalls
(nothing moves for seconds, the connection stays up), drop-outs (the connection is reset and the
broker publishes the will) and a link rate that varies. ``dynamics.py`` turns a scenario into one
device's seeded timeline. As in ``profiles.toml``, every figure names its source or is marked as an
assumption in the scenario's ``sources`` table; a file that leaves one out is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgemesh.common.emulation.datafile import read, sourced
from edgemesh.common.errors import ConfigError

BUILTIN = "scenarios.toml"
"""The scenarios shipped with EdgeMesh, beside this module."""
NUMBERS = ("throttle_speed", "throttled_s", "unthrottled_s", "stalls_per_minute", "stall_s", "max_stall_s",
           "disconnects_per_hour", "outage_s", "max_outage_s", "bandwidth_sigma", "bandwidth_interval_s")
"""The numeric figures of a scenario, each >= 0 (``throttle_speed`` in (0, 1])."""
FIGURES = ("throttle_profiles", *NUMBERS)
"""Every figure a scenario gives, each with a source."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """How a fleet's devices change over time (board seconds throughout)."""

    name: str
    description: str = ""
    throttle_profiles: tuple[str, ...] = ()
    """Profiles that throttle (boards in fanless cases)."""
    throttle_speed: float = 1.0
    """Share of full compute speed while throttled."""
    throttled_s: float = 0.0
    """Mean length of a throttled spell (exponential); 0 = never throttles."""
    unthrottled_s: float = 0.0
    """Mean length of a full-speed spell between throttled ones (exponential)."""
    stalls_per_minute: float = 0.0
    """Rate of link stalls per device (Poisson): nothing moves either way, the connection stays up."""
    stall_s: float = 0.0
    """Mean stall length (exponential)."""
    max_stall_s: float = 0.0
    """Longest stall (0 = no cap)."""
    disconnects_per_hour: float = 0.0
    """Rate of drop-outs per device (Poisson): the connection is reset, the broker publishes the will."""
    outage_s: float = 0.0
    """Mean drop-out length (exponential)."""
    max_outage_s: float = 0.0
    """Longest drop-out (0 = no cap)."""
    bandwidth_sigma: float = 0.0
    """Standard deviation of ln(link rate / the profile's rate); 0 = constant rate."""
    bandwidth_interval_s: float = 0.0
    """How long one drawn link rate lasts (0 = constant rate)."""
    sources: dict[str, str] = field(default_factory=dict)

    def throttles(self, profile: str) -> bool:
        return profile in self.throttle_profiles and self.throttled_s > 0 and self.throttle_speed < 1

    @property
    def varies_bandwidth(self) -> bool:
        return self.bandwidth_sigma > 0 and self.bandwidth_interval_s > 0

    def summary(self) -> dict[str, Any]:
        """The scenario as plain figures (for reports)."""
        return {"scenario": self.name, "description": self.description,
                "throttle_profiles": list(self.throttle_profiles),
                **{k: getattr(self, k) for k in NUMBERS}}


def _number(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}.{key}: expected a finite number >= 0, got {value!r}")
    return float(value)


def parse_scenarios(data: dict[str, Any], *, source: str, profiles: set[str] | None = None) -> dict[str, Scenario]:
    """Scenarios from a parsed TOML document; ConfigError names the file, scenario and field at fault.
    ``profiles``, if given, are the profile names ``throttle_profiles`` may list."""
    tables = data.get("scenarios")
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(f"{source}: no [scenarios.NAME] tables")
    out = {}
    for name, table in tables.items():
        where = f"{source}: scenarios.{name}"
        sources = sourced(where, table, FIGURES)
        throttling = table["throttle_profiles"]
        if not isinstance(throttling, list) or not all(isinstance(p, str) and p for p in throttling):
            raise ConfigError(f"{where}.throttle_profiles: expected a list of profile names")
        if profiles is not None and (bad := sorted(set(throttling) - profiles)):
            raise ConfigError(f"{where}.throttle_profiles: unknown profile(s) {', '.join(bad)}")
        v = {k: _number(where, k, table[k]) for k in NUMBERS}
        if not 0 < v["throttle_speed"] <= 1:
            raise ConfigError(f"{where}.throttle_speed: must be in (0, 1], got {v['throttle_speed']}")
        for rate, length in (("throttled_s", "unthrottled_s"), ("stalls_per_minute", "stall_s"),
                             ("disconnects_per_hour", "outage_s"), ("bandwidth_sigma", "bandwidth_interval_s")):
            if v[rate] > 0 and v[length] <= 0:
                raise ConfigError(f"{where}.{length}: must be > 0 when {rate} > 0")
        out[name] = Scenario(name=name, description=str(table.get("description", "")),
                             throttle_profiles=tuple(throttling), sources=sources,
                             **v)
    return out


def load_scenarios(path: str | Path | None = None, *, profiles: set[str] | None = None) -> dict[str, Scenario]:
    """The scenarios of ``path``, or the built-in ``scenarios.toml``."""
    data, source = read(path, BUILTIN, "emulation scenarios")
    return parse_scenarios(data, source=source, profiles=profiles)


def get_scenario(name: str, path: str | Path | None = None) -> Scenario:
    scenarios = load_scenarios(path)
    try:
        return scenarios[name]
    except KeyError:
        raise ConfigError(f"unknown emulation scenario {name!r}; known: {', '.join(sorted(scenarios))}") from None
