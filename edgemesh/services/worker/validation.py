"""A job evaluated where its data lives: this device's validation share and its reports on it.

Every ``evaluation.every`` versions of the model (the first update accepted at or past each multiple), the
model's loss and accuracy on the share, computed in the training thread's model between steps, go out as a
``LocalEvaluation`` for the parameter server to combine with the other devices' by their samples (the device's
status names how many it has).
"""

from __future__ import annotations

import asyncio

from edgemesh.common.data import Dataset
from edgemesh.common.messages import LocalEvaluation
from edgemesh.services.worker.source import Held
from edgemesh.services.worker.trainer import Trainer


class ValidationShare:
    """This device's validation share, and the last version it was evaluated at."""

    def __init__(self, data: Dataset, *, every: int, trainer: Trainer, device: str) -> None:
        self.data, self.every, self.trainer, self.device = data, every, trainer, device
        self._evaluated = -1
        """``version // every`` of the last evaluation."""

    def __len__(self) -> int:
        return len(self.data)

    async def report(self, model: Held) -> LocalEvaluation | None:
        """The evaluation of ``model``, if one is due at its version (None otherwise)."""
        if model.version // self.every <= self._evaluated:
            return None
        self._evaluated = model.version // self.every
        loss, accuracy = await asyncio.to_thread(self.trainer.evaluate, self.data, model.params, model.version,
                                                 stamp=model.stamp)
        samples = len(self.data)
        return LocalEvaluation(device=self.device, version=model.version, samples=samples,
                               correct=round(accuracy * samples), loss_sum=loss * samples)
