"""The parameter server's scheduler (pure): judging delays, and what each policy applies, holds and acks."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import candidate as update
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemesh.common.config import AdaptiveConfig
from edgemesh.common.messages import Plan
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay, staleness_weight
from edgemesh.services.parameter_server.scheduler import (
    AsyncScheduler,
    Clock,
    Decision,
    Fleet,
    Step,
    Verdict,
    judge,
    make_scheduler,
    must_wait,
    round_scale,
)

TWO = Fleet(clusters=("c-a", "c-b"), plan_version=1, devices=frozenset({"a", "b"}), bound=4, planned_samples=16)


def acks(decision: Decision) -> list[tuple[str, int, str, str]]:
    return [(a.update.device, a.update.seq, a.status, a.reason) for a in decision.acks]


# --------------------------------------------------------------------------- judging


@pytest.mark.parametrize("version,base,bound,accept,delay,reason", [
    (10, 6, 4, True, 4, ""),
    (10, 5, 4, False, 5, "stale"),
    (10, 10, 0, True, 0, ""),
    (10, 9, 0, False, 1, "stale"),
    (10, 11, 4, False, -1, "future"),
    (0, 1, 4, False, -1, "future"),
    (0, 0, 0, True, 0, ""),
])
def test_judge(version: int, base: int, bound: int, accept: bool, delay: int, reason: str) -> None:
    assert judge(version, base, bound) == Verdict(accept, delay, reason)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(version=st.integers(0, 10**6), back=st.integers(-5, 50), bound=st.integers(0, 20))
def test_judge_applies_exactly_the_updates_within_the_bound(version: int, back: int, bound: int) -> None:
    verdict = judge(version, version - back, bound)
    assert verdict.delay == back
    assert verdict.accept is (0 <= back <= bound)
    assert verdict.reason == ("" if verdict.accept else "future" if back < 0 else "stale")


def test_staleness_weight() -> None:
    assert staleness_weight(0) == 1.0
    assert staleness_weight(1) == 0.5
    assert staleness_weight(3) == 0.25
    assert staleness_weight(-2) == 1.0  # never amplifies
    weights = [staleness_weight(d) for d in range(50)]
    assert all(a > b > 0 for a, b in zip(weights, weights[1:], strict=False))


def test_must_wait_only_beyond_the_bound() -> None:
    clocks = {"c0": 10, "c1": 7, "c2": 12}
    live = ["c0", "c1", "c2"]
    assert must_wait("c2", clocks, live, 4)  # 12 - 7 = 5 > 4
    assert not must_wait("c2", clocks, live, 5)  # exactly the bound is fine
    assert not must_wait("c0", clocks, live, 4)
    assert not must_wait("c1", clocks, live, 0)  # the slowest never waits


def test_must_wait_ignores_clusters_that_are_not_live() -> None:
    clocks = {"c0": 10, "gone": 0}
    assert not must_wait("c0", clocks, ["c0"], 2)  # alone: nobody to wait for
    assert must_wait("c0", clocks, ["c0", "gone"], 2)
    assert not must_wait("c0", {"c0": 10, "c1": 9, "gone": 0}, ["c0", "c1"], 2)


def test_must_wait_counts_a_new_live_cluster_at_zero() -> None:
    assert must_wait("c0", {"c0": 3}, ["c0", "new"], 2)
    assert not must_wait("new", {"c0": 3}, ["c0", "new"], 2)


# --------------------------------------------------------------------------- the policies


def scheduler(policy: str, clock: Clock | None = None, **settings: float) -> tuple:
    clock = clock or Clock()
    rule = AdaptiveDelay(AdaptiveConfig(**settings))  # type: ignore[arg-type]
    return make_scheduler(policy, clock, rule, staleness_weighting=True), clock, rule  # type: ignore[arg-type]


def test_async_applies_each_update_on_arrival_with_its_delay() -> None:
    s, clock, _ = scheduler("async")
    d = s.take([update("a", 1, 0), update("b", 1, 0), update("a", 2, 9)], TWO)
    assert [step.version for step in d.steps] == [1, 2]
    assert acks(d) == [("a", 1, "accepted", ""), ("b", 1, "accepted", ""), ("a", 2, "discarded", "future")]
    assert [a.delay for a in d.acks[:2]] == [0, 1] and not any(a.resync for a in d.acks[:2])
    assert clock.high_water == {"a": (1, 1), "b": (1, 1)} and clock.clocks == {"c-a": 1, "c-b": 1}
    # staleness weighting: the second update, one version late, weighs half
    assert d.steps[1].weights == (0.5,)


@pytest.mark.parametrize("policy", ["async", "ssp"])
def test_under_async_and_ssp_the_bound_counts_rounds_of_the_fleet_so_a_large_fleet_keeps_its_updates(
        policy: str) -> None:
    """Twenty clusters updating in turn: each update is computed while the other nineteen were applied, a delay of 19
    versions and 0 rounds. Bound 1: delays up to (1 + 1) x 20 - 1 = 39 are applied, 40 is stale; one cluster alone
    keeps the bound as it is."""
    names = [f"d{i:02d}" for i in range(20)]
    fleet = Fleet(clusters=tuple(f"c-{n}" for n in names), plan_version=1, devices=frozenset(names), bound=1)
    s, clock, _ = scheduler(policy)
    clock.version = 100
    d = s.take([update("d00", 1, 100 - 19), update("d01", 1, 101 - 39), update("d02", 1, 102 - 40)], fleet)
    assert acks(d) == [("d00", 1, "accepted", ""), ("d01", 1, "accepted", ""), ("d02", 1, "discarded", "stale")]
    assert [a.delay for a in d.acks] == [19, 39, 40]
    assert d.steps[0].weights == (pytest.approx(1 / 20),)  # still damped by its delay in versions
    alone, clock, _ = scheduler(policy)
    clock.version = 10
    one = Fleet(clusters=("c-a",), plan_version=1, devices=frozenset({"a"}), bound=1)
    assert acks(alone.take([update("a", 1, 9), update("a", 2, 9)], one)) == [
        ("a", 1, "accepted", ""), ("a", 2, "discarded", "stale")]


def test_every_policy_acks_an_applied_update_again_as_a_duplicate() -> None:
    for policy in ("sync", "async", "ssp", "adaptive"):
        s, clock, _ = scheduler(policy)
        clock.high_water["a"] = (1, 5)
        d = s.take([update("a", 5, 0), update("a", 3, 0)], TWO)
        assert acks(d) == [("a", 5, "duplicate", ""), ("a", 3, "duplicate", "")] and not d.steps, policy


def test_sync_waits_for_every_cluster_and_takes_one_update_of_each() -> None:
    s, clock, _ = scheduler("sync")
    d = s.take([update("a", 1, 0), update("a", 2, 0)], TWO)
    assert not d.steps and acks(d) == [("a", 2, "discarded", "round_full")]
    assert [i.update.device for i in s.pending()] == ["a"]
    d = s.take([update("b", 1, 0)], TWO)
    assert [(step.version, [i.update.device for i in step.items]) for step in d.steps] == [(1, ["a", "b"])]
    assert all(a.status == "accepted" and a.resync for a in d.acks)
    assert d.steps[0].weights == (0.5, 0.5)
    clock.version = 1
    assert acks(s.take([update("a", 3, 0)], TWO)) == [("a", 3, "discarded", "stale")]  # BSP: no bound


def test_sync_lets_go_of_a_cluster_the_plan_dropped() -> None:
    s, _, _ = scheduler("sync")
    s.take([update("a", 1, 0)], TWO)
    replanned = Fleet(clusters=("c-b",), plan_version=2, bound=4)
    d = s.take([], replanned)  # a's round entry came from plan 1, whose cluster c-a is gone
    assert acks(d) == [("a", 1, "discarded", "replanned")]
    d = s.take([update("b", 1, 0, plan_version=2)], replanned)
    assert [step.version for step in d.steps] == [1]


def test_a_resend_after_its_round_closed_is_a_duplicate_not_a_second_contribution() -> None:
    s, _, _ = scheduler("sync")
    d = s.take([update("a", 1, 0), update("b", 1, 0), update("a", 1, 0)], TWO)
    assert len(d.steps) == 1 and acks(d)[-1] == ("a", 1, "duplicate", "")


def test_ssp_holds_a_cluster_too_far_ahead_until_the_slowest_catches_up() -> None:
    s, clock, _ = scheduler("ssp")
    fleet = Fleet(clusters=("c-a", "c-b"), bound=1)
    d = s.take([update("a", 1, 0), update("a", 2, 1), update("a", 3, 2)], fleet)
    assert [a.update.seq for a in d.acks] == [1, 2] and len(s.pending()) == 1
    clock.version = 2
    d = s.take([update("b", 1, 2)], fleet)  # the held update is judged first: b has not caught up yet
    assert [(a.update.device, a.update.seq) for a in d.acks] == [("b", 1)] and len(s.pending()) == 1
    clock.version = 3
    d = s.take([], fleet)  # the next call (the PS asks again when a step moved the clocks) releases it
    assert [(a.update.device, a.update.seq, a.delay) for a in d.acks] == [("a", 3, 1)]


def test_adaptive_closes_a_round_at_its_deadline_with_whoever_is_in() -> None:
    s, _, rule = scheduler("adaptive", min_deadline_s=0.2, max_deadline_s=0.2)
    d = s.take([update("a", 1, 0)], _at(TWO, 10.0))
    assert not d.steps and s.timeout(_at(TWO, 10.1)) == pytest.approx(0.1)
    d = s.take([], _at(TWO, 10.25))
    assert [len(step.items) for step in d.steps] == [1]
    assert d.steps[0].weights == (0.5,)  # 8 of the 16 samples the plan expects: half a step
    assert rule.indices == {"a": 0.0}


def test_adaptive_discards_beyond_its_bound_and_learns_from_it() -> None:
    s, clock, rule = scheduler("adaptive", alpha=1.0, min_bound=1, slack=1.0)
    rule.indices.update({"a": 0.0, "b": 1.0})
    clock.version = 10
    d = s.take([update("a", 1, 5)], _at(TWO, 0.0))  # delay 5 > D
    assert acks(d) == [("a", 1, "discarded", "stale")]
    assert rule.indices["a"] == 2.0  # counted as "later than the bound", not as 5


def test_switching_policy_judges_an_open_round_again() -> None:
    s, clock, rule = scheduler("sync")
    s.take([update("a", 1, 0)], TWO)
    switched = make_scheduler("async", clock, rule, staleness_weighting=True, carry=s.pending())
    d = switched.take([], TWO)
    assert acks(d) == [("a", 1, "accepted", "")] and [step.version for step in d.steps] == [1]


def _at(fleet: Fleet, now: float) -> Fleet:
    return dataclasses.replace(fleet, now=now)


def test_the_adaptive_deadline_follows_every_cluster_s_cycle_and_does_not_collapse() -> None:
    """A fleet whose clusters each take a fixed cycle from a model to their update (one a straggler). The deadline
    is timed on every update, punctual or late; timed only on the punctual ones, one round cut short left the
    late clusters unmeasured and the deadline shrank round by round to its floor (rounds of one update)."""
    cycles = {"a": 1.0, "b": 1.0, "c": 1.05, "d": 3.0}  # d: a throttled straggler
    clusters = tuple(f"c-{d}" for d in cycles)
    rule = AdaptiveDelay(AdaptiveConfig(min_deadline_s=0.01, max_deadline_s=30.0, slack=1.5))
    scheduler = make_scheduler("adaptive", Clock(), rule, staleness_weighting=True)
    fleet = Fleet(clusters=clusters, plan_version=1, devices=frozenset(cycles), bound=4, planned_samples=32)
    now, seq = 0.0, dict.fromkeys(cycles, 0)
    due = {d: c for d, c in cycles.items()}  # when each device's next update arrives, and on which version
    base = dict.fromkeys(cycles, 0)
    sizes = []
    for _ in range(200):
        device = min(due, key=due.__getitem__)
        timeout = scheduler.timeout(dataclasses.replace(fleet, now=now))
        if timeout is not None and now + timeout < due[device]:  # the deadline comes first
            now += timeout
            decision = scheduler.take([], dataclasses.replace(fleet, now=now))
        else:
            now = due[device]
            seq[device] += 1
            item = update(device, seq[device], base[device])
            item.received = now
            decision = scheduler.take([item], dataclasses.replace(fleet, now=now))
            due[device] = float("inf")  # waits for its ack
        for step in decision.steps:
            sizes.append(len(step.items))
        if decision.steps:
            scheduler.model_published(now)
        for ack in decision.acks:  # acked: it computes its next update on the newest model
            d = ack.update.device
            base[d] = scheduler.clock.version
            due[d] = now + cycles[d]
    late = sizes[len(sizes) // 2:]
    # the deadline waits for the three punctual clusters (1.5 x the 90th percentile of the cycles, clamped)
    assert 1.05 <= rule.deadline(clusters) <= 1.5 * 3.0
    assert sum(late) / len(late) >= 3, sizes  # rounds keep (nearly) every punctual cluster


def test_a_rounds_step_grows_with_the_batches_it_averages_under_round_scaling() -> None:
    """``ps.round_scaling``: four clusters' batches of the plan's mean size make a step four times (``linear``) or
    twice (``sqrt``) one batch's; ``none`` keeps one step of the learning rate."""
    fleet = Fleet(clusters=("a", "b", "c", "d"), planned_samples=4 * 16)
    assert round_scale("linear", 64, fleet) == 4.0
    assert round_scale("sqrt", 64, fleet) == 2.0
    assert round_scale("none", 64, fleet) == 1.0
    assert round_scale("linear", 8, fleet) == 1.0  # never below one batch's step
    assert round_scale("linear", 64, Fleet()) == 1.0  # no plan yet
    # the gradual warm-up: from one batch's step at version 0 to the full scale at the warm-up's end
    assert round_scale("linear", 64, fleet, version=0, warmup=20) == 1.0
    assert round_scale("linear", 64, fleet, version=10, warmup=20) == 2.5
    assert round_scale("linear", 64, fleet, version=20, warmup=20) == 4.0 == round_scale("linear", 64, fleet,
                                                                                          version=500, warmup=20)


def test_a_round_counts_batches_of_the_learning_rates_batch_not_clusters() -> None:
    """Model parallelism splits one iteration's ``training.batch_size`` among its clusters: a round of four
    clusters of 8 samples is one batch of 32, a step of the learning rate (counted by clusters it was four, and
    the demo's mesh job diverged at 0.05); data parallelism's four batches of 32 stay four."""
    mesh = Fleet(clusters=("a", "b", "c", "d"), planned_samples=32, lr_batch=32)
    assert round_scale("linear", 32, mesh) == 1.0
    assert round_scale("linear", 32, dataclasses.replace(mesh, lr_batch=0)) == 4.0  # none given: the mean batch
    data = Fleet(clusters=("a", "b", "c", "d"), planned_samples=4 * 32, lr_batch=32)
    assert round_scale("linear", 128, data) == 4.0
    assert round_scale("linear", 96, data) == 3.0  # a cluster missing from an adaptive round
    plan = Plan(version=1, created=0.0, model_spec="digits-cnn", dataset="digits")
    assert Fleet.of(plan, 2, 0.0, lr_batch=32).lr_batch == Fleet.of(None, 2, 0.0, lr_batch=32).lr_batch == 32
    # under async a cluster's update of 8 samples moves the model a quarter of a batch of 32's step, as one process
    async_ = AsyncScheduler(Clock(), staleness_weighting=False)
    assert async_.weights(Step((update("a", 1, 0),), 1), mesh) == [0.25]
