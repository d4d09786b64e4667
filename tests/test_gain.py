"""AdaScale's gain under ``ps.round_scaling = "adascale"``: the estimates on gradients of known noise and signal, the
gain's bounds, the round schedulers that ask for it, the step it scales (logged, replayed exactly, measured only
where the step is decided), and a parameter server on a real broker taking a round's step by it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from helpers import candidate as update
from helpers import gradient, make_config, plan_for, serving_ps

from edgemesh.common.codecs import get_codec
from edgemesh.common.config import ParameterServerConfig
from edgemesh.common.messages import Plan, ShardUpdate
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay
from edgemesh.services.parameter_server.gain import NoiseScale, measure, ratio
from edgemesh.services.parameter_server.optimizer import ModelState, ShardGrad
from edgemesh.services.parameter_server.recovery import Optimizer, Recovery
from edgemesh.services.parameter_server.robust import Aggregation, Aggregator, combine
from edgemesh.services.parameter_server.scheduler import Candidate, Clock, Fleet, Step, make_scheduler

DIM = 200


def gradients(rng: np.random.Generator, mean: np.ndarray, per_sample_sd: float,
              samples: list[int]) -> list[list[ShardGrad]]:
    """One gradient per device: the mean of ``n`` samples' gradients, each ``mean`` plus noise of ``per_sample_sd``
    per coordinate."""
    return [[ShardGrad("w", 0, 1, (mean + rng.normal(0, per_sample_sd / np.sqrt(n), DIM)).astype(np.float32)
                       .reshape(1, DIM))] for n in samples]


def test_the_estimates_recover_the_noise_and_signal_of_known_gradients() -> None:
    """Devices of unequal batches: the per-batch variance and the squared mean norm are recovered."""
    rng = np.random.default_rng(3)
    mean = np.full(DIM, 0.05)
    samples = [8, 16, 32] * 200
    sigma2, mu2 = measure(gradients(rng, mean, 2.0, samples), samples, batches=sum(samples) / 16)
    assert sigma2 == pytest.approx(DIM * 4.0 / 16, rel=0.05)  # one batch of 16: DIM coordinates of variance 4/16
    assert mu2 == pytest.approx(float(mean @ mean), rel=0.1)


def test_the_gain_nears_the_batches_when_gradients_are_noise_and_one_when_they_agree() -> None:
    rng = np.random.default_rng(4)
    noisy = NoiseScale().gain(gradients(rng, np.zeros(DIM), 1.0, [16] * 8), [16] * 8, 8.0)
    agreeing = NoiseScale().gain(gradients(rng, np.ones(DIM), 1e-4, [16] * 8), [16] * 8, 8.0)
    assert noisy > 6.0 and agreeing == pytest.approx(1.0, abs=1e-3)
    assert ratio(1.0, 0.0, 8.0) == 8.0 and ratio(0.0, 1.0, 8.0) == 1.0 and ratio(None, 1.0, 8.0) == 1.0
    assert ratio(float("nan"), 1.0, 8.0) == 1.0  # an overflow measured nothing: one batch's step


def test_a_round_of_one_gradient_keeps_the_last_estimates() -> None:
    """One gradient has no variance: with no estimate yet the step is one batch's (gain 1); after rounds that
    measured, it is the gain they measured."""
    rng = np.random.default_rng(5)
    noise = NoiseScale()
    assert noise.gain(gradients(rng, np.zeros(DIM), 1.0, [16]), [16], 4.0) == 1.0
    measured = noise.gain(gradients(rng, np.zeros(DIM), 1.0, [16] * 4), [16] * 4, 4.0)
    assert measured > 1.0 and noise.gain(gradients(rng, np.zeros(DIM), 1.0, [16]), [16], 4.0) == measured
    assert noise.gain(gradients(rng, np.zeros(DIM), 1.0, [16] * 4), [16] * 4, 1.0) == 1.0  # one batch: no growth


def _plan(batches: dict[str, int]) -> Plan:
    """``plan_for``'s plan with these batches."""
    plan = plan_for(list(batches))
    return dataclasses.replace(plan, devices=tuple(dataclasses.replace(d, batch_size=batches[d.device])
                                                   for d in plan.devices))


@pytest.mark.parametrize("policy", ["sync", "adaptive"])
def test_round_policies_ask_for_the_gain_instead_of_scaling_by_the_batches(policy: str) -> None:
    """Under ``adascale`` a round's weights are its sample shares (as under ``none``) and its step may grow up to
    the batches it averages; under ``linear`` the weights carry the growth and no gain is measured."""
    plan = _plan({"a": 16, "b": 16, "c": 32})
    for scaling, weights, limit in (("adascale", [0.25, 0.25, 0.5], 4.0), ("linear", [1.0, 1.0, 2.0], 1.0)):
        scheduler = make_scheduler(policy, Clock(), AdaptiveDelay(), staleness_weighting=True,  # type: ignore[arg-type]
                                   round_scaling=scaling)  # type: ignore[arg-type]
        fleet = Fleet.of(plan, 0, 0.0, lr_batch=16)
        items = [update(d, 1, 0, samples=n) for d, n in (("a", 16), ("b", 16), ("c", 32))]
        steps = scheduler.take(items, fleet).steps
        assert len(steps) == 1
        assert list(steps[0].weights) == pytest.approx(weights) and steps[0].gain_limit == limit
    async_ = make_scheduler("async", Clock(), AdaptiveDelay(), staleness_weighting=True, round_scaling="adascale")
    step = async_.take([update("a", 1, 0, samples=16)], Fleet.of(plan, 2, 0.0, lr_batch=16))
    assert step.steps[0].gain_limit == 1.0  # a step of one update has no round to measure


def carrying(device: str, seq: int, grads: list[ShardGrad]) -> Candidate:
    """An update of 16 samples whose wire shards carry ``grads`` (so that the log holds them)."""
    shards = tuple(ShardUpdate(param=g.param, start=g.start, stop=g.stop, codec="none",
                               data=get_codec("none").encode(g.values.ravel(), None)) for g in grads)
    return dataclasses.replace(update(device, seq, seq - 1, samples=16), grads=grads,
                               update=dataclasses.replace(update(device, seq, seq - 1, samples=16).update,
                                                          shards=shards))


def test_the_gain_scales_the_step_is_logged_with_it_and_replays_exactly(tmp_path: Path) -> None:
    """The parameter server's aggregator measures the round's gain after clip, multiplies the step's weights by it,
    counts it on its gauge and logs it; a replay of the log holds the same model bit for bit."""
    rng = np.random.default_rng(6)
    params = {"w": np.zeros((1, DIM), np.float32)}
    live = Recovery(tmp_path, fsync=False)
    state = live.resume("spec", params, Clock()).state
    metrics = ServiceMetrics("ps")
    aggregator = Aggregator(ParameterServerConfig(aggregation="clip"), metrics)
    gains = []
    for version in range(1, 6):
        grads = gradients(rng, np.full(DIM, 0.1), 1.0, [16] * 4)
        step = Step(tuple(carrying(f"d{i}", version, g) for i, g in enumerate(grads)), version, (0.25,) * 4,
                    gain_limit=4.0)
        combined = aggregator.combine(step.contributions(), gain_limit=step.gain_limit, samples=step.samples)
        plain = combine(step.contributions(), Aggregation("clip", combined.how.clip_threshold))
        gains.append(combined.how.gain)
        assert 1.0 < combined.how.gain <= 4.0
        assert [w for w, _ in combined.contributions] == pytest.approx([w * combined.how.gain
                                                                       for w, _ in plain.contributions])
        assert metrics.registry.get_sample_value("edgemesh_ps_step_gain") == combined.how.gain
        replayed = combine(step.contributions(), Aggregation.of_record(combined.how.record()))  # as a replay does
        assert [w for w, _ in replayed.contributions] == [w for w, _ in combined.contributions]
        summed = state.step(combined.contributions, lr=0.1, momentum=0.9)
        live.log([step], Optimizer(0.1, 0.9), [combined], [summed]).durable()
    live.close()
    assert len(set(gains)) > 1  # each round moved the estimates
    resumed = Recovery(tmp_path, fsync=False).resume("spec", params, Clock())
    np.testing.assert_array_equal(resumed.state.params["w"], state.params["w"])
    np.testing.assert_array_equal(resumed.state.momentum["w"], state.momentum["w"])


def test_only_the_process_that_decides_a_step_measures_its_gain() -> None:
    """A sharded server's other shards take shard 0's step with the gain already in its weights: they measure none."""
    rng = np.random.default_rng(8)
    follower = Aggregator(ParameterServerConfig(aggregation="clip", shards=2, shard=1), ServiceMetrics("ps"))
    contributions = [(0.25, g) for g in gradients(rng, np.zeros(DIM), 1.0, [16] * 4)]
    assert follower.combine(contributions, rule="mean", gain_limit=4.0, samples=[16] * 4).how.gain == 1.0


def test_a_model_state_refuses_nothing_a_gain_within_its_limit_makes() -> None:
    """The gain is at most the batches a round averages: never a larger step than the linear rule's."""
    rng = np.random.default_rng(9)
    aggregator = Aggregator(ParameterServerConfig(aggregation="mean"), ServiceMetrics("ps"))
    contributions = [(0.125, g) for g in gradients(rng, np.zeros(DIM), 10.0, [16] * 8)]
    combined = aggregator.combine(contributions, gain_limit=8.0, samples=[16] * 8)
    assert combined.how.gain <= 8.0
    state = ModelState({"w": np.ones((1, DIM), np.float32)})
    assert state.apply(state.sum(combined.contributions, []), lr=0.01, momentum=0.0) is None


async def test_a_parameter_server_takes_a_sync_round_by_its_measured_gain(broker: BrokerProcess,
                                                                         tmp_path: Path) -> None:
    """Three devices' batches of 8 (the learning rate's batch) with gradients of 0.01, 0.02 and 0.03 everywhere: one
    batch's gradient varies by P x 1e-4 over P values, the true gradient's square is P x 4e-4 less the mean's
    variance, so the gain is (1e-4 + 3.667e-4) / (1e-4 / 3 + 3.667e-4) = 7/6, not the 3 of ``linear``; the first
    step (no momentum yet) moves every weight by lr x 7/6 x 0.02, and the gauge says 7/6."""
    cfg = make_config(broker, job="gain", **{"ps.state_dir": tmp_path, "ps.eval_every": 0, "ps.broadcast": "snapshot",
                                             "ps.snapshot_dtype": "float32", "training.sync_policy": "sync",
                                             "training.batch_size": 8, "ps.round_scaling": "adascale"})
    async with serving_ps(cfg, ["a", "b", "c"]) as (c, ps):
        start = await c.version_at_least(0)
        for device, scale in (("a", 0.01), ("b", 0.02), ("c", 0.03)):
            await c.bus.publish(c.topics.grad(f"c-{device}", device), gradient(device, 1, 0, scale=scale))
        assert [(await c.ack_for(d, 1)).status for d in "abc"] == ["accepted"] * 3
        after = await c.version_at_least(1)
        moved = after.tensors["fc2.bias"].to_numpy() - start.tensors["fc2.bias"].to_numpy()
        np.testing.assert_allclose(moved, -cfg.training.lr * 7 / 6 * 0.02, rtol=1e-3)
        assert ps.metrics.value("edgemesh_ps_step_gain") == pytest.approx(7 / 6, rel=1e-4)
