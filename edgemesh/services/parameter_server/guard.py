"""The divergence guard: when to roll the model back to its best evaluated version (pure).

Asynchronous training can diverge: a learning rate too high for the fleet's staleness, a burst of stale updates,
an operator's ``set-lr``. The guard watches every evaluation of the model and keeps the best one (highest
accuracy, then lowest loss) with its state. An evaluation whose loss is not finite rolls back at once; one whose
loss exceeds ``loss_factor`` times the best's (and the best's plus ``LOSS_MARGIN``), or whose accuracy lies more
than ``accuracy_drop`` below the best's, or that fell back to chance after the model had learned (``chance``: a
network whose units died answers one class whatever the input, an early collapse a fall of ``accuracy_drop`` from a
best of 0.39 does not reach), rolls back after ``patience`` such evaluations in a row. Where chance is known, the
two accuracy rules wait until the model has learned: its best accuracy clearly above chance and its best loss
clearly below a uniform guess's (``LEARNED_LOSS``). The parameter
server then restores the best state (weights and buffers, momentum cleared), multiplies the learning rate by
``lr_factor`` and goes on from there, as a new version (docs/synchronization.md#the-divergence-guard). After
``max_rollbacks`` the guard only reports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edgemesh.common.config import GuardConfig

CHANCE_MARGIN = 0.05
"""An accuracy at most this above chance (one over the classes) is at chance; a model has learned once its best is
twice this above."""
LEARNED_LOSS = 0.95
"""A model has learned once its best loss is also at most this share of a uniform guess's, ln(classes). Before that
its logits are nearly flat and its accuracy on a small held-out set is noise: an asynchronous batch-norm job on
three classes scored 0.544 at a loss of 1.088 (a uniform guess: 1.099), then 0.33-0.38 as its running statistics
moved, and the accuracy rules rolled it back five times before it learned anything, leaving it a learning rate
too small ever to learn. Five-class models at 0.39, just learning, measured 0.83-0.96 of a uniform guess."""
LOSS_MARGIN = 1.0
"""An exploding loss is also at least this much (nats) above the best's: a best loss of 0.02 rising to 0.09 is
noise, not divergence."""


@dataclass(frozen=True, slots=True)
class Evaluated:
    """One evaluation of the model: its version, loss and accuracy, and the state evaluated (None when the devices
    evaluated it on their own validation shares: the parameter server holds no copy of what they evaluated)."""

    version: int
    loss: float
    accuracy: float
    params: Mapping[str, np.ndarray] | None = None

    def better_than(self, other: Evaluated | None) -> bool:
        """Higher accuracy, or the same with a lower loss; any finite evaluation beats none."""
        if not math.isfinite(self.loss):
            return False
        if other is None:
            return True
        return (self.accuracy, -self.loss) > (other.accuracy, -other.loss)


@dataclass(frozen=True, slots=True)
class Rollback:
    """The guard's verdict: go back to ``to`` because of ``reason``."""

    to: Evaluated
    reason: str


class Guard:
    """The best evaluation so far and the run of bad ones since."""

    def __init__(self, settings: GuardConfig) -> None:
        self.settings = settings
        self.best: Evaluated | None = None
        """The best evaluation whose state the parameter server can go back to (one with ``params``)."""
        self.best_accuracy: float | None = None
        """The best accuracy seen, held state or not (what "far below the best" compares with)."""
        self.best_loss = math.inf
        """The lowest loss seen (whether the model has learned)."""
        self.bad = 0
        """Evaluations in a row that exploded or fell far below the best."""
        self.rollbacks = 0
        self.diverging = ""
        """Why the model diverges where the guard could not (or may no longer) roll back; empty otherwise."""
        self.chance: float | None = None
        """One over the classes of the held-out set (None: not known, no fall back to chance is judged)."""

    def judge(self, evaluated: Evaluated) -> Rollback | None:
        """The rollback ``evaluated`` calls for (None: train on); a good evaluation may become the best."""
        reason = self._trouble(evaluated)
        if not reason:
            self.bad, self.diverging = 0, ""
            if evaluated.better_than(self.best) and evaluated.params is not None:
                self.best = evaluated
            if self.best_accuracy is None or evaluated.accuracy > self.best_accuracy:
                self.best_accuracy = evaluated.accuracy
            self.best_loss = min(self.best_loss, evaluated.loss)
            return None
        self.bad += 1
        at_once = not math.isfinite(evaluated.loss)
        if not (at_once or self.bad >= self.settings.patience):
            return None
        if not self.settings.enabled or self.best is None or self.rollbacks >= self.settings.max_rollbacks:
            self.diverging = f"version {evaluated.version}: {reason}" + (
                f" after {self.rollbacks} rollbacks" if self.rollbacks else "")
            return None
        return Rollback(self.best, reason)

    def rolled_back(self) -> None:
        """The parameter server went back to the best state: the run of bad evaluations starts again."""
        self.rollbacks += 1
        self.bad = 0

    def _trouble(self, e: Evaluated) -> str:
        """Why ``e`` looks like divergence ('' when it does not)."""
        if not math.isfinite(e.loss):
            return "the evaluation loss is not finite"
        s, best = self.settings, self.best
        if best is not None and e.loss > max(s.loss_factor * best.loss, best.loss + LOSS_MARGIN):
            return f"loss {e.loss:.4g} > {s.loss_factor:g} x the best's {best.loss:.4g} (version {best.version})"
        chance = self.chance
        if self.best_accuracy is None or not (chance is None or self.learned):
            return ""
        if e.accuracy < self.best_accuracy - s.accuracy_drop:
            return (f"accuracy {e.accuracy:.4f} is more than {s.accuracy_drop:g} below the best, "
                    f"{self.best_accuracy:.4f}")
        if chance is not None and e.accuracy <= chance + CHANCE_MARGIN:
            return (f"accuracy {e.accuracy:.4f} fell back to chance ({chance:.4f}) from the best, "
                    f"{self.best_accuracy:.4f}")
        return ""

    @property
    def learned(self) -> bool:
        """Whether the model has learned: its best accuracy at least twice ``CHANCE_MARGIN`` above chance and its
        best loss at most ``LEARNED_LOSS`` of a uniform guess's (False while chance is not known)."""
        chance = self.chance
        return (chance is not None and self.best_accuracy is not None
                and self.best_accuracy >= chance + 2 * CHANCE_MARGIN
                and self.best_loss <= LEARNED_LOSS * math.log(1 / chance))
