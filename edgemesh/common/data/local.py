"""A device's own data, named by a training job: :func:`load_local` and the held-out split.

Three formats, each labelled by class NAME (the job's ``classes``; a label is its index there):

``"image-folder"``
    A directory ``path/<class name>/<file>``. Files ending in ``.png``, ``.jpg`` or ``.jpeg``
    (any case) are read with :func:`read_image`: decoded by Pillow's PNG or JPEG decoder alone, converted
    to grayscale or RGB by the channel count of ``input_shape`` and resized to its height and width.
    Hidden entries and other files are ignored; a subfolder that is not a known class is an error. An
    image Pillow cannot read, or larger than :func:`image_pixel_limit`, is skipped and counted
    (``LocalData.skipped``, logged with the first one), up to ``max_skipped_share`` of the folder's image
    files (``MAX_SKIPPED_SHARE``, 5 %); above it the data is refused, naming how many and the first one.
``"csv"``
    A UTF-8 file with a header row, at most ``MAX_CSV_BYTES``. ``label_column`` holds the class names,
    every other column is a numeric feature; each row's features are reshaped to ``input_shape``.
``"npz"``
    A numpy archive with arrays ``x`` of shape (N, *input_shape) or (N, prod(input_shape)) (uint8 is
    scaled to [0, 1]) and ``y`` of class indices or names. Their ``.npy`` headers are read and checked
    first; no pickle is ever loaded.

**Where data is read.** A host passes its data folder (``data_dir``): the job's path is relative to it,
never absolute nor through ``..``, and every file read, symbolic links followed, lies inside it
(:func:`data_path`). Errors then name files as the job wrote their path, relative to the folder.

**What errors say.** A device publishes why it left a job, where every device of the fleet reads it, so a
:class:`DataError` names the file, folder, line, column or array index at fault and the rule it breaks, and
never what the file holds: no cell, header, class name from the file, array member or decoder message.

**Bounds.** The samples a device loads take at most ``max_bytes`` (``MAX_DATA_BYTES``) as float32 inputs and
int64 labels, checked before they are read (from an image folder's file count, an npz file's array headers, a
CSV file's rows as they are parsed into a compact buffer). Whatever else goes wrong while loading, a failure of
memory included, is a DataError: the device leaves the job, and its process goes on.
"""

from __future__ import annotations

import array
import csv
import logging
import math
import struct
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, Final

import numpy as np
from numpy.lib import format as npy_format
from PIL import Image

from edgemesh.common.data.dataset import UINT8_PIXEL_MAX, Dataset
from edgemesh.common.errors import DataError

logger = logging.getLogger(__name__)

DATA_FORMATS: Final = ("image-folder", "csv", "npz")
IMAGE_SUFFIXES: Final = (".png", ".jpg", ".jpeg")
IMAGE_DECODERS: Final = ("PNG", "JPEG")
"""The only Pillow decoders a device's image files go to, whatever their names say."""
MAX_SKIPPED_SHARE: Final = 0.05
"""Largest share of an image folder's image files that may be unreadable: those are skipped; above it, the folder is
refused (one broken photo among a thousand does not drop a device's data; a folder of broken files does)."""
MAX_DATA_BYTES: Final = 128 * 2**20
"""Most memory the samples a device loads for a job may take (float32 inputs, int64 labels): 10,900 RGB 32x32
images, 42,000 28x28 grayscale ones. Checked before they are read; loading peaks at about twice it (a validation
share is a copy)."""
MAX_CSV_BYTES: Final = 64 * 2**20
"""Largest CSV file a device reads, checked before it is opened."""
MAX_CSV_CELL_CHARS: Final = 64
"""Most characters a CSV row may take per column the job needs: a longer row is refused before it is split into
cells (a row of millions of cells would take gigabytes as Python strings)."""
MAX_IMAGE_PIXELS: Final = 16 * 2**20
"""Most pixels an image may decode to, unless ``input_shape`` itself is larger (:func:`image_pixel_limit`): a 16
megapixel photo takes at most 128 MiB on its way to ``input_shape``. A JPEG decodes at the smallest of its reduced
scales (1/2, 1/4, 1/8) that is still as large as ``input_shape``, so a camera's photos stay well under it."""
MAX_NPZ_DIRECTORY_BYTES: Final = 64 * 2**10
"""Largest zip directory of an npz file: ``zipfile`` reads it whole, an object per entry, and an npz lists two
arrays."""
READ_CHUNK_BYTES: Final = 4 * 2**20
"""How much of an npz array is read and converted to float32 at a time (no whole copy in its own type)."""
FLOAT32_MAX: Final = float(np.finfo(np.float32).max)

_IMAGE_MODES: Final = {1: "L", 3: "RGB"}
"""Pillow mode of an image by the channel count of the model's input."""
_NPY_MAGIC: Final = b"\x93NUMPY"
_ZIP_END: Final = b"PK\x05\x06"
"""The signature of a zip file's end record: ... total entries (2 bytes at 10), directory size (4 bytes at 12)."""
_ZIP_END_SIZE: Final = 22
_ZIP_COMMENT_MAX: Final = 2**16 - 1
_LABEL_BYTES: Final = 8
"""An int64 label per sample."""


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


@dataclass(frozen=True, slots=True)
class _Source:
    """What :func:`load_local` reads: its real path, how errors name it, and the folder no file of it may leave."""

    path: Path
    shown: str
    """The path as errors name it: as the job wrote it (relative to the data folder), or as the caller gave it."""
    fence: Path | None
    """The host's data folder (its real path), in which every file read must lie; None: the caller's own path."""

    def name(self, entry: Path) -> str:
        """``entry`` (``path`` or a file under it) as errors name it."""
        relative = entry.relative_to(self.path).as_posix()
        return self.shown if relative == "." else f"{self.shown}/{relative}"

    def check_inside(self, entry: Path) -> None:
        """DataError when ``entry``, symbolic links followed, lies outside the data folder."""
        if self.fence is not None and not _real(entry, self.name(entry)).is_relative_to(self.fence):
            raise DataError(f"'{self.name(entry)}' leads out of this host's data folder (a symbolic link); data is "
                            "read only from inside it")


def data_path(path: str, data_dir: str | Path) -> Path:
    """The real path that a job's data ``path`` names on this host, under its data folder ``data_dir`` ('' is the
    working directory), symbolic links followed. DataError, naming ``path`` as the job wrote it, for an absolute
    path, a path through ``..`` and one that leads out of the folder."""
    written = PurePosixPath(path)
    if not path or "\0" in path or written.is_absolute() or ".." in written.parts:
        raise DataError(f"data path {path[:200]!r} must be relative to this host's data folder, without '..'")
    root = _real(Path(data_dir or "."), "this host's data folder")
    real = _real(root / written, repr(path))
    if not real.is_relative_to(root):
        raise DataError(f"data path {path!r} leads out of this host's data folder (a symbolic link); data is read "
                        "only from inside it")
    return real


def _real(path: Path, shown: str) -> Path:
    """``path`` with every symbolic link followed (it need not exist); DataError naming it as ``shown``."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a loop of links (Python 3.11)
        raise DataError(f"{shown} cannot be followed to a file: {type(exc).__name__}") from exc


def image_pixel_limit(input_shape: Sequence[int]) -> int:
    """Most pixels an image may decode to for a model input of ``input_shape``: ``MAX_IMAGE_PIXELS``, or the input's
    own height x width when it is larger."""
    return max(MAX_IMAGE_PIXELS, math.prod(input_shape[1:]))


def read_image(path: str | Path, input_shape: tuple[int, ...]) -> np.ndarray:
    """One image file as float32 (C, H, W) in [0, 1], with (C, H, W) = ``input_shape``.

    C = 1 reads the image as grayscale (Pillow mode ``"L"``), C = 3 as ``"RGB"``; it is resized to
    (H, W) with bilinear resampling. DataError naming the file if it is not a PNG or JPEG file Pillow can
    decode, or if it is larger than :func:`image_pixel_limit`.
    """
    try:
        return _decode(path, input_shape)
    except DataError as exc:
        raise DataError(f"image file '{path}' cannot be read: {exc}") from exc


def _decode(path: str | Path, input_shape: Sequence[int]) -> np.ndarray:
    """:func:`read_image`; DataError with the reason alone, never what the file holds (a decoder's message may)."""
    channels, height, width = _image_shape(tuple(input_shape))
    mode, limit = _IMAGE_MODES[channels], image_pixel_limit(input_shape)
    try:
        with Image.open(path, formats=IMAGE_DECODERS) as image:  # the header alone: nothing is decoded yet
            image.draft(mode, (width, height))  # a JPEG: its smallest reduced scale at least this large
            if image.width * image.height > limit:
                raise DataError(f"it is {image.width}x{image.height} pixels, more than the {limit:,} an image may "
                                f"be for input_shape {tuple(input_shape)}")
            converted = image.convert(mode)
        if converted.size != (width, height):
            converted = converted.resize((width, height), Image.Resampling.BILINEAR)
    except DataError:
        raise
    except MemoryError:
        raise DataError("it does not fit in this device's memory to be decoded") from None
    except Exception as exc:  # Pillow's decoders raise many kinds of error on a damaged or foreign file
        logger.debug("%s: not decoded: %s", path, exc)
        raise DataError(f"not a PNG or JPEG file Pillow can decode ({type(exc).__name__})") from exc
    pixels = np.asarray(converted, dtype=np.float32) / np.float32(UINT8_PIXEL_MAX)
    return pixels[None, :, :] if channels == 1 else np.ascontiguousarray(pixels.transpose(2, 0, 1))


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
    if data_dir is None:
        source = _Source(Path(path), str(path), None)
    else:
        fence = _real(Path(data_dir or "."), "this host's data folder")
        source = _Source(data_path(str(path), data_dir), PurePosixPath(str(path)).as_posix(), fence)
    try:
        return _load(fmt, source, tuple(input_shape), classes, validation_share=validation_share, seed=seed,
                     label_column=label_column, max_samples=max_samples, max_skipped_share=max_skipped_share,
                     max_bytes=max_bytes)
    except DataError:
        raise
    except MemoryError as exc:
        raise DataError(f"data '{source.shown}' does not fit in this device's memory") from exc
    except OSError as exc:
        raise DataError(f"data '{source.shown}' cannot be read: {exc.strerror or type(exc).__name__}") from exc
    except Exception as exc:  # the last resort: this device leaves the job, its process goes on
        logger.exception("data '%s' cannot be loaded", source.shown)
        raise DataError(f"data '{source.shown}' cannot be loaded ({type(exc).__name__})") from exc


def _load(fmt: str, source: _Source, shape: tuple[int, ...], classes: Sequence[str], *, validation_share: float,
          seed: int, label_column: str, max_samples: int, max_skipped_share: float, max_bytes: int) -> LocalData:
    """:func:`load_local` of checked arguments."""
    if not source.path.exists():
        raise DataError(f"data path '{source.shown}' does not exist on this device")
    index = {name: i for i, name in enumerate(classes)}
    skipped: list[str] = []
    if fmt == "image-folder":
        if not source.path.is_dir():
            raise DataError(f"data path '{source.shown}' is not a directory; the image-folder format needs one")
        x, y, skipped = _read_image_folder(source, shape, index, max_skipped_share, max_bytes)
    else:
        if not source.path.is_file():
            raise DataError(f"data path '{source.shown}' is not a file; the {fmt} format needs one")
        if fmt == "csv":
            x, y = _read_csv(source, shape, index, label_column, max_bytes)
        else:
            x, y = _read_npz(source, shape, index, max_bytes)
    if y.shape[0] == 0:
        raise DataError(f"data path '{source.shown}' holds no samples")

    rng = np.random.default_rng(seed)
    if 0 < max_samples < y.shape[0]:
        kept = np.sort(rng.permutation(y.shape[0])[:max_samples])
        x, y = x[kept], y[kept]
    name = f"{fmt}:{source.shown}"
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


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _check_bytes(what: str, samples: int, input_shape: tuple[int, ...], max_bytes: int) -> None:
    """DataError when ``samples`` of ``input_shape`` (float32 inputs, int64 labels) take more than ``max_bytes``."""
    nbytes = samples * (4 * math.prod(input_shape) + _LABEL_BYTES)
    if nbytes > max_bytes:
        raise DataError(f"{what}: {samples:,} samples of shape {input_shape} take {_mib(nbytes)}, more than the "
                        f"{_mib(max_bytes)} a device loads for a job; keep fewer samples on this device")


# --------------------------------------------------------------------------- image folders


def _read_image_folder(
    source: _Source, input_shape: tuple[int, ...], index: dict[str, int], max_skipped_share: float, max_bytes: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The images and labels, and the image files skipped as unreadable (relative to the folder, in reading order)."""
    _image_shape(input_shape)  # a bad shape is reported before any file is opened
    files: list[tuple[Path, int]] = []
    for folder in sorted(source.path.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        if folder.name not in index:
            raise DataError(f"folder '{source.name(folder)}' is not one of the job's classes; known: "
                            f"{', '.join(index)}")
        source.check_inside(folder)
        for file in sorted(folder.iterdir()):
            if file.name.startswith(".") or file.suffix.lower() not in IMAGE_SUFFIXES or not file.is_file():
                continue
            source.check_inside(file)
            files.append((file, index[folder.name]))
    _check_bytes(f"image folder '{source.shown}'", len(files), input_shape, max_bytes)
    images = np.empty((len(files), *input_shape), dtype=np.float32)
    labels = np.empty(len(files), dtype=np.int64)
    read = 0
    skipped: list[tuple[str, str]] = []
    for file, label in files:
        try:
            images[read] = _decode(file, input_shape)
        except DataError as exc:
            skipped.append((file.relative_to(source.path).as_posix(), str(exc)))
            continue
        labels[read] = label
        read += 1
    total = len(files)
    if skipped and len(skipped) > max_skipped_share * total:
        first, why = skipped[0]
        raise DataError(f"{len(skipped)} of the {total} image files in '{source.shown}' cannot be read, more than "
                        f"the {max_skipped_share:.0%} a device may skip; the first: '{first}' ({why})")
    if skipped:
        first, why = skipped[0]
        logger.warning("%s: skipped %d of the %d image files, which cannot be read (at most %.0f%% may be); "
                       "the first: '%s' (%s)", source.shown, len(skipped), total, max_skipped_share * 100, first, why)
    if not read:
        raise DataError(f"data path '{source.shown}' holds no images ({', '.join(IMAGE_SUFFIXES)}) in class folders")
    return images[:read], labels[:read], [relative for relative, _ in skipped]


# --------------------------------------------------------------------------- CSV


class _Rows:
    """The lines of a CSV file for ``csv.reader``, refusing a row (its lines since :meth:`next_row`) longer than
    ``limit`` characters before the csv module splits it into cells."""

    def __init__(self, handle: IO[str], limit: int, name: str) -> None:
        self.handle, self.limit, self.name = handle, limit, name
        self.line = 0
        self.row_chars = 0

    def __iter__(self) -> _Rows:
        return self

    def __next__(self) -> str:
        text = self.handle.readline(self.limit - self.row_chars + 1)
        if not text:
            raise StopIteration
        self.line += 1
        self.row_chars += len(text)
        if self.row_chars > self.limit:
            raise DataError(f"CSV file '{self.name}' line {self.line}: a row longer than {self.limit:,} characters "
                            f"({MAX_CSV_CELL_CHARS} per column the job's input_shape needs)")
        return text

    def next_row(self) -> None:
        self.row_chars = 0


def _read_csv(
    source: _Source, input_shape: tuple[int, ...], index: dict[str, int], label_column: str, max_bytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Features into a float32 buffer and labels into an int64 one as the rows are parsed: no list of Python floats."""
    name, needed = source.shown, math.prod(input_shape)
    size = source.path.stat().st_size
    if size > MAX_CSV_BYTES:
        raise DataError(f"CSV file '{name}' is {_mib(size)}, more than the {_mib(MAX_CSV_BYTES)} a device reads; "
                        "keep fewer rows on this device")
    values = array.array("f")
    labels = array.array("q")
    most = max_bytes // (4 * needed + _LABEL_BYTES)  # rows
    # utf-8-sig: a byte-order mark (as spreadsheets write) is not part of the first column's name
    with open(source.path, encoding="utf-8-sig", newline="") as handle:
        rows = _Rows(handle, MAX_CSV_CELL_CHARS * (needed + 1), name)
        reader = csv.reader(rows)
        try:
            header = next(reader, None)
            if header is None:
                raise DataError(f"CSV file '{name}' is empty; it needs a header row")
            if label_column not in header:
                raise DataError(f"CSV file '{name}' has no label column {label_column!r} in its header row")
            label_at = header.index(label_column)
            features = [i for i in range(len(header)) if i != label_at]
            if len(features) != needed:
                raise DataError(f"CSV file '{name}' has {len(features)} feature columns besides {label_column!r}, "
                                f"the model's input_shape {input_shape} needs {needed}")
            rows.next_row()
            for row in reader:
                rows.next_row()
                if not row:
                    continue
                where = f"CSV file '{name}' line {reader.line_num}"
                if len(row) != len(header):
                    raise DataError(f"{where}: {len(row)} cells, the header has {len(header)}")
                label = index.get(row[label_at].strip())
                if label is None:
                    raise DataError(f"{where}, column {label_at + 1} ({label_column!r}): not one of the job's "
                                    f"classes ({', '.join(index)})")
                values.extend(_parse_cell(row[i], where, i + 1) for i in features)
                labels.append(label)
                if len(labels) > most:
                    _check_bytes(f"CSV file '{name}' by line {reader.line_num}", len(labels), input_shape, max_bytes)
        except UnicodeDecodeError as exc:
            raise DataError(f"CSV file '{name}' near line {reader.line_num + 1} is not UTF-8") from exc
        except csv.Error as exc:  # the csv module's own words (a NUL, a stray quote), never a cell
            raise DataError(f"CSV file '{name}' line {reader.line_num}: {exc}") from exc
    x = np.frombuffer(values, dtype=np.float32).reshape(len(labels), *input_shape)
    return x, np.frombuffer(labels, dtype=np.int64)


def _parse_cell(cell: str, where: str, column: int) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise DataError(f"{where}, column {column}: not a number") from None
    if not abs(value) <= FLOAT32_MAX:  # NaN fails this too
        raise DataError(f"{where}, column {column}: not a finite number that float32 holds")
    return value


# --------------------------------------------------------------------------- npz


@dataclass(frozen=True, slots=True)
class _Header:
    """What an ``.npy`` header says about its array, read before any of the array is."""

    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype[Any]

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def plain(self) -> bool:
        """One number or string per element: no fields, no sub-arrays, no Python objects."""
        return self.dtype.names is None and self.dtype.subdtype is None and not self.dtype.hasobject

    @property
    def type_name(self) -> str:
        return self.dtype.name if self.plain else "a structured or object dtype"


def _read_npz(
    source: _Source, input_shape: tuple[int, ...], index: dict[str, int], max_bytes: int
) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` of the archive, their headers checked (shapes, types, sizes) before any of them is read."""
    where = f"npz file '{source.shown}'"
    with open(source.path, "rb") as handle:
        if handle.read(len(_NPY_MAGIC)) == _NPY_MAGIC:
            raise DataError(f"{where} holds a single array, not an archive with arrays 'x' and 'y'")
        _check_zip_directory(handle, source.path.stat().st_size, where)
        try:
            with zipfile.ZipFile(handle) as archive:
                members = set(archive.namelist())
                x_name, y_name = (_member(members, key, where) for key in ("x", "y"))
                with archive.open(x_name) as x_file, archive.open(y_name) as y_file:
                    x_head, y_head = _npy_header(x_file, f"{where}: x"), _npy_header(y_file, f"{where}: y")
                    _check_npz(where, x_head, y_head, input_shape, max_bytes)
                    x = _read_floats(x_file, x_head, f"{where}: x")
                    y = _read_plain(y_file, y_head, f"{where}: y")
        except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, NotImplementedError) as exc:
            raise DataError(f"{where} cannot be read as a NumPy archive ({type(exc).__name__})") from exc
    if x_head.dtype == np.uint8:
        np.divide(x, np.float32(UINT8_PIXEL_MAX), out=x)
    bad = ~np.isfinite(x)
    if bad.any():
        raise DataError(f"{where}: x holds {int(bad.sum())} non-finite values (as float32); the first at flat "
                        f"index {int(np.flatnonzero(bad)[0])}")
    return x.reshape(x_head.shape[0], *input_shape), _npz_labels(where, y, index)


def _check_zip_directory(handle: IO[bytes], size: int, where: str) -> None:
    """DataError unless the file ends in a zip directory of at most ``MAX_NPZ_DIRECTORY_BYTES``, read from its end
    record before ``zipfile`` reads it whole."""
    tail = min(size, _ZIP_END_SIZE + _ZIP_COMMENT_MAX)
    handle.seek(size - tail)
    end = handle.read(tail)
    at = end.rfind(_ZIP_END)
    if at < 0 or len(end) - at < _ZIP_END_SIZE:
        raise DataError(f"{where} cannot be read as a NumPy archive (it is not a zip file)")
    entries, directory = struct.unpack_from("<HL", end, at + 10)
    if directory > MAX_NPZ_DIRECTORY_BYTES:
        raise DataError(f"{where} lists {entries} entries in a zip directory of {directory:,} bytes, more than the "
                        f"{MAX_NPZ_DIRECTORY_BYTES:,} an archive of arrays 'x' and 'y' needs")
    handle.seek(0)


def _member(members: set[str], key: str, where: str) -> str:
    """The archive's entry of array ``key`` (``np.savez`` names it ``key.npy``)."""
    for candidate in (f"{key}.npy", key):
        if candidate in members:
            return candidate
    raise DataError(f"{where} has no array {key!r}; it needs arrays 'x' and 'y'")


def _npy_header(stream: IO[bytes], what: str) -> _Header:
    """The header of the ``.npy`` array ``stream`` starts with; DataError naming the array when it has none."""
    try:
        version = npy_format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = npy_format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = npy_format.read_array_header_2_0(stream)
        else:
            raise DataError(f"{what}: .npy format version {version[0]}.{version[1]} is not read (1.0 and 2.0 are)")
    except DataError:
        raise
    except Exception as exc:  # numpy's message quotes the header, which is the file's own text
        raise DataError(f"{what} has no valid .npy header ({type(exc).__name__})") from exc
    if any(d < 0 for d in shape):
        raise DataError(f"{what}: its header gives a negative dimension")
    return _Header(tuple(shape), bool(fortran), dtype)


def _check_npz(where: str, x: _Header, y: _Header, input_shape: tuple[int, ...], max_bytes: int) -> None:
    """DataError when the headers of ``x`` and ``y`` do not fit ``input_shape``, or their data would not fit
    ``max_bytes``."""
    for key, head in (("x", x), ("y", y)):
        if head.dtype.hasobject:
            raise DataError(f"{where} cannot be read: {key} is stored as a pickle, and pickled arrays are never "
                            "loaded")
    accepted = (input_shape, (math.prod(input_shape),))
    if len(x.shape) < 1 or x.shape[1:] not in accepted:
        expected = " or ".join(f"(N, {', '.join(map(str, s))})" for s in dict.fromkeys(accepted))
        raise DataError(f"{where}: x has shape {x.shape}, expected {expected}")
    if not x.plain or x.dtype.kind not in "iuf" or x.dtype.itemsize > 8:
        raise DataError(f"{where}: x must hold numbers (integers or floats), got dtype {x.type_name}")
    if y.shape != (x.shape[0],):
        raise DataError(f"{where}: y has shape {y.shape}, expected ({x.shape[0]},) to match x")
    if not y.plain or y.dtype.kind not in "iuUS" or y.dtype.itemsize == 0:
        raise DataError(f"{where}: y must hold class indices or class names, got dtype {y.type_name}")
    _check_bytes(where, x.shape[0], input_shape, max_bytes)
    if y.count * y.dtype.itemsize > max_bytes:
        raise DataError(f"{where}: y takes {_mib(y.count * y.dtype.itemsize)}, more than the {_mib(max_bytes)} a "
                        "device loads for a job")


def _read_floats(stream: IO[bytes], head: _Header, what: str) -> np.ndarray:
    """The array as float32, read and converted ``READ_CHUNK_BYTES`` at a time into one buffer."""
    out = np.empty(head.count, dtype=np.float32)
    step = max(1, READ_CHUNK_BYTES // head.dtype.itemsize)
    for start in range(0, head.count, step):
        n = min(step, head.count - start)
        out[start:start + n] = np.frombuffer(_read_exactly(stream, n * head.dtype.itemsize, what), dtype=head.dtype)
    return out.reshape(head.shape, order="F" if head.fortran else "C")


def _read_plain(stream: IO[bytes], head: _Header, what: str) -> np.ndarray:
    """The array in its own dtype (its size checked against the limit already)."""
    data = _read_exactly(stream, head.count * head.dtype.itemsize, what)
    return np.frombuffer(data, dtype=head.dtype).reshape(head.shape, order="F" if head.fortran else "C")


def _read_exactly(stream: IO[bytes], nbytes: int, what: str) -> bytes:
    data = stream.read(nbytes)
    if len(data) != nbytes:
        raise DataError(f"{what} is cut short: its header promises more data than the file holds")
    return data


def _npz_labels(where: str, y: np.ndarray, index: dict[str, int]) -> np.ndarray:
    """``y`` as int64 indices of the job's classes; DataError naming the first sample whose label is not one."""
    if y.dtype.kind in "iu":
        bad = np.flatnonzero((y < 0) | (y >= len(index)))
        if bad.size:
            raise DataError(f"{where}: y[{bad[0]}] is a class index outside [0, {len(index)}) of the job's classes")
        return y.astype(np.int64)
    names, inverse = np.unique(y, return_inverse=True)
    codes = np.empty(names.size, dtype=np.int64)
    for i, value in enumerate(names):  # at most len(index) + 1 of them: one more is not a class
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        if text not in index:
            first = int(np.flatnonzero(inverse.reshape(-1) == i)[0])
            raise DataError(f"{where}: y[{first}] is not one of the job's class names ({', '.join(index)})")
        codes[i] = index[text]
    return codes[inverse.reshape(-1)]
