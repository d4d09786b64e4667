"""Tests for edgemesh.common.data's mini-batches: BatchIterator."""

from __future__ import annotations

import numpy as np
import pytest

from edgemesh.common.data import BatchIterator, Dataset
from edgemesh.common.errors import DataError

# --------------------------------------------------------------------------- helpers


def _tiny_dataset(n: int = 10, num_classes: int = 3) -> Dataset:
    x = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1)
    y = (np.arange(n) % num_classes).astype(np.int64)
    return Dataset("tiny", x, y, num_classes)


# --------------------------------------------------------------------------- batching


def test_batch_iterator_epochs_cover_everything_and_reshuffle() -> None:
    ds = _tiny_dataset(10)
    it = BatchIterator(ds, 4, seed=3)
    epochs: list[list[float]] = []
    sizes: list[int] = []
    for _ in range(2):
        seen: list[float] = []
        start_epoch = it.epoch
        while it.epoch == start_epoch:
            x, y = next(it)
            assert x.shape[1:] == (1, 1, 1) and x.dtype == np.float32 and y.dtype == np.int64
            np.testing.assert_array_equal(y, x[:, 0, 0, 0].astype(np.int64) % 3)  # pairs stay aligned
            seen.extend(x[:, 0, 0, 0].tolist())
            sizes.append(len(y))
        epochs.append(seen)
    assert sizes == [4, 4, 2, 4, 4, 2]
    assert it.epoch == 2
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(10))
    assert epochs[0] != epochs[1]


def test_a_last_sample_left_over_joins_the_batch_before_it() -> None:
    """73 samples in batches of 8: eight of 8, then 9, never a batch of one (a batch norm layer cannot normalize
    one value per channel: a device holding 73 rows of a CSV left its job at its first epoch's end)."""
    for n, batch, sizes in ((73, 8, [8] * 8 + [9]), (9, 4, [4, 5]), (10, 4, [4, 4, 2]), (3, 1, [1, 1, 1])):
        it = BatchIterator(_tiny_dataset(n), batch, seed=1)
        seen: list[float] = []
        got = []
        while it.epoch == 0:
            x, _ = next(it)
            got.append(len(x))
            seen += x[:, 0, 0, 0].tolist()
        assert got == sizes, (n, batch)
        assert sorted(seen) == list(range(n))
        assert len(next(it)[0]) == sizes[0]  # the next epoch starts afresh


def test_batch_iterator_is_deterministic_per_seed() -> None:
    ds = _tiny_dataset(20)

    def first_batches(seed: int) -> list[list[float]]:
        it = BatchIterator(ds, 7, seed=seed)
        return [next(it)[0][:, 0, 0, 0].tolist() for _ in range(6)]

    assert first_batches(1) == first_batches(1)
    assert first_batches(1) != first_batches(2)


def test_batch_iterator_batch_size_can_change_between_batches() -> None:
    ds = _tiny_dataset(10)
    it = BatchIterator(ds, 2)
    seen = next(it)[0][:, 0, 0, 0].tolist()
    it.batch_size = 5
    assert it.batch_size == 5
    x, _ = next(it)
    assert len(x) == 5
    seen += x[:, 0, 0, 0].tolist()
    x, _ = next(it)
    assert len(x) == 3  # rest of the epoch
    seen += x[:, 0, 0, 0].tolist()
    assert sorted(seen) == list(range(10)) and it.epoch == 1
    with pytest.raises(DataError, match="batch_size"):
        it.batch_size = 0
    assert it.batch_size == 5


def test_batch_larger_than_dataset_yields_whole_shard_each_epoch() -> None:
    ds = _tiny_dataset(6)
    it = BatchIterator(ds, 100)
    for expected_epoch in (1, 2, 3):
        x, y = next(it)
        assert len(x) == 6 and sorted(x[:, 0, 0, 0].tolist()) == list(range(6))
        assert it.epoch == expected_epoch
    assert iter(it) is it


def test_batch_iterator_rejects_bad_arguments() -> None:
    with pytest.raises(DataError, match="batch_size"):
        BatchIterator(_tiny_dataset(3), 0)
    empty = Dataset("empty", np.zeros((0, 1, 1, 1), np.float32), np.zeros(0, np.int64), 2)
    with pytest.raises(DataError, match="empty"):
        BatchIterator(empty, 4)


def test_batches_are_writable_copies() -> None:
    ds = _tiny_dataset(4)
    x, _ = next(BatchIterator(ds, 4))
    x[:] = -1.0
    assert ds.x.min() == 0.0
