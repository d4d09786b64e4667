"""A device's health: CPU temperature from thermal zones or ``vcgencmd``, throttling and under-voltage from
``vcgencmd get_throttled``; exported as ``edgemesh_device_*`` where a source is there, absent where it is not.

The sources are files and a ``vcgencmd`` program each test writes (a real executable, run as the service
runs it); the stats message carries the reading, old and new senders alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path

import msgpack
import pytest
from helpers import until, write_thermal_zones, write_vcgencmd
from prometheus_client import generate_latest

from edgemesh.common import health, wire
from edgemesh.common.errors import WireError
from edgemesh.common.health import DeviceHealth, HealthReading, HealthSources, flag_state, read_health
from edgemesh.common.messages import DeviceStats
from edgemesh.common.metrics import ServiceMetrics, parse_metrics
from edgemesh.operator.devices import health_columns

PI_4 = {"cpu-thermal": 61.234}
"""A Raspberry Pi's one thermal zone."""
UNDERVOLTED_AND_THROTTLED = "0x50005"
"""Under-voltage and throttled now (bits 0, 2), and both since boot (bits 16, 18)."""


def exported(metrics: ServiceMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The ``edgemesh_device_*`` samples of ``metrics``' registry, as Prometheus reads them."""
    samples = parse_metrics(generate_latest(metrics.registry).decode())
    return {key: value for key, value in samples.items() if key[0].startswith("edgemesh_device_")}


# --------------------------------------------------------------------------- parsing


def test_get_throttled_and_measure_temp_are_parsed() -> None:
    assert health.parse_get_throttled("throttled=0x50005\n") == 0x50005
    assert health.parse_get_throttled("throttled=0x0") == 0
    assert health.parse_get_throttled("error=1 error_msg=\"Command not registered\"") is None
    assert health.parse_measure_temp("temp=48.3'C\n") == 48.3
    assert health.parse_measure_temp("temp=-5'C") == -5.0
    assert health.parse_measure_temp("nonsense") is None


def test_flags_now_and_since_boot() -> None:
    bits = 0x50005
    assert health.flag(bits, "undervoltage") and health.flag(bits, "throttled")
    assert not health.flag(bits, "frequency_capped") and not health.flag(bits, "soft_temperature_limit")
    assert health.flag(bits, "undervoltage", since_boot=True) and not health.flag(bits, "frequency_capped",
                                                                                   since_boot=True)
    assert flag_state(0x50005, "undervoltage") == "now"
    assert flag_state(0x10000, "undervoltage") == "since boot"  # it dipped once since boot, fine now
    assert flag_state(0x0, "undervoltage") == "no"
    assert flag_state(None, "undervoltage") is None
    assert flag_state(0x80000, *health.SLOWED_FLAGS) == "since boot"  # soft temperature limit, earlier


def test_devices_columns_show_the_health_or_a_dash() -> None:
    pi = DeviceStats(device="pi-07", cpu_temp_c=61.25, throttled_bits=0x50005)
    assert health_columns(pi).split() == ["61.2", "now", "now"]
    assert health_columns(DeviceStats(device="pi-08", cpu_temp_c=45.0, throttled_bits=0x20000)).split() == [
        "45.0", "since", "boot", "no"]
    assert health_columns(DeviceStats(device="laptop")).split() == ["-", "-", "-"]
    assert health_columns(None).split() == ["-", "-", "-"]


# --------------------------------------------------------------------------- reading the sources


def test_the_hottest_cpu_or_soc_zone_is_the_temperature(tmp_path: Path) -> None:
    thermal = write_thermal_zones(tmp_path / "thermal", {"acpitz": 80.0, "cpu-thermal": 61.234, "SOC-therm": 58.0,
                                                          "GPU-therm": 90.0})
    broken = thermal / "thermal_zone9"
    broken.mkdir()
    (broken / "type").write_text("cpu-thermal\n")
    (broken / "temp").write_text("not a number\n")  # a sensor that failed to read: the others still count
    assert health.thermal_temperature(str(thermal)) == pytest.approx(61.234)
    assert health.thermal_temperature(str(tmp_path / "no-such-dir")) is None
    assert health.thermal_temperature(str(write_thermal_zones(tmp_path / "x86", {"x86_pkg_temp": 50.0}))) is None


def test_vcgencmd_gives_the_flags_and_a_temperature_where_no_zone_does(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    write_vcgencmd(tmp_path / "bin", throttled=UNDERVOLTED_AND_THROTTLED, temp="48.3")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    # the default name, looked up on PATH as on a Pi
    reading = read_health(HealthSources(thermal_dir=str(tmp_path / "none")))
    assert reading == HealthReading(temperature_c=48.3, throttled_bits=0x50005)
    # a thermal zone wins over measure_temp
    thermal = write_thermal_zones(tmp_path / "thermal", PI_4)
    assert read_health(HealthSources(thermal_dir=str(thermal))).temperature_c == pytest.approx(61.234)


def test_absent_sources_give_no_reading(tmp_path: Path) -> None:
    reading = read_health(HealthSources(thermal_dir=str(tmp_path / "none"), vcgencmd="edgemesh-no-such-vcgencmd"))
    assert reading == HealthReading()
    assert read_health(HealthSources(thermal_dir=str(tmp_path / "none"), vcgencmd="")) == HealthReading()


def test_a_vcgencmd_that_fails_or_hangs_gives_no_flags_and_says_why(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    failing = write_vcgencmd(tmp_path / "failing", body='echo "VCHI initialization failed" >&2; exit 255')
    reading = read_health(HealthSources(thermal_dir=str(tmp_path / "none"), vcgencmd=str(failing)))
    assert reading.throttled_bits is None and reading.temperature_c is None
    assert "exited 255" in reading.failure and "VCHI initialization failed" in reading.failure

    monkeypatch.setattr(health, "VCGENCMD_TIMEOUT_S", 0.2)
    hanging = write_vcgencmd(tmp_path / "hanging", body="exec sleep 30")
    reading = read_health(HealthSources(thermal_dir=str(tmp_path / "none"), vcgencmd=str(hanging)))
    assert reading.throttled_bits is None and "took over 0.2s" in reading.failure


# --------------------------------------------------------------------------- exporting


async def test_a_reading_is_exported_as_gauges(tmp_path: Path) -> None:
    metrics = ServiceMetrics("worker")
    device = metrics.export_health(HealthSources(thermal_dir=str(write_thermal_zones(tmp_path / "t", PI_4)),
                                                 vcgencmd=str(write_vcgencmd(tmp_path / "bin"))))
    assert metrics.export_health(HealthSources()) is device  # once per registry
    await device.sample()
    samples = exported(metrics)
    assert samples[("edgemesh_device_cpu_temperature_celsius", ())] == pytest.approx(61.234)
    flags = {(name.removeprefix("edgemesh_device_"), dict(labels)["when"]): value
             for (name, labels), value in samples.items() if name != "edgemesh_device_cpu_temperature_celsius"}
    assert flags == {("undervoltage", "now"): 1, ("undervoltage", "since_boot"): 1,
                     ("throttled", "now"): 1, ("throttled", "since_boot"): 1,
                     ("frequency_capped", "now"): 0, ("frequency_capped", "since_boot"): 0,
                     ("soft_temperature_limit", "now"): 0, ("soft_temperature_limit", "since_boot"): 0}


async def test_an_absent_source_is_an_absent_metric_not_a_zero(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServiceMetrics("planner")
    device = metrics.export_health(HealthSources(thermal_dir=str(tmp_path / "none"),
                                                 vcgencmd="edgemesh-no-such-vcgencmd"))
    await device.sample()
    assert exported(metrics) == {}
    # only the thermal zone: a temperature, no flags
    metrics = ServiceMetrics("planner")
    device = metrics.export_health(HealthSources(thermal_dir=str(write_thermal_zones(tmp_path / "t", PI_4)),
                                                 vcgencmd=""))
    await device.sample()
    assert set(exported(metrics)) == {("edgemesh_device_cpu_temperature_celsius", ())}
    # a vcgencmd that is there but fails: no flags, and the reason logged once
    failing = write_vcgencmd(tmp_path / "failing", body="exit 255")
    device = DeviceHealth(HealthSources(thermal_dir=str(tmp_path / "none"), vcgencmd=str(failing)))
    with caplog.at_level(logging.WARNING, logger="edgemesh.common.health"):
        for _ in range(3):
            assert (await device.sample()).throttled_bits is None
    assert len([r for r in caplog.records if "exited 255" in r.getMessage()]) == 1


async def test_reading_does_not_block_the_event_loop(tmp_path: Path) -> None:
    """The reading runs in a thread: a ``vcgencmd`` that waits for the test to let it go finishes, which it
    could not if the reading held the event loop the test runs on."""
    started, gate = tmp_path / "started", tmp_path / "gate"
    waiting = write_vcgencmd(tmp_path / "bin", body=f"touch {started}; while [ ! -e {gate} ]; do sleep 0.01; done")
    device = DeviceHealth(HealthSources(thermal_dir=str(tmp_path / "none"), vcgencmd=str(waiting)))
    reading = asyncio.create_task(device.sample())
    await until("vcgencmd to start", started.exists, timeout_s=health.VCGENCMD_TIMEOUT_S / 2)
    assert not reading.done()
    gate.touch()
    assert (await reading).throttled_bits == 0x50005 and device.latest.throttled_bits == 0x50005


# --------------------------------------------------------------------------- on the wire


def test_stats_carry_the_flags_and_stay_readable_by_old_and_new() -> None:
    stats = DeviceStats(device="pi-07", cpu_temp_c=61.5, throttled_bits=0x50005)
    assert wire.decode(wire.encode(stats), DeviceStats) == stats
    # an older worker's stats have no throttled_bits: the field takes its default, None (unknown)
    envelope = msgpack.unpackb(wire.encode(stats))
    del envelope["body"]["throttled_bits"]
    old = wire.decode(msgpack.packb(envelope), DeviceStats)
    assert old.throttled_bits is None and old.cpu_temp_c == 61.5
    # a newer worker may add fields: ignored
    envelope["body"]["fan_rpm"] = 3000
    assert wire.decode(msgpack.packb(envelope), DeviceStats) == dataclasses.replace(stats, throttled_bits=None)
    for bad in (-1, 2**32):
        with pytest.raises(WireError) as err:
            wire.decode(wire.encode(dataclasses.replace(stats, throttled_bits=bad)), DeviceStats)
        assert err.value.reason == "field"
