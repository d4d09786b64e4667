"""A device's own data, named by a training job: :func:`load_local` and the held-out split.

Three formats, each labelled by class NAME (the job's ``classes``; a label is its index there):

``"image-folder"``
    A directory ``path/<class name>/<file>``. Files ending in ``.png``, ``.jpg`` or ``.jpeg``
    (any case) are read with :func:`read_image`: converted to grayscale or RGB by the channel
    count of ``input_shape`` and resized to its height and width. Hidden entries and other
    files are ignored; a subfolder that is not a known class is an error. An image Pillow cannot
    read is skipped and counted (``LocalData.skipped``, logged with the first one), up to
    ``max_skipped_share`` of the folder's image files (``MAX_SKIPPED_SHARE``, 5 %); above it the
    data is refused, naming how many and the first one.
``"csv"``
    A UTF-8 file with a header row. ``label_column`` holds the class names, every other column
    is a numeric feature; each row's features are reshaped to ``input_shape``.
``"npz"``
    A numpy archive, read without pickle, with arrays ``x`` of shape (N, *input_shape) or
    (N, prod(input_shape)) (uint8 is scaled to [0, 1]) and ``y`` of class indices or names.

A device may hold only some of the classes. Every problem is a :class:`DataError` that names
the file, folder, line or column at fault, so an operator can fix the data on the device.
"""

from __future__ import annotations

import csv
import logging
import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
from PIL import Image

from edgemesh.common.data.dataset import UINT8_PIXEL_MAX, Dataset
from edgemesh.common.errors import DataError

logger = logging.getLogger(__name__)

DATA_FORMATS: Final = ("image-folder", "csv", "npz")
IMAGE_SUFFIXES: Final = (".png", ".jpg", ".jpeg")
MAX_SKIPPED_SHARE: Final = 0.05
"""Largest share of an image folder's image files that may be unreadable: those are skipped; above it, the folder is
refused (one broken photo among a thousand does not drop a device's data; a folder of broken files does)."""

_IMAGE_MODES: Final = {1: "L", 3: "RGB"}
"""Pillow mode of an image by the channel count of the model's input."""


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
    """The first of them, relative to the data folder ('' if none)."""


def read_image(path: str | Path, input_shape: tuple[int, ...]) -> np.ndarray:
    """One image file as float32 (C, H, W) in [0, 1], with (C, H, W) = ``input_shape``.

    C = 1 reads the image as grayscale (Pillow mode ``"L"``), C = 3 as ``"RGB"``; it is resized to
    (H, W) with bilinear resampling. DataError naming the file if Pillow cannot read it.
    """
    channels, height, width = _image_shape(input_shape)
    try:
        with Image.open(path) as image:
            converted = image.convert(_IMAGE_MODES[channels])
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DataError(f"image file '{path}' cannot be read: {exc}") from exc
    if converted.size != (width, height):
        converted = converted.resize((width, height), Image.Resampling.BILINEAR)
    pixels = np.asarray(converted, dtype=np.float32) / np.float32(UINT8_PIXEL_MAX)
    return pixels[None, :, :] if channels == 1 else np.ascontiguousarray(pixels.transpose(2, 0, 1))


def load_local(
    fmt: str,
    path: str | Path,
    *,
    input_shape: tuple[int, ...],
    classes: Sequence[str],
    validation_share: float = 0.0,
    seed: int = 0,
    label_column: str = "label",
    max_samples: int = 0,
    max_skipped_share: float = MAX_SKIPPED_SHARE,
) -> LocalData:
    """Load the data at ``path`` on this device in format ``fmt`` (one of DATA_FORMATS).

    ``x`` comes out float32 of shape (N, *input_shape), labels index ``classes``. ``max_samples > 0``
    keeps that many samples, drawn with ``seed``. ``validation_share`` in [0, 1) holds out, per class
    with at least two samples, round(share * count) samples (at least one), drawn with ``seed``;
    a class with a single sample stays in train. Unreadable images are skipped up to ``max_skipped_share``
    of an image folder's image files (in [0, 1]; 0: none may be).
    """
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
    source = Path(path)
    if not source.exists():
        raise DataError(f"data path '{source}' does not exist on this device")
    index = {name: i for i, name in enumerate(classes)}
    shape = tuple(input_shape)
    skipped: list[str] = []
    if fmt == "image-folder":
        if not source.is_dir():
            raise DataError(f"data path '{source}' is not a directory; the image-folder format needs one")
        x, y, skipped = _read_image_folder(source, shape, index, max_skipped_share)
    else:
        if not source.is_file():
            raise DataError(f"data path '{source}' is not a file; the {fmt} format needs one")
        x, y = _read_csv(source, shape, index, label_column) if fmt == "csv" else _read_npz(source, shape, index)
    if y.shape[0] == 0:
        raise DataError(f"data path '{source}' holds no samples")

    rng = np.random.default_rng(seed)
    if 0 < max_samples < y.shape[0]:
        kept = np.sort(rng.permutation(y.shape[0])[:max_samples])
        x, y = x[kept], y[kept]
    name = f"{fmt}:{source}"
    counts = np.bincount(y, minlength=len(classes))
    class_counts = {classes[i]: int(n) for i, n in enumerate(counts) if n > 0}
    first_skipped = skipped[0] if skipped else ""
    if validation_share == 0.0:
        train = Dataset(name, np.ascontiguousarray(x), y, len(classes))
        logger.info("loaded %s: %d samples in %d classes", name, len(train), len(class_counts))
        return LocalData(train, None, class_counts, len(skipped), first_skipped)

    held = _validation_indices(y, validation_share, rng)
    if held.size == 0:
        raise DataError(f"{name}: validation_share={validation_share} leaves no validation samples")
    if held.size == y.shape[0]:
        raise DataError(f"{name}: validation_share={validation_share} leaves no training samples")
    in_train = np.ones(y.shape[0], dtype=bool)
    in_train[held] = False
    train = Dataset(name, np.ascontiguousarray(x[in_train]), y[in_train], len(classes))
    validation = Dataset(f"{name}:validation", np.ascontiguousarray(x[held]), y[held], len(classes))
    logger.info(
        "loaded %s: %d train and %d validation samples in %d classes",
        name,
        len(train),
        len(validation),
        len(class_counts),
    )
    return LocalData(train, validation, class_counts, len(skipped), first_skipped)


def _validation_indices(labels: np.ndarray, share: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices held out: per class of 2+ samples, max(1, round(share * count)) of them."""
    picked = [np.empty(0, dtype=np.int64)]
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        if members.size >= 2:
            picked.append(rng.permutation(members)[: max(1, round(share * members.size))])
    return np.sort(np.concatenate(picked))


def _image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise DataError(f"images need an input_shape of (C, H, W), got {input_shape!r}")
    channels, height, width = input_shape
    if channels not in _IMAGE_MODES:
        raise DataError(f"images are read with 1 (grayscale) or 3 (RGB) channels, input_shape has {channels}")
    return channels, height, width


# --------------------------------------------------------------------------- formats


def _read_image_folder(
    root: Path, input_shape: tuple[int, ...], index: dict[str, int], max_skipped_share: float
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The images and labels, and the image files skipped as unreadable (relative to ``root``, in reading order)."""
    _image_shape(input_shape)  # a bad shape is reported before any file is opened
    images: list[np.ndarray] = []
    labels: list[int] = []
    skipped: list[tuple[str, str]] = []
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        if folder.name not in index:
            raise DataError(f"folder '{folder}' is not one of the job's classes; known: {', '.join(index)}")
        for file in sorted(folder.iterdir()):
            if file.name.startswith(".") or file.suffix.lower() not in IMAGE_SUFFIXES or not file.is_file():
                continue
            try:
                images.append(read_image(file, input_shape))
            except DataError as exc:
                relative = file.relative_to(root).as_posix()
                skipped.append((relative, str(exc.__cause__ or exc).replace(str(file), relative)))
                continue
            labels.append(index[folder.name])
    total = len(images) + len(skipped)
    if skipped and len(skipped) > max_skipped_share * total:
        first, why = skipped[0]
        raise DataError(f"{len(skipped)} of the {total} image files in '{root}' cannot be read, more than the "
                        f"{max_skipped_share:.0%} a device may skip; the first: '{first}' ({why})")
    if skipped:
        first, why = skipped[0]
        logger.warning("%s: skipped %d of the %d image files, which cannot be read (at most %.0f%% may be); "
                       "the first: '%s' (%s)", root, len(skipped), total, max_skipped_share * 100, first, why)
    if not images:
        raise DataError(f"data path '{root}' holds no images ({', '.join(IMAGE_SUFFIXES)}) in class folders")
    return np.stack(images), np.asarray(labels, dtype=np.int64), [relative for relative, _ in skipped]


def _read_csv(
    path: Path, input_shape: tuple[int, ...], index: dict[str, int], label_column: str
) -> tuple[np.ndarray, np.ndarray]:
    needed = math.prod(input_shape)
    rows: list[list[float]] = []
    labels: list[int] = []
    # utf-8-sig: a byte-order mark (as spreadsheets write) is not part of the first column's name
    with open(path, encoding="utf-8-sig", newline="") as handle:
        reader = csv.reader(handle)
        try:
            header = next(reader, None)
            if header is None:
                raise DataError(f"CSV file '{path}' is empty; it needs a header row")
            if label_column not in header:
                raise DataError(f"CSV file '{path}' has no label column {label_column!r}; header: {header}")
            label_at = header.index(label_column)
            features = [i for i in range(len(header)) if i != label_at]
            if len(features) != needed:
                raise DataError(
                    f"CSV file '{path}' has {len(features)} feature columns besides {label_column!r}, "
                    f"the model's input_shape {input_shape} needs {needed}"
                )
            for row in reader:
                if not row:
                    continue
                where = f"CSV file '{path}' line {reader.line_num}"
                if len(row) != len(header):
                    raise DataError(f"{where}: {len(row)} cells, the header has {len(header)}")
                value = row[label_at].strip()
                if value not in index:
                    raise DataError(f"{where}: unknown class {value!r}; known: {', '.join(index)}")
                rows.append([_parse_cell(row[i], where, header[i]) for i in features])
                labels.append(index[value])
        except UnicodeDecodeError as exc:
            raise DataError(f"CSV file '{path}' near line {reader.line_num + 1} is not UTF-8: {exc}") from exc
        except csv.Error as exc:
            raise DataError(f"CSV file '{path}' line {reader.line_num}: {exc}") from exc
    x = np.asarray(rows, dtype=np.float32).reshape(len(rows), *input_shape)
    return x, np.asarray(labels, dtype=np.int64)


def _parse_cell(cell: str, where: str, column: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise DataError(f"{where}: column {column!r} holds {cell!r}, not a number") from None
    if not math.isfinite(value):
        raise DataError(f"{where}: column {column!r} holds {cell!r}, not a finite number")
    return value


def _read_npz(path: Path, input_shape: tuple[int, ...], index: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise DataError(f"npz file '{path}' holds a single array, not an archive with arrays 'x' and 'y'")
        with loaded as archive:
            for key in ("x", "y"):
                if key not in archive.files:
                    raise DataError(f"npz file '{path}' has no array {key!r}; it holds {archive.files}")
            x, y = archive["x"], archive["y"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"npz file '{path}' cannot be read (pickled arrays are never loaded): {exc}") from exc
    accepted = (input_shape, (math.prod(input_shape),))
    if x.ndim < 1 or x.shape[1:] not in accepted:
        expected = " or ".join(f"(N, {', '.join(map(str, s))})" for s in dict.fromkeys(accepted))
        raise DataError(f"npz file '{path}': x has shape {x.shape}, expected {expected}")
    if x.dtype.kind not in "iuf":
        raise DataError(f"npz file '{path}': x must hold numbers, got dtype {x.dtype}")
    pixels = x.astype(np.float32) / np.float32(UINT8_PIXEL_MAX) if x.dtype == np.uint8 else x.astype(np.float32)
    if not np.isfinite(pixels).all():
        raise DataError(f"npz file '{path}': x holds {int((~np.isfinite(pixels)).sum())} non-finite values")
    if y.shape != (x.shape[0],):
        raise DataError(f"npz file '{path}': y has shape {y.shape}, expected ({x.shape[0]},) to match x")
    return pixels.reshape(x.shape[0], *input_shape), _npz_labels(path, y, index)


def _npz_labels(path: Path, y: np.ndarray, index: dict[str, int]) -> np.ndarray:
    if y.dtype.kind in "iu":
        bad = y[(y < 0) | (y >= len(index))]
        if bad.size:
            raise DataError(f"npz file '{path}': label {bad[0]} is outside [0, {len(index)}) of the job's classes")
        return y.astype(np.int64)
    if y.dtype.kind in "US":
        names = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in y.tolist()]
        for value in names:
            if value not in index:
                raise DataError(f"npz file '{path}': unknown class {value!r} in y; known: {', '.join(index)}")
        return np.asarray([index[v] for v in names], dtype=np.int64)
    raise DataError(f"npz file '{path}': y must hold class indices or class names, got dtype {y.dtype}")
