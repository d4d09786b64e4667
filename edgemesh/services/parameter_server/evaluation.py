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

No device decides alone (docs/synchronization.md#what-the-parameter-server-refuses). A report is refused (counted on
``rejected_total{route="evaluation"}``, logged, the service goes on) from a device the plan does not name
(``unknown_device``), for a version the model has not reached (``future``), or claiming more samples than the
validation share the device announced in its retained status (``DeviceStatus.validation_samples``), or from a device
that announced none (``samples``). And the devices' accuracy ends a job at its target only when a quorum of them
agree (:meth:`Evaluator.quorum`): at least ``QUORUM_MIN_DEVICES``, and more than half of the plan's devices that
evaluate (each alone in its cluster: a model-parallel member holds a slice of the model and does not), each with its
own latest report at or above the target.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edgemesh.common import models
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.data import load_dataset, load_local
from edgemesh.common.errors import WireError
from edgemesh.common.jobs import JobSpec
from edgemesh.common.messages import DeviceStatus, LocalEvaluation, Plan
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.services.parameter_server.guard import Evaluated

Report = Callable[[int, float, float], Awaitable[None]]
"""``report(version, loss, accuracy)``."""
Assemble = Callable[[int, dict[str, np.ndarray]], Awaitable[dict[str, np.ndarray] | None]]
"""``assemble(version, rows)``: a sharded server's whole model at ``version`` from its own rows (None: not now)."""
QUORUM_MIN_DEVICES = 2
"""Fewest devices whose own reports must reach a job's target before their accuracy ends it: never one alone (a job
evaluated on a single device ends at its other limits)."""


@dataclass(frozen=True, slots=True)
class Quorum:
    """How many of the plan's evaluating devices agree that the target is reached, and how many must."""

    agreeing: int
    needed: int
    devices: int

    @property
    def met(self) -> bool:
        return self.agreeing >= self.needed

    def __str__(self) -> str:
        return f"{self.agreeing} of {self.devices} devices agree, {self.needed} needed"


def quorum_of(devices: int) -> int:
    """Devices that must agree among ``devices`` that evaluate: more than half, and at least QUORUM_MIN_DEVICES."""
    return max(QUORUM_MIN_DEVICES, devices // 2 + 1)


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
        self.shares: dict[str, tuple[int, int]] = {}
        """Device -> (incarnation, samples of its validation share), from its latest ``online`` status."""
        self.planned: frozenset[str] = frozenset()
        """The devices of the current plan."""
        self.evaluating: frozenset[str] = frozenset()
        """Those of them that evaluate: alone in their cluster."""
        self._model: Any = None
        self.buffers: dict[str, bool] = {}
        """The model's buffers (``load``): name -> whether it holds integers."""
        self.momenta: dict[str, float] = {}
        """Its running averages (``load``): name -> momentum."""
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
        self.buffers, self.momenta = models.buffer_kinds(self._model), models.buffer_momenta(self._model)
        if job is not None and job.evaluation.path:
            self._test_set = load_local(job.data.format, job.evaluation.path, data_dir=self.cfg.ps.data_dir,
                                        input_shape=job.model.input_shape, classes=job.model.classes,
                                        label_column=job.data.label_column).train
        elif not self.local:
            _, self._test_set = load_dataset(t.dataset, t.dataset_path or None, seed=t.seed)
        return models.get_params(self._model)

    @property
    def chance(self) -> float | None:
        """One over the held-out set's classes (None before ``load``, or when the devices evaluate)."""
        return 1 / self._test_set.num_classes if self._test_set is not None else None

    def attach(self, bus: Bus, topics: Topics, *, version: Callable[[], int], report: Report) -> None:
        """Evaluated on the devices: hear their statuses (which bound their reports) and their reports, and
        ``report`` the devices' combined accuracy as the model's (a report that may not count raises WireError:
        counted and logged by the bus)."""
        if not self.local:
            return

        async def status(message: DeviceStatus, _: TopicMatch) -> None:
            self.know(message)

        async def evaluated(message: LocalEvaluation, _: TopicMatch) -> None:
            combined = self.combine(message, version())
            if combined is not None:
                await report(*combined)

        bus.route(topics.status_filter(), DeviceStatus, status)
        bus.route(topics.evaluation_filter(), LocalEvaluation, evaluated)

    def replanned(self, plan: Plan) -> None:
        """The plan whose devices' reports count; a device's report from before it is kept while it stays."""
        self.planned = frozenset(d.device for d in plan.devices)
        self.evaluating = frozenset(d.device for d in plan.devices
                                    if len(c.members if (c := plan.cluster(d.cluster)) else ()) <= 1)
        for gone in set(self._reports) - self.planned:
            del self._reports[gone]

    def know(self, status: DeviceStatus) -> None:
        """A device's retained status: an ``online`` one gives the samples of its validation share (a later
        incarnation's replaces an earlier's; ``offline`` and ``left`` change nothing: the share is the same)."""
        known = self.shares.get(status.device)
        if status.state == "online" and (known is None or status.incarnation >= known[0]):
            self.shares[status.device] = (status.incarnation, status.validation_samples)

    def check(self, report: LocalEvaluation, version: int) -> None:
        """Raise WireError unless ``report`` may count while the model is at ``version`` (module docstring)."""
        if report.device not in self.planned:
            raise WireError(f"an evaluation from {report.device}, which the plan does not name", "unknown_device")
        if report.version > version:
            raise WireError(f"{report.device} evaluated version {report.version}; the model is at {version}",
                            "future")
        share = self.shares.get(report.device, (0, 0))[1]
        if report.samples > share:
            raise WireError(f"{report.device} claims {report.samples} evaluated samples; its status announced "
                            + (f"{share} in its validation share" if share else "no validation share"), "samples")

    def combine(self, report: LocalEvaluation, version: int) -> tuple[int, float, float] | None:
        """(version, loss, accuracy) over the latest report of every device in the plan, weighted by their samples,
        once ``report`` is in; None while no device of the plan has reported. A report that may not count
        (:meth:`check`, at model ``version``) raises WireError and changes nothing."""
        self.check(report, version)
        self._reports[report.device] = report
        latest = [r for name, r in self._reports.items() if name in self.planned and r.samples]
        if not latest:
            return None
        samples = sum(r.samples for r in latest)
        accuracy, loss = sum(r.correct for r in latest) / samples, sum(r.loss_sum for r in latest) / samples
        self.last_accuracy, self.last_loss = accuracy, loss
        self.last = Evaluated(min(r.version for r in latest), loss, accuracy)
        return self.last.version, loss, accuracy

    def quorum(self, target: float) -> Quorum | None:
        """Under local evaluation, how many of the plan's evaluating devices report ``target`` reached on their own
        shares, and how many must (None: this server evaluates the model itself, and its accuracy counts)."""
        if not self.local:
            return None
        agreeing = sum(1 for name, r in self._reports.items()
                       if name in self.evaluating and r.samples and r.correct / r.samples >= target)
        return Quorum(agreeing, quorum_of(len(self.evaluating)), len(self.evaluating))

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
