"""Held-out evaluation of the global model, off the step loop.

After a step the parameter server offers the model; every ``ps.eval_every`` versions, and every
``ps.eval_interval_s`` seconds the model moved, a copy is handed to the evaluation loop, which
evaluates the newest one handed over in a thread (stepping never waits for it) and reports loss
and accuracy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from edgemesh.common import models
from edgemesh.common.config import Config
from edgemesh.common.data import load_dataset

Report = Callable[[int, float, float], Awaitable[None]]
"""``report(version, loss, accuracy)``."""


class Evaluator:
    """The model and the held-out split of the job's data set."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.last_accuracy: float | None = None
        self._model: Any = None
        self._test_set: Any = None
        self._last_version = -1
        self._last_time = -float("inf")
        self._wake = asyncio.Event()
        self._next: tuple[int, dict[str, np.ndarray]] | None = None

    def load(self) -> dict[str, np.ndarray]:
        """Build the model and read the held-out split (in a thread); the model's initial weights."""
        t = self.cfg.training
        self._model = models.build_model(t.model_spec, seed=t.seed)
        _, self._test_set = load_dataset(t.dataset, t.dataset_path or None, seed=t.seed)
        return models.get_params(self._model)

    def offer(self, version: int, params: Mapping[str, np.ndarray]) -> None:
        """Hand ``params`` over if an evaluation is due at ``version``."""
        every, interval = self.cfg.ps.eval_every, self.cfg.ps.eval_interval_s
        by_count = bool(every) and version - self._last_version >= every
        by_time = bool(interval) and version != self._last_version and time.monotonic() - self._last_time >= interval
        if not (by_count or by_time):
            return
        self._last_version, self._last_time = version, time.monotonic()
        # a copy: the step loop goes on changing the weights while the evaluation runs
        self._next = (version, {k: v.copy() for k, v in params.items()})
        self._wake.set()

    async def run(self, report: Report) -> None:
        """Evaluate the latest model handed over, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._next is None:
                continue
            version, params = self._next
            self._next = None
            loss, accuracy = await asyncio.to_thread(self._evaluate, params)
            self.last_accuracy = accuracy
            await report(version, loss, accuracy)

    def _evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        models.set_params(self._model, params)
        return models.evaluate(self._model, self._test_set)
