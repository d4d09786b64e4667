"""Held-out evaluation of the global model, off the step loop.

After a step the parameter server offers the model; every ``ps.eval_every`` versions, and every
``ps.eval_interval_s`` seconds the model moved, a copy is handed to the evaluation loop, which
evaluates the newest one handed over in a thread (stepping never waits for it) and reports loss
and accuracy.

The held-out set is the configured data set's test split, or a submitted job's ``evaluation.path`` on
this host. A job evaluated where its data lives (``evaluation.local_share``) has no set here: each device
reports its accuracy on its own validation share (``LocalEvaluation``), and :meth:`Evaluator.combine`
weighs the latest report of every device in the plan by its sample count.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from edgemesh.common import models
from edgemesh.common.config import Config
from edgemesh.common.data import load_dataset, load_local
from edgemesh.common.jobs import JobSpec, resolve
from edgemesh.common.messages import LocalEvaluation

Report = Callable[[int, float, float], Awaitable[None]]
"""``report(version, loss, accuracy)``."""


class Evaluator:
    """The model and the held-out split of the job's data set."""

    def __init__(self, config: Config, job: JobSpec | None = None) -> None:
        self.cfg = config
        self.job = job
        self.local = job is not None and job.evaluation.local
        """Evaluated on the devices' validation shares, not here."""
        self.last_accuracy: float | None = None
        self.last_loss: float | None = None
        self._reports: dict[str, LocalEvaluation] = {}
        self._model: Any = None
        self._test_set: Any = None
        self._last_version = -1
        self._last_time = -float("inf")
        self._wake = asyncio.Event()
        self._next: tuple[int, dict[str, np.ndarray]] | None = None

    def load(self) -> dict[str, np.ndarray]:
        """Build the model and read the held-out split (in a thread); the model's initial weights."""
        t, job = self.cfg.training, self.job
        self._model = models.build_model(t.model_spec, seed=t.seed)
        if job is not None and job.evaluation.path:
            path = resolve(job.evaluation.path, self.cfg.ps.data_dir)
            self._test_set = load_local(job.data.format, path, input_shape=job.model.input_shape,
                                        classes=job.model.classes, label_column=job.data.label_column).train
        elif not self.local:
            _, self._test_set = load_dataset(t.dataset, t.dataset_path or None, seed=t.seed)
        return models.get_params(self._model)

    def combine(self, report: LocalEvaluation, devices: set[str]) -> tuple[int, float, float] | None:
        """(version, loss, accuracy) over the latest report of every device in ``devices``, weighted by their
        samples, once ``report`` is in; None while no device of the plan has reported."""
        self._reports[report.device] = report
        latest = [r for name, r in self._reports.items() if name in devices and r.samples]
        if not latest:
            return None
        samples = sum(r.samples for r in latest)
        accuracy, loss = sum(r.correct for r in latest) / samples, sum(r.loss_sum for r in latest) / samples
        self.last_accuracy, self.last_loss = accuracy, loss
        return min(r.version for r in latest), loss, accuracy

    def offer(self, version: int, params: Mapping[str, np.ndarray]) -> None:
        """Hand ``params`` over if an evaluation is due at ``version`` (and there is a held-out set here)."""
        if self.local:
            return
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
            self.last_accuracy, self.last_loss = accuracy, loss
            await report(version, loss, accuracy)

    def _evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        models.set_params(self._model, params)
        return models.evaluate(self._model, self._test_set)
