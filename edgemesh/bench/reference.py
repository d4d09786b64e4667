"""The plain PyTorch reference of ``bench models``: one process training a job's model on the pooled data.

The module is the job's own (built through the job's model spec, so its normalization is the fleet's), trained
with ``torch.optim.SGD`` (the job's learning rate, momentum and weight decay) on mini-batches of the job's batch
size, drawn the way a worker draws them (:class:`~edgemesh.common.data.BatchIterator`: reshuffled every epoch,
the last batch of an epoch may be smaller), and evaluated in eval mode on the held-out set whenever the samples
it trained on reach one of ``checkpoints``. No I/O: the caller loads the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edgemesh.common.data import BatchIterator, Dataset


@dataclass(frozen=True, slots=True)
class Curve:
    """The held-out accuracy of a reference run at each checkpoint it passed."""

    points: tuple[tuple[int, float], ...]
    """(samples trained on, accuracy), in order of samples."""
    seconds: float

    def at(self, samples: int) -> float | None:
        """The accuracy at the first checkpoint at or past ``samples``."""
        return next((accuracy for seen, accuracy in self.points if seen >= samples), None)

    def reaching(self, accuracy: float) -> int | None:
        """The samples at the first checkpoint whose accuracy is at least ``accuracy`` (None: none is)."""
        return next((seen for seen, reached in self.points if reached >= accuracy), None)

    def best_at(self, samples: Sequence[int]) -> float | None:
        """The best accuracy at the first checkpoint at or past each of ``samples``: the pick a run evaluated at
        those points has."""
        found = [accuracy for accuracy in map(self.at, samples) if accuracy is not None]
        return max(found, default=None)

    def best(self, samples: int) -> float | None:
        """The best accuracy at the checkpoints up to the first at or past ``samples``."""
        upto = [accuracy for seen, accuracy in self.points if seen < samples]
        last = self.at(samples)
        return max([*upto, last]) if last is not None else None


def checkpoints(targets: Sequence[int], spacing: int) -> list[int]:
    """Sample counts to evaluate at: every one of ``targets`` and every ``spacing`` samples up to the largest."""
    top = max(targets, default=0)
    return sorted({*targets, *range(spacing, top, spacing)} - {0})


def train(module: object, data: Dataset, held_out: Dataset, *, lr: float, momentum: float, weight_decay: float,
          batch_size: int, seed: int, at: Sequence[int]) -> Curve:
    """Train ``module`` (a ``torch.nn.Module``) until it has seen ``max(at)`` samples; its held-out accuracy each
    time the samples it saw reach one of ``at``."""
    import time

    import torch
    import torch.nn.functional as F
    from torch import nn

    assert isinstance(module, nn.Module)
    started = time.perf_counter()
    wanted = sorted(set(at))
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    batches = BatchIterator(data, batch_size, seed=seed)
    x_held, y_held = torch.tensor(held_out.x), torch.tensor(held_out.y)
    points: list[tuple[int, float]] = []
    seen = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # dropout's draws
        for goal in wanted:
            if points and seen >= goal:
                continue  # the last batch already took it past this one
            module.train()
            while seen < goal:
                x, y = next(batches)
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y)).backward()
                optimizer.step()
                seen += len(y)
            module.eval()
            with torch.no_grad():
                accuracy = float((module(x_held).argmax(dim=1) == y_held).float().mean())
            points.append((seen, round(accuracy, 4)))
    return Curve(points=tuple(points), seconds=round(time.perf_counter() - started, 2))
