"""The divergence guard: which evaluations roll the model back, and to what; the model a job keeps, and the
warning a running job gives (pure)."""

from __future__ import annotations

import math

import numpy as np

from edgemesh.common.config import GuardConfig
from edgemesh.common.messages.jobs import JobEvaluation
from edgemesh.services.parameter_server.guard import Evaluated, Guard
from edgemesh.services.parameter_server.jobs import STUCK_EVALUATIONS, job_warning, kept_model, no_device_warning


def held(version: int, loss: float, accuracy: float) -> Evaluated:
    return Evaluated(version, loss, accuracy, {"w": np.full(2, float(version), np.float32)})


def test_the_best_evaluation_is_kept_and_a_good_run_never_rolls_back() -> None:
    guard = Guard(GuardConfig(patience=2))
    for version, (loss, accuracy) in enumerate([(2.3, 0.1), (1.0, 0.6), (0.5, 0.8), (0.6, 0.78), (0.4, 0.8)], 1):
        assert guard.judge(held(version, loss, accuracy)) is None
    assert guard.best is not None and guard.best.version == 5  # the same accuracy at a lower loss
    assert guard.best_accuracy == 0.8 and guard.rollbacks == 0 and not guard.diverging


def test_a_non_finite_loss_rolls_back_at_once_to_the_best() -> None:
    guard = Guard(GuardConfig(patience=3))
    guard.judge(held(5, 0.4, 0.9))
    guard.judge(held(10, 0.5, 0.85))
    rollback = guard.judge(held(15, math.nan, 0.1))
    assert rollback is not None and rollback.to.version == 5 and "not finite" in rollback.reason
    guard.rolled_back()
    assert guard.rollbacks == 1 and guard.bad == 0


def test_an_exploding_loss_or_a_fallen_accuracy_rolls_back_after_its_patience() -> None:
    guard = Guard(GuardConfig(patience=2, loss_factor=4.0, accuracy_drop=0.25))
    guard.judge(held(5, 0.5, 0.9))
    assert guard.judge(held(10, 3.0, 0.7)) is None  # 6 x the best's loss, once: patience
    rollback = guard.judge(held(15, 1.0, 0.6))  # 0.3 below the best: the second bad one in a row
    assert rollback is not None and rollback.to.version == 5 and "below the best" in rollback.reason
    # a good evaluation between two bad ones starts the count again
    guard = Guard(GuardConfig(patience=2))
    guard.judge(held(5, 0.5, 0.9))
    assert guard.judge(held(10, 3.0, 0.5)) is None
    assert guard.judge(held(15, 0.5, 0.88)) is None
    assert guard.judge(held(20, 3.0, 0.5)) is None


def test_a_model_that_learned_and_fell_back_to_chance_rolls_back() -> None:
    """Five classes: a best of 0.39 then 0.2 three times (units died, one class answered: a fall of 0.19, short of
    ``accuracy_drop``) rolls back to the best; a model that never learned, or chance not known, does not."""
    guard = Guard(GuardConfig(patience=3))
    guard.chance = 0.2
    guard.judge(held(29, 1.50, 0.39))
    assert guard.judge(held(59, 1.55, 0.22)) is None and guard.judge(held(79, 1.58, 0.2)) is None
    rollback = guard.judge(held(109, 1.61, 0.2))
    assert rollback is not None and rollback.to.version == 29 and "fell back to chance" in rollback.reason
    never = Guard(GuardConfig(patience=1))  # 0.28 is not learning yet: twice the margin above chance is 0.3
    never.chance = 0.2
    never.judge(held(5, 1.6, 0.28))
    assert never.judge(held(10, 1.61, 0.2)) is None
    unknown = Guard(GuardConfig(patience=1))  # the devices evaluate: the classes are theirs
    unknown.judge(held(5, 1.5, 0.39))
    assert unknown.judge(held(10, 1.61, 0.2)) is None


def test_accuracy_noise_before_the_model_learned_never_rolls_it_back() -> None:
    """Three classes (a uniform guess's loss is ln 3 = 1.099): a best of 0.544 at a loss of 1.088 has nearly flat
    logits, and its evaluations falling to chance or far below it are noise; once its loss fell to 0.95 of a uniform
    guess's, the same fall rolls back. An exploding loss rolls back either way."""
    guard = Guard(GuardConfig(patience=1))
    guard.chance = 1 / 3
    guard.judge(held(130, 1.088, 0.544))
    assert not guard.learned
    assert guard.judge(held(135, 1.09, 0.333)) is None and guard.judge(held(140, 1.09, 0.28)) is None
    assert guard.judge(held(145, 4.5, 0.333)) is not None  # over 4 x the best loss: divergence, learned or not
    guard.judge(held(150, 1.0, 0.6))
    assert guard.learned
    rollback = guard.judge(held(155, 1.09, 0.36))
    assert rollback is not None and rollback.to.version == 150 and "fell back to chance" in rollback.reason


def test_noise_near_a_tiny_best_loss_is_not_divergence() -> None:
    guard = Guard(GuardConfig(patience=1))
    guard.judge(held(5, 0.02, 0.99))
    assert guard.judge(held(10, 0.09, 0.98)) is None  # 4.5 x, but less than LOSS_MARGIN above


def test_without_a_held_state_or_past_its_rollbacks_the_guard_only_reports() -> None:
    local = Guard(GuardConfig(patience=1))  # the devices evaluated: no state here to go back to
    local.judge(Evaluated(5, 0.5, 0.9))
    assert local.judge(Evaluated(10, math.inf, 0.1)) is None and "not finite" in local.diverging
    spent = Guard(GuardConfig(patience=1, max_rollbacks=1))
    spent.judge(held(5, 0.5, 0.9))
    assert spent.judge(held(10, math.nan, 0.1)) is not None
    spent.rolled_back()
    assert spent.judge(held(15, math.nan, 0.1)) is None and "after 1 rollbacks" in spent.diverging
    off = Guard(GuardConfig(enabled=False, patience=1))
    off.judge(held(5, 0.5, 0.9))
    assert off.judge(held(10, math.nan, 0.1)) is None and off.diverging


def test_a_job_keeps_its_best_evaluated_model_when_its_last_scored_lower() -> None:
    best, last = held(50, 0.3, 0.92), held(80, 0.6, 0.85)
    current = Evaluated(80, math.nan, math.nan, {"w": np.zeros(2, np.float32)})
    assert kept_model(last, best, current) is best
    assert kept_model(held(90, 0.2, 0.95), best, current).version == 90  # the last, when it is the best
    # evaluated on the devices' shares: the model as it stands, with their accuracy
    local = kept_model(Evaluated(78, 0.5, 0.8), None, current)
    assert (local.version, local.accuracy, local.params) == (80, 0.8, current.params)
    assert kept_model(None, None, current) is current


def evaluations(*accuracies: float) -> tuple[JobEvaluation, ...]:
    return tuple(JobEvaluation(version=5 * i, accuracy=a) for i, a in enumerate(accuracies, start=1))


def test_a_running_jobs_warning_names_divergence_or_an_accuracy_stuck_at_chance() -> None:
    assert job_warning("", evaluations(*[0.2] * (STUCK_EVALUATIONS - 1)), 5) == ""  # not yet
    stuck = job_warning("", evaluations(*[0.2, 0.24] * (STUCK_EVALUATIONS // 2)), 5)
    assert stuck.startswith("stuck at chance") and "5 classes" in stuck
    assert job_warning("", evaluations(0.2, *[0.2] * STUCK_EVALUATIONS, 0.6), 5) == ""  # it learns
    assert job_warning("version 40: the evaluation loss is not finite", (), 5).startswith("diverging: version 40")


def test_a_running_job_no_device_can_join_says_so() -> None:
    """Every device heard from is out of the job (its data missing): the state warns, while it waits for one that
    can join; a device in the plan, or none heard from yet, is no cause for it."""
    errors = {"dev-a": "data path 'nowhere.csv' does not exist on this device", "dev-b": "the same"}
    warning = no_device_warning((), errors)
    assert warning.startswith("no device is in the job: the 2 heard from are out of it")
    assert no_device_warning(("dev-c",), errors) == "" and no_device_warning((), {}) == ""
