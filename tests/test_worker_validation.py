"""A device's validation share (services/worker/validation.py): when its evaluation is due and what it reports."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import numpy as np
import pytest
from helpers import plan_for

from edgemesh.common import models
from edgemesh.common.config import Config, load_config
from edgemesh.common.data import BatchIterator, Dataset, load_dataset
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.services.worker.board import Board
from edgemesh.services.worker.link import LinkMeter
from edgemesh.services.worker.source import Held
from edgemesh.services.worker.trainer import Trainer
from edgemesh.services.worker.validation import ValidationShare

DEVICE = "pi-3"
SPEC = "digits-cnn"
SEED = 0
TRAINING_STEPS = 40
"""SGD steps that take ``digits-cnn`` well past chance on digits, for a report whose accuracy says something."""
LEARNING_RATE = 0.1
BN_SPEC = "validation-digits-bn"
"""A small model of digits with batch norm: a training step moves its running statistics (buffers)."""
BN_LAYERS = [{"conv2d": 4, "kernel": 3}, "batchnorm", "relu", "flatten", {"linear": 10}]


def worker_config(spec: str = SPEC) -> Config:
    return load_config(env={}, overrides={"job": "validation", "training.model_spec": spec,
                                          "training.seed": str(SEED)})


@functools.cache
def digits() -> tuple[Dataset, Dataset]:
    """The digits data set's training and held-out parts."""
    return load_dataset("digits", seed=SEED)


def untrained(seed: int) -> dict[str, np.ndarray]:
    """The state of a freshly built ``digits-cnn``."""
    return models.get_params(models.build_model(SPEC, seed=seed))


@functools.cache
def trained() -> Mapping[str, np.ndarray]:
    """The state of ``digits-cnn`` after ``TRAINING_STEPS`` steps of plain SGD on the digits training set."""
    model = models.build_model(SPEC, seed=SEED)
    batches = BatchIterator(digits()[0], 64, seed=SEED)
    trainable = models.gradient_layout(model)
    for _ in range(TRAINING_STEPS):
        x, y = next(batches)
        _, grads = models.compute_gradients(model, x, y)
        params = models.get_params(model)
        models.set_params(model, {name: p - LEARNING_RATE * grads[name] if name in trainable else p
                                  for name, p in params.items()})
    return models.get_params(model)


def expected(params: Mapping[str, np.ndarray], data: Dataset, spec: str = SPEC) -> tuple[float, float]:
    """(loss, accuracy) of a model of ``params`` on ``data``, computed apart from the worker."""
    model = models.build_model(spec, seed=SEED)
    models.set_params(model, params)
    return models.evaluate(model, data)


def share(every: int, data: Dataset | None = None, *, trainer: Trainer | None = None) -> ValidationShare:
    """A validation share of ``data`` (the digits held-out set) evaluated by a real worker's trainer."""
    trainer = trainer or new_trainer()
    return ValidationShare(data if data is not None else digits()[1], every=every, trainer=trainer, device=DEVICE)


def new_trainer(spec: str = SPEC) -> Trainer:
    """A worker's trainer on a real (not emulated) board."""
    config = worker_config(spec)
    return Trainer(config, DEVICE, Board(config.worker, DEVICE, LinkMeter(), ServiceMetrics("worker")))


def registered_bn_spec() -> str:
    """``BN_SPEC``, registered in this process (again: the same spec)."""
    models.register_spec(models.layer_list_spec(BN_SPEC, BN_LAYERS, (1, 8, 8), 10))
    return BN_SPEC


def held(params: Mapping[str, np.ndarray], version: int) -> Held:
    """The model of a parameter server of one process at ``version``, as the worker's source holds it."""
    return Held(params, version, False, version)


# --------------------------------------------------------------------------- when an evaluation is due


@pytest.mark.parametrize(("every", "versions", "due"), [
    # the first version at or past each multiple of 5; a jump over several multiples is one report
    (5, [0, 1, 3, 4, 5, 6, 9, 12, 13, 20, 31, 31, 34, 35], [0, 5, 12, 20, 31, 35]),
    (1, [0, 0, 1, 2, 2, 7], [0, 1, 2, 7]),  # every new version, once
    (10, [3, 9, 10, 10, 11, 19, 25], [3, 10, 25]),  # the first model the device holds is at or past 0
])
async def test_an_evaluation_is_due_at_the_first_version_at_or_past_each_multiple_once(
        every: int, versions: list[int], due: list[int]) -> None:
    validation = share(every)
    params = untrained(SEED)
    reported = []
    for version in versions:
        report = await validation.report(held(params, version))
        if report is not None:
            assert report.version == version
            reported.append(version)
    assert reported == due


# --------------------------------------------------------------------------- what a report carries


async def test_a_report_carries_the_share_s_samples_correct_answers_and_loss_sum() -> None:
    """The parameter server combines the devices' reports by their samples: accuracy = sum(correct) / sum(samples),
    loss = sum(loss_sum) / sum(samples)."""
    data = digits()[1]
    validation = share(5, data)
    params = trained()
    report = await validation.report(held(params, 15))
    assert report is not None
    loss, accuracy = expected(params, data)
    assert accuracy > 0.3  # trained: the counts say something
    assert (report.device, report.version, report.samples) == (DEVICE, 15, len(data))
    assert len(validation) == len(data)  # what the device's status names
    assert report.correct == round(accuracy * len(data))
    assert 0 < report.correct < report.samples
    assert report.loss_sum == pytest.approx(loss * len(data), rel=1e-6)
    report.validate()  # as the parameter server checks it


async def test_each_report_evaluates_the_model_of_its_version() -> None:
    """The trainer's model is shared with the steps: a report at a new version loads that version's weights."""
    data = digits()[1]
    validation = share(5, data)
    first = await validation.report(held(untrained(SEED), 0))
    second = await validation.report(held(trained(), 5))
    assert first is not None and second is not None
    for report, params in ((first, untrained(SEED)), (second, trained())):
        loss, accuracy = expected(params, data)
        assert report.correct == round(accuracy * len(data))
        assert report.loss_sum == pytest.approx(loss * len(data), rel=1e-6)
    assert second.correct > first.correct and second.loss_sum < first.loss_sum


async def test_a_small_share_reports_its_own_samples() -> None:
    """A device with few held-out samples reports exactly those: the parameter server weighs it by them."""
    full = digits()[1]
    small = Dataset(name="digits-few", x=full.x[:7], y=full.y[:7], num_classes=full.num_classes)
    validation = share(3, small)
    report = await validation.report(held(trained(), 3))
    assert report is not None
    loss, accuracy = expected(trained(), small)
    assert (report.samples, report.correct) == (7, round(accuracy * 7))
    assert report.loss_sum == pytest.approx(loss * 7, rel=1e-6)


async def test_a_report_after_a_step_at_the_same_version_evaluates_that_version_s_model() -> None:
    """The worker evaluates right after an accepted update, often before the delta that applied it arrives: the
    model it holds is still the version the step trained on. The report names that version, and the parameter
    server combines the devices' reports of one version: each must be of that version's model."""
    spec = registered_bn_spec()
    data = digits()[1]
    trainer = new_trainer(spec)
    params = models.get_params(models.build_model(spec, seed=SEED))
    plan = dataclasses.replace(plan_for([DEVICE], version=1, batch=8), model_spec=spec)
    me = plan.device(DEVICE)
    assert me is not None
    trainer.step(plan, me, params, 4, None)  # the worker's step at version 4 (moves batch norm's statistics)
    report = await share(1, data, trainer=trainer).report(held(params, 4))
    assert report is not None
    loss, accuracy = expected(params, data, spec)
    assert report.loss_sum == pytest.approx(loss * len(data), rel=1e-6)
    assert report.correct == round(accuracy * len(data))
