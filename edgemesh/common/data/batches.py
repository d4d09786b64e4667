"""Mini-batches: an endless reshuffling iterator, and the batch of a step as a pure function of the seed."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from edgemesh.common.data.dataset import Dataset
from edgemesh.common.errors import DataError


class BatchIterator(Iterator[tuple[np.ndarray, np.ndarray]]):
    """Endless ``(x, y)`` mini-batches over a data set, reshuffled every epoch.

    ``batch_size`` may be changed between batches; the current epoch continues with the
    new size. The last batch of an epoch may be smaller, but not a single sample when batches are
    larger: a last sample left over joins the batch before it (a batch norm layer cannot normalize
    one value per channel, and such a model's step on it fails). ``epoch`` counts the full passes
    completed so far. A batch size larger than the data set yields the whole set.
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, seed: int = 0) -> None:
        if len(dataset) == 0:
            raise DataError(f"cannot iterate over empty dataset {dataset.name!r}")
        self._dataset = dataset
        self._rng = np.random.default_rng(seed)
        self._batch_size = _check_batch_size(batch_size)
        self._order = self._rng.permutation(len(dataset))
        self._position = 0
        self.epoch = 0

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batch_size = _check_batch_size(value)

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        if self._position >= self._order.shape[0]:
            self._order = self._rng.permutation(len(self._dataset))
            self._position = 0
        stop = min(self._position + self._batch_size, self._order.shape[0])
        if self._batch_size > 1 and self._order.shape[0] - stop == 1:
            stop += 1  # the epoch's one sample left joins this batch: never a batch of one (class docstring)
        chosen = self._order[self._position : stop]
        self._position = stop
        if stop == self._order.shape[0]:
            self.epoch += 1
        return self._dataset.x[chosen], self._dataset.y[chosen]


def _check_batch_size(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise DataError(f"batch_size must be a positive int, got {value!r}")
    return int(value)


def batch_at(dataset: Dataset, batch_size: int, *, seed: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of ``step``: a pure function of ``(seed, step)``, so every member of a
    model-parallel cluster draws the same samples without talking (``batch_size`` samples without
    replacement, the whole set if it is smaller)."""
    if len(dataset) == 0:
        raise DataError(f"cannot draw batches from empty dataset {dataset.name!r}")
    size = min(_check_batch_size(batch_size), len(dataset))
    rng = np.random.default_rng([seed, step])
    index = np.sort(rng.choice(len(dataset), size=size, replace=False))
    return dataset.x[index], dataset.y[index]
