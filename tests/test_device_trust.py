"""No device decides alone: what the parameter server refuses from one device (docs/synchronization.md#what-the-
parameter-server-refuses). A local evaluation report claiming more samples than the device's validation share, or
from a device outside the plan, is refused and counted; one device's report cannot end a job at its target, a quorum
of them does; an update of 1e30 never reaches the model, under every rule (the norm filter leaves it out, or the
model refuses the step), and training goes on with the honest updates. Services on a real broker, the rules pure."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import WAIT_S, gradient, inbox, make_config, plan_for, running, serving_ps, until

from edgemesh.common.config import Config, ParameterServerConfig, load_config
from edgemesh.common.errors import WireError
from edgemesh.common.jobs import parse_job, render_job
from edgemesh.common.messages import (
    DeviceStatus,
    GradientUpdate,
    JobState,
    LocalEvaluation,
    ModelSnapshot,
    Plan,
    PlanCluster,
    PlanDevice,
    ShardSteps,
    UpdateAck,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics, all_job_states_filter
from edgemesh.common.vocabulary import AGGREGATION_RULES, AggregationRule
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.demo import DIGITS_MODEL, DIGITS_NORMALIZATION
from edgemesh.operator.job import submission_of
from edgemesh.services.host import JobHost
from edgemesh.services.parameter_server import jobs as ps_jobs
from edgemesh.services.parameter_server.evaluation import QUORUM_MIN_DEVICES, Evaluator, Quorum, quorum_of
from edgemesh.services.parameter_server.jobs import REACHED, JobBoard
from edgemesh.services.parameter_server.optimizer import MAX_GROWTH, ModelState, ShardGrad
from edgemesh.services.parameter_server.robust import CLIP_WINDOW, Aggregation, Aggregator, Combined
from edgemesh.services.parameter_server.scheduler import Candidate, Clock, Fleet, Step, UpdateId
from edgemesh.services.parameter_server.service import ParameterServer
from edgemesh.services.parameter_server.shards import FollowerScheduler, Leader

HUGE = 1e30
"""The forged update's every value: finite, far beyond any gradient."""
SHARE = 100
"""Samples of each device's validation share in the evaluation tests."""
TARGET = 0.9


# --------------------------------------------------------------------------- evaluation reports and the stop rule


def local_job(name: str) -> Any:
    """A digits job evaluated on the devices' own validation shares, its target ``TARGET``."""
    spec = parse_job(render_job({"job": {"name": name, "target_accuracy": TARGET, "max_versions": 100000},
                                 "model": DIGITS_MODEL, "data": {"format": "digits", **DIGITS_NORMALIZATION},
                                 "evaluation": {"local_share": 0.2, "every": 1}}))
    return dataclasses.replace(submission_of(spec, search_path=[]), submitted_at=time.time())


@contextlib.asynccontextmanager
async def running_job(broker: BrokerProcess, tmp_path: Path, name: str) -> AsyncIterator[tuple[Any, ParameterServer]]:
    """The PS's host and its job board serving ``name`` (a ``local_job``) to devices a, b, c, each online with a
    validation share of ``SHARE`` samples; an inbox of the job's states."""
    config = make_config(broker, job="", **{"ps.state_dir": tmp_path})
    topics = Topics(name)
    host = JobHost("ps", config, ps_jobs.for_job)
    task = asyncio.create_task(host.run(extra=JobBoard(host).attach))
    try:
        async with inbox(dataclasses.replace(config, job=name), (all_job_states_filter(), JobState)) as box:
            await box.publish(topics.job_file(), local_job(name), retain=True)
            await box.next(JobState, lambda s: s.name == name and s.state == "running")
            ps = await box.until("the PS serving the job", lambda: isinstance(host.service, ParameterServer)
                                 and host.service.state is not None and host.service)
            await box.publish(topics.plan(), plan_for(["a", "b", "c"]), retain=True)
            for device in "abc":
                await box.publish(topics.status(device), DeviceStatus(
                    device=device, state="online", incarnation=1, validation_samples=SHARE), retain=True)
            await box.until("the plan and every share", lambda: ps.plan is not None and len(ps.evaluator.shares) == 3)
            yield box, ps
    finally:
        host.stop.set()
        await asyncio.wait_for(task, 30)


def report(device: str, correct: int, samples: int = SHARE) -> LocalEvaluation:
    return LocalEvaluation(device=device, version=0, samples=samples, correct=correct, loss_sum=0.1 * samples)


async def test_a_fake_evaluation_report_does_not_end_a_job_and_is_counted_as_rejected(
        mosquitto_broker: BrokerProcess, tmp_path: Path) -> None:
    """One device's report of 10^12 samples, all correct, once finished a job at "1.0000 >= 0.99" (its accuracy was
    0.55): it claims more than the 100 samples its status announced, and is refused; so is a report from a device
    outside the plan. The job's accuracy is the honest reports' alone, and it runs on."""
    async with running_job(mosquitto_broker, tmp_path, "fake") as (box, ps):
        topics = Topics("fake")
        await box.publish(topics.evaluation("a"), report("a", 10**12, 10**12))
        await box.publish(topics.evaluation("ghost"), report("ghost", SHARE))

        def rejected(reason: str) -> float:
            return ps.metrics.value("edgemesh_ps_rejected_total", route="evaluation", reason=reason)

        await until("both reports refused", lambda: rejected("samples") == 1 and rejected("unknown_device") == 1)
        await box.publish(topics.evaluation("a"), report("a", 55))
        state = await box.next(JobState, lambda s: s.name == "fake" and s.accuracy is not None)
    assert (state.state, state.accuracy) == ("running", 0.55)  # the fake counted nowhere
    assert ps.evaluator.last_accuracy == 0.55


async def test_one_devices_report_cannot_end_a_job_alone_a_quorum_of_them_does(mosquitto_broker: BrokerProcess,
                                                                                tmp_path: Path) -> None:
    """Of three evaluating devices two must agree that the target is reached: a's perfect report alone makes the
    job's accuracy 1.0 and the job runs on (the stop rule ran on that state before it was published); b's agreeing
    report ends it, and the reason says who agreed."""
    async with running_job(mosquitto_broker, tmp_path, "quorum") as (box, ps):
        topics = Topics("quorum")
        await box.publish(topics.evaluation("a"), report("a", SHARE))
        alone = await box.next(JobState, lambda s: s.name == "quorum" and s.accuracy == 1.0)
        assert alone.state == "running"
        quorum = ps.evaluator.quorum(TARGET)
        assert quorum is not None and (quorum.agreeing, quorum.needed, quorum.met) == (1, 2, False)
        await box.publish(topics.evaluation("c"), report("c", 80))  # below the target: a and c do not agree
        await box.next(JobState, lambda s: s.name == "quorum" and s.accuracy == 0.9 and s.state == "running")
        await box.publish(topics.evaluation("b"), report("b", 95))
        ended = await box.next(JobState, lambda s: s.name == "quorum" and s.ended)
    assert ended.state == "finished"
    assert ended.reason.startswith(REACHED) and "2 of 3 devices agree, 2 needed" in ended.reason, ended.reason


def test_the_quorum_is_a_majority_of_the_devices_that_evaluate_and_never_one() -> None:
    assert [quorum_of(n) for n in range(1, 7)] == [2, 2, 2, 3, 3, 4]
    assert QUORUM_MIN_DEVICES == 2
    job = parse_job(render_job({"job": {"name": "unit"}, "model": DIGITS_MODEL, "data": {"format": "digits"},
                                "evaluation": {"local_share": 0.2}}))
    evaluator = Evaluator(load_config(env={}, overrides={"job": "unit"}), job)
    # a model-parallel cluster's members hold slices of the model and do not evaluate: d and e count as one absent
    plan = Plan(version=1, created=0.0, model_spec="digits-cnn", dataset="digits",
                devices=tuple(PlanDevice(device=d, cluster=c, shard_index=0, shard_count=1, batch_size=8)
                              for d, c in (("a", "c-a"), ("b", "c-b"), ("d", "m"), ("e", "m"))),
                clusters=(PlanCluster(cluster="c-a", members=("a",)), PlanCluster(cluster="c-b", members=("b",)),
                          PlanCluster(cluster="m", members=("d", "e"))))
    evaluator.replanned(plan)
    for device in "ab":
        evaluator.know(DeviceStatus(device=device, state="online", incarnation=1, validation_samples=10))
    evaluator.know(DeviceStatus(device="a", state="offline", incarnation=1))  # a will: the share stays known
    evaluator.combine(report("a", 10, 10), version=0)
    assert evaluator.quorum(0.9) == Quorum(agreeing=1, needed=2, devices=2)
    evaluator.combine(report("b", 9, 10), version=0)
    quorum = evaluator.quorum(0.9)
    assert quorum is not None and quorum.met
    with pytest.raises(WireError) as future:
        evaluator.combine(dataclasses.replace(report("b", 9, 10), version=3), version=2)
    assert future.value.reason == "future"
    with pytest.raises(WireError) as unannounced:
        evaluator.combine(report("d", 1, 1), version=0)  # d never announced a validation share
    assert unannounced.value.reason == "samples"
    with pytest.raises(ValueError, match="validation_samples"):
        DeviceStatus(device="a", state="online", validation_samples=-1).validate()
    with pytest.raises(ValueError, match="loss_sum"):
        LocalEvaluation(device="a", version=0, samples=1, correct=1, loss_sum=-5.0).validate()


# --------------------------------------------------------------------------- an update of 1e30


def ps_config(broker: BrokerProcess, state_dir: Path, **settings: object) -> Config:
    """A PS publishing every version's exact model (float32 snapshots), no evaluation."""
    return make_config(broker, job="trust", **{"ps.state_dir": state_dir, "ps.eval_every": 0,
                                               "ps.broadcast": "snapshot", "ps.snapshot_dtype": "float32",
                                               **settings})


def weights(snap: ModelSnapshot) -> dict[str, np.ndarray]:
    return {name: t.to_numpy() for name, t in snap.tensors.items()}


def model_norm(params: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in params.values())))


async def test_an_update_of_1e30_under_mean_is_refused_by_norm_and_training_goes_on(mosquitto_broker: BrokerProcess,
                                                                                   tmp_path: Path) -> None:
    """Under ``mean`` (async), once ``ps.norm_warmup`` honest updates are applied, a device's finite update of 1e30
    (once it took the model to 2.5e29 and the job's accuracy to 0.086) is left out of its step, counted with reason
    ``norm``: the model is exactly what it was. The next honest update moves it; a NaN update is still ``nan``."""
    cfg = ps_config(mosquitto_broker, tmp_path, **{"ps.aggregation": "mean", "training.sync_policy": "async"})
    assert cfg.ps.norm_warmup == 8 and cfg.ps.norm_factor == 10.0
    async with serving_ps(cfg, ["a", "b", "c"]) as (c, ps):
        version = (await c.version_at_least(0)).version
        for seq in range(1, 5):  # the warm-up: eight honest updates applied
            for device in "ab":
                ack = await c.push(gradient(device, seq, version))
                assert ack.status == "accepted"
                version = ack.version
        before = weights(await c.version_at_least(version))
        ack = await c.push(gradient("c", 1, version, scale=HUGE))
        assert ack.status == "accepted"  # taken into a step, and left out of it, as Krum leaves an update out
        after = weights(await c.version_at_least(ack.version))
        assert ps.metrics.value("edgemesh_ps_robust_refused_total", reason="norm") == 1
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        ack = await c.push(gradient("a", 5, ack.version))
        moved = weights(await c.version_at_least(ack.version))
        assert any(not np.array_equal(moved[k], after[k]) for k in moved)  # training goes on
        assert all(np.isfinite(v).all() for v in moved.values())
        assert model_norm(moved) == pytest.approx(model_norm(before), rel=0.1)  # one honest step from it
        nan = await c.push(gradient("b", 5, ack.version, scale=float("nan")))
        assert (nan.status, nan.reason) == ("discarded", "nan")
    assert ps.metrics.value("edgemesh_ps_steps_refused_total") == 0  # the filter caught it before the model


@pytest.mark.parametrize("rule", ["mean", "clip"])
async def test_a_first_update_of_1e30_is_a_step_the_model_refuses(mosquitto_broker: BrokerProcess, tmp_path: Path,
                                                                   rule: str) -> None:
    """Before any norm is known (the norm filter waits, ``clip``'s reference is the round's own norms) a sync round of
    an honest update and one of 1e30 would throw the model: the model refuses the step, counted with reason
    ``growth``, and stays as it was, at the next version; the next round trains."""
    cfg = ps_config(mosquitto_broker, tmp_path, **{"ps.aggregation": rule, "training.sync_policy": "sync"})
    async with serving_ps(cfg, ["a", "b"]) as (c, ps):
        start = weights(await c.version_at_least(0))
        await c.bus.publish(c.topics.grad("c-a", "a"), gradient("a", 1, 0))
        await c.bus.publish(c.topics.grad("c-b", "b"), gradient("b", 1, 0, scale=HUGE))
        assert [(await c.ack_for(d, 1)).status for d in "ab"] == ["accepted"] * 2
        refused = weights(await c.version_at_least(1))
        assert ps.metrics.value("edgemesh_ps_steps_refused_total", reason="growth") == 1
        for name in start:
            np.testing.assert_array_equal(refused[name], start[name], err_msg=name)
        for device in "ab":
            await c.bus.publish(c.topics.grad(f"c-{device}", device), gradient(device, 2, 1))
        assert [(await c.ack_for(d, 2)).status for d in "ab"] == ["accepted"] * 2
        trained = weights(await c.version_at_least(2))
    assert any(not np.array_equal(trained[k], start[k]) for k in start)
    assert model_norm(trained) == pytest.approx(model_norm(start), rel=0.1)


# --------------------------------------------------------------------------- the rules and the step, pure

SHAPES = {"w": (16, 8), "b": (16,)}


def contribution(rng: np.random.Generator, scale: float, weight: float = 1.0) -> tuple[float, list[ShardGrad]]:
    return weight, [ShardGrad(name, 0, shape[0], (rng.normal(0, 1, shape) * scale).astype(np.float32))
                    for name, shape in SHAPES.items()]


@contextlib.contextmanager
def no_warnings() -> Iterator[None]:
    """Every warning (numpy's overflow among them) fails the test: nothing passes silently as a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


@pytest.mark.parametrize("rule", AGGREGATION_RULES)
def test_an_update_of_1e30_reaches_the_model_under_no_rule_alone_or_in_a_round(rule: AggregationRule) -> None:
    """Under every rule, in a step of one update (async, ssp) or a round of 2 or 3, before the norm filter has a
    reference and after: the 1e30 is left out (counted ``norm``) or the step refused (counted ``growth``); the model
    stays finite and near its norm, and no numpy warning is raised."""
    rng = np.random.default_rng(3)
    initial = {name: rng.normal(0, 0.1, shape).astype(np.float32) for name, shape in SHAPES.items()}
    for warm in (0, 10):
        for n in (1, 2, 3):
            state = ModelState(initial)
            aggregator = Aggregator(ParameterServerConfig(aggregation=rule), ServiceMetrics("ps"))
            with no_warnings():
                for _ in range(warm):
                    state.apply(state.sum(aggregator.combine([contribution(rng, 0.01)]).contributions), lr=0.05,
                                momentum=0.9)
                norm_before = model_norm(state.params)
                step = [*(contribution(rng, 0.01, 1 / n) for _ in range(n - 1)), contribution(rng, HUGE, 1 / n)]
                combined = aggregator.combine(step)
                refused = state.apply(state.sum(combined.contributions), lr=0.05, momentum=0.9)
            if warm and rule != "clip":
                expected = "norm"  # the filter has a reference: left out
            elif rule == "clip" and (warm or n == 3) or (n == 3 and rule in ("median", "krum")):
                expected = "rule"  # clipped to a reference of other norms; outvoted by the median, Krum of three
            else:
                expected = "growth"  # nothing bounds it before the model: the step is refused
            outcome = "growth" if refused is not None else "norm" if combined.refused else "rule"
            assert outcome == expected, (rule, warm, n)
            assert aggregator.m_refused.labels(reason="norm")._value.get() == combined.refused
            if expected == "rule" and rule == "clip":
                assert combined.clipped == 1
            assert all(np.isfinite(v).all() for v in state.params.values())
            assert model_norm(state.params) == pytest.approx(norm_before, rel=0.05), (rule, warm, n)
            if refused is not None:
                assert refused.reason == "growth"
                aggregator.step_refused(1, refused, combined)
                assert aggregator.m_steps_refused.labels(reason="growth")._value.get() == 1


def test_a_refused_step_leaves_weights_and_momentum_exactly_as_they_were() -> None:
    """A step that grows a tensor past ``MAX_GROWTH`` times its norm, and one whose sum overflows float32 (two
    updates of 3e38: infinities, no warning), are refused and undone; the honest step after them is the step it
    would have been without them."""
    rng = np.random.default_rng(5)
    initial = {name: rng.normal(0, 1, shape).astype(np.float32) for name, shape in SHAPES.items()}
    state, clean = ModelState(initial), ModelState(initial)
    honest = [contribution(rng, 0.1)]
    for s in (state, clean):
        assert s.apply(s.sum(honest), lr=0.1, momentum=0.9) is None  # momentum to undo
    with no_warnings():
        grow = state.apply(state.sum([contribution(rng, 0.0)[:1] + ([ShardGrad("w", 0, 16, np.full(
            SHAPES["w"], 50.0 * MAX_GROWTH, np.float32))],)]), lr=1.0, momentum=0.9)
        overflow = state.apply(state.sum([(1.0, [ShardGrad("b", 0, 16, np.full(16, 3e38, np.float32))])] * 2),
                               lr=0.1, momentum=0.9)
    assert grow is not None and grow.reason == "growth" and "w" in grow.detail
    assert overflow is not None and overflow.reason == "nonfinite"
    for name in initial:
        np.testing.assert_array_equal(state.params[name], clean.params[name])
        np.testing.assert_array_equal(state.momentum[name], clean.momentum[name])
    for s in (state, clean):
        s.apply(s.sum(honest), lr=0.1, momentum=0.9)
    for name in initial:
        np.testing.assert_array_equal(state.params[name], clean.params[name])


def test_the_norm_filter_starts_its_reference_again_when_the_whole_fleet_s_gradients_grow() -> None:
    """Refusals that are most of the last ``CLIP_WINDOW`` judged are the fleet's gradients growing, not one device:
    the reference starts again, and after a warm-up on the new scale the updates are applied again."""
    rng = np.random.default_rng(9)
    aggregator = Aggregator(ParameterServerConfig(aggregation="mean", norm_warmup=4), ServiceMetrics("ps"))
    for _ in range(8):
        aggregator.combine([contribution(rng, 0.01)])
    refused = [aggregator.combine([contribution(rng, 1.0)]).refused for _ in range(CLIP_WINDOW + 8)]
    assert refused[:CLIP_WINDOW // 2] == [1] * (CLIP_WINDOW // 2)  # a minority of the window: one device's, refused
    assert refused[-4:] == [0] * 4  # then the reference restarted and learnt the new scale
    assert aggregator.m_refused.labels(reason="norm")._value.get() == sum(refused)


def test_a_round_that_refuses_hundreds_names_the_largest_eight_in_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """A round of a thousand devices may refuse hundreds of updates at once: every one is counted, and the warning
    names the largest few and how many more, not hundreds of numbers on one line."""
    rng = np.random.default_rng(10)
    aggregator = Aggregator(ParameterServerConfig(aggregation="mean", norm_warmup=4), ServiceMetrics("ps"))
    for _ in range(8):
        aggregator.combine([contribution(rng, 0.01)])
    with caplog.at_level(logging.WARNING, logger="edgemesh.services.parameter_server.robust"):
        combined = aggregator.combine([contribution(rng, 0.01) for _ in range(4)] +
                                      [contribution(rng, 1.0 + i) for i in range(300)])
    assert combined.refused == 300 and aggregator.m_refused.labels(reason="norm")._value.get() == 300
    [warning] = [r.getMessage() for r in caplog.records if "of a step's" in r.getMessage()]
    assert warning.startswith("refused 300 of a step's 304 updates") and "and 292 more" in warning
    assert len(warning) < 400


# --------------------------------------------------------------------------- a sharded server


def _candidate(device: str, seq: int) -> Candidate:
    update = GradientUpdate(device=device, cluster=f"c-{device}", incarnation=1, seq=seq, base_version=0, samples=8,
                            shards=())
    return Candidate(update, [ShardGrad("w", 0, 2, np.full((2, 2), 100.0 if device == "x" else 1.0, np.float32))],
                     0.0)


def test_a_follower_shard_leaves_out_what_shard_0_refused_by_norm() -> None:
    """Shard 0 marks the update its norm filter refused as left out in its step record (any rule); a follower shard,
    which judges no norm itself, takes the step without it."""
    leader = Leader(Topics("j"), lambda: None, 2, WAIT_S, ServiceMetrics("lead"))
    items = tuple(_candidate(d, 1) for d in "abx")
    step = Step(items, 1, (1 / 3,) * 3)
    leader.stepped([step], [Combined([], how=Aggregation("mean", chosen=(0, 1), norm_limit=20.0))])
    (record,) = leader.steps
    assert [p.excluded for p in record.parts] == [False, False, True] and record.rule == "mean"
    follower = FollowerScheduler(Clock(), WAIT_S, ServiceMetrics("follow"))
    follower.take(list(items), Fleet(now=0.0))
    follower.follow(ShardSteps(version=1, policy="async", steps=(record,)))
    (taken,) = follower.take([], Fleet(now=0.0)).steps
    assert taken.chosen == (0, 1) and [UpdateId.of(i.update).device for i in taken.items] == ["a", "b", "x"]
    aggregator = Aggregator(ParameterServerConfig(aggregation="mean", shards=2, shard=1, norm_warmup=1),
                            ServiceMetrics("ps-1"))
    assert not aggregator.judges
    combined = aggregator.combine(taken.contributions(), rule=taken.rule, chosen=taken.chosen)
    assert combined.refused == 1 and len(combined.contributions) == 2
    assert all(float(np.abs(g.values).max()) == 1.0 for _, shards in combined.contributions for g in shards)


async def test_a_sharded_server_keeps_an_update_of_1e30_out_of_every_shard(mosquitto_broker: BrokerProcess,
                                                                          tmp_path: Path) -> None:
    """Two shards under ``mean`` (async), after the warm-up: an update of 1e30 is left out by shard 0's norm filter,
    and by shard 1 too, as shard 0's step record says; one huge only in shard 1's rows (shard 0 judges the norm of
    the rows it holds) is a step shard 1's model refuses. Every shard's rows stay finite, and the next honest update
    trains both."""
    cfg = make_config(mosquitto_broker, job="trust-shards", **{
        "ps.state_dir": tmp_path, "ps.shards": 2, "training.sync_policy": "async", "ps.aggregation": "mean",
        "ps.broadcast": "snapshot", "ps.snapshot_dtype": "float32", "ps.eval_every": 0})
    servers = [ParameterServer(dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, shard=i))) for i in range(2)]
    shard = [Topics(cfg.job, i) for i in range(2)]
    async with running(*servers), inbox(cfg, *((t.ack_filter("+"), UpdateAck) for t in shard)) as box:
        await box.publish(Topics(cfg.job).plan(), plan_for(["a", "b", "c"]), retain=True)
        await until("both shards' plan", lambda: all(s.plan is not None and s.state is not None for s in servers))
        spans = [[(r.param, r.start, r.stop) for r in s.division.spans] for s in servers]  # type: ignore[union-attr]

        async def push(device: str, seq: int, scales: tuple[float, float]) -> list[dict[str, np.ndarray]]:
            """``device``'s update (each shard its rows, of the scale given for it), once both shards stepped on it;
            each shard's rows then."""
            version = servers[0].version
            for i in range(2):
                await box.publish(shard[i].grad(f"c-{device}", device),
                                  gradient(device, seq, version, scale=scales[i], spans=spans[i]))
            await until(f"version {version + 1} on both shards", lambda: all(s.version == version + 1
                                                                             for s in servers))
            return [{k: v.copy() for k, v in s.state.params.items()} for s in servers if s.state is not None]

        for seq in range(1, 5):
            for device in "ab":
                rows = await push(device, seq, (0.01, 0.01))
        left_out = await push("c", 1, (HUGE, HUGE))
        assert servers[0].metrics.value("edgemesh_ps_robust_refused_total", reason="norm") == 1
        refused = await push("c", 2, (0.01, HUGE))
        assert servers[1].metrics.value("edgemesh_ps_steps_refused_total", reason="growth") == 1
        trained = await push("a", 5, (0.01, 0.01))
    for name in rows[1]:
        np.testing.assert_array_equal(left_out[1][name], rows[1][name], err_msg=name)  # left out on shard 1 too
        np.testing.assert_array_equal(refused[1][name], left_out[1][name], err_msg=name)  # refused there
    assert any(not np.array_equal(refused[0][k], left_out[0][k]) for k in rows[0])  # shard 0 took c's honest rows
    for i in range(2):
        assert all(np.isfinite(v).all() for v in trained[i].values())
        assert any(not np.array_equal(trained[i][k], refused[i][k]) for k in trained[i])
        assert model_norm(trained[i]) == pytest.approx(model_norm(rows[i]), rel=0.1)
