"""Tests for edgemesh.common.data's federated partitions: split_indices (IID, weighted, Dirichlet) and shard."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import label_distribution
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemesh.common.data import load_dataset, shard, split_indices
from edgemesh.common.errors import DataError

# --------------------------------------------------------------------------- helpers


def _mean_tv_distance(labels: np.ndarray, shards: list[np.ndarray], num_classes: int) -> float:
    """Mean total-variation distance between each shard's label mix and the global one."""
    overall = label_distribution(labels, num_classes)
    return float(
        np.mean([0.5 * np.abs(label_distribution(labels[s], num_classes) - overall).sum() for s in shards])
    )


# --------------------------------------------------------------------------- splits


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_split_is_a_deterministic_partition(scheme: str) -> None:
    labels = load_dataset("digits")[0].y
    shards = split_indices(labels, 7, scheme=scheme, alpha=0.3, seed=11)
    assert len(shards) == 7
    assert all(s.size > 0 for s in shards)
    everything = np.concatenate(shards)
    assert everything.size == labels.size  # disjoint ...
    np.testing.assert_array_equal(np.sort(everything), np.arange(labels.size))  # ... and covering
    again = split_indices(labels, 7, scheme=scheme, alpha=0.3, seed=11)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))
    other = split_indices(labels, 7, scheme=scheme, alpha=0.3, seed=12)
    assert not all(np.array_equal(a, b) for a, b in zip(shards, other, strict=True))


def test_iid_split_sizes_are_near_equal() -> None:
    sizes = [s.size for s in split_indices(np.zeros(103, dtype=np.int64), 10)]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_small_alpha_is_skewed_compared_with_iid() -> None:
    labels = load_dataset("digits")[0].y
    iid = _mean_tv_distance(labels, split_indices(labels, 10, scheme="iid", seed=0), 10)
    skewed = _mean_tv_distance(labels, split_indices(labels, 10, scheme="dirichlet", alpha=0.1, seed=0), 10)
    mild = _mean_tv_distance(labels, split_indices(labels, 10, scheme="dirichlet", alpha=100.0, seed=0), 10)
    assert iid < 0.15
    assert skewed > 0.5
    assert skewed > 3 * iid
    assert mild < skewed


def test_dirichlet_repairs_empty_shards() -> None:
    labels = np.repeat(np.arange(3), 10)
    shards = split_indices(labels, 30, scheme="dirichlet", alpha=0.01, seed=5)
    assert [s.size for s in shards] == [1] * 30
    shards = split_indices(labels, 12, scheme="dirichlet", alpha=0.01, seed=5)
    assert all(s.size > 0 for s in shards)
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(30))


@settings(max_examples=60, deadline=None)
@given(
    labels=st.lists(st.integers(0, 4), min_size=1, max_size=80),
    data=st.data(),
    scheme=st.sampled_from(["iid", "dirichlet"]),
    alpha=st.floats(0.01, 50.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_split_invariants_hold_for_any_input(
    labels: list[int], data: st.DataObject, scheme: str, alpha: float, seed: int
) -> None:
    num_shards = data.draw(st.integers(1, len(labels)))
    shards = split_indices(np.array(labels), num_shards, scheme=scheme, alpha=alpha, seed=seed)
    assert len(shards) == num_shards
    assert all(s.size > 0 for s in shards)
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(len(labels)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_shards": 0}, "num_shards"),
        ({"num_shards": 11}, "num_shards"),
        ({"num_shards": 2, "scheme": "pathological"}, "scheme"),
        ({"num_shards": 2, "scheme": "dirichlet", "alpha": 0.0}, "alpha"),
        ({"num_shards": 2, "scheme": "dirichlet", "alpha": float("nan")}, "alpha"),
    ],
)
def test_split_validates_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(DataError, match=match):
        split_indices(np.arange(10) % 2, **kwargs)  # type: ignore[arg-type]


def test_split_rejects_non_flat_labels() -> None:
    with pytest.raises(DataError, match="1-D"):
        split_indices(np.zeros((4, 2), dtype=np.int64), 2)


def test_shard_returns_matching_subsets() -> None:
    train = load_dataset("digits")[0]
    indices = split_indices(train.y, 4, scheme="dirichlet", alpha=0.5, seed=2)
    parts = [shard(train, i, 4, scheme="dirichlet", alpha=0.5, seed=2) for i in range(4)]
    assert sum(len(p) for p in parts) == len(train)
    for part, idx in zip(parts, indices, strict=True):
        np.testing.assert_array_equal(part.y, train.y[idx])
        np.testing.assert_array_equal(part.x, train.x[idx])
        assert part.num_classes == train.num_classes
    with pytest.raises(DataError, match="index"):
        shard(train, 4, 4)
    with pytest.raises(DataError, match="index"):
        shard(train, -1, 4)


def test_iid_shards_can_follow_uneven_batches() -> None:
    """A shard that trains three times the samples per iteration holds three times the data."""
    labels = np.arange(600) % 10
    sizes = [len(s) for s in split_indices(labels, 3, seed=2, weights=[30, 10, 20])]
    assert sizes == [300, 100, 200]
    together = np.sort(np.concatenate(split_indices(labels, 3, seed=2, weights=[30, 10, 20])))
    np.testing.assert_array_equal(together, np.arange(600))
    with pytest.raises(DataError, match="positive shard weights"):
        split_indices(labels, 3, weights=[1, 0, 1])
