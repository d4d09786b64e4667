"""Held-out evaluation of the global model, off the step loop.

After a step the parameter server offers the model; every ``ps.eval_every`` versions, and every
``ps.eval_interval_s`` seconds the model moved, a copy is handed to the evaluation loop, which
evaluates the newest one handed over in a thread (stepping never waits for it) and reports loss
and accuracy. Evaluation has its own budget: ``ps.eval_threads`` torch threads, and at most
``ps.eval_budget`` of that time (after an evaluation of d seconds the next waits d x (1 / budget - 1)),
so that however often ``eval_every`` asks, ingest keeps the rest of the host.

The held-out set is the configured data set's test split, or a submitted job's ``evaluation.path`` on
this host. A job evaluated where its data lives (``evaluation.local_share``) has no set here: each device
reports its accuracy on its own validation share (``LocalEvaluation``), and :meth:`Evaluator.combine`
weighs the latest report of every device in the plan by its sample count.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
import torch

from edgemesh.common import models
from edgemesh.common.config import Config
from edgemesh.common.data import load_dataset, load_local
from edgemesh.common.jobs import JobSpec, resolve
from edgemesh.common.messages import LocalEvaluation
from edgemesh.services.parameter_server.guard import Evaluated

Report = Callable[[int, float, float], Awaitable[None]]
"""``report(version, loss, accuracy)``."""
Assemble = Callable[[int, dict[str, np.ndarray]], Awaitable[dict[str, np.ndarray] | None]]
"""``assemble(version, rows)``: a sharded server's whole model at ``version`` from its own rows (None: not now)."""


class Evaluator:
    """The model and the held-out split of the job's data set."""

    def __init__(self, config: Config, job: JobSpec | None = None) -> None:
        self.cfg = config
        self.job = job
        self.local = job is not None and job.evaluation.local
        """Evaluated on the devices' validation shares, not here."""
        self.last_accuracy: float | None = None
        self.last_loss: float | None = None
        self.last: Evaluated | None = None
        """The latest evaluation, with the state evaluated when it was this server's own."""
        self._reports: dict[str, LocalEvaluation] = {}
        self._model: Any = None
        self.buffers: dict[str, bool] = {}
        """The model's buffers (``load``): name -> whether it holds integers."""
        self._test_set: Any = None
        self._last_version = -1
        self._last_time = -float("inf")
        self._evaluated = -1
        """Version of the last model evaluated."""
        self._wake = asyncio.Event()
        self._next: tuple[int, dict[str, np.ndarray]] | None = None
        self._model_lock = threading.Lock()
        """One evaluation at a time: a job's final one may come while one during training still runs, in another
        thread, on the same module (the weights of one would be scored by the other's forward passes)."""
        self.enabled = True
        """False on a parameter server shard other than the first: that one evaluates the whole model."""
        self.assemble: Assemble | None = None
        """Set on a sharded server's first shard: the whole model from the rows it keeps."""

    def load(self) -> dict[str, np.ndarray]:
        """Build the model and read the held-out split (in a thread); the model's initial state (parameters and
        buffers)."""
        t, job = self.cfg.training, self.job
        self._model = models.build_model(t.model_spec, seed=t.seed)
        self.buffers = models.buffer_kinds(self._model)
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
        self.last = Evaluated(min(r.version for r in latest), loss, accuracy)
        return self.last.version, loss, accuracy

    def offer(self, version: int, params: Mapping[str, np.ndarray]) -> None:
        """Hand ``params`` over if an evaluation is due at ``version`` (and there is a held-out set here)."""
        if self.local or not self.enabled:
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
            if self.assemble is not None:
                whole = await self.assemble(version, params)
                if whole is None:
                    continue
                params = whole
            started = time.perf_counter()
            loss, accuracy = await asyncio.to_thread(self._evaluate, params)
            took = time.perf_counter() - started
            self.last_accuracy, self.last_loss, self._evaluated = accuracy, loss, version
            self.last = Evaluated(version, loss, accuracy, params)
            await report(version, loss, accuracy)
            # the budget: the newest model handed over meanwhile waits its turn
            await asyncio.sleep(took * (1 / self.cfg.ps.eval_budget - 1))

    async def final(self, version: int, params: Mapping[str, np.ndarray], report: Report) -> None:
        """Evaluate ``params`` (version ``version``) now, outside the budget, unless that version was the last
        evaluated: a job's end, so that its last state gives its last model's accuracy."""
        if self.local or self._test_set is None or version == self._evaluated:
            return
        loss, accuracy = await asyncio.to_thread(self._evaluate, params)
        self.last_accuracy, self.last_loss, self._evaluated = accuracy, loss, version
        self.last = Evaluated(version, loss, accuracy, dict(params))
        await report(version, loss, accuracy)

    def _evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        torch.set_num_threads(self.cfg.ps.eval_threads)  # per thread: the executor's threads each keep their own
        with self._model_lock:
            models.set_params(self._model, params)
            return models.evaluate(self._model, self._test_set)
