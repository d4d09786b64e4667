"""A stable plan on a real broker (issue 33, item 3): a mesh planner fed loopback-like noisy stats by its devices
publishes no new plan for them, and still re-plans at once when a device joins or leaves, saying why."""

from __future__ import annotations

import pytest
from helpers import make_config, planner_devices, running

from edgemesh.common import costs
from edgemesh.common.messages import DeviceHello, DeviceStats, DeviceStatus, Event, Plan
from edgemesh.local.broker import BrokerProcess
from edgemesh.operator.devices import list_devices
from edgemesh.services.planner.service import Planner

BOARDS = {"big-0": (60e9, 7 << 30), "big-1": (60e9, 7 << 30), "small-0": (20e9, 268 << 20),
          "small-1": (20e9, 268 << 20), "small-2": (20e9, 268 << 20)}
"""Two boards that hold cifar-cnn and three that must share it; their hellos say nothing of their links, as a real
device's do not (the cost model takes 12.5 MB/s until they measure)."""
FIRST = ("big-0", "big-1", "small-0", "small-1")
"""The devices there from the start; small-2 joins later."""
ROUNDS = 30
"""Stats each device publishes before the join: three windows of the planner's smoothing."""
PLAN_WAIT_S = 30.0
"""How long the planner may take to lay out its first grid on a loaded host."""
MEMBERSHIP_S = 5.0
"""Issue 33's promise: a device joining or leaving is re-planned within this many seconds."""


def hello(name: str) -> DeviceHello:
    flops, memory = BOARDS[name]
    return DeviceHello(device=name, incarnation=1, flops=flops, memory_bytes=memory)


def noisy(name: str, i: int) -> DeviceStats:
    """Measurement ``i`` of a loopback link: 10-15 MB/s, one in five dipping anywhere down to 0.35 MB/s (the
    range issue 33 saw on one machine); latency 0.2-3 ms; the board's speed +-10 %."""
    def link(k: int) -> float:
        if (i + k) % 5 == 2:
            return 0.35e6 * (5 / 0.35) ** (((i * 7 + k) % 11) / 10)  # 0.35-5 MB/s
        return 10e6 + 5e6 * (((i * 3 + k * 5) % 13) / 12)
    return DeviceStats(device=name, incarnation=1, steps=i + 1, link_rate_bps=link(0), downlink_rate_bps=link(1),
                       latency_s=(0.2e-3, 0.5e-3, 3e-3, 0.3e-3, 0.8e-3)[i % 5],
                       compute_flops=BOARDS[name][0] * costs.TRAIN_EFFICIENCY * (0.9 + 0.2 * ((i * 5) % 7) / 6))


@pytest.mark.timeout(120)
async def test_noisy_measurements_make_no_plan_and_a_join_or_leave_re_plans_within_seconds(
        mosquitto_broker: BrokerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = make_config(mosquitto_broker, job="stableplan", **{
        "planner.parallelism": "mesh", "planner.round_samples": 64, "planner.replan_debounce_s": 0.05,
        "planner.min_devices": len(FIRST), "training.model_spec": "cifar-cnn", "training.dataset": "synthetic-cifar",
        "planner.rebalance_interval_s": 0,  # the grid is reviewed on every stats message
        "planner.replan_min_interval_s": 0})  # nothing but the smoothing and the band hold the noise back
    planner = Planner(cfg)
    async with running(planner), planner_devices(cfg) as box:
        for name in FIRST:
            await box.publish(box.topics.hello(name), hello(name), retain=True)
            await box.publish(box.topics.status(name), DeviceStatus(device=name, state="online", incarnation=1),
                              retain=True)
        first = await box.next(Plan, lambda p: bool(p.devices), PLAN_WAIT_S)
        for i in range(ROUNDS):
            for name in FIRST:
                await box.publish(box.topics.stats(name), noisy(name, i))
        await box.until("every stats message taken", lambda: all(
            (s := planner.registry.stats.get(name)) is not None and s.steps == ROUNDS for name in FIRST))

        await box.publish(box.topics.hello("small-2"), hello("small-2"), retain=True)
        await box.publish(box.topics.status("small-2"), DeviceStatus(device="small-2", state="online", incarnation=1),
                          retain=True)
        joined = await box.next(Plan, lambda p: p.version > first.version, MEMBERSHIP_S)
        joined_event = await box.next(Event, lambda e: e.kind == "replan" and e.data.get("version") == joined.version)

        await box.publish(box.topics.status("small-1"), DeviceStatus(device="small-1", state="offline",
                                                                     incarnation=1), retain=True)
        left = await box.next(Plan, lambda p: p.version > joined.version, MEMBERSHIP_S)
        left_event = await box.next(Event, lambda e: e.kind == "replan" and e.data.get("version") == left.version)
        capsys.readouterr()
        assert await list_devices(cfg, wait_s=1.0) == 0  # edgemesh devices: the planner answers its status
        listed = capsys.readouterr().out

    # no plan went out for the noise: the join's is the very next version
    assert (joined.version, joined.reason) == (first.version + 1, "join")
    assert (left.version, left.reason) == (joined.version + 1, "leave")
    for reason in ("links", "slowdown"):
        assert planner.metrics.value("edgemesh_planner_replans_total", reason=reason) == 0
    # the planner plans with the medians of what the devices measured, not the last dip
    planned = {d.device: d for d in planner.parallelism.grid_devices}
    assert all(10e6 <= planned[name].link_rate_bps <= 15e6 for name in ("big-0", "big-1", "small-0"))
    # why each re-plan happened: the event and the planner's status name the device
    assert (joined_event.data["reason"], joined_event.data["cause"]) == ("join", "small-2 joined")
    assert (left_event.data["reason"], left_event.data["cause"]) == ("leave", "small-1 left")
    assert f"plan v{left.version}: " in listed and "re-planned: leave: small-1 left" in listed, listed
