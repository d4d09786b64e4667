"""The divergence guard at work: every evaluation of the model reported, those during training judged by the guard
(``guard``, pure), and the rollback it calls for done (docs/synchronization.md#the-divergence-guard).

A rollback puts the best evaluated state in place of the model (weights and buffers; momentum cleared) as a new
version, multiplies the learning rate by ``ps.guard.lr_factor`` and checkpoints both, in one hold of the model's
lock: no step lands between, and a crash finds one or the other. The model then goes out whole, and an event says
why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from edgemesh.common.metrics import ServiceMetrics
from edgemesh.services.parameter_server.evaluation import Evaluator
from edgemesh.services.parameter_server.guard import Evaluated, Guard, Rollback
from edgemesh.services.parameter_server.settings import Settings
from edgemesh.services.parameter_server.step import Stepper
from edgemesh.services.runtime import Events

logger = logging.getLogger(__name__)


class Divergence:
    """Where the server's evaluations go: their gauges and event, and the guard's judgement."""

    def __init__(self, guard: Guard, lr_factor: float, metrics: ServiceMetrics, *, evaluator: Evaluator,
                 stepper: Stepper, settings: Settings, kept: Callable[[], dict[str, Any]]) -> None:
        self.guard, self.lr_factor, self.evaluator = guard, lr_factor, evaluator
        self.stepper, self.settings, self.kept = stepper, settings, kept
        self.events: Events | None = None
        self.m_accuracy = metrics.gauge("eval_accuracy_ratio", "Held-out accuracy of the current model")
        self.m_loss = metrics.gauge("eval_loss", "Held-out loss of the current model")
        self.m_rollbacks = metrics.counter("guard_rollbacks", "Rollbacks of the model to its best evaluated version")

    async def report(self, version: int, loss: float, accuracy: float) -> None:
        """An evaluation of the model (a job's final one too): on the gauges, and an event."""
        assert self.events is not None
        self.m_accuracy.set(accuracy)
        self.m_loss.set(loss)
        await self.events.emit("evaluation", f"version {version}: accuracy {accuracy:.4f}, loss {loss:.4f}",
                               version=version, accuracy=accuracy, loss=loss)

    async def evaluated(self, version: int, loss: float, accuracy: float) -> None:
        """An evaluation during training: reported, then judged, and the model rolled back if the guard says so."""
        await self.report(version, loss, accuracy)
        last = self.evaluator.last
        if last is None or last.version != version or version < self.stepper.clock.floor:
            return  # not judged: an evaluation of a model a rollback already left behind
        rollback = self.guard.judge(last)
        if rollback is not None:
            await self._roll_back(rollback)

    async def _roll_back(self, rollback: Rollback) -> None:
        assert self.events is not None
        before = self.settings.lr
        version = await asyncio.to_thread(self._go_back, rollback.to)
        self.guard.rolled_back()
        self.m_rollbacks.inc()
        self.stepper.request_snapshot()
        lr = self.settings.lr
        logger.warning("divergence guard: %s; the model goes back to version %d (accuracy %.4f) as version %d, "
                       "learning rate %g -> %g", rollback.reason, rollback.to.version, rollback.to.accuracy, version,
                       before, lr)
        await self.events.emit("rollback", f"{rollback.reason}: back to version {rollback.to.version} (accuracy "
                               f"{rollback.to.accuracy:.4f}) as version {version}; lr {before:g} -> {lr:g}",
                               version=version, restored=rollback.to.version, accuracy=rollback.to.accuracy, lr=lr)

    def _go_back(self, best: Evaluated) -> int:
        """``best``'s state in place of the model as the next version, the lower learning rate, and a checkpoint of
        both (in a thread, one hold of the lock); the new version."""
        assert best.params is not None
        with self.stepper.lock:
            version = self.stepper.restore(best.params)
            self.settings.lr *= self.lr_factor
            self.stepper.checkpoint_held(self.kept())
        return version
