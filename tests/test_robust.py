"""Robust aggregation: the rules on known inputs, the attack a faulty worker emulates, exact replay of
steps a robust rule combined, and the configuration (the parameter server's command is tested over a
real broker in test_robust_ps.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemesh.common.codecs import get_codec
from edgemesh.common.config import ParameterServerConfig, load_config
from edgemesh.common.errors import ConfigError, JobError
from edgemesh.common.jobs import job_config, parse_job
from edgemesh.common.messages import GradientUpdate, ShardUpdate
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.vocabulary import AGGREGATION_RULES, AggregationRule
from edgemesh.services.parameter_server.optimizer import ModelState, ShardGrad
from edgemesh.services.parameter_server.recovery import Optimizer, Recovery
from edgemesh.services.parameter_server.robust import (
    CLIP_WINDOW,
    Aggregation,
    Aggregator,
    combine,
    idle_under,
    krum_choice,
    norm,
)
from edgemesh.services.parameter_server.scheduler import Candidate, Clock, Step
from edgemesh.services.parameter_server.store import read_wal
from edgemesh.services.worker.attack import attack_rng, falsify


def whole(*values: float, weight: float = 1.0) -> tuple[float, list[ShardGrad]]:
    """A contribution to a 1-row parameter ``w`` of len(values) columns."""
    return weight, [ShardGrad("w", 0, 1, np.array([values], dtype=np.float32))]


def aggregate(rule: AggregationRule, contributions: list[tuple[float, list[ShardGrad]]], **how: object) -> np.ndarray:
    """The gradient of ``w`` the SGD step applies: the combined contributions, summed by weight."""
    combined = combine(contributions, Aggregation(rule, **how))  # type: ignore[arg-type]
    out = np.zeros((1, len(contributions[0][1][0].values[0])), dtype=np.float32)
    for weight, shards in combined.contributions:
        for g in shards:
            out[g.start:g.stop] += g.values * np.float32(weight)
    return out[0]


HONEST = [whole(1.0, 2.0), whole(1.2, 2.2), whole(0.8, 1.8), whole(1.1, 2.1)]
"""Four honest contributions near (1, 2)."""
OUTLIER = whole(-100.0, 500.0)


# --------------------------------------------------------------------------- the rules


def test_mean_is_the_weighted_sum_unchanged() -> None:
    contributions = [whole(1.0, 2.0, weight=0.25), whole(3.0, 4.0, weight=0.75)]
    combined = combine(contributions, Aggregation("mean"))
    assert combined.contributions == contributions  # the very same arrays: the step is what it was
    np.testing.assert_allclose(aggregate("mean", contributions), [2.5, 3.5])


def test_median_is_coordinate_wise() -> None:
    contributions = [whole(1.0, 9.0, weight=0.2), whole(5.0, -3.0, weight=0.2), whole(2.0, 4.0, weight=0.2),
                     whole(100.0, 7.0, weight=0.2), whole(3.0, 0.0, weight=0.2)]
    np.testing.assert_allclose(aggregate("median", contributions), [3.0, 4.0], rtol=1e-6)
    # an even count: the mean of the two middle values
    np.testing.assert_allclose(aggregate("median", [whole(1.0, 0.0, weight=0.5), whole(3.0, 8.0, weight=0.5)]),
                               [2.0, 4.0])


def test_robust_rules_scale_by_the_steps_total_weight() -> None:
    """A round the adaptive deadline cut short (weights summing to less than 1) still takes a smaller step."""
    half = [(w * 0.5, shards) for w, shards in [whole(1.0, 2.0, weight=1 / 3)] * 3]
    for rule in ("median", "trimmed-mean", "krum"):
        np.testing.assert_allclose(aggregate(rule, half), [0.5, 1.0], rtol=1e-6, err_msg=rule)


def test_trimmed_mean_drops_the_largest_and_smallest_values() -> None:
    contributions = [(0.2, shards) for _, shards in [*HONEST, OUTLIER]]
    got = aggregate("trimmed-mean", contributions, trim_fraction=0.2)  # 5 values: 1 dropped at each end
    # w[0]: -100 and 1.2 dropped, mean of 0.8, 1.0, 1.1; w[1]: 1.8 and 500 dropped, mean of 2.0, 2.1, 2.2
    np.testing.assert_allclose(got, [np.mean([0.8, 1.0, 1.1]), np.mean([2.0, 2.1, 2.2])], rtol=1e-6)
    combined = combine(contributions, Aggregation("trimmed-mean", trim_fraction=0.2))
    assert combined.excluded == 2
    # a fraction of nothing trims nothing: the plain mean; a large one keeps the middle value
    np.testing.assert_allclose(aggregate("trimmed-mean", contributions, trim_fraction=0.0),
                               aggregate("mean", contributions), rtol=1e-6)
    np.testing.assert_allclose(aggregate("trimmed-mean", contributions, trim_fraction=0.49),
                               aggregate("median", contributions), rtol=1e-6)


def test_krum_leaves_out_the_outlier_among_five() -> None:
    contributions = [(0.2, shards) for _, shards in [HONEST[0], HONEST[1], OUTLIER, HONEST[2], HONEST[3]]]
    assert krum_choice(contributions, 1) == [0, 1, 3, 4]
    combined = combine(contributions, Aggregation("krum", krum_f=1))
    assert combined.excluded == 1
    np.testing.assert_allclose(aggregate("krum", contributions, krum_f=1), [1.025, 2.025], rtol=1e-6)
    # the mean is dragged far away by the one outlier
    assert abs(aggregate("mean", contributions)[1] - 2.0) > 50
    # assuming two attackers, the three best scored are kept: never the outlier
    assert 2 not in krum_choice(contributions, 2) and len(krum_choice(contributions, 2)) == 3


def test_krum_of_one_or_two_keeps_them() -> None:
    assert krum_choice([HONEST[0]], 1) == [0]
    assert krum_choice([HONEST[0], OUTLIER], 1) == [0, 1]  # two cannot tell which one is wrong


def test_clip_bounds_every_contributions_norm() -> None:
    contributions = [(0.2, shards) for _, shards in [*HONEST, OUTLIER]]
    combined = combine(contributions, Aggregation("clip", clip_threshold=5.0))
    assert combined.clipped == 1
    norms = [norm(shards) for _, shards in combined.contributions]
    assert max(norms) == pytest.approx(5.0, rel=1e-6) and combined.norms == pytest.approx(norms)
    clipped = combined.contributions[4][1][0].values[0]
    np.testing.assert_allclose(clipped / np.linalg.norm(clipped), np.array([-100, 500]) / np.hypot(100, 500),
                               rtol=1e-6)  # the direction is kept
    assert [c[1] for c in combined.contributions[:4]] == [c[1] for c in contributions[:4]]  # honest ones untouched


def test_the_clip_threshold_follows_recent_norms_so_it_bounds_single_updates_too() -> None:
    """Under async every step is one update: the threshold comes from the recent steps' norms."""
    aggregator = Aggregator(ParameterServerConfig(aggregation="clip", clip_factor=2.0), ServiceMetrics("ps"))
    for _ in range(CLIP_WINDOW):
        combined = aggregator.combine([whole(3.0, 4.0)])  # norm 5
        assert combined.clipped == 0 and combined.how.clip_threshold == pytest.approx(10.0)
    combined = aggregator.combine([whole(300.0, 400.0)])  # norm 500, alone in its step
    assert combined.clipped == 1 and combined.how.clip_threshold == pytest.approx(10.0)
    assert norm(combined.contributions[0][1]) == pytest.approx(10.0, rel=1e-6)
    assert aggregator.norms[-1] == pytest.approx(10.0)  # the window keeps what was applied
    assert aggregator.m_clipped._value.get() == 1  # edgemesh_ps_robust_clipped_total


def test_the_first_clip_step_of_a_round_compares_its_own_contributions() -> None:
    aggregator = Aggregator(ParameterServerConfig(aggregation="clip", clip_factor=3.0), ServiceMetrics("ps"))
    combined = aggregator.combine([*HONEST, OUTLIER])
    # the median of the five norms is an honest one's, (1.1, 2.1): only the outlier is cut
    assert combined.clipped == 1 and combined.how.clip_threshold == pytest.approx(3 * np.hypot(1.1, 2.1))


def test_a_segment_only_one_contribution_covers_is_taken_as_it_is() -> None:
    """Model parallel slices: rows cut at every boundary; rows 2-4 of ``w`` only the slice of ``c`` covers."""
    a = (0.25, [ShardGrad("w", 0, 2, np.full((2, 3), 1.0, np.float32)), ShardGrad("b", 0, 1, np.ones(1, np.float32))])
    b = (0.25, [ShardGrad("w", 0, 2, np.full((2, 3), 2.0, np.float32))])
    c = (0.5, [ShardGrad("w", 0, 4, np.array([[9.0] * 3, [3.0] * 3, [7.0] * 3, [7.0] * 3], np.float32))])
    for rule in ("median", "trimmed-mean", "krum"):
        combined = combine([a, b, c], Aggregation(rule, trim_fraction=0.0, krum_f=0))  # type: ignore[arg-type]
        got = {(g.param, g.start, g.stop): g.values * np.float32(w) for w, shards in combined.contributions
               for g in shards}
        assert set(got) == {("w", 0, 2), ("w", 2, 4), ("b", 0, 1)}, rule
        np.testing.assert_allclose(got[("w", 2, 4)], 0.5 * 7.0, err_msg=rule)  # c's own rows, with c's weight
        np.testing.assert_allclose(got[("b", 0, 1)], 0.25, err_msg=rule)  # a's own bias
    combined = combine([a, b, c], Aggregation("median"))
    rows = {g.start: g.values for _, shards in combined.contributions for g in shards if g.param == "w"}
    np.testing.assert_allclose(rows[0], [[2.0] * 3, [2.0] * 3])  # median(1, 2, 9) and median(1, 2, 3), weight 1


def test_round_rules_are_idle_under_single_update_policies() -> None:
    assert idle_under("median", "async") and idle_under("krum", "ssp") and idle_under("trimmed-mean", "async")
    assert not idle_under("clip", "async") and not idle_under("median", "sync") and not idle_under("krum", "adaptive")


def test_an_idle_rule_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    aggregator = Aggregator(ParameterServerConfig(aggregation="median"), ServiceMetrics("ps"))
    for _ in range(3):
        aggregator.warn_if_idle("async")
    aggregator.warn_if_idle("sync")
    assert sum("every step is one update" in r.message for r in caplog.records) == 1


# --------------------------------------------------------------------------- the emulated attacker


def test_a_sign_flip_attacker_sends_its_gradient_negated_and_scaled() -> None:
    grads = {"w": np.array([[1.0, -2.0]], np.float32), "b": np.array([0.5], np.float32)}
    out = falsify(grads, "sign-flip", 10.0, attack_rng(0, "pi-1"))
    np.testing.assert_allclose(out["w"], [[-10.0, 20.0]]) and np.testing.assert_allclose(out["b"], [-5.0])
    assert falsify(grads, "", 10.0, attack_rng(0, "pi-1")) == grads


def test_a_noise_attacker_sends_noise_of_the_scale_times_its_gradients_rms() -> None:
    rng = np.random.default_rng(0)
    grads = {"w": rng.normal(0, 0.02, (200, 100)).astype(np.float32)}
    out = falsify(grads, "noise", 10.0, attack_rng(3, "pi-1"))
    rms = float(np.sqrt(np.mean(grads["w"].astype(np.float64) ** 2)))
    assert out["w"].shape == grads["w"].shape and out["w"].dtype == np.float32
    assert float(out["w"].std()) == pytest.approx(10 * rms, rel=0.02)
    assert abs(float(np.corrcoef(out["w"].ravel(), grads["w"].ravel())[0, 1])) < 0.05  # not the gradient
    np.testing.assert_array_equal(out["w"], falsify(grads, "noise", 10.0, attack_rng(3, "pi-1"))["w"])  # repeats
    assert not np.array_equal(out["w"], falsify(grads, "noise", 10.0, attack_rng(3, "pi-2"))["w"])  # per device


# --------------------------------------------------------------------------- exact replay


PARAMS = {"w": np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "b": np.array([0.5, -0.5], np.float32)}


def _candidate(state: ModelState, cluster: str, parts: list[tuple[str, dict[str, tuple[int, int, np.ndarray]]]],
               seq: int) -> Candidate:
    """A cluster's update: one part per member ``(device, {param: (start, stop, values)})`` (several: a
    model-parallel step the assembly joined)."""
    enc = get_codec("none")
    updates = [GradientUpdate(device=device, cluster=cluster, incarnation=1, seq=seq, base_version=0, samples=8,
                              shards=tuple(ShardUpdate(param=p, start=a, stop=z, codec="none",
                                                       data=enc.encode(v.astype(np.float32).ravel(), None))
                                           for p, (a, z, v) in rows.items()),
                              mesh_step=seq if len(parts) > 1 else 0)
               for device, rows in parts]
    grads = [g for u in updates for g in state.decode(u.shards)]
    return Candidate(updates[0], grads, 0.0, parts=tuple(updates) if len(updates) > 1 else ())


def _round(state: ModelState, rng: np.random.Generator, seq: int) -> Step:
    """Four data-parallel devices (one sending huge values) and a model-parallel cluster of two members."""
    def grad(shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
        return rng.normal(0, scale, shape).astype(np.float32)

    items = [_candidate(state, f"c-{d}", [(d, {"w": (0, 4, grad((4, 3), 50.0 if d == "bad" else 1.0)),
                                               "b": (0, 2, grad((2,)))})], seq) for d in ("a", "b", "c", "bad")]
    items.append(_candidate(state, "m", [("m1", {"w": (0, 1, grad((1, 3))), "b": (0, 2, grad((2,)))}),
                                         ("m2", {"w": (1, 4, grad((3, 3)))})], seq))
    return Step(tuple(items), seq, (0.2,) * 5)


def test_a_replay_of_the_log_reproduces_the_model_a_robust_rule_made(tmp_path: Path) -> None:
    """Steps under clip (its threshold from the norms before each step), krum and the trimmed mean, logged as
    the PS logs them (each step's weighted sum, smaller here than its six updates); a new PS replaying the log
    holds bit for bit the same weights and momentum, and the norms clip compares with."""
    rng = np.random.default_rng(7)
    live = Recovery(tmp_path, fsync=False)
    state = live.resume("spec", PARAMS, Clock()).state
    aggregator = Aggregator(ParameterServerConfig(aggregation="clip", clip_factor=1.5), ServiceMetrics("ps"))
    mean = ModelState(PARAMS)  # the same steps, summed plainly: what a replay ignoring the rules would give
    clipped = 0
    for seq, rule in enumerate(["clip"] * 6 + ["krum", "trimmed-mean", "median", "clip"], start=1):
        aggregator.rule = rule  # type: ignore[assignment]
        step = _round(state, rng, seq)
        combined = aggregator.combine(step.contributions())
        clipped += combined.clipped
        summed = state.step(combined.contributions, lr=0.1, momentum=0.9)
        mean.step(step.contributions(), lr=0.1, momentum=0.9)
        live.log([step], Optimizer(0.1, 0.9), [combined], [summed]).durable()
    live.close()
    assert clipped >= 6  # "bad" at least, every clip step
    # six dense updates a step: the log keeps each step's sum, smaller than they are, and names every update
    records = read_wal(tmp_path)
    assert all("sum" in r and "shards" not in r["entries"][0] and len(r["entries"]) == 6 for r in records)

    clock = Clock()
    resumed = Recovery(tmp_path, fsync=False).resume("spec", PARAMS, clock)
    assert resumed.replayed == 10 and clock.version == 10 and clock.high_water["m2"] == (1, 10)
    for name in PARAMS:
        np.testing.assert_array_equal(resumed.state.params[name], state.params[name])
        np.testing.assert_array_equal(resumed.state.momentum[name], state.momentum[name])
        assert not np.allclose(mean.params[name], state.params[name])  # the rules did change the model
    assert resumed.settings["norms"][-CLIP_WINDOW:] == list(aggregator.norms)


def test_a_log_record_from_before_robust_rules_replays_as_a_mean() -> None:
    assert Aggregation.of_record(None) == Aggregation("mean")
    assert Aggregation.of_record({"rule": "bogus"}).rule == "mean"
    how = Aggregation("clip", 2.5, 0.1, 3)
    assert Aggregation.of_record(how.record()) == how


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(("key", "value", "message"), [
    ("ps.aggregation", "average", "'average' is not one of mean, clip, median, trimmed-mean, krum"),
    ("ps.clip_factor", "0", "must be > 0"),
    ("ps.trim_fraction", "0.5", "must be in [0, 0.5)"),
    ("ps.krum_f", "-1", "must be >= 0"),
    ("worker.emulation_attack", "flip", "is not one of"),
    ("worker.emulation_attack_scale", "0", "must be > 0"),
])
def test_bad_robust_settings_name_their_key(key: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: .*{message.replace('[', '.').replace(')', '.')}"):
        load_config(env={}, overrides={key: value})


def test_every_rule_is_a_setting_and_a_job_file_chooses_one() -> None:
    for rule in AGGREGATION_RULES:
        assert load_config(env={}, overrides={"ps.aggregation": rule}).ps.aggregation == rule
    job = """
[job]
name = "robust"
[model]
input_shape = [1, 4]
classes = ["a", "b"]
layers = ["flatten", {linear = 2}]
[data]
format = "csv"
path = "data.csv"
[evaluation]
path = "eval.csv"
[ps]
aggregation = "%s"
krum_f = 2
"""
    cfg = job_config(load_config(env={}), parse_job(job % "krum"), "run")
    assert (cfg.ps.aggregation, cfg.ps.krum_f) == ("krum", 2)
    with pytest.raises(JobError) as caught:
        parse_job(job % "average")
    assert any(p.startswith("ps.aggregation:") for p in caught.value.problems)
