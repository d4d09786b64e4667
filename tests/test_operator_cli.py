"""``edgemesh devices`` and ``edgemesh ctl`` against running services, as an operator runs them."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from edgemesh.common.broker import BrokerProcess
from edgemesh.common.config import load_config
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.operator import parse_value
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

WAIT_S = 60.0
POLL_S = 0.1


async def cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "edgemesh.services.cli", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), WAIT_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_parse_value_sends_numbers_as_numbers() -> None:
    assert parse_value("4") == 4 and parse_value("0.5") == 0.5 and parse_value("true") is True
    assert parse_value("async") == "async" and parse_value(None) is None and parse_value("[1]") == "[1]"


async def test_devices_lists_a_worker_and_ctl_steers_the_ps(mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    base = {"broker.url": mosquitto_broker.url, "job": "ops", "metrics.address": "127.0.0.1:0",
            "ps.state_dir": str(tmp_path / "ps")}
    cfg = load_config(env={}, overrides=base)
    worker = Worker(load_config(env={}, overrides={**base, "worker.device": "pi-07"}))
    services = [Planner(cfg), ParameterServer(cfg), Compressor(cfg), worker]
    tasks = [asyncio.create_task(s.run()) for s in services]
    common = ["--broker", mosquitto_broker.url, "--job", "ops"]
    try:
        async with asyncio.timeout(WAIT_S):
            while worker.accepted < 2:
                await asyncio.sleep(POLL_S)
        code, out, err = await cli("devices", *common, "--wait", "1.5")
        assert code == 0, err
        row = next(line for line in out.splitlines() if line.startswith("pi-07"))
        assert "online" in row and "c-pi-07" in row
        assert "plan v" in out

        code, out, err = await cli("ctl", "set-bound", "--target", "ps", "--value", "7", *common)
        assert code == 0, err
        reply = json.loads(out.splitlines()[0])
        assert reply["ok"] and reply["result"]["bound"] == 7 and services[1].bound == 7

        code, out, err = await cli("ctl", "set-bound", "--target", "ps", "--value", "-1", *common)
        assert code == 1 and not json.loads(out.splitlines()[0])["ok"]

        code, out, err = await cli("ctl", "status", "--target", "nobody-home", *common, "--timeout-s", "1")
        assert code == 1 and "no reply" in err
    finally:
        for s in services:
            s.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT_S)


async def test_devices_on_an_empty_job_says_so(mosquitto_broker: BrokerProcess) -> None:
    code, out, _ = await cli("devices", "--broker", mosquitto_broker.url, "--job", "empty", "--wait", "0.5")
    assert code == 1 and "no devices" in out


def test_config_prints_the_effective_settings_and_bad_ones_fail_clearly(tmp_path: Path) -> None:
    import subprocess

    run = [sys.executable, "-m", "edgemesh.services.cli", "config"]
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
