"""The parameter server's held-out evaluation: off the step loop, within its own budget."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from helpers import until

from edgemesh.common.config import load_config
from edgemesh.services.parameter_server.evaluation import Evaluator

EVALUATION_S = 0.05
"""How long the stand-in evaluation below takes."""


async def test_evaluation_waits_out_its_budget_then_takes_the_newest_model() -> None:
    cfg = load_config(env={}, overrides={"ps.eval_every": "1", "ps.eval_budget": "0.25"})
    evaluator = Evaluator(cfg)
    ran: list[tuple[float, float]] = []

    def evaluate(params: dict[str, np.ndarray]) -> tuple[float, float]:
        began = time.perf_counter()
        time.sleep(EVALUATION_S)  # a held-out pass of known length, in the evaluation's thread
        ran.append((began, time.perf_counter()))
        return 1.0, float(params["w"][0])

    evaluator._evaluate = evaluate  # type: ignore[method-assign]
    reports: list[tuple[int, float]] = []

    async def report(version: int, loss: float, accuracy: float) -> None:
        reports.append((version, accuracy))

    loop = asyncio.create_task(evaluator.run(report))
    try:
        evaluator.offer(1, {"w": np.array([1.0])})
        await until("the first evaluation", lambda: reports)
        for version in (2, 3, 4):  # while it rests, newer models come; only the newest is evaluated
            evaluator.offer(version, {"w": np.array([float(version)])})
        await until("the second evaluation", lambda: len(reports) == 2)
    finally:
        loop.cancel()
    assert reports == [(1, 1.0), (4, 4.0)]
    (_, first_end), (second_start, _) = ran
    took = ran[0][1] - ran[0][0]
    assert second_start - first_end >= took * (1 / 0.25 - 1) * 0.99  # three times its length at a quarter's budget


async def test_a_jobs_end_evaluates_its_last_model_at_once_and_only_once() -> None:
    cfg = load_config(env={}, overrides={"ps.eval_every": "1", "ps.eval_budget": "0.01"})
    evaluator = Evaluator(cfg)
    evaluator._test_set = object()  # a held-out set is there; the stand-in below evaluates
    evaluator._evaluate = lambda params: (0.5, float(params["w"][0]))  # type: ignore[method-assign]
    reports: list[tuple[int, float]] = []

    async def report(version: int, loss: float, accuracy: float) -> None:
        reports.append((version, accuracy))

    await evaluator.final(7, {"w": np.array([0.75])}, report)  # whatever the budget: now
    await evaluator.final(7, {"w": np.array([0.75])}, report)  # that version again: nothing to do
    assert reports == [(7, 0.75)] and evaluator.last_accuracy == 0.75


def test_evaluations_in_two_threads_each_score_their_own_model() -> None:
    """A job's final evaluation may start while one during training still runs, both in threads on the one module:
    each must score its own weights (they once scored a mix: reported 0.78 for a model that exports 0.76)."""
    evaluator = Evaluator(load_config(env={}))
    first = evaluator.load()
    second = {name: -value if value.dtype.kind == "f" else value for name, value in first.items()}
    alone = [evaluator._evaluate(first), evaluator._evaluate(second)]
    assert alone[0] != alone[1]
    with ThreadPoolExecutor(max_workers=2) as pool:
        scored = list(pool.map(evaluator._evaluate, [first, second] * 20))
    assert scored == alone * 20
