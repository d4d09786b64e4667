"""Emulation scenarios: the shipped file, a device's seeded timeline, and what it does to a board and its link."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from helpers import make_config

from edgemesh.common import costs
from edgemesh.common.emulation.dynamics import Timeline
from edgemesh.common.emulation.link import EmulatedLink
from edgemesh.common.emulation.profiles import get_profile, load_profiles
from edgemesh.common.emulation.scenarios import (
    FIGURES,
    NUMBERS,
    Scenario,
    get_scenario,
    load_scenarios,
    parse_scenarios,
)
from edgemesh.common.emulation.shape import LinkShape
from edgemesh.common.errors import ConfigError
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.worker.board import EmulatedBoard
from edgemesh.services.worker.service import Worker

WAIT = 10.0
"""Seconds any single expected event may take."""


def test_the_shipped_scenarios_source_every_figure_and_harsh_is_worse_than_dynamic() -> None:
    scenarios = load_scenarios(profiles=set(load_profiles()))
    assert {"steady", "dynamic", "harsh"} <= set(scenarios)
    for s in scenarios.values():
        assert set(s.sources) == set(FIGURES) and all(len(text) > 20 for text in s.sources.values()), s.name
    steady, dynamic, harsh = scenarios["steady"], scenarios["dynamic"], scenarios["harsh"]
    # steady is today's fleet: nothing changes but the profiles' own rare drop-outs
    assert not steady.throttle_profiles and steady.stalls_per_minute == 0 and not steady.varies_bandwidth
    assert steady.disconnects_per_hour == get_profile("pi4").disconnects_per_hour
    assert dynamic.throttle_profiles and dynamic.stalls_per_minute > 0 and dynamic.varies_bandwidth
    assert set(dynamic.throttle_profiles) <= set(harsh.throttle_profiles)
    assert harsh.throttle_speed <= dynamic.throttle_speed
    for rate in ("stalls_per_minute", "stall_s", "disconnects_per_hour", "outage_s", "bandwidth_sigma"):
        assert getattr(harsh, rate) >= getattr(dynamic, rate) > 0, rate
    # a run of a few minutes of 8 devices sees drop-outs in dynamic (the "rates a run actually sees")
    assert dynamic.disconnects_per_hour * 8 * 3 / 60 >= 1


def _table(**changes: Any) -> dict[str, Any]:
    table: dict[str, Any] = {"description": "d", "throttle_profiles": ["pi4"], "throttle_speed": 0.5,
                             "throttled_s": 10.0, "unthrottled_s": 20.0, "stalls_per_minute": 1.0, "stall_s": 2.0,
                             "max_stall_s": 0.0, "disconnects_per_hour": 6.0, "outage_s": 10.0, "max_outage_s": 30.0,
                             "bandwidth_sigma": 0.5, "bandwidth_interval_s": 3.0}
    table["sources"] = {k: "measured somewhere, 2026" for k in FIGURES}
    table.update(changes)
    return {"scenarios": {"site": table}}


@pytest.mark.parametrize("change,message", [
    ({"throttle_speed": 0.0}, "throttle_speed: must be in"),
    ({"throttle_speed": 1.5}, "throttle_speed: must be in"),
    ({"stall_s": -1.0}, "stall_s: expected a finite number >= 0"),
    ({"stall_s": 0.0}, "stall_s: must be > 0 when stalls_per_minute > 0"),
    ({"unthrottled_s": 0.0}, "unthrottled_s: must be > 0 when throttled_s > 0"),
    ({"throttle_profiles": "pi4"}, "expected a list of profile names"),
    ({"throttle_profiles": ["pi9"]}, "unknown profile"),
    ({"gusts": 3}, "unknown field"),
    ({"sources": {k: "x" for k in FIGURES if k != "stall_s"}}, "no source noted for stall_s"),
])
def test_a_scenario_with_a_bad_or_unsourced_figure_is_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_scenarios(_table(**change), source="site.toml", profiles={"pi3", "pi4"})
    missing = _table()
    del missing["scenarios"]["site"]["outage_s"]
    with pytest.raises(ConfigError, match="missing outage_s"):
        parse_scenarios(missing, source="site.toml")


def test_scenarios_load_from_a_file_of_ones_own_and_unknown_names_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "site.toml"
    path.write_text(_toml(_table()["scenarios"]["site"]))
    assert get_scenario("site", path).stall_s == 2.0
    with pytest.raises(ConfigError, match="unknown emulation scenario 'calm'; known: site"):
        get_scenario("calm", path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenarios(tmp_path / "missing.toml")


def _toml(table: dict[str, Any], name: str = "site") -> str:
    def value(v: Any) -> str:
        return "[" + ", ".join(f'"{x}"' for x in v) + "]" if isinstance(v, list) else repr(v) if not isinstance(
            v, str) else f'"{v}"'
    lines = [f"[scenarios.{name}]"] + [f"{k} = {value(v)}" for k, v in table.items() if k != "sources"]
    lines += [f"[scenarios.{name}.sources]"] + [f'{k} = "{v}"' for k, v in table["sources"].items()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- timelines


def test_a_timeline_replays_from_its_seed_and_each_kind_keeps_its_own_events() -> None:
    site = parse_scenarios(_table(), source="t")["site"]
    a = Timeline.of(site, "pi4", "pi4-0", seed=1)
    assert a.until(600) == Timeline.of(site, "pi4", "pi4-0", seed=1).until(600)
    assert a.until(600) != Timeline.of(site, "pi4", "pi4-1", seed=1).until(600)  # devices differ
    assert a.until(600) != Timeline.of(site, "pi4", "pi4-0", seed=2).until(600)
    # more stalls leave the throttled spells and drop-outs where they were
    stormy = Timeline.of(Scenario(**{**_fields(site), "stalls_per_minute": 5.0}), "pi4", "pi4-0", seed=1)
    assert stormy.until(600, ("throttle", "drop")) == a.until(600, ("throttle", "drop"))
    assert len(stormy.until(600, ("stall",))) > len(a.until(600, ("stall",)))
    # a board the scenario does not throttle never slows down
    assert Timeline.of(site, "laptop", "laptop-0", seed=1).until(600, ("throttle",)) == []


def _fields(s: Scenario) -> dict[str, Any]:
    return {"name": s.name, "throttle_profiles": s.throttle_profiles, **{k: getattr(s, k) for k in NUMBERS}}


def test_a_timeline_follows_the_scenario_s_rates_and_lengths() -> None:
    site = parse_scenarios(_table(), source="t")["site"]
    horizon = 6 * 3600.0
    t = Timeline.of(site, "pi4", "pi4-0", seed=3)
    assert t.share("throttle", horizon) == pytest.approx(10 / 30, abs=0.05)
    stalls = t.until(horizon, ("stall",))
    assert len(stalls) / (horizon / 60) == pytest.approx(1.0, rel=0.1)
    assert sum(e.length_s for e in stalls) / len(stalls) == pytest.approx(2.0, rel=0.15)
    drops = t.until(horizon, ("drop",))
    assert len(drops) / (horizon / 3600) == pytest.approx(6.0, rel=0.3)
    assert max(e.length_s for e in drops) <= 30.0  # the cap
    rates = [e.value for e in t.episodes["bandwidth"]]
    assert sum(rates) / len(rates) == pytest.approx(1.0, abs=0.05)  # the profile's rate stays the mean
    assert min(rates) < 0.6 and max(rates) > 1.6
    for kind in ("stall", "drop"):  # episodes of a kind never overlap
        events = t.until(horizon, (kind,))
        assert all(a.end_s <= b.start_s for a, b in zip(events, events[1:], strict=False))


def test_work_in_a_throttled_spell_takes_longer_by_the_speed_factor() -> None:
    site = parse_scenarios(_table(), source="t")["site"]
    t = Timeline.of(site, "pi4", "pi4-0", seed=0)
    spell = t.until(3600, ("throttle",))[1]
    assert t.speed_at(spell.start_s + spell.length_s / 2) == 0.5 and t.speed_at(spell.end_s + 1e-9) == 1.0
    # inside the spell at half speed
    inside = min(0.1, spell.length_s / 4)
    assert t.work_end(spell.start_s, inside) == pytest.approx(spell.start_s + 2 * inside)
    # begun just before it: the first half second at full speed, the rest at half speed
    work = 0.5 + spell.length_s / 2
    assert t.work_end(spell.start_s - 0.5, work) == pytest.approx(spell.end_s)
    # begun inside and running past its end: full speed again after it
    assert t.work_end(spell.end_s - 1.0, 1.0) == pytest.approx(spell.end_s + 0.5)


# --------------------------------------------------------------------------- the link and the board


async def test_a_stall_holds_every_byte_with_the_connection_kept_and_a_new_rate_applies() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    try:
        async with EmulatedLink(LinkShape(uplink_bps=1e6, downlink_bps=1e6), upstream_host="127.0.0.1",
                                upstream_port=port) as link:
            reader, writer = await asyncio.open_connection(link.host, link.port)
            link.stall(0.5)
            start = loop.time()
            writer.write(b"ping")
            async with asyncio.timeout(WAIT):
                assert await reader.readexactly(4) == b"ping"
            assert loop.time() - start >= 0.45  # held until the stall ended, not dropped
            assert (link.stalls, link.disconnects, link.connections) == (1, 0, 1)
            link.set_rates(0.1)  # 100 kB/s each way: 50 kB take at least 0.5 s up
            start = loop.time()
            writer.write(bytes(50_000))
            async with asyncio.timeout(WAIT):
                await reader.readexactly(50_000)
            assert loop.time() - start >= 0.85 * 0.5
            writer.close()
    finally:
        server.close()
        await server.wait_closed()


def _scenario_file(tmp_path: Path, **changes: Any) -> Path:
    path = tmp_path / "always-hot.toml"
    path.write_text(_toml({**_table(**changes)["scenarios"]["site"]}))
    return path


async def test_a_throttled_board_computes_at_its_throttled_speed_from_its_first_plan(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    # throttled nearly all the time, and nothing else happens
    path = _scenario_file(tmp_path, throttled_s=1e6, unthrottled_s=1e-6, stalls_per_minute=0.0,
                          disconnects_per_hour=0.0, bandwidth_sigma=0.0)
    cfg = make_config(mosquitto_broker, job="hot", **{
        "worker.device": "pi4-0", "worker.emulate": "pi4", "worker.emulation_scenario": "site",
        "worker.emulation_scenarios": str(path), "worker.emulation_dilation": "2",
        "worker.emulation_host_gflops": "50"})
    board = Worker(cfg).board
    assert isinstance(board, EmulatedBoard) and board.timeline is not None
    pi4 = get_profile("pi4")
    flops = costs.cost("digits-cnn").train_flops_per_sample * 8
    full = flops / (costs.TRAIN_EFFICIENCY * pi4.train_gflops / 2 * 1e9)  # dilated x2
    assert await board.hold(0.0, flops) == pytest.approx(full)  # before the first plan: the profile's speed
    board.begin()
    assert await board.hold(0.0, flops) == pytest.approx(full / 0.5, rel=0.05)
    board.sample()
    assert board.m_speed._value.get() == 0.5  # type: ignore[attr-defined]
