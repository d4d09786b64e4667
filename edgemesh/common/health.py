"""A device's health as its host reports it: CPU temperature, and the Raspberry Pi firmware's throttling and
under-voltage flags (docs/metrics.md#device-health).

Where it is read from is a parameter (:class:`HealthSources`), so a test points it at files and a program of
its own:

* the temperature: the hottest kernel thermal zone of type cpu or soc (``{thermal_dir}/thermal_zone*/type``
  and ``temp``, millidegrees), else ``vcgencmd measure_temp`` (``temp=48.3'C``);
* the flags: ``vcgencmd get_throttled`` (``throttled=0x50005``), a bit mask: bits 0-3 hold now (under-voltage,
  ARM frequency capped, throttled, soft temperature limit), bits 16-19 have held since boot.

A source that is absent (a laptop has no ``vcgencmd``, a container no thermal zone) gives no reading, and the
metric is then absent, never 0. Reading runs a program and touches files: :meth:`DeviceHealth.watch` does it
in a thread, every ``metrics.health_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from edgemesh.common.config import MetricsConfig

logger = logging.getLogger(__name__)

VCGENCMD_TIMEOUT_S = 2.0
"""Longest a ``vcgencmd`` call may take; a hung firmware call gives no reading."""
THERMAL_TYPES = ("cpu", "soc")
"""A thermal zone counts when its type contains one of these (``cpu-thermal`` on a Pi, ``SOC-therm`` on a Jetson)."""
FLAG_BITS = {"undervoltage": 0, "frequency_capped": 1, "throttled": 2, "soft_temperature_limit": 3}
"""Bits of ``vcgencmd get_throttled`` that hold now; the same bit plus ``SINCE_BOOT_SHIFT`` has held since boot."""
SINCE_BOOT_SHIFT = 16
FLAG_HELP = {
    "undervoltage": "Under-voltage detected (Raspberry Pi firmware)",
    "frequency_capped": "ARM frequency capped (Raspberry Pi firmware)",
    "throttled": "CPU throttled (Raspberry Pi firmware)",
    "soft_temperature_limit": "Soft temperature limit reached (Raspberry Pi firmware)",
}
"""Help text of each flag's gauge; the ``when`` label says now or since boot."""
SLOWED_FLAGS = ("frequency_capped", "throttled", "soft_temperature_limit")
"""The flags that mean the CPU runs below its speed (``edgemesh devices``' ``throttled`` column)."""

FlagState = Literal["now", "since boot", "no"]


@dataclass(frozen=True, slots=True)
class HealthSources:
    """Where the health is read: a directory of thermal zones, and the ``vcgencmd`` program (a name looked up
    on PATH or a path; empty = not read)."""

    thermal_dir: str = "/sys/class/thermal"
    vcgencmd: str = "vcgencmd"

    @classmethod
    def of(cls, config: MetricsConfig) -> HealthSources:
        """The sources ``metrics.thermal_dir`` and ``metrics.vcgencmd`` name."""
        return cls(thermal_dir=config.thermal_dir, vcgencmd=config.vcgencmd)


@dataclass(frozen=True, slots=True)
class HealthReading:
    """One reading; None where the source is absent."""

    temperature_c: float | None = None
    throttled_bits: int | None = None
    """``vcgencmd get_throttled``'s mask."""
    failure: str = ""
    """Why a source that is there gave nothing (``vcgencmd`` exited 255: no access to ``/dev/vchiq``)."""


# --------------------------------------------------------------------------- parsing (pure)


def parse_measure_temp(text: str) -> float | None:
    """``temp=48.3'C`` -> 48.3."""
    found = re.search(r"temp=(-?\d+(?:\.\d+)?)", text)
    return float(found.group(1)) if found else None


def parse_get_throttled(text: str) -> int | None:
    """``throttled=0x50005`` -> 0x50005."""
    found = re.search(r"throttled=(0x[0-9a-fA-F]+|\d+)", text)
    return int(found.group(1), 0) if found else None


def flag(bits: int, name: str, *, since_boot: bool = False) -> bool:
    """Whether flag ``name`` holds now (or has held since boot) in a ``get_throttled`` mask."""
    return bool(bits >> (FLAG_BITS[name] + (SINCE_BOOT_SHIFT if since_boot else 0)) & 1)


def flag_state(bits: int | None, *names: str) -> FlagState | None:
    """``now`` if one of the flags ``names`` holds, ``since boot`` if one held earlier, ``no``; None if unknown."""
    if bits is None:
        return None
    if any(flag(bits, n) for n in names):
        return "now"
    if any(flag(bits, n, since_boot=True) for n in names):
        return "since boot"
    return "no"


# --------------------------------------------------------------------------- reading (blocking)


def thermal_temperature(thermal_dir: str) -> float | None:
    """The hottest thermal zone of type cpu or soc under ``thermal_dir``, °C; None if there is none."""
    found: list[float] = []
    for zone in sorted(Path(thermal_dir).glob("thermal_zone*")):
        try:
            kind = (zone / "type").read_text().strip().lower()
            if any(t in kind for t in THERMAL_TYPES):
                found.append(int((zone / "temp").read_text().strip()) / 1000.0)
        except (OSError, ValueError):
            continue  # a zone that vanished or a sensor that failed to read: the others still count
    return max(found) if found else None


def vcgencmd(program: str, *args: str) -> str | None:
    """``program``'s output; None if it is not installed. OSError if it is there but fails."""
    path = shutil.which(program) if program else None
    if path is None:
        return None
    try:
        done = subprocess.run([path, *args], capture_output=True, text=True, timeout=VCGENCMD_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        raise OSError(f"{program} {' '.join(args)} took over {VCGENCMD_TIMEOUT_S:g}s") from exc
    if done.returncode != 0:
        raise OSError(f"{program} {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[:200]}")
    return done.stdout


def read_health(sources: HealthSources) -> HealthReading:
    """A reading of every source (blocking: call it in a thread)."""
    temperature = thermal_temperature(sources.thermal_dir)
    bits, failure = None, ""
    try:
        out = vcgencmd(sources.vcgencmd, "get_throttled")
        if out is not None:
            bits = parse_get_throttled(out)
            if bits is None:
                failure = f"{sources.vcgencmd} get_throttled said {out.strip()[:80]!r}"
        if temperature is None and out is not None:
            said = vcgencmd(sources.vcgencmd, "measure_temp")
            temperature = parse_measure_temp(said) if said is not None else None
    except OSError as exc:
        failure = str(exc)
    return HealthReading(temperature_c=temperature, throttled_bits=bits, failure=failure)


# --------------------------------------------------------------------------- exporting


class DeviceHealth(Collector):
    """The host's latest reading, exported as ``edgemesh_device_*`` gauges (none for a source that is absent)
    on the registry it is registered with; :meth:`watch` keeps it fresh."""

    def __init__(self, sources: HealthSources) -> None:
        self.sources = sources
        self.latest = HealthReading()
        self._failures: set[str] = set()

    async def sample(self) -> HealthReading:
        """Read every source now, in a thread; the reading is kept as ``latest``."""
        reading = await asyncio.to_thread(read_health, self.sources)
        if reading.failure and reading.failure not in self._failures:
            self._failures.add(reading.failure)
            logger.warning("device health: %s (its metrics are left out)", reading.failure)
        self.latest = reading
        return reading

    async def watch(self, interval_s: float) -> None:
        """Read now, then every ``interval_s``, until cancelled."""
        while True:
            await self.sample()
            await asyncio.sleep(interval_s)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        reading = self.latest  # one reading for the whole scrape (the watcher replaces it whole)
        temperature = GaugeMetricFamily("edgemesh_device_cpu_temperature_celsius",
                                        "CPU temperature of the host: its hottest cpu or soc thermal zone")
        if reading.temperature_c is not None:
            temperature.add_metric([], reading.temperature_c)
        yield temperature
        for name, help_text in FLAG_HELP.items():
            family = GaugeMetricFamily(f"edgemesh_device_{name}", f"{help_text}: 1 if so, now or since boot",
                                       labels=["when"])
            if reading.throttled_bits is not None:
                family.add_metric(["now"], float(flag(reading.throttled_bits, name)))
                family.add_metric(["since_boot"], float(flag(reading.throttled_bits, name, since_boot=True)))
            yield family
