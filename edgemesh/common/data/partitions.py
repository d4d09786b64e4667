"""Federated partitions: disjoint, non-empty shards of a data set, IID or label-skewed (Dirichlet)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np

from edgemesh.common.data.dataset import Dataset
from edgemesh.common.errors import DataError

SPLIT_SCHEMES: Final = ("iid", "dirichlet")


def split_indices(
    labels: np.ndarray,
    num_shards: int,
    *,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    weights: Sequence[float] | None = None,
) -> list[np.ndarray]:
    """Split sample indices into ``num_shards`` disjoint, non-empty, sorted int64 arrays.

    ``"iid"`` shuffles and cuts into near-equal parts, or into parts in proportion to
    ``weights`` (one per shard: a shard that trains more samples per iteration holds more, so
    that every sample is drawn about as often and uneven batches do not bias the gradient).
    ``"dirichlet"`` draws, for each class, the proportions of that class given to each shard
    from Dirichlet(alpha) (``weights`` do not apply): small alpha
    means each shard sees few classes. Empty shards are repaired by moving samples from the
    largest shard. The result depends only on the arguments.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"labels must be 1-D, got shape {labels.shape}")
    if isinstance(num_shards, bool) or not isinstance(num_shards, int | np.integer):
        raise DataError(f"num_shards must be an int, got {num_shards!r}")
    if not 1 <= num_shards <= labels.shape[0]:
        raise DataError(f"num_shards must lie in [1, {labels.shape[0]}], got {num_shards}")
    if scheme not in SPLIT_SCHEMES:
        raise DataError(f"unknown split scheme {scheme!r}; known: {', '.join(SPLIT_SCHEMES)}")
    if not (alpha > 0 and np.isfinite(alpha)):
        raise DataError(f"alpha must be a positive finite number, got {alpha}")
    if weights is not None and (len(weights) != num_shards or not all(w > 0 and np.isfinite(w) for w in weights)):
        raise DataError(f"need {num_shards} positive shard weights, got {list(weights)}")
    rng = np.random.default_rng(seed)
    if scheme == "iid" and weights is not None:
        order = rng.permutation(labels.shape[0])
        cuts = np.round(np.cumsum(weights)[:-1] / sum(weights) * labels.shape[0]).astype(np.int64)
        shards = np.split(order, cuts)
    elif scheme == "iid":
        shards = np.array_split(rng.permutation(labels.shape[0]), int(num_shards))
    else:
        shards = _dirichlet_shards(labels, int(num_shards), float(alpha), rng)
    return [np.sort(s).astype(np.int64) for s in _repair_empty(shards)]


def _dirichlet_shards(
    labels: np.ndarray, num_shards: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[] for _ in range(num_shards)]
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        proportions = rng.dirichlet(np.full(num_shards, alpha))
        cuts = (np.cumsum(proportions)[:-1] * members.shape[0]).astype(np.int64)
        for shard_id, piece in enumerate(np.split(members, cuts)):
            parts[shard_id].append(piece)
    return [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in parts]


def _repair_empty(shards: list[np.ndarray]) -> list[np.ndarray]:
    """Give each empty shard one sample taken from the currently largest shard."""
    shards = [np.asarray(s, dtype=np.int64) for s in shards]
    for i, current in enumerate(shards):
        if current.size:
            continue
        donor = max(range(len(shards)), key=lambda j: (shards[j].size, -j))
        shards[i] = shards[donor][-1:]
        shards[donor] = shards[donor][:-1]
    return shards


def shard(
    dataset: Dataset,
    index: int,
    count: int,
    *,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    weights: Sequence[float] | None = None,
) -> Dataset:
    """Return the ``index``-th of ``count`` shards of ``dataset`` (see :func:`split_indices`)."""
    if not isinstance(index, int | np.integer) or not 0 <= index < count:
        raise DataError(f"shard index must lie in [0, {count}), got {index!r}")
    indices = split_indices(dataset.y, count, scheme=scheme, alpha=alpha, seed=seed, weights=weights)[index]
    return Dataset(
        f"{dataset.name}[{index}/{count}]", dataset.x[indices], dataset.y[indices], dataset.num_classes
    )
