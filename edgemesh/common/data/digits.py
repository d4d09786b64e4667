"""``"digits"``: scikit-learn's bundled 8x8 digits, with a stratified train/test split."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import logging
from pathlib import Path
from typing import Final

import numpy as np

from edgemesh.common.data.dataset import Dataset, register_dataset
from edgemesh.common.errors import DataError

logger = logging.getLogger(__name__)

DIGITS_PIXEL_MAX: Final = 16.0
DIGITS_COLUMNS: Final = 65
"""64 pixels and the label per row of scikit-learn's digits.csv.gz."""


def _read_digits_csv() -> tuple[np.ndarray, np.ndarray]:
    """The digits data set as scikit-learn ships it (``datasets/data/digits.csv.gz``).

    Read straight from the package data: importing scikit-learn would cost a worker about
    90 MiB of memory, a tenth of a Raspberry Pi 3.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits data set needs scikit-learn installed (pip install scikit-learn)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    try:
        with gzip.open(path, "rt") as fh:
            table = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read the digits data set ({type(exc).__name__})") from exc
    if table.ndim != 2 or table.shape[1] != DIGITS_COLUMNS:
        raise DataError(f"{path}: expected {DIGITS_COLUMNS} columns, got shape {table.shape}")
    return np.ascontiguousarray(table[:, :-1]), table[:, -1].astype(np.int64)


def stratified_test_indices(labels: np.ndarray, test_fraction: float, seed: int) -> np.ndarray:
    """Indices of a held-out split with each class in proportion, deterministic for ``seed``."""
    rng = np.random.default_rng(seed)
    picked = []
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        picked.append(members[: int(round(len(members) * test_fraction))])
    return np.sort(np.concatenate(picked))


@functools.lru_cache(maxsize=8)
def _load_digits(test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    pixels, labels = _read_digits_csv()
    x = (pixels.reshape(-1, 8, 8) / np.float32(DIGITS_PIXEL_MAX))[:, None, :, :]
    y = labels
    test_idx = stratified_test_indices(y, test_fraction, seed)
    if len(test_idx) == 0 or len(test_idx) == len(y):
        raise DataError(f"digits: cannot split with test_fraction={test_fraction}")
    train_mask = np.ones(len(y), dtype=bool)
    train_mask[test_idx] = False
    x_train, y_train = x[train_mask], y[train_mask]
    x_test, y_test = x[test_idx], y[test_idx]
    num_classes = int(y.max()) + 1
    logger.debug("digits loaded: %d train, %d test (seed=%d)", len(y_train), len(y_test), seed)
    return (
        Dataset("digits-train", np.ascontiguousarray(x_train), np.ascontiguousarray(y_train), num_classes),
        Dataset("digits-test", np.ascontiguousarray(x_test), np.ascontiguousarray(y_test), num_classes),
    )


@register_dataset("digits")
def _digits(path: str | Path | None, *, test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """``"digits"`` ignores ``path``; the split is cached per ``(test_fraction, seed)``."""
    return _load_digits(float(test_fraction), int(seed))
