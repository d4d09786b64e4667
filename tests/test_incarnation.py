"""A device's incarnation grows with every start, even when its clock went back (a Pi has no real-time
clock): the parameter server would take every update of an older-looking incarnation for a duplicate."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import gradient, make_config, running, serving_ps, until

from edgemesh.local.broker import BrokerProcess
from edgemesh.services.parameter_server.ledger import read_ledger
from edgemesh.services.worker.incarnation import next_incarnation
from edgemesh.services.worker.service import Worker

DAY_US = 86_400 * 1_000_000


def test_each_start_is_larger_than_the_last_whatever_the_clock_says(tmp_path: Path) -> None:
    assert next_incarnation("", now_us=5, environ=False) == 5  # no state directory: the clock alone
    assert next_incarnation(tmp_path, now_us=1_000) == 1_000
    assert next_incarnation(tmp_path, now_us=400) == 1_001  # the clock went back: the kept number goes on
    assert next_incarnation(tmp_path, now_us=9_000) == 9_000  # the clock is ahead again
    assert (tmp_path / "incarnation").read_text().strip() == "9000"


def test_systemds_state_directory_is_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}:/elsewhere")
    assert next_incarnation("", now_us=3) == 3
    assert next_incarnation("", now_us=1) == 4


def test_a_damaged_counter_falls_back_to_the_clock(tmp_path: Path) -> None:
    (tmp_path / "incarnation").write_text("not a number")
    assert next_incarnation(tmp_path, now_us=77) == 77
    assert next_incarnation(tmp_path, now_us=10) == 78


async def test_a_worker_whose_clock_went_back_is_not_taken_for_a_replay(mosquitto_broker: BrokerProcess,
                                                                       tmp_path: Path) -> None:
    """The device's last run had an incarnation a day ahead of this clock (its clock was right then, and
    is behind now): with the counter it kept, the new run's updates are applied, not acked ``duplicate``."""
    ahead = time.time_ns() // 1000 + DAY_US
    state = tmp_path / "worker-state"
    state.mkdir()
    (state / "incarnation").write_text(f"{ahead}\n")
    cfg = make_config(mosquitto_broker, job="rtc", **{
        "ps.state_dir": tmp_path / "ps", "ps.eval_every": 0, "training.sync_policy": "async",
        "worker.device": "pi-9", "worker.state_dir": state, "worker.ack_timeout_s": 2,
        "worker.ack_log": tmp_path / "acked.log"})
    async with serving_ps(cfg, ["pi-9"]) as (c, ps):
        ack = await c.push(gradient("pi-9", 1, 0, incarnation=ahead))  # the last run's update
        assert ack.status == "accepted"
        worker = Worker(cfg)
        assert worker.incarnation == ahead + 1
        async with running(worker):
            await until("the new run's updates applied", lambda: worker.accepted >= 3)
        assert ps.metrics.value("edgemesh_ps_updates_total", status="duplicate", reason="") == 0
    # the device's audit of what it saw acked agrees with the PS's ledger: each applied once
    acked = [tuple(int(x) for x in line.split()[:2]) for line in (tmp_path / "acked.log").read_text().splitlines()]
    ledger = [(e.incarnation, e.seq) for e in read_ledger(tmp_path / "ps" / "ledger.log") if e.device == "pi-9"]
    assert len(acked) >= 3 and all(key[0] == ahead + 1 for key in acked)
    assert len(set(ledger)) == len(ledger) and set(acked) <= set(ledger)
