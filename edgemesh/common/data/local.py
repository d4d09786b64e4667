"""A device's own data, named by a training job: :func:`load_local` and the held-out split.

Three formats, each labelled by class NAME (the job's ``classes``; a label is its index there), each read by a
module of its own (``READERS``):

``"image-folder"``
    A directory ``path/<class name>/<file>`` of PNG and JPEG files (``images``). An image Pillow cannot read, or
    larger than :func:`image_pixel_limit`, is skipped and counted (``LocalData.skipped``, logged with the first
    one), up to ``max_skipped_share`` of the folder's image files (``MAX_SKIPPED_SHARE``, 5 %); above it the data
    is refused, naming how many and the first one.
``"csv"``
    A UTF-8 file with a header row, at most ``MAX_CSV_BYTES`` (``csv_file``). ``label_column`` holds the class
    names, every other column is a numeric feature; each row's features are reshaped to ``input_shape``.
``"npz"``
    A numpy archive with arrays ``x`` of shape (N, *input_shape) or (N, prod(input_shape)) (uint8 is
    scaled to [0, 1]) and ``y`` of class indices or names (``npz_file``). Their ``.npy`` headers are read and
    checked first; no pickle is ever loaded.

**Where data is read.** A host passes its data folder (``data_dir``): the job's path is relative to it,
never absolute nor through ``..``, and every file read, symbolic links followed, lies inside it
(:func:`data_path`, ``source``). Errors then name files as the job wrote their path, relative to the folder.

**What errors say.** A device publishes why it left a job, where every device of the fleet reads it, so a
:class:`DataError` names the file, folder, line, column or array index at fault and the rule it breaks, and
never what the file holds: no cell, header, class name from the file, array member or decoder message.

**Bounds.** The samples a device loads take at most ``max_bytes`` (``MAX_DATA_BYTES``) as float32 inputs and
int64 labels, checked before they are read (from an image folder's file count, an npz file's array headers, a
CSV file's rows as they are parsed into a compact buffer). Whatever else goes wrong while loading, a failure of
memory included, is a DataError: the device leaves the job, and its process goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from edgemesh.common.data.csv_file import read_csv
from edgemesh.common.data.dataset import Dataset
from edgemesh.common.data.images import MAX_SKIPPED_SHARE, read_image_folder
from edgemesh.common.data.npz_file import read_npz
from edgemesh.common.data.source import DataSource, Expected, Samples
from edgemesh.common.errors import DataError

logger = logging.getLogger(__name__)

READERS: Final[dict[str, Callable[[DataSource, Expected], Samples]]] = {
    "image-folder": read_image_folder, "csv": read_csv, "npz": read_npz,
}
"""The reader of each data format."""
DATA_FORMATS: Final = tuple(READERS)
MAX_DATA_BYTES: Final = 128 * 2**20
"""Most memory the samples a device loads for a job may take (float32 inputs, int64 labels): 10,900 RGB 32x32
images, 42,000 28x28 grayscale ones. Checked before they are read; loading peaks at about twice it (a validation
share is a copy)."""
@dataclass(frozen=True, slots=True)
class LocalData:
    """The data of one device: a training set, an optional held-out set and how many samples per class."""

    train: Dataset
    validation: Dataset | None
    """``None`` when ``validation_share`` is 0."""
    class_counts: dict[str, int]
    """Samples per class name over train and validation; classes absent on this device are omitted."""
    skipped: int = 0
    """Image files skipped because they cannot be read (at most ``max_skipped_share`` of them)."""
    first_skipped: str = ""
    """The first of them, relative to the image folder ('' if none)."""


def load_local(
    fmt: str,
    path: str | Path,
    *,
    input_shape: tuple[int, ...],
    classes: Sequence[str],
    data_dir: str | Path | None = None,
    validation_share: float = 0.0,
    seed: int = 0,
    label_column: str = "label",
    max_samples: int = 0,
    max_skipped_share: float = MAX_SKIPPED_SHARE,
    max_bytes: int = MAX_DATA_BYTES,
) -> LocalData:
    """Load the data at ``path`` on this device in format ``fmt`` (one of DATA_FORMATS).

    With ``data_dir`` (a host's data folder: ``worker.data_dir``, ``ps.data_dir``), ``path`` is a job's path,
    relative to it (:func:`data_path`), no file is read outside it and errors name files relative to it; without,
    ``path`` is the caller's own and is read as given. ``x`` comes out float32 of shape (N, *input_shape), labels
    index ``classes``. ``max_samples > 0`` keeps that many samples, drawn with ``seed``. ``validation_share`` in
    [0, 1) holds out, per class with at least two samples, round(share * count) samples (at least one), drawn with
    ``seed``; a class with a single sample stays in train. Unreadable images are skipped up to
    ``max_skipped_share`` of an image folder's image files (in [0, 1]; 0: none may be). Data that would take more
    than ``max_bytes`` is refused before it is read. Every failure is a DataError.
    """
    _check_arguments(fmt, input_shape, classes, validation_share=validation_share, max_samples=max_samples,
                     max_skipped_share=max_skipped_share, max_bytes=max_bytes)
    source = DataSource.of(path, data_dir)
    expected = Expected(tuple(input_shape), classes, label_column, max_skipped_share, max_bytes)
    try:
        return _load(fmt, source, expected, validation_share=validation_share, seed=seed, max_samples=max_samples)
    except DataError:
        raise
    except MemoryError as exc:
        raise DataError(f"data '{source.shown}' does not fit in this device's memory") from exc
    except OSError as exc:
        raise DataError(f"data '{source.shown}' cannot be read: {exc.strerror or type(exc).__name__}") from exc
    except Exception as exc:  # the last resort: this device leaves the job, its process goes on
        logger.exception("data '%s' cannot be loaded", source.shown)
        raise DataError(f"data '{source.shown}' cannot be loaded ({type(exc).__name__})") from exc


def _check_arguments(fmt: str, input_shape: tuple[int, ...], classes: Sequence[str], *, validation_share: float,
                     max_samples: int, max_skipped_share: float, max_bytes: int) -> None:
    """DataError naming the first of :func:`load_local`'s arguments that is out of its range."""
    if fmt not in DATA_FORMATS:
        raise DataError(f"unknown data format {fmt!r}; known: {', '.join(DATA_FORMATS)}")
    if isinstance(classes, str) or not classes or len(set(classes)) != len(classes):
        raise DataError(f"classes must be a non-empty list of unique names, got {classes!r}")
    if not input_shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in input_shape):
        raise DataError(f"input_shape must be a non-empty tuple of positive ints, got {input_shape!r}")
    if not 0.0 <= validation_share < 1.0:
        raise DataError(f"validation_share must lie in [0, 1), got {validation_share}")
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < 0:
        raise DataError(f"max_samples must be an int >= 0, got {max_samples!r}")
    if not 0.0 <= max_skipped_share <= 1.0:
        raise DataError(f"max_skipped_share must lie in [0, 1], got {max_skipped_share}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise DataError(f"max_bytes must be a positive int, got {max_bytes!r}")


def _load(fmt: str, source: DataSource, expected: Expected, *, validation_share: float, seed: int,
          max_samples: int) -> LocalData:
    """:func:`load_local` of checked arguments: the format's reader, then at most ``max_samples`` of what it read,
    then the held-out split."""
    if not source.path.exists():
        raise DataError(f"data path '{source.shown}' does not exist on this device")
    samples = READERS[fmt](source, expected)
    x, y = samples.x, samples.y
    if y.shape[0] == 0:
        raise DataError(f"data path '{source.shown}' holds no samples")
    rng = np.random.default_rng(seed)
    if 0 < max_samples < y.shape[0]:
        kept = np.sort(rng.permutation(y.shape[0])[:max_samples])
        x, y = x[kept], y[kept]
    name, classes = f"{fmt}:{source.shown}", expected.classes
    counts = np.bincount(y, minlength=len(classes))
    class_counts = {classes[i]: int(n) for i, n in enumerate(counts) if n > 0}
    train, validation = _split(name, x, y, len(classes), validation_share, rng)
    if validation is None:
        logger.info("loaded %s: %d samples in %d classes", name, len(train), len(class_counts))
    else:
        logger.info("loaded %s: %d train and %d validation samples in %d classes", name, len(train),
                    len(validation), len(class_counts))
    skipped = samples.skipped
    return LocalData(train, validation, class_counts, len(skipped), skipped[0] if skipped else "")


def _split(name: str, x: np.ndarray, y: np.ndarray, classes: int, validation_share: float,
           rng: np.random.Generator) -> tuple[Dataset, Dataset | None]:
    """The training set and the held-out one (None at a share of 0)."""
    if validation_share == 0.0:
        return Dataset(name, np.ascontiguousarray(x), y, classes), None
    held = _validation_indices(y, validation_share, rng)
    if held.size == 0:
        raise DataError(f"{name}: validation_share={validation_share} leaves no validation samples")
    if held.size == y.shape[0]:
        raise DataError(f"{name}: validation_share={validation_share} leaves no training samples")
    in_train = np.ones(y.shape[0], dtype=bool)
    in_train[held] = False
    train = Dataset(name, np.ascontiguousarray(x[in_train]), y[in_train], classes)
    return train, Dataset(f"{name}:validation", np.ascontiguousarray(x[held]), y[held], classes)


def _validation_indices(labels: np.ndarray, share: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices held out: per class of 2+ samples, max(1, round(share * count)) of them."""
    picked = [np.empty(0, dtype=np.int64)]
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        if members.size >= 2:
            picked.append(rng.permutation(members)[: max(1, round(share * members.size))])
    return np.sort(np.concatenate(picked))
