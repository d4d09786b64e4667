"""Shard 0 of a sharded parameter server runs the policy and every other shard takes its steps
(``parameter_server.shards``): the same updates, in the same order, with the same weights, whatever order they reached
each shard in; shard 0's discards answered by every shard; what a shard never got waited for, then gone
without. Pure rules first, then real shards on a real broker."""

from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import gradient, inbox, make_config, plan_for, running, until

from edgemesh.common import models
from edgemesh.common.bus import Bus
from edgemesh.common.config import AdaptiveConfig, Config, load_config
from edgemesh.common.errors import CheckpointError
from edgemesh.common.messages import GradientUpdate, ShardSteps, StepDiscard, StepPart, StepRecord, UpdateAck
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.shards import Division, ShardedView
from edgemesh.common.topics import Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.compressor.service import Compressor
from edgemesh.services.parameter_server import store
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay
from edgemesh.services.parameter_server.ledger import read_ledger
from edgemesh.services.parameter_server.robust import Aggregation, Combined
from edgemesh.services.parameter_server.scheduler import Ack, Candidate, Clock, Decision, Fleet, Step, make_scheduler
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.parameter_server.shards import FollowerScheduler, Leader
from edgemesh.services.parameter_server.shards.leader import KEPT_STEPS, WHOLE_EVERY_S, kept_step
from edgemesh.services.planner.service import Planner
from edgemesh.services.worker.service import Worker

WAIT_S = 5.0


def update(device: str, seq: int, base: int = 0) -> GradientUpdate:
    return GradientUpdate(device=device, cluster=f"c-{device}", incarnation=1, seq=seq, base_version=base,
                          samples=8, shards=())


def candidate(device: str, seq: int, base: int = 0) -> Candidate:
    return Candidate(update(device, seq, base), [], 0.0)


def steps(*records: tuple[int, list[tuple[str, int, float]]], policy: str = "async",
          discards: tuple[StepDiscard, ...] = ()) -> ShardSteps:
    return ShardSteps(version=max((v for v, _ in records), default=0), policy=policy, discards=discards,  # type: ignore[arg-type]
                      steps=tuple(StepRecord(version=v, parts=tuple(
                          StepPart(device=d, incarnation=1, seq=s, weight=w) for d, s, w in parts))
                          for v, parts in records))


REGISTRIES: dict[int, ServiceMetrics] = {}


def follower(name: str) -> FollowerScheduler:
    metrics = ServiceMetrics(name)
    f = FollowerScheduler(Clock(), WAIT_S, metrics)
    REGISTRIES[id(f)] = metrics
    return f


def counted(f: FollowerScheduler, counter: str) -> float:
    """``f``'s counter ``shard_parts_missed`` or ``shard_versions_skipped``, as Prometheus reads it."""
    metrics = REGISTRIES[id(f)]
    return metrics.value(f"edgemesh_{metrics.service}_{counter}_total")


def at(now: float) -> Fleet:
    return Fleet(now=now)


def take(f: FollowerScheduler, batch: list[Candidate], now: float = 0.0) -> Decision:
    """``f.take``, and the version its steps make (the server sets it once they are applied)."""
    got = f.take(batch, at(now))
    if got.steps:
        f.clock.version = got.steps[-1].version
    return got


# --------------------------------------------------------------------------- the rules


def test_a_follower_takes_shard_0s_steps_in_its_order_with_its_weights_whatever_order_updates_came_in() -> None:
    f = follower("order")
    got = take(f, [candidate("b", 1), candidate("a", 1)], 0)  # here b came first; shard 0 took a first
    assert got.steps == [] and len(f.pending()) == 2  # held until shard 0 names them
    f.follow(steps((1, [("a", 1, 1.0)]), (2, [("b", 1, 0.5)])))
    got = take(f, [], 0)
    assert [(s.version, [i.update.device for i in s.items], s.weights) for s in got.steps] == [
        (1, ["a"], (1.0,)), (2, ["b"], (0.5,))]
    assert [(a.update.device, a.status, a.delay, a.resync) for a in got.acks] == [
        ("a", "accepted", 0, False), ("b", "accepted", 1, False)]  # b computed on 0, applied making 2
    assert f.clock.version == 2 and f.pending() == []
    f.follow(steps((2, [("b", 1, 0.5)]), (3, [("a", 2, 0.25), ("b", 2, 0.25)]), policy="adaptive"))
    got = take(f, [candidate("a", 2, 2), candidate("b", 2, 2)], 0)  # a step already taken is not again
    assert [s.version for s in got.steps] == [3] and all(a.resync for a in got.acks)  # a round policy's


def test_a_follower_answers_shard_0s_discards_and_a_resend_of_one_the_same() -> None:
    f = follower("discards")
    take(f, [candidate("a", 1)], 0)
    f.follow(steps(discards=(StepDiscard(device="a", incarnation=1, seq=1, reason="stale", delay=5),
                             StepDiscard(device="b", incarnation=1, seq=7, reason="nan"))))
    got = take(f, [], 0)
    assert [(a.update.device, a.status, a.reason, a.delay) for a in got.acks] == [("a", "discarded", "stale", 5)]
    got = take(f, [candidate("b", 7), candidate("a", 1)], 0)  # b's part came after shard 0 refused it; a resent
    assert [(a.update.device, a.status, a.reason) for a in got.acks] == [
        ("b", "discarded", "nan"), ("a", "discarded", "stale")]
    assert f.pending() == []


def test_a_step_waits_for_an_update_this_shard_lacks_then_goes_without_it_and_answers_it_late() -> None:
    f = follower("missing")
    take(f, [candidate("a", 1)], 0)
    f.follow(steps((1, [("a", 1, 0.5), ("b", 1, 0.5)]), policy="sync"))
    assert take(f, [], 1).steps == [] and f.timeout(at(1)) == pytest.approx(WAIT_S)
    assert take(f, [], 1 + WAIT_S / 2).steps == []
    got = take(f, [], 1 + WAIT_S)
    assert [(s.version, [i.update.device for i in s.items], s.weights) for s in got.steps] == [(1, ["a"], (0.5,))]
    assert counted(f, "shard_parts_missed") == 1 and f.timeout(at(1 + WAIT_S)) is None
    late = take(f, [candidate("b", 1)], 10)  # shard 0 took it: answered so, not applied here
    assert late.steps == [] and [(a.update.device, a.status) for a in late.acks] == [("b", "accepted")]
    # an update this shard refused itself (its rows were malformed here) is not waited for
    f.answered(Ack(update("c", 1), "discarded", "shape"))
    take(f, [candidate("a", 2, 1)], 20)
    f.follow(steps((2, [("a", 2, 0.5), ("c", 1, 0.5)]), policy="sync"))
    assert [s.version for s in take(f, [], 20).steps] == [2]


def test_shard_0s_latest_message_replaces_the_last_so_an_earlier_runs_retained_steps_are_not_taken() -> None:
    f = follower("rerun")
    f.follow(steps((1, [("old", 1, 1.0)]), (2, [("old", 2, 1.0)])))  # retained by a run of the job before this
    f.follow(steps())  # this run's shard 0, started: nothing stepped yet
    assert take(f, [], WAIT_S * 2).steps == [] and f.clock.version == 0
    f.follow(steps((1, [("a", 1, 1.0)])))
    assert [s.version for s in take(f, [candidate("a", 1)], WAIT_S * 2).steps] == [1]


def test_a_follower_too_far_behind_jumps_to_the_oldest_step_it_can_still_take() -> None:
    f = follower("gap")
    f.follow(steps((5, [("a", 1, 1.0)])))
    got = take(f, [candidate("a", 1)], 0)
    assert [s.version for s in got.steps] == [5] and counted(f, "shard_versions_skipped") == 4


def test_news_add_to_the_steps_and_a_gap_in_them_waits_for_shard_0s_whole_message() -> None:
    f = follower("news")
    f.follow(steps((1, [("a", 1, 1.0)])))  # the retained whole: shard 0 keeps from version 1
    f.follow(replace(steps((2, [("b", 1, 1.0)])), whole=False))
    assert [s.version for s in take(f, [candidate("a", 1), candidate("b", 1)], 0).steps] == [1, 2]
    # this shard was away while 3 and 4 went out: news of 5 alone is held, not jumped to
    f.follow(replace(steps((5, [("a", 4, 1.0)])), whole=False))
    assert take(f, [candidate("a", 2, 2), candidate("a", 3, 3), candidate("a", 4, 4)], 1).steps == []
    assert counted(f, "shard_versions_skipped") == 0
    f.follow(steps(*((v, [("a", v - 1, 1.0)]) for v in range(1, 6))))  # the next whole fills the gap
    assert [s.version for s in take(f, [], 1).steps] == [3, 4, 5] and f.pending() == []


async def test_shard_0_sends_news_and_the_whole_retained_within_whole_every_s(
        mosquitto_broker: BrokerProcess) -> None:
    cfg = make_config(mosquitto_broker, job=f"news-{uuid.uuid4().hex[:6]}")
    topics = Topics(cfg.job)
    woken: list[int] = []
    leader = Leader(topics, lambda: woken.append(1), 2, WAIT_S, ServiceMetrics("lead-news"))
    bus = Bus(cfg.broker, client_id=f"shard-0-{uuid.uuid4().hex[:6]}", metrics=ServiceMetrics("lead-bus"))
    leader.attach(bus)
    async with bus, inbox(cfg, (topics.steps_filter(), ShardSteps), name="follower") as box:
        await until("the connect owing the whole", lambda: leader.owed and leader.whole_owed)
        leader.publish(0, "async")
        assert (await box.next(ShardSteps)) == ShardSteps(version=0, policy="async")  # whole, nothing kept yet
        for v in (1, 2):
            leader.stepped([Step((candidate("a", v),), v, (1.0,))])
            leader.publish(v, "async")
            news = await box.next(ShardSteps)
            assert (news.whole, [r.version for r in news.steps]) == (False, [v])  # the new step alone
        await until("the whole due", lambda: bool(woken) and leader.whole_owed, timeout_s=WHOLE_EVERY_S + WAIT_S)
        leader.publish(2, "async")
        whole = await box.next(ShardSteps)
        assert (whole.whole, [r.version for r in whole.steps]) == (True, [1, 2])
        async with inbox(cfg, (topics.steps_filter(), ShardSteps), name="restarted") as later:
            assert (await later.next(ShardSteps)) == whole  # what a shard that (re)subscribes gets


def test_shard_0_keeps_its_latest_steps_through_a_checkpoint_and_its_log() -> None:
    leader = Leader(Topics("j"), lambda: None, 2, WAIT_S, ServiceMetrics("lead"))
    for v in range(1, KEPT_STEPS + 11):
        leader.stepped([Step((candidate("a", v),), v, (0.5,))])
    assert len(leader.steps) == KEPT_STEPS and leader.steps[0].version == 11
    kept = leader.kept()
    again = Leader(Topics("j"), lambda: None, 2, WAIT_S, ServiceMetrics("lead"))
    replayed = StepRecord(version=KEPT_STEPS + 11, parts=(StepPart(device="b", incarnation=2, seq=3, weight=1.0),))
    again.resume(kept, [replayed])
    assert list(again.steps)[:-1] == list(leader.steps)[1:] and again.steps[-1] == replayed and again.owed
    woken = []
    discarding = Leader(Topics("j"), lambda: woken.append(1), 2, WAIT_S, ServiceMetrics("lead"))
    discarding.answered(Ack(update("a", 1), "accepted"))
    assert not discarding.owed and not woken
    discarding.answered(Ack(update("a", 2), "discarded", "stale", 3))
    assert discarding.owed and woken and list(discarding.discards.values()) == [
        StepDiscard(device="a", incarnation=1, seq=2, reason="stale", delay=3)]


def test_a_follower_combines_with_shard_0s_rule_and_averages_what_its_krum_chose() -> None:
    """A step record names shard 0's rule, which a follower uses whatever its own: ``clip`` as a sum of the scaled
    weights, ``krum`` averaging the parts shard 0 did not exclude (counted in this shard's own items, where one it
    missed is not), ``median`` per coordinate as it is."""
    leader = Leader(Topics("j"), lambda: None, 2, WAIT_S, ServiceMetrics("lead"))
    round_ = Step(tuple(candidate(d, 1) for d in "abcx"), 1, (0.25,) * 4)
    leader.stepped([round_], [Combined([], how=Aggregation("krum", chosen=(0, 1, 2)))])
    (record,) = leader.steps
    assert record.rule == "krum" and [p.excluded for p in record.parts] == [False, False, False, True]
    again = Leader(Topics("j"), lambda: None, 2, WAIT_S, ServiceMetrics("lead"))
    again.resume(leader.kept(), [])
    assert list(again.steps) == [record]
    again.resume({"shard_steps": [[1, [["a", 1, 1, 0.5]], True]]}, [])  # an earlier version's: clipped or not
    assert again.steps[-1].rule == "clip" and not again.steps[-1].parts[0].excluded
    f = follower("rules")
    take(f, [candidate("a", 1), candidate("c", 1), candidate("x", 1)], 0)  # b's part never came here
    f.follow(ShardSteps(version=1, policy="sync", steps=(record,)))
    assert take(f, [], 0).steps == []  # waits for b, then goes without it
    (step,) = take(f, [], WAIT_S).steps
    assert [i.update.device for i in step.items] == ["a", "c", "x"] and (step.rule, step.chosen) == ("krum", (0, 1))
    take(f, [candidate(d, 2, 1) for d in "ac"], WAIT_S)
    f.follow(ShardSteps(version=2, policy="sync", steps=(
        StepRecord(version=2, rule="median", parts=tuple(StepPart(device=d, incarnation=1, seq=2, weight=0.5)
                                                         for d in "ac")),)))
    (step,) = take(f, [], WAIT_S).steps
    assert (step.rule, step.chosen) == ("median", None)


def test_a_round_shard_0_closes_at_its_deadline_without_a_slow_cluster_is_the_round_a_follower_takes() -> None:
    """Under ``adaptive`` shard 0's round closes at its deadline without the slow cluster, not before (the time is the
    fleet's ``now``: an emulated clock), and the slow cluster's update, one version late, goes into the next round,
    damped. A follower that got the updates in another order takes the very same rounds, as the same versions, with
    the same weights."""
    deadline = 1.0
    zero = make_scheduler("adaptive", Clock(), AdaptiveDelay(AdaptiveConfig(max_deadline_s=deadline)),
                          staleness_weighting=True)
    leader = Leader(Topics("j"), lambda: None, 2, WAIT_S, ServiceMetrics("lead-adaptive"))
    fleet = Fleet(clusters=("c-fast", "c-slow"), plan_version=1, devices=frozenset({"fast", "slow"}), bound=4,
                  planned_samples=16)

    def on_shard_0(batch: list[Candidate], now: float) -> list[Step]:
        decision = zero.take(batch, replace(fleet, now=now))
        if decision.steps:
            zero.clock.version = decision.steps[-1].version  # as the server does once they are applied
            leader.stepped(decision.steps)
        return decision.steps

    assert on_shard_0([candidate("fast", 1)], 0.0) == []  # the round waits for the slow cluster ...
    assert zero.timeout(replace(fleet, now=0.0)) == pytest.approx(deadline)
    assert on_shard_0([], deadline / 2) == []
    (closed,) = on_shard_0([], deadline)  # ... until its deadline, then closes without it
    assert (closed.version, [i.update.device for i in closed.items]) == (1, ["fast"])
    assert on_shard_0([candidate("slow", 1, base=0)], deadline + 0.2) == []  # late: the next round
    (next_round,) = on_shard_0([candidate("fast", 2, base=1)], deadline + 0.3)
    assert (next_round.version, [i.update.device for i in next_round.items]) == (2, ["slow", "fast"])
    assert next_round.weights[0] < next_round.weights[1]  # the slow cluster's, one version late, damped

    f = follower("adaptive-rounds")
    take(f, [candidate("slow", 1, base=0), candidate("fast", 2, base=1)], 0.0)  # here the slow one came first
    f.follow(ShardSteps(version=2, policy="adaptive", steps=tuple(leader.steps)))
    assert take(f, [], 0.0).steps == []  # version 1 needs fast's first update
    followed = take(f, [candidate("fast", 1)], 0.0).steps
    assert [(s.version, [i.update.device for i in s.items], s.weights) for s in followed] == [
        (s.version, [i.update.device for i in s.items], s.weights) for s in (closed, next_round)]


def test_shard_0_reads_the_steps_a_checkpoint_of_the_code_before_kept_as_lists(tmp_path: Path) -> None:
    """Shard 0 keeps its latest steps in its checkpoint as step records (maps); the code before kept them as lists
    (and before that without Krum's choice, with whether clip scaled them): such a checkpoint is read all the same,
    its steps published again, and the next checkpoint keeps them as records. A kept step neither can read is a
    ``CheckpointError``, not a server that starts without it."""
    cfg = load_config(env={}, overrides={"job": "kept", "ps.state_dir": str(tmp_path), "ps.shards": "2",
                                         "training.model_spec": "digits-cnn", "ps.eval_every": "0"})
    directory = tmp_path / "shard-0-of-2"

    def loaded() -> Leader:
        ps = ParameterServer(cfg)
        ps._load()
        ps._checkpoint()  # what it holds, as this code keeps it
        ps.recovery.close()
        ps.ledger.close()
        assert isinstance(ps.role, Leader) and ps.role.owed  # published again at the first chance
        return ps.role

    loaded()
    snap = store.read_checkpoint(directory)
    assert snap is not None
    before = [[3, [["a", 1, 7, 0.5, False], ["b", 2, 9, 0.5, True]], "krum"], [4, [["a", 1, 8, 1.0]], True]]
    store.write_checkpoint(directory, replace(snap, settings={**snap.settings, "shard_steps": before}))
    expected = [StepRecord(version=3, rule="krum", parts=(StepPart(device="a", incarnation=1, seq=7, weight=0.5),
                                                           StepPart(device="b", incarnation=2, seq=9, weight=0.5,
                                                                    excluded=True))),
                StepRecord(version=4, rule="clip", parts=(StepPart(device="a", incarnation=1, seq=8, weight=1.0),))]
    assert list(loaded().steps) == expected
    kept = store.read_checkpoint(directory)
    assert kept is not None and kept.settings["shard_steps"][0] == {
        "version": 3, "rule": "krum", "parts": [
            {"device": "a", "incarnation": 1, "seq": 7, "weight": 0.5, "excluded": False},
            {"device": "b", "incarnation": 2, "seq": 9, "weight": 0.5, "excluded": True}]}
    assert list(loaded().steps) == expected  # and read back as records
    with pytest.raises(CheckpointError, match="malformed"):
        kept_step({"version": 5, "parts": [{"device": "a"}]})


# --------------------------------------------------------------------------- shards on a broker


def shard_config(broker: BrokerProcess, tmp_path: Path, policy: str, **extra: object) -> Config:
    return make_config(broker, job=f"steps-{uuid.uuid4().hex[:6]}", **{
        "ps.state_dir": tmp_path / "ps", "ps.shards": 2, "training.model_spec": "digits-cnn",
        "training.sync_policy": policy, "ps.broadcast": "snapshot", "ps.snapshot_dtype": "float32",
        "ps.eval_every": 0, "training.seed": 5, **extra})


def shards_of(cfg: Config) -> list[ParameterServer]:
    return [ParameterServer(replace(cfg, ps=replace(cfg.ps, shard=i))) for i in range(cfg.ps.shards)]


def ledgers(cfg: Config) -> list[list[tuple[int, str, int, int]]]:
    return [[tuple(e) for e in read_ledger(Path(cfg.ps.state_dir) / f"shard-{i}-of-2" / "ledger.log")]  # type: ignore[misc]
            for i in range(2)]


async def test_async_shards_apply_updates_that_came_in_opposite_orders_in_shard_0s_order(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """Two updates reach shard 0 as a, b and shard 1 as b, a: both shards make version 1 of a and version 2 of
    b (b one version late, its weight damped so), and the model they make is the one one server makes of a, b."""
    # the plain mean: under clip shard 0 would wait for shard 1's part of a's norm, which is what this test orders
    cfg = shard_config(mosquitto_broker, tmp_path, "async", **{"training.staleness_bound": 4, "ps.aggregation": "mean"})
    servers = shards_of(cfg)
    shard = [Topics(cfg.job, i) for i in range(2)]
    async with running(*servers), inbox(cfg, *((t.ack_filter("+"), UpdateAck) for t in shard)) as box:
        await box.publish(Topics(cfg.job).plan(), plan_for(["a", "b"]), retain=True)
        await until("both shards' plan", lambda: all(s.plan is not None for s in servers))
        spans = [[(s.param, s.start, s.stop) for s in ps.division.spans] for ps in servers]  # type: ignore[union-attr]
        a = [gradient("a", 1, 0, scale=0.01, spans=spans[i]) for i in range(2)]
        b = [gradient("b", 1, 0, scale=-0.03, spans=spans[i]) for i in range(2)]
        await box.publish(shard[1].grad("c-b", "b"), b[1])
        await until("shard 1 holding b", lambda: len(servers[1].scheduler.pending()) == 1)
        await box.publish(shard[0].grad("c-a", "a"), a[0])
        await until("shard 0 at version 1", lambda: servers[0].version == 1)
        await box.publish(shard[0].grad("c-b", "b"), b[0])
        await box.publish(shard[1].grad("c-a", "a"), a[1])
        await box.until("every shard's acks", lambda: len(box.of(UpdateAck)) == 4)
        await until("both shards at version 2", lambda: [s.version for s in servers] == [2, 2])
        acks = {(m.shard, u.device): (u.status, u.delay) for m, u in box.received if isinstance(u, UpdateAck)}
        assert acks == {(0, "a"): ("accepted", 0), (1, "a"): ("accepted", 0), (0, "b"): ("accepted", 1),
                        (1, "b"): ("accepted", 1)}
        view = ShardedView(2)
        view.know({k: v.shape for k, v in models.get_params(models.build_model("digits-cnn", seed=5)).items()})
        two = view.assemble([s.state.params for s in servers if s.state is not None])
    assert ledgers(cfg)[0] == ledgers(cfg)[1] == [(1, "a", 1, 1), (2, "b", 1, 1)]
    one_cfg = replace(cfg, ps=replace(cfg.ps, shards=1, state_dir=str(tmp_path / "one")))
    one = ParameterServer(one_cfg)
    async with running(one), inbox(one_cfg, (Topics(cfg.job).ack_filter("+"), UpdateAck)) as box:
        await box.publish(Topics(cfg.job).plan(), plan_for(["a", "b"]), retain=True)
        await until("the plan", lambda: one.plan is not None)
        for u in (gradient("a", 1, 0, scale=0.01), gradient("b", 1, 0, scale=-0.03)):
            await box.publish(Topics(cfg.job).grad(u.cluster, u.device), u)
            await box.next(UpdateAck, lambda m, d=u.device: m.device == d)  # type: ignore[misc]
        assert one.state is not None
        for name, value in one.state.params.items():
            np.testing.assert_allclose(two[name], value, rtol=0, atol=1e-7, err_msg=name)


async def test_adaptive_shards_train_and_every_shard_takes_the_rounds_shard_0_closes(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """Planner, compressor, two shards under ``adaptive`` and two workers, one of them an emulated Pi 3: both
    workers finish, and both shards applied the same updates as the same versions (their ledgers are one), whichever
    rounds shard 0's deadline closed and whichever of the Pi's late updates it discarded. That the deadline closes a
    round without a slow cluster, and that the others take that round, is tested on an emulated clock
    (``test_a_round_shard_0_closes_at_its_deadline_without_a_slow_cluster_is_the_round_a_follower_takes``)."""
    steps_wanted = 12
    cfg = shard_config(mosquitto_broker, tmp_path, "adaptive", **{
        "planner.min_devices": 2, "compressor.mode": "static", "compressor.default_codec": "none",
        "worker.max_steps": steps_wanted, "worker.ack_timeout_s": 5, "ps.adaptive.max_deadline_s": 0.15,
        "planner.batching": "uniform"})
    servers = shards_of(cfg)
    # the Pi's steps stretched from a host said to do 1600 GFLOP/s, at the same batch as the other
    workers = [Worker(replace(cfg, worker=replace(cfg.worker, device=f"w{i}", emulate="pi3" if i else "",
                                                  emulation_host_gflops=1600.0 if i else 0.0,
                                                  state_dir=str(tmp_path / f"w{i}")))) for i in range(2)]
    async with running(Planner(cfg), Compressor(cfg), *servers, *workers):
        await until("both workers' steps", lambda: all(w.stop.is_set() for w in workers), 120)
        await until("shard 1 caught up", lambda: servers[1].version == servers[0].version)
    zero, one = ledgers(cfg)
    # every accepted update, as the same version (the Pi's late ones may be discarded as stale: fewer than 2 x 12)
    assert zero == one and len(zero) >= steps_wanted, (zero, one)
    assert servers[0].version == max(v for v, *_ in zero) and servers[0].policy == "adaptive"


async def test_clip_on_shards_clips_each_update_by_the_norm_of_the_whole_of_it(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """Under ``clip`` shard 1 tells shard 0 its part of every update's norm, and shard 0 clips by the whole norm:
    an update that is huge only in shard 1's rows is clipped on both shards, by the same factor, and the model
    is the one one server makes of the same updates (each shard judging alone would not clip it at all)."""
    cfg = shard_config(mosquitto_broker, tmp_path, "async", **{"ps.aggregation": "clip", "ps.clip_factor": 3.0})
    servers = shards_of(cfg)
    shard = [Topics(cfg.job, i) for i in range(2)]
    scales = {"a": (0.01, 0.01), "b": (0.02, 0.02), "c": (0.01, 5.0)}  # per shard's rows; c huge in shard 1's
    async with running(*servers), inbox(cfg, *((t.ack_filter("+"), UpdateAck) for t in shard)) as box:
        await box.publish(Topics(cfg.job).plan(), plan_for(list(scales)), retain=True)
        await until("both shards' plan", lambda: all(s.plan is not None for s in servers))
        spans = [[(s.param, s.start, s.stop) for s in ps.division.spans] for ps in servers]  # type: ignore[union-attr]
        for n, (device, (low, high)) in enumerate(scales.items()):
            for i, scale in enumerate((low, high)):
                await box.publish(shard[i].grad(f"c-{device}", device), gradient(device, 1, n, scale=scale,
                                                                                 spans=spans[i]))
            await until(f"version {n + 1} on both shards", lambda v=n + 1: [s.version for s in servers] == [v, v])  # type: ignore[misc]
        assert servers[0].metrics.value("edgemesh_ps_robust_clipped_total") == 1
        assert servers[0].metrics.value("edgemesh_ps_shard_norms_missing_total") == 0
        view = ShardedView(2)
        view.know({k: v.shape for k, v in models.get_params(models.build_model("digits-cnn", seed=5)).items()})
        two = view.assemble([s.state.params for s in servers if s.state is not None])
    one_cfg = replace(cfg, ps=replace(cfg.ps, shards=1, state_dir=str(tmp_path / "one")))
    one = ParameterServer(one_cfg)
    async with running(one), inbox(one_cfg, (Topics(cfg.job).ack_filter("+"), UpdateAck)) as box:
        await box.publish(Topics(cfg.job).plan(), plan_for(list(scales)), retain=True)
        await until("the plan", lambda: one.plan is not None)
        for n, (device, (low, high)) in enumerate(scales.items()):
            parts = [gradient(device, 1, n, scale=s, spans=spans[i]) for i, s in enumerate((low, high))]
            await box.publish(Topics(cfg.job).grad(f"c-{device}", device),
                              replace(parts[0], shards=parts[0].shards + parts[1].shards))
            await box.next(UpdateAck, lambda m, d=device: m.device == d)  # type: ignore[misc]
        assert one.metrics.value("edgemesh_ps_robust_clipped_total") == 1 and one.state is not None
        for name, value in one.state.params.items():
            np.testing.assert_allclose(two[name], value, rtol=0, atol=1e-6, err_msg=name)


KRUM_ROUND = {"a": (0.010, 0.010), "b": (0.011, 0.011), "c": (0.016, 0.016), "x": (0.0105, 1.0)}
"""Each device's gradient value in shard 0's rows and in shard 1's: ``x`` is the most central in shard 0's rows and
far off in shard 1's; ``c`` is the farthest in shard 0's."""


def assembled(servers: list[ParameterServer]) -> dict[str, np.ndarray]:
    view = ShardedView(2)
    view.know({k: v.shape for k, v in models.get_params(models.build_model("digits-cnn", seed=5)).items()})
    return view.assemble([s.state.params for s in servers if s.state is not None])


async def assert_one_servers_krum(cfg: Config, tmp_path: Path, spans: list[list[tuple[str, int, int]]],
                                  two: dict[str, np.ndarray]) -> None:
    """``two`` is the model one server makes of ``KRUM_ROUND``'s whole updates in one round."""
    one_cfg = replace(cfg, ps=replace(cfg.ps, shards=1, state_dir=str(tmp_path / "one")))
    one = ParameterServer(one_cfg)
    async with running(one), inbox(one_cfg, (Topics(cfg.job).ack_filter("+"), UpdateAck)) as box:
        await box.publish(Topics(cfg.job).plan(), plan_for(list(KRUM_ROUND)), retain=True)
        await until("the plan", lambda: one.plan is not None)
        for device, (low, high) in KRUM_ROUND.items():
            parts = [gradient(device, 1, 0, scale=s, spans=spans[i]) for i, s in enumerate((low, high))]
            await box.publish(Topics(cfg.job).grad(f"c-{device}", device),
                              replace(parts[0], shards=parts[0].shards + parts[1].shards))
        await box.until("the round's acks", lambda: len(box.of(UpdateAck)) == 4)
        assert one.state is not None and one.version == 1
        assert one.metrics.value("edgemesh_ps_robust_excluded_total", rule="krum") == 1
        for name, value in one.state.params.items():
            np.testing.assert_allclose(two[name], value, rtol=0, atol=1e-6, err_msg=name)


async def test_krum_on_shards_scores_updates_by_their_distances_over_the_whole_model(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """Under ``krum`` shard 1 tells shard 0 its part of the distance between every two updates it holds, and shard
    0 scores them over the whole model: an update that looks the most central in shard 0's rows but is far off in
    shard 1's is the one left out, on both shards, and the model is the one one server makes of the same round
    (shard 0 judging its rows alone would leave out ``c`` instead, and shard 1 ``x``)."""
    cfg = shard_config(mosquitto_broker, tmp_path, "sync", **{"ps.aggregation": "krum", "ps.krum_f": 1})
    servers = shards_of(cfg)
    shard = [Topics(cfg.job, i) for i in range(2)]
    async with running(*servers), inbox(cfg, *((t.ack_filter("+"), UpdateAck) for t in shard)) as box:
        await box.publish(Topics(cfg.job).plan(), plan_for(list(KRUM_ROUND)), retain=True)
        await until("both shards' plan", lambda: all(s.plan is not None for s in servers))
        spans = [[(s.param, s.start, s.stop) for s in ps.division.spans] for ps in servers]  # type: ignore[union-attr]
        for device, (low, high) in KRUM_ROUND.items():
            for i, scale in enumerate((low, high)):
                await box.publish(shard[i].grad(f"c-{device}", device), gradient(device, 1, 0, scale=scale,
                                                                                 spans=spans[i]))
        await until("version 1 on both shards", lambda: [s.version for s in servers] == [1, 1])
        await box.until("every shard's acks", lambda: len(box.of(UpdateAck)) == 8)
        assert {u.status for u in box.of(UpdateAck)} == {"accepted"}
        for ps in servers:
            assert ps.metrics.value("edgemesh_ps_robust_excluded_total", rule="krum") == 1
        assert servers[0].metrics.value("edgemesh_ps_shard_norms_missing_total") == 0
        two = assembled(servers)
    assert ledgers(cfg)[0] == ledgers(cfg)[1]
    await assert_one_servers_krum(cfg, tmp_path, spans, two)


async def test_a_shard_tells_shard_0_again_what_it_measured_when_an_update_is_resent(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """Shard 1 takes a round's updates while shard 0 is down, and tells a shard 0 that is not there their
    distances. Their senders, with no ack, send them again: shard 1 tells shard 0 again, so the shard 0 that is
    now up scores the round over the whole model without waiting (``ps.shard_wait_s``) and without a part
    missing, and the model is one server's."""
    cfg = shard_config(mosquitto_broker, tmp_path, "sync", **{"ps.aggregation": "krum", "ps.krum_f": 1,
                                                              "ps.shard_wait_s": 10})
    servers = shards_of(cfg)
    shard = [Topics(cfg.job, i) for i in range(2)]
    updates = {}
    async with running(servers[1]), inbox(cfg, *((t.ack_filter("+"), UpdateAck) for t in shard)) as box:
        await box.publish(Topics(cfg.job).plan(), plan_for(list(KRUM_ROUND)), retain=True)
        await until("shard 1's plan", lambda: servers[1].plan is not None)
        shapes = {k: v.shape for k, v in models.get_params(models.build_model("digits-cnn", seed=5)).items()}
        spans = [[(s.param, s.start, s.stop) for s in Division.of(shapes, i, 2).spans] for i in range(2)]
        updates = {(device, i): gradient(device, 1, 0, scale=scale, spans=spans[i])
                   for device, scales in KRUM_ROUND.items() for i, scale in enumerate(scales)}
        for device in KRUM_ROUND:
            await box.publish(shard[1].grad(f"c-{device}", device), updates[device, 1])
        await until("shard 1 holding the round", lambda: len(servers[1].scheduler.pending()) == 4)
        async with running(servers[0]):
            await until("shard 0's plan", lambda: servers[0].plan is not None)
            for device in KRUM_ROUND:
                await box.publish(shard[0].grad(f"c-{device}", device), updates[device, 0])
                await box.publish(shard[1].grad(f"c-{device}", device), updates[device, 1])  # the resend
            await until("version 1 on both shards", lambda: [s.version for s in servers] == [1, 1])
            assert servers[0].metrics.value("edgemesh_ps_shard_norms_missing_total") == 0
            await until("shard 1 answering every resend", lambda: servers[1].metrics.value(
                "edgemesh_ps_rejected_total", reason="queued") == 4)
            two = assembled(servers)
    await assert_one_servers_krum(cfg, tmp_path, spans, two)
