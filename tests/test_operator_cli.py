"""The ``edgemesh`` command: ``devices`` and ``ctl`` against running services, as an operator runs them;
``config``; and what a subcommand imports (``worker`` on a Pi loads neither the benchmarks nor amqtt)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

from helpers import inbox, make_config, running, until, write_thermal_zones, write_vcgencmd

from edgemesh.common.messages import DeviceHello, DeviceStats, JobState
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.operator.ctl import parse_value
from edgemesh.operator.devices import step_columns
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

WAIT_S = 60.0


async def cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "edgemesh", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_parse_value_sends_numbers_as_numbers() -> None:
    assert parse_value("4") == 4 and parse_value("0.5") == 0.5 and parse_value("true") is True
    assert parse_value("async") == "async" and parse_value(None) is None and parse_value("[1]") == "[1]"


async def test_devices_lists_a_worker_and_ctl_steers_the_ps(mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = make_config(mosquitto_broker, job="ops", **{"ps.state_dir": tmp_path / "ps", "metrics.vcgencmd": "",
                                                       "metrics.thermal_dir": tmp_path / "no-thermal-zones"})
    # a Pi 4 at 61.2 °C, under-voltage since boot and throttled now: its thermal zone and vcgencmd, written here
    worker = Worker(make_config(mosquitto_broker, job="ops", **{
        "ps.state_dir": tmp_path / "ps", "worker.device": "pi-07",
        "metrics.thermal_dir": write_thermal_zones(tmp_path / "thermal", {"cpu-thermal": 61.25}),
        "metrics.vcgencmd": write_vcgencmd(tmp_path / "bin", throttled="0x10004")}))
    services = [Planner(cfg), ParameterServer(cfg), Compressor(cfg), worker]
    common = ["--broker", mosquitto_broker.url, "--job", "ops"]
    async with running(*services):
        await until("two accepted updates", lambda: worker.accepted >= 2, WAIT_S)
        # the first reading runs vcgencmd (a process): on a loaded host it may come after the first stats
        await until("the first health reading",
                    lambda: worker.metrics.value("edgemesh_device_cpu_temperature_celsius") == 61.25, WAIT_S)
        # stats are not retained: by default the command listens until every online device's stats are in (at
        # most worker.stats_interval_s + 1 s) to hear one with the reading
        code, out, err = await cli("devices", *common)
        assert code == 0, err
        row = next(line for line in out.splitlines() if line.startswith("pi-07"))
        assert "online" in row and "c-pi-07" in row
        assert row.split()[-4:] == ["61.2", "now", "since", "boot"]  # temperature, throttled, under-voltage
        # the links it measured (a real worker declares none): uplink and downlink Mbit/s, latency ms
        up, down, latency = row.split()[-7:-4]
        assert float(up) > 0 and all(cell == "-" or float(cell) > 0 for cell in (down, latency))
        assert "up Mbit" in out and "lat ms" in out
        # the same reading on the worker's /metrics; the other services were given no source: no series
        assert worker.metrics.value("edgemesh_device_cpu_temperature_celsius") == 61.25
        assert worker.metrics.value("edgemesh_device_throttled", when="now") == 1
        assert not any(s.name.startswith("edgemesh_device_") for svc in services[:3]
                       for family in svc.metrics.registry.collect() for s in family.samples)
        assert "plan v" in out

        code, out, err = await cli("ctl", "set-bound", "--target", "ps", "--value", "7", *common)
        assert code == 0, err
        reply = json.loads(out.splitlines()[0])
        assert reply["ok"] and reply["result"]["bound"] == 7 and services[1].bound == 7

        code, out, err = await cli("ctl", "set-bound", "--target", "ps", "--value", "-1", *common)
        assert code == 1 and not json.loads(out.splitlines()[0])["ok"]

        code, out, err = await cli("ctl", "status", "--target", "nobody-home", *common, "--timeout-s", "1")
        assert code == 1 and "no reply" in err

        # no --target: the command goes to the service that answers it (drain-device: the planner, set-codec: the
        # compressor), not to the parameter server, which knows neither
        for command, source in (("drain-device", "planner"), ("set-codec", "compressor")):
            value = ["--value", "grid"] if command == "set-codec" else []
            code, out, err = await cli("ctl", command, "--device", "pi-07", *value, *common)
            reply = json.loads(out.splitlines()[0])
            assert code == 0 and reply["ok"] and reply["source"] == source, (out, err)


def test_a_device_without_stats_shows_dashes_not_zeros() -> None:
    """Stats come every worker.stats_interval_s and are not retained: a row without them says it has no figures."""
    assert step_columns(None).split() == ["-", "-", "-"]
    stats = DeviceStats(device="pi-07", steps=12, step_time_s=0.25, model_version=40)
    assert step_columns(stats).split() == ["12", "250.0", "40"]


async def test_devices_on_an_empty_job_says_so(mosquitto_broker: BrokerProcess) -> None:
    code, out, _ = await cli("devices", "--broker", mosquitto_broker.url, "--job", "empty", "--wait", "0.5")
    assert code == 1 and "no devices" in out


async def test_devices_and_ctl_without_a_job_speak_to_the_running_one(mosquitto_broker: BrokerProcess) -> None:
    """Services that serve submitted jobs run one at a time: with no --job, the operator tools take that one (and
    say so); with none running, they name the jobs the broker knows."""
    flags = ("--broker", mosquitto_broker.url)
    code, _, err = await cli("devices", *flags, "--wait", "0.5")
    assert code == 2 and "no job is running: name the job with --job NAME" in err
    cfg = make_config(mosquitto_broker, job="operator")
    async with inbox(cfg) as box:
        await box.publish(Topics("done").job_state(), JobState(name="done", state="finished"), retain=True)
        code, _, err = await cli("ctl", "status", *flags, "--timeout-s", "0.5")
        assert code == 2 and "no job is running" in err and "the broker knows done" in err
        await box.publish(Topics("lab").job_state(), JobState(name="lab", state="running"), retain=True)
        code, out, err = await cli("devices", *flags, "--wait", "0.5")
        assert code == 1 and "(job lab, the one running)" in err and "no devices" in out


def test_config_prints_the_effective_settings_and_bad_ones_fail_clearly(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "edgemesh", "config"]
    ok = subprocess.run([*run, "--set", "training.lr=0.3", "--set", "broker.password=secret"],
                        capture_output=True, text=True, timeout=WAIT_S, check=False)
    assert ok.returncode == 0 and "training.lr = 0.3" in ok.stdout and "secret" not in ok.stdout
    bad = subprocess.run([*run, "--set", "training.lr=-1"], capture_output=True, text=True, timeout=WAIT_S,
                         check=False)
    assert bad.returncode == 2 and "training.lr" in bad.stderr
    toml = tmp_path / "c.toml"
    toml.write_text("[ps]\nlr = 0.1\n")
    typo = subprocess.run([*run, "--config", str(toml)], capture_output=True, text=True, timeout=WAIT_S,
                          check=False)
    assert typo.returncode == 2 and "ps.lr" in typo.stderr


# --------------------------------------------------------------------------- what a subcommand imports

RECORD_MODULES = ("import atexit, sys; from edgemesh.cli import main; "
                  "atexit.register(lambda: open(sys.argv.pop(1), 'w').write('\\n'.join(sorted(sys.modules)))); "
                  "sys.exit(main(sys.argv[2:]))")
"""``edgemesh`` as a ``python -c`` program that writes the modules it imported, at exit, to its first argument."""


def run_recording(out: Path, *args: str, **kwargs: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", RECORD_MODULES, str(out), *args], **kwargs)  # type: ignore[call-overload]


async def test_a_started_worker_has_imported_neither_the_benchmarks_nor_amqtt(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = make_config(mosquitto_broker, job="imports")
    out = tmp_path / "modules"
    proc = run_recording(out, "worker", "--broker", mosquitto_broker.url, "--job", "imports", "--device", "pi-1",
                         "--metrics", "", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with inbox(cfg, (Topics("imports").hello_filter(), DeviceHello)) as devices:
            await devices.next(DeviceHello, timeout_s=WAIT_S)  # up: measured, connected, announced
    finally:
        proc.send_signal(signal.SIGTERM)  # a clean stop: the modules loaded by then are written at exit
        assert proc.wait(timeout=WAIT_S) == 0
    modules = set(out.read_text().split())
    assert {"edgemesh.services.worker.service", "torch"} <= modules  # what it needs, it loaded
    assert not {m for m in modules if m.startswith(("edgemesh.bench", "amqtt", "edgemesh.local"))}


def test_only_the_subcommand_that_runs_is_imported(tmp_path: Path) -> None:
    out = tmp_path / "modules"
    bench = run_recording(out, "bench", "--help", stdout=subprocess.PIPE)
    assert bench.wait(timeout=WAIT_S) == 0
    assert {"edgemesh.bench.codecs", "edgemesh.bench.fleet", "edgemesh.bench.mesh"} <= set(out.read_text().split())
    top = run_recording(out, "--help", stdout=subprocess.PIPE)
    stdout, _ = top.communicate(timeout=WAIT_S)
    assert top.returncode == 0
    for command in ("planner", "ps", "compressor", "worker", "broker", "demo", "devices", "ctl", "bench", "config"):
        assert command in stdout.decode()
    assert not {m for m in out.read_text().split() if m.startswith(("edgemesh.services", "edgemesh.bench", "torch",
                                                                    "amqtt"))}
