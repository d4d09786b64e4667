"""The planner sizes batches to device speeds (adaptive policy), follows the PS's sync state, and
leaves out devices whose memory holds no share or that refused theirs. Real brokers."""

from __future__ import annotations

import time

from helpers import Inbox, device_names, join, planner_config, planner_devices, running

from edgemesh.common import costs
from edgemesh.common.messages import ControlReply, DeviceStats, DeviceStatus, Plan, SyncState
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.planner.service import Planner

JOB = "t-planner"
TOPICS = Topics(JOB)
BATCH = 32


def sizes(plan: Plan) -> dict[str, int]:
    return {d.device: d.batch_size for d in plan.devices}


async def stats(bus: Inbox, name: str, *, batch: int, step_s: float) -> None:
    await bus.publish(TOPICS.stats(name), DeviceStats(device=name, incarnation=1, time=time.time(), batch_size=batch,
                                                      step_time_s=step_s))


async def sync_state(bus: Inbox, policy: str, slow: tuple[str, ...] = (), indices: dict[str, float] | None = None,
                     ) -> None:
    await bus.publish(TOPICS.sync(), SyncState(policy=policy, version=1, bound=2, delay_indices=indices or {},  # type: ignore[arg-type]
                                               slow=slow), retain=True)


async def test_adaptive_balances_batches_to_speed_and_follows_measured_step_times(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB, **{"training.sync_policy": "adaptive", "planner.min_devices": 2,
                                                 "planner.rebalance_interval_s": 0})
    planner = Planner(config)
    async with planner_devices(config) as bus, running(planner):
        await join(bus, "slow", flops=2e9)
        await join(bus, "fast", flops=8e9)
        first = await bus.next(Plan)
        assert first.batching == "balanced" and first.round_time_s > 0
        assert sizes(first)["fast"] > sizes(first)["slow"]
        assert sum(sizes(first).values()) >= 2 * BATCH  # a round carries as many samples as a uniform one
        # measured: the "fast" device is in fact 3x slower per sample than the "slow" one
        await stats(bus, "slow", batch=sizes(first)["slow"], step_s=0.001 * sizes(first)["slow"])
        await stats(bus, "fast", batch=sizes(first)["fast"], step_s=0.003 * sizes(first)["fast"])
        plan = await bus.next(Plan, lambda p: p.reason == "rebalance")
        assert sizes(plan)["slow"] > sizes(plan)["fast"]
        assert abs(sizes(plan)["slow"] - 3 * sizes(plan)["fast"]) <= 3  # t = b x per-sample time, equal for both
        assert planner.metrics.value("edgemesh_planner_replans_total", reason="rebalance") == 1
        assert planner.metrics.value("edgemesh_planner_predicted_round_seconds") == plan.round_time_s
        # the same measurements again: no new plan
        await stats(bus, "slow", batch=sizes(plan)["slow"], step_s=0.001 * sizes(plan)["slow"] * 1.05)
        reply_plan = await _status(bus, planner)
        assert reply_plan == plan.version


async def _status(bus: Inbox, planner: Planner) -> int:
    """Plan version after the planner handled everything sent so far (a control round trip)."""
    await bus.bus.publish(TOPICS.control("planner"), b'{"command": "status", "request_id": "st"}')
    reply = await bus.next(ControlReply, lambda r: r.request_id == "st")
    assert reply.ok
    return int(reply.result["plan_version"])  # type: ignore[arg-type]


async def test_the_ps_sync_state_switches_batching_and_shrinks_slow_devices(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB, **{"training.sync_policy": "sync", "planner.min_devices": 2,
                                                 "planner.rebalance_interval_s": 0})
    async with planner_devices(config) as bus, running(Planner(config)):
        await join(bus, "a", flops=4e9)
        await join(bus, "b", flops=4e9)
        plan = await bus.next(Plan)
        assert plan.batching == "uniform" and set(sizes(plan).values()) == {BATCH} and plan.sync_policy == "sync"
        # an operator switched the PS to adaptive: balanced batches (equal devices: equal batches)
        await sync_state(bus, "adaptive")
        plan = await bus.next(Plan, lambda p: p.batching == "balanced")
        assert plan.sync_policy == "adaptive" and sizes(plan)["a"] == sizes(plan)["b"]
        # the PS reports b three rounds behind: b's batch shrinks by about 1 + 3
        await sync_state(bus, "adaptive", slow=("b",), indices={"a": 0.0, "b": 3.0})
        plan = await bus.next(Plan, lambda p: sizes(p)["b"] < sizes(p)["a"])
        assert abs(sizes(plan)["a"] - 4 * sizes(plan)["b"]) <= 4
        # back to sync: uniform again
        await sync_state(bus, "sync")
        plan = await bus.next(Plan, lambda p: p.batching == "uniform")
        assert set(sizes(plan).values()) == {BATCH}


async def test_devices_without_room_for_a_share_are_left_out(broker: BrokerProcess) -> None:
    config = planner_config(broker, job=JOB, **{"planner.min_devices": 1})
    planner = Planner(config)
    async with planner_devices(config) as bus, running(planner):
        await join(bus, "tiny", flops=1e9, memory=costs.RUNTIME_BYTES)  # the runtime alone fills it
        await join(bus, "ok", flops=1e9)
        plan = await bus.next(Plan)
        assert device_names(plan) == ["ok"]
        assert planner.metrics.value("edgemesh_planner_devices_excluded") == 1
        # a device that refused its share (its retained status says so) leaves the plan ...
        await join(bus, "picky", flops=1e9)
        plan = await bus.next(Plan, lambda p: "picky" in device_names(p))
        await bus.publish(TOPICS.status("picky"), DeviceStatus(device="picky", state="online", incarnation=1,
                                                               refused_plan=plan.version, reason="too big"),
                          retain=True)
        plan = await bus.next(Plan, lambda p: "picky" not in device_names(p))
        assert plan.reason == "leave" and device_names(plan) == ["ok"]
        # ... until it restarts (a new incarnation, no refusal)
        await join(bus, "picky", flops=1e9, incarnation=2)
        plan = await bus.next(Plan, lambda p: "picky" in device_names(p))
        assert device_names(plan) == ["ok", "picky"]
