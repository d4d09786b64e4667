"""The adaptive bounded-delay policy (docs/synchronization.md): the pure rule, then the PS on a real broker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import gradient, inbox, make_config, plan_for, running, serving_ps, until

from edgemesh.common.config import AdaptiveConfig, Config
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import SyncState
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.parameter_server import store
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay, compensated_momentum, quantile, round_weights
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.parameter_server.settings import OperatorSettings


def ps_config(broker: BrokerProcess, state_dir: Path, **settings: object) -> Config:
    return make_config(broker, job="adaptive", **{"ps.state_dir": state_dir, "ps.eval_every": 0,
                                                  "ps.broadcast": "snapshot", **settings})

# --------------------------------------------------------------------------- pure rule


def test_delay_index_is_a_moving_average_of_each_devices_delays() -> None:
    a = AdaptiveDelay(AdaptiveConfig(alpha=0.5))
    assert a.observe_delay("pi", 4) == 4.0  # the first observation sets it
    assert a.observe_delay("pi", 0) == 2.0
    assert a.observe_delay("pi", 2) == 2.0
    assert a.observe_delay("pi", -3) == 1.0  # negative delays count as 0
    a.observe_delay("fast", 0)
    assert a.indices == {"pi": 1.0, "fast": 0.0}


def test_a_new_plan_keeps_only_its_devices_indices_and_its_clusters_arrivals() -> None:
    a = AdaptiveDelay(AdaptiveConfig(alpha=0.5))
    for device in ("a", "b", "gone"):
        a.observe_delay(device, 2)
        a.observe_arrival(f"c-{device}", 0.1)
    a.retain(["a", "b"], ["c-a", "c-b"])
    assert set(a.indices) == {"a", "b"} and set(a.arrivals) == {"c-a", "c-b"}


def test_bound_follows_the_delay_indices_of_live_devices_within_its_clamp() -> None:
    a = AdaptiveDelay(AdaptiveConfig(alpha=0.5, quantile=0.9, slack=1.5, min_bound=1), max_bound=6)
    assert a.bound() == 6  # nothing observed yet: the max bound
    # a homogeneous fleet, every update on the current version: the bound shrinks to its floor
    trace = {f"d{i}": [0, 0, 0, 0] for i in range(8)}
    for delays in zip(*trace.values(), strict=True):
        for device, d in zip(trace, delays, strict=True):
            a.observe_delay(device, d)
    assert a.bound() == 1
    # two devices fall behind by 3 versions per update: the bound rises to let them in ...
    for _ in range(6):
        a.observe_delay("d6", 3)
        a.observe_delay("d7", 3)
    wanted = quantile(a.indices.values(), 0.9) * 1.5
    assert a.bound() == min(6, max(1, int(-(-wanted // 1)))) and 3 <= a.bound() <= 6
    # ... but never past the max bound
    for _ in range(20):
        for d in ("d5", "d6", "d7"):
            a.observe_delay(d, 30)
    assert a.bound() == 6
    assert a.bound(max_bound=2) == 2
    # devices that left the plan do not count
    assert a.bound(live_devices=["d0", "d1", "d2"]) == 1
    # the plan's devices and the configured bound, as the scheduler tells the rule
    a.follow(6, frozenset({"d0", "d1"}))
    assert a.bound() == 1


def test_slow_devices_are_far_above_the_fleet_median() -> None:
    a = AdaptiveDelay(AdaptiveConfig(alpha=1.0, slow_factor=2.0))
    assert a.slow_devices() == []
    for device, index in {"a": 1, "b": 1, "c": 2, "d": 5, "e": 9}.items():
        a.observe_delay(device, index)
    assert a.slow_devices() == ["d", "e"]  # median 2: above max(2 * 2, 2 + 1) = 4
    assert a.slow_devices(["a", "b", "e"]) == ["e"]
    for device in ("a", "b", "c", "d", "e"):
        a.observe_delay(device, 0)
    assert a.slow_devices() == []  # all equal: nobody is slow (median 0 needs an excess of half a version)
    # a device one round late twice running is slow (index 0.3, then 0.51): with a margin of one version, a
    # device always one round late (index -> 1) never was
    late = AdaptiveDelay(AdaptiveConfig(alpha=0.3))
    for device in ("a", "b", "c", "d"):
        late.observe_delay(device, 0)
    late.observe_delay("e", 0)
    late.observe_delay("e", 1)
    assert late.slow_devices() == []
    late.observe_delay("e", 1)
    assert late.slow_devices() == ["e"]
    for _ in range(20):
        late.observe_delay("e", 1)
    assert AdaptiveDelay(AdaptiveConfig(slow_margin=1.0), indices=dict(late.indices)).slow_devices() == []


def test_deadline_adapts_to_recent_cluster_arrival_times() -> None:
    a = AdaptiveDelay(AdaptiveConfig(deadline_quantile=0.9, slack=1.5, min_deadline_s=0.2, max_deadline_s=10.0,
                                     window=4))
    assert a.deadline() == 10.0  # no arrivals seen: wait the longest
    # three clusters arrive within ~1 s of the round opening, one at ~2 s
    for t in (0.0, 0.1, 0.05, 0.0):
        a.observe_arrival("c0", t)
    for t in (0.8, 1.0, 0.9, 1.1):
        a.observe_arrival("c1", t)
    for t in (0.5, 0.6, 0.4, 0.5):
        a.observe_arrival("c2", t)
    for t in (2.0, 2.2, 1.8, 2.0):
        a.observe_arrival("c3", t)
    typical = [0.025, 0.95, 0.5, 2.0]
    assert a.deadline() == pytest.approx(quantile(typical, 0.9) * 1.5)
    assert 2.0 < a.deadline() < 3.0
    assert a.deadline(["c0", "c2"]) == pytest.approx(max(0.2, quantile([0.025, 0.5], 0.9) * 1.5))
    # c3 speeds up: only the last `window` arrivals count, and the deadline shrinks
    for _ in range(4):
        a.observe_arrival("c3", 0.3)
    assert a.deadline() == pytest.approx(quantile([0.025, 0.95, 0.5, 0.3], 0.9) * 1.5)
    # everybody arrives at once: clamped to the shortest deadline; a very slow fleet: to the longest
    b = AdaptiveDelay(AdaptiveConfig(min_deadline_s=0.2, max_deadline_s=10.0))
    b.observe_arrival("c0", 0.0)
    assert b.deadline() == 0.2
    b.observe_arrival("c1", 60.0)
    b.observe_arrival("c2", 60.0)
    assert b.deadline() == 10.0


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="ps.adaptive.alpha"):
        AdaptiveConfig(alpha=0.0)
    with pytest.raises(ConfigError, match="ps.adaptive.max_deadline_s"):
        AdaptiveConfig(min_deadline_s=2.0, max_deadline_s=1.0)


# --------------------------------------------------------------------------- parameter server

DEADLINE_S = 0.6
FIRST_DEADLINE_S = 1.5
"""``ps.adaptive.max_deadline_s``: what a round waits before any cluster's cycle is measured."""


async def test_adaptive_round_closes_at_the_deadline_and_bounds_late_updates(
        broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path, **{
        "training.sync_policy": "adaptive", "training.staleness_bound": "2", "ps.round_scaling": "none",
        "ps.adaptive.min_deadline_s": str(DEADLINE_S), "ps.adaptive.max_deadline_s": str(FIRST_DEADLINE_S)})
    async with serving_ps(cfg, ["a", "b"]) as (c, ps):  # the weights below are the rounds' own (no scaling)
        # round 1: only a sends; b is silent. No cycle measured yet: the round waits the longest deadline for b
        sent = time.monotonic()
        ack_a = await c.push(gradient("a", 1, 0))
        waited = time.monotonic() - sent
        assert (ack_a.status, ack_a.version, ack_a.delay) == ("accepted", 1, 0)
        assert FIRST_DEADLINE_S - 0.05 <= waited, waited
        # b's update on version 0 arrives late (d = 1 <= D): applied in the next round, weighted 1/2
        ack_b = await c.push(gradient("b", 1, 0))
        assert (ack_b.status, ack_b.delay, ack_b.version) == ("accepted", 1, 2)
        # round 3: both on time, it closes as soon as both contributed (well before a deadline); each one's
        # cycle, from the model it trained on to its update, is measured
        sent = time.monotonic()
        await c.bus.publish(c.topics.grad("c-a", "a"), gradient("a", 2, 2))
        ack_b = await c.push(gradient("b", 2, 2))
        assert (ack_b.status, ack_b.version) == ("accepted", 3)
        assert (await c.ack_for("a", 2)).status == "accepted"
        assert time.monotonic() - sent < FIRST_DEADLINE_S
        # round 4: only a; the round closes at the adapted deadline (the cycles are short: the shortest deadline),
        # not the longest; a generous upper bound, not a speed requirement
        sent = time.monotonic()
        ack_a = await c.push(gradient("a", 3, 3))
        waited = time.monotonic() - sent
        assert (ack_a.status, ack_a.version) == ("accepted", 4)
        assert DEADLINE_S - 0.05 <= waited < FIRST_DEADLINE_S, waited
        assert ps.metrics.value("edgemesh_ps_adaptive_deadline_seconds") == pytest.approx(DEADLINE_S)
        # an update beyond the bound is discarded, acked stale, and its sender resyncs
        bound = int(ps.metrics.value("edgemesh_ps_adaptive_bound_versions"))
        assert 1 <= bound <= 2
        ack = await c.push(gradient("b", 3, 4 - bound - 1))
        assert (ack.status, ack.reason, ack.resync, ack.delay) == ("discarded", "stale", True, bound + 1)
        assert ps.version == 4
        assert ps.metrics.value("edgemesh_ps_updates_total", status="discarded", reason="stale") == 1

        # the log records the weights, so a replay is exact: each contribution weighs its share of the
        # 16 samples the plan expects per round, halved when one version late
        weights = {(e["device"], int(r["version"])): e["weight"] for r in store.read_wal(tmp_path)
                   for e in r["entries"]}
        assert weights == {("a", 1): 0.5, ("b", 2): 0.25, ("a", 3): 0.5, ("b", 3): 0.5, ("a", 4): 0.5}
        assert ps.rule.indices["b"] > ps.rule.indices["a"]


async def test_switching_to_adaptive_mid_run_keeps_training(broker: BrokerProcess, tmp_path: Path) -> None:
    cfg = ps_config(broker, tmp_path, **{"training.sync_policy": "sync",
                                           "ps.adaptive.min_deadline_s": "0.3", "ps.adaptive.max_deadline_s": "2"})
    async with serving_ps(cfg, ["a", "b"]) as (c, ps):
        await c.bus.publish(c.topics.grad("c-a", "a"), gradient("a", 1, 0))
        assert (await c.push(gradient("b", 1, 0))).version == 1
        # a's next update opens a sync round that b never completes ...
        await c.bus.publish(c.topics.grad("c-a", "a"), gradient("a", 2, 1))
        await c.until("a's update in the open round", lambda: ps.metrics.value("edgemesh_ps_pending_updates") == 1)
        assert ps.version == 1
        # ... until the operator switches to adaptive: the held update goes through at the deadline
        await c.bus.publish(c.topics.control("ps"), b'{"command": "set-sync-policy", "value": "adaptive",'
                                                    b' "requester": "tester", "request_id": "s1"}')
        reply = await c.reply("s1")
        assert reply.ok and reply.result["policy"] == "adaptive" and ps.policy == "adaptive"
        assert "adaptive_bound" in reply.result and "slow_devices" in reply.result
        ack = await c.ack_for("a", 2)
        assert (ack.status, ack.version) == ("accepted", 2)
        # training goes on under the new policy
        for seq in (3, 4):
            v = ps.version
            await c.bus.publish(c.topics.grad("c-a", "a"), gradient("a", seq, v))
            assert (await c.push(gradient("b", seq, v))).status == "accepted"
        await c.version_at_least(4)
        assert ps.metrics.value("edgemesh_ps_sync_policy_info", policy="adaptive") == 1
        # set-bound under adaptive sets the max bound
        await c.bus.publish(c.topics.control("ps"), b'{"command": "set-bound", "value": 0, "requester": "tester",'
                                                    b' "request_id": "s2"}')
        reply = await c.reply("s2")
        assert reply.ok and reply.result["adaptive_bound"] == 0 and ps.rule.bound() == 0


def test_round_weights_are_shares_of_the_planned_samples_damped_by_delay() -> None:
    # a full round on time: the usual sample-weighted mean
    assert round_weights([8, 24], [0, 0], planned=32) == [0.25, 0.75]
    # the deadline closed it with half the planned samples: half a step, not a whole one
    assert round_weights([16], [0], planned=32) == [0.5]
    # a late contribution counts 1 / (1 + d) of its share
    assert round_weights([16, 16], [0, 1], planned=32) == [0.5, 0.25]
    # more samples than planned (a late one on top of a full round): never more than one step
    assert sum(round_weights([16, 16, 16], [0, 0, 0], planned=32)) == pytest.approx(1.0)
    assert round_weights([8], [0], planned=0) == [1.0]  # no plan: the round is all there is
    # FedBuff's rule damps by the square root of the delay: gentler on a long one
    assert round_weights([16, 16], [0, 4], planned=32, rule="sqrt") == [0.5, pytest.approx(0.5 / 3)]
    assert round_weights([16, 16], [0, 4], planned=32) == [0.5, pytest.approx(0.5 / 5)]


def test_a_checkpoints_cycles_are_taken_only_as_seconds_and_only_for_clusters_not_yet_timed() -> None:
    kept = OperatorSettings.of({"cycles": {"c-a": [0.2, "x", -1, float("nan"), True, 0.4], "c-b": "no", "c-c": [0.1]}})
    assert kept.cycles == {"c-a": [0.2, 0.4], "c-c": [0.1]}
    assert OperatorSettings.of({"cycles": [0.2]}).cycles == {}
    rule = AdaptiveDelay(AdaptiveConfig(window=2, slack=1.0, min_deadline_s=0.01))
    rule.observe_arrival("c-c", 0.05)
    rule.restore_arrivals({**kept.cycles, "c-d": [0.3, 0.5, 0.7]})
    assert {c: list(a) for c, a in rule.arrivals.items()} == {"c-c": [0.05], "c-a": [0.2, 0.4], "c-d": [0.5, 0.7]}
    assert rule.deadline(["c-a"]) == pytest.approx(0.3)


async def test_the_ps_publishes_its_sync_state_and_keeps_delay_indices_across_a_restart(
        broker: BrokerProcess, tmp_path: Path) -> None:
    devices = ["a", "b", "c"]
    cfg = ps_config(broker, tmp_path, **{
        "training.sync_policy": "sync", "training.staleness_bound": "4", "ps.sync_state_interval_s": "0",
        "ps.checkpoint_every": "1", "ps.adaptive.min_deadline_s": "0.3", "ps.adaptive.max_deadline_s": "1"})
    topics = Topics(cfg.job)
    async with inbox(cfg, (topics.sync_filter(), SyncState)) as watch:
        def states() -> list[SyncState]:
            return watch.of(SyncState)

        async with serving_ps(cfg, devices) as (c, ps):
            await watch.until("the first sync state", lambda: states() and states()[-1].policy == "sync")
            assert (states()[-1].bound, states()[-1].slow, states()[-1].delay_indices) == (4, (), {})
            await c.bus.publish(c.topics.control("ps"), b'{"command": "set-sync-policy", "value": "adaptive",'
                                                        b' "requester": "tester"}')
            await watch.until("the adaptive state", lambda: states()[-1].policy == "adaptive")
            # a and c train on the current model; b's updates are three versions late every round
            # (applied, weighted, while within the adapted bound; discarded beyond it)
            for seq in range(1, 7):
                v = ps.version
                await c.bus.publish(c.topics.grad("c-a", "a"), gradient("a", seq, v))
                await c.bus.publish(c.topics.grad("c-c", "c"), gradient("c", seq, v))
                ack = await c.push(gradient("b", seq, max(0, v - 3)))
                assert ack.status == "accepted" or (ack.status, ack.reason) == ("discarded", "stale")
                await c.until(f"round {v + 1}", lambda v=v: ps.version > v)
            state = await watch.until("b listed as slow", lambda: states()[-1].slow == ("b",) and states()[-1])
            assert state.delay_indices["b"] > 1 >= state.delay_indices["a"] == state.delay_indices["c"]
            assert state.version == ps.version and state.deadline_s > 0 and 1 <= state.bound <= 4
            indices = dict(ps.rule.indices)
            cycles = {c: list(a) for c, a in ps.rule.arrivals.items()}
        # a restarted PS has the indices of its checkpoint, and says so
        again = ParameterServer(ps_config(broker, tmp_path, **{"training.sync_policy": "adaptive",
                                                               "ps.sync_state_interval_s": "0"}))
        async with running(again):
            await until("the restored indices", lambda: again.rule.indices == indices)
            # and the clusters' cycles its round deadline is learned from: with a device gone it waits that long,
            # not ps.adaptive.max_deadline_s (30 s) for every round until it has learned them again
            kept = {c: list(a) for c, a in again.rule.arrivals.items()}
            assert kept.keys() == cycles.keys() and all(kept[c] == cycles[c][:len(kept[c])] for c in kept)
            assert again.rule.deadline() < again.rule.settings.max_deadline_s
            await watch.until("them published", lambda: states()[-1].policy == "adaptive"
                              and states()[-1].delay_indices.get("b") == round(indices["b"], 3))
            # b leaves the plan: its index goes with it (it was kept forever before)
            await watch.publish(topics.plan(), plan_for(["a", "c"], version=9), retain=True)
            await until("b's index dropped", lambda: set(again.rule.indices) == {"a", "c"})


def test_asynchronous_steps_take_the_momentum_their_asynchrony_does_not_add() -> None:
    # four clusters in turn add about 1 - 1/4: 0.9 in all takes 0.6 of the PS's own
    assert compensated_momentum(0.9, 4) == pytest.approx(0.6)
    assert compensated_momentum(0.9, 1) == pytest.approx(0.9)  # one cluster: nothing to compensate
    assert compensated_momentum(0.9, 12) == 0.0 and compensated_momentum(0.0, 3) == 0.0  # never below none
