"""The in-memory :class:`Dataset`, the registry of named data sets and :func:`load_dataset`.

Each module of a data set (``digits``, ``mnist``, ``cifar``) registers its loader under its
name with :func:`register_dataset` when it is imported; the package imports all of them, so
:func:`load_dataset` knows every name in :data:`DATASET_NAMES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import numpy as np

from edgemesh.common.errors import DataError

DATASET_NAMES: Final = ("digits", "mnist-idx", "cifar10", "synthetic-cifar")

UINT8_PIXEL_MAX: Final = 255.0


@dataclass(frozen=True, slots=True)
class Dataset:
    """An in-memory labelled data set.

    ``x`` is float32 of shape (N, *sample_shape) with at least one sample dimension: (N, C, H, W)
    for images, (N, F) for the feature rows of a CSV file. ``y`` is int64 of shape (N,) with labels
    in ``[0, num_classes)``. The stored arrays are read-only views, so a cached data set cannot be
    changed by one of its users.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        if not isinstance(self.x, np.ndarray) or not isinstance(self.y, np.ndarray):
            raise DataError(f"dataset {self.name!r}: x and y must be numpy arrays")
        if self.x.dtype != np.float32 or self.x.ndim < 2:
            raise DataError(
                f"dataset {self.name!r}: x must be float32 of shape (N, *sample_shape) with at least "
                f"one sample dimension, got {self.x.dtype} {self.x.shape}"
            )
        if self.y.dtype != np.int64 or self.y.ndim != 1:
            raise DataError(
                f"dataset {self.name!r}: y must be int64 of shape (N,), got {self.y.dtype} {self.y.shape}"
            )
        if self.x.shape[0] != self.y.shape[0]:
            raise DataError(f"dataset {self.name!r}: {self.x.shape[0]} samples but {self.y.shape[0]} labels")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int):
            raise DataError(f"dataset {self.name!r}: num_classes must be an int")
        if self.num_classes < 1:
            raise DataError(f"dataset {self.name!r}: num_classes must be >= 1, got {self.num_classes}")
        if self.y.size and (int(self.y.min()) < 0 or int(self.y.max()) >= self.num_classes):
            raise DataError(
                f"dataset {self.name!r}: labels must lie in [0, {self.num_classes}), "
                f"got [{int(self.y.min())}, {int(self.y.max())}]"
            )
        object.__setattr__(self, "x", _read_only_view(self.x))
        object.__setattr__(self, "y", _read_only_view(self.y))

    def __len__(self) -> int:
        return int(self.y.shape[0])


def _read_only_view(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


# --------------------------------------------------------------------------- loading


class DatasetLoader(Protocol):
    """Loads one named data set from the arguments of :func:`load_dataset`, as given."""

    def __call__(self, path: str | Path | None, *, test_fraction: float, seed: int) -> tuple[Dataset, Dataset]: ...


_LOADERS: dict[str, DatasetLoader] = {}


def register_dataset(name: str) -> Callable[[DatasetLoader], DatasetLoader]:
    """Decorator: ``load_dataset(name, ...)`` calls the decorated loader (``name`` must be in DATASET_NAMES)."""
    if name not in DATASET_NAMES:
        raise ValueError(f"dataset {name!r} is not in DATASET_NAMES")

    def register(loader: DatasetLoader) -> DatasetLoader:
        _LOADERS[name] = loader
        return loader

    return register


def load_dataset(
    name: str,
    path: str | Path | None = None,
    *,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> tuple[Dataset, Dataset]:
    """Load a named data set and return ``(train, test)``.

    ``test_fraction`` and ``seed`` choose the stratified split of ``"digits"`` (``seed`` also the
    images of ``"synthetic-cifar"``); MNIST and CIFAR-10 come with their official train/test split
    and ignore them. ``path`` is the directory holding the MNIST IDX files, or the
    ``cifar-10-batches-py`` directory.
    """
    if name not in DATASET_NAMES:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(DATASET_NAMES)}")
    return _LOADERS[name](path, test_fraction=test_fraction, seed=seed)


def require_dir(name: str, path: str | Path | None) -> Path:
    """``path`` as the existing directory data set ``name`` is read from (DataError if none)."""
    if path is None:
        raise DataError(f"dataset {name!r} needs a directory path")
    directory = Path(path)
    if not directory.is_dir():
        raise DataError(f"dataset {name!r}: directory {str(directory)!r} does not exist")
    return directory
