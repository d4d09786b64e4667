"""The ``npz`` format of a device's data (:func:`read_npz`).

A numpy archive with arrays ``x`` of shape (N, *input_shape) or (N, prod(input_shape)) (uint8 is scaled to
[0, 1]) and ``y`` of class indices or names, of shape (N,) or (N, 1): integers, whole numbers as floats (labels a
data frame with missing values stored as float64), booleans (classes 0 and 1), or strings. Its zip directory is
bounded (``MAX_NPZ_DIRECTORY_BYTES``) and the arrays' ``.npy`` headers are read and checked first; the arrays are
read ``READ_CHUNK_BYTES`` at a time; no pickle is ever loaded. :func:`npz_samples` reads an archive to classify
(``edgemesh predict``) a sample at a time, its ``y`` optional.
"""

from __future__ import annotations

import math
import struct
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import numpy as np
from numpy.lib import format as npy_format

from edgemesh.common.data.dataset import UINT8_PIXEL_MAX
from edgemesh.common.data.source import DataSource, Expected, Samples, check_bytes, mib
from edgemesh.common.errors import DataError

MAX_NPZ_DIRECTORY_BYTES: Final = 64 * 2**10
"""Largest zip directory of an npz file: ``zipfile`` reads it whole, an object per entry, and an npz lists two
arrays."""
READ_CHUNK_BYTES: Final = 4 * 2**20
"""How much of an npz array is read and converted to float32 at a time (no whole copy in its own type)."""
MAX_PREDICT_LABEL_BYTES: Final = 256 * 2**20
"""Most bytes of labels :func:`npz_samples` reads whole (the samples themselves are read a chunk at a time)."""
_NPY_MAGIC: Final = b"\x93NUMPY"
_ZIP_END: Final = b"PK\x05\x06"
"""The signature of a zip file's end record: ... total entries (2 bytes at 10), directory size (4 bytes at 12)."""
_ZIP_END_SIZE: Final = 22
_ZIP_COMMENT_MAX: Final = 2**16 - 1


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


def read_npz(source: DataSource, expected: Expected) -> Samples:
    """``x`` and ``y`` of the archive, their headers checked (shapes, types, sizes) before any of them is read."""
    source.check_file("npz")
    input_shape, max_bytes = expected.shape, expected.max_bytes
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
    return Samples(x.reshape(x_head.shape[0], *input_shape), _npz_labels(where, y, expected.index))


def npz_samples(path: Path, input_shape: tuple[int, ...],
                classes: Sequence[str]) -> Iterator[tuple[int, np.ndarray, int | None]]:
    """The samples of an archive to classify, read as they are reached: ``(index, sample, label)``, the sample
    ``x[index]`` as float32 of ``input_shape`` (uint8 scaled to [0, 1]) and its class index from ``y`` (read as a
    device reads it), None for every sample of an archive without ``y``. DataError naming the file (and the sample)
    for what cannot be read."""
    where = f"npz file '{path}'"
    index = {name: i for i, name in enumerate(classes)}
    try:
        with open(path, "rb") as handle:
            if handle.read(len(_NPY_MAGIC)) == _NPY_MAGIC:
                raise DataError(f"{where} holds a single array, not an archive with an array 'x'")
            _check_zip_directory(handle, path.stat().st_size, where)
            with zipfile.ZipFile(handle) as archive:
                members = set(archive.namelist())
                with archive.open(_member(members, "x", where)) as x_file:
                    x_head = _npy_header(x_file, f"{where}: x")
                    _check_x(where, x_head, input_shape)
                    labels = _labels_of(archive, members, where, x_head, index)
                    for start, rows in _rows(x_file, x_head, f"{where}: x"):
                        if x_head.dtype == np.uint8:
                            rows = rows / np.float32(UINT8_PIXEL_MAX)
                        for i, row in enumerate(rows.reshape(len(rows), *input_shape), start):
                            if not np.isfinite(row).all():
                                raise DataError(f"{where}: x[{i}] holds non-finite values")
                            yield i, row, None if labels is None else int(labels[i])
    except OSError as exc:
        raise DataError(f"{where} cannot be read: {exc.strerror or exc}") from exc
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, NotImplementedError) as exc:
        raise DataError(f"{where} cannot be read as a NumPy archive ({type(exc).__name__})") from exc


def _labels_of(archive: zipfile.ZipFile, members: set[str], where: str, x: _Header,
               index: dict[str, int]) -> np.ndarray | None:
    """The class indices of the archive's ``y`` (None: it has none), checked as a device's labels are."""
    if not {"y", "y.npy"} & members:
        return None
    with archive.open(_member(members, "y", where)) as y_file:
        y = _npy_header(y_file, f"{where}: y")
        _check_y(where, x, y)
        if y.count * y.dtype.itemsize > MAX_PREDICT_LABEL_BYTES:
            raise DataError(f"{where}: y takes {mib(y.count * y.dtype.itemsize)}, more than the "
                            f"{mib(MAX_PREDICT_LABEL_BYTES)} read to check predictions")
        return _npz_labels(where, _read_plain(y_file, y, f"{where}: y"), index)


def _rows(stream: IO[bytes], head: _Header, what: str) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, rows as float32)`` of the array, about ``READ_CHUNK_BYTES`` at a time (a Fortran-ordered array,
    whose rows are not stored one after the other, at once)."""
    if head.fortran:
        yield 0, _read_floats(stream, head, what).reshape(head.shape[0], -1)
        return
    row = math.prod(head.shape[1:])
    step = max(1, READ_CHUNK_BYTES // max(1, row * head.dtype.itemsize))
    for start in range(0, head.shape[0], step):
        n = min(step, head.shape[0] - start)
        data = _read_exactly(stream, n * row * head.dtype.itemsize, what)
        yield start, np.frombuffer(data, dtype=head.dtype).astype(np.float32).reshape(n, row)


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
    _check_x(where, x, input_shape)
    _check_y(where, x, y)
    check_bytes(where, x.shape[0], input_shape, max_bytes)
    if y.count * y.dtype.itemsize > max_bytes:
        raise DataError(f"{where}: y takes {mib(y.count * y.dtype.itemsize)}, more than the {mib(max_bytes)} a "
                        "device loads for a job")


def _check_x(where: str, x: _Header, input_shape: tuple[int, ...]) -> None:
    """DataError when the header of ``x`` does not give samples of ``input_shape`` in numbers."""
    if x.dtype.hasobject:
        raise DataError(f"{where} cannot be read: x is stored as a pickle, and pickled arrays are never loaded")
    accepted = (input_shape, (math.prod(input_shape),))
    if len(x.shape) < 1 or x.shape[1:] not in accepted:
        expected = " or ".join(f"(N, {', '.join(map(str, s))})" for s in dict.fromkeys(accepted))
        raise DataError(f"{where}: x has shape {x.shape}, expected {expected}")
    if not x.plain or x.dtype.kind not in "iuf" or x.dtype.itemsize > 8:
        raise DataError(f"{where}: x must hold numbers (integers or floats), got dtype {x.type_name}")


def _check_y(where: str, x: _Header, y: _Header) -> None:
    """DataError when the header of ``y`` does not give one class index or name per sample of ``x``."""
    if y.dtype.hasobject:
        raise DataError(f"{where} cannot be read: y is stored as a pickle, and pickled arrays are never loaded")
    if y.shape not in ((x.shape[0],), (x.shape[0], 1)):
        raise DataError(f"{where}: y has shape {y.shape}, expected ({x.shape[0]},) to match x (one class per sample: "
                        "indices or names, not one-hot rows)")
    numeric = y.dtype.kind in "iufb"
    if not y.plain or y.dtype.kind not in "iufbUS" or y.dtype.itemsize == 0 or (numeric and y.dtype.itemsize > 8):
        raise DataError(f"{where}: y must hold class indices or class names, got dtype {y.type_name}")


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
    y = y.reshape(-1)
    if y.dtype.kind == "b":
        y = y.astype(np.int64)
    elif y.dtype.kind == "f":
        whole = np.isfinite(y) & (y == np.round(y))
        if not whole.all():
            first = int(np.flatnonzero(~whole)[0])
            raise DataError(f"{where}: y[{first}] is not a whole number (a class index)")  # never the value
        y = y.astype(np.int64)
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


