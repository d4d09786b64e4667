"""The ``csv`` format of a device's data (:func:`read_csv`).

A UTF-8 file with a header row, at most ``MAX_CSV_BYTES``. ``label_column`` holds the class names, every other
column is a numeric feature; each row's features are reshaped to ``input_shape``. Rows are parsed into a float32
and an int64 buffer, and a row is refused before it is split into cells when it is longer than
``MAX_CSV_CELL_CHARS`` a column.
"""

from __future__ import annotations

import array
import csv
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Final

import numpy as np

from edgemesh.common.data.source import LABEL_BYTES, DataSource, Expected, Samples, check_bytes, mib
from edgemesh.common.errors import DataError

if TYPE_CHECKING:
    from _csv import Reader

MAX_CSV_BYTES: Final = 64 * 2**20
"""Largest CSV file a device reads, checked before it is opened."""
MAX_CSV_CELL_CHARS: Final = 64
"""Most characters a CSV row may take per column the job needs: a longer row is refused before it is split into
cells (a row of millions of cells would take gigabytes as Python strings)."""
FLOAT32_MAX: Final = float(np.finfo(np.float32).max)


def read_csv(source: DataSource, expected: Expected) -> Samples:
    """Features into a float32 buffer and labels into an int64 one as the rows are parsed: no list of Python floats."""
    source.check_file("csv")
    name, shape = source.shown, expected.shape
    size = source.path.stat().st_size
    if size > MAX_CSV_BYTES:
        raise DataError(f"CSV file '{name}' is {mib(size)}, more than the {mib(MAX_CSV_BYTES)} a device reads; "
                        "keep fewer rows on this device")
    # utf-8-sig: a byte-order mark (as spreadsheets write) is not part of the first column's name
    with open(source.path, encoding="utf-8-sig", newline="") as handle:
        rows = _Rows(handle, MAX_CSV_CELL_CHARS * (math.prod(shape) + 1), name)
        reader = csv.reader(rows)
        try:
            columns = _Columns.of(next(reader, None), name, expected.label_column, shape)
            rows.next_row()
            values, labels = _parse_rows(reader, rows, columns, name, expected)
        except UnicodeDecodeError as exc:
            raise DataError(f"CSV file '{name}' near line {reader.line_num + 1} is not UTF-8") from exc
        except csv.Error as exc:  # the csv module's own words (a NUL, a stray quote), never a cell
            raise DataError(f"CSV file '{name}' line {reader.line_num}: {exc}") from exc
    x = np.frombuffer(values, dtype=np.float32).reshape(len(labels), *shape)
    return Samples(x, np.frombuffer(labels, dtype=np.int64))


@dataclass(frozen=True, slots=True)
class _Columns:
    """Where a CSV file's label and features are, from its header row."""

    cells: int
    """Cells in a row."""
    label_at: int
    label_column: str
    features: list[int]
    """The feature columns, in order."""

    @classmethod
    def of(cls, header: list[str] | None, name: str, label_column: str, shape: tuple[int, ...], *,
           labelled: bool = True) -> _Columns:
        """The columns of ``header``; DataError without one, without ``label_column`` (unless not ``labelled``: then
        a header without it has features alone, ``label_at`` -1), or with other than as many feature columns as
        ``shape`` has values."""
        if header is None:
            raise DataError(f"CSV file '{name}' is empty; it needs a header row")
        if not labelled and label_column not in header and len(header) == math.prod(shape):
            return cls(len(header), -1, label_column, list(range(len(header))))
        if label_column not in header:
            one = (" (the header row is one column: the file is read as comma-separated, and one separated by "
                   "semicolons or tabs, as spreadsheets export in some locales, reads as one column)"
                   if len(header) == 1 else "")
            raise DataError(f"CSV file '{name}' has no label column {label_column!r} in its header row{one}")
        label_at = header.index(label_column)
        features = [i for i in range(len(header)) if i != label_at]
        if len(features) != math.prod(shape):
            raise DataError(f"CSV file '{name}' has {len(features)} feature columns besides {label_column!r}, "
                            f"the model's input_shape {shape} needs {math.prod(shape)}")
        return cls(len(header), label_at, label_column, features)

    def check_width(self, row: list[str], where: str) -> None:
        """DataError for a row of another width than the header's."""
        if len(row) != self.cells:
            raise DataError(f"{where}: {len(row)} cells, the header has {self.cells}")

    def label(self, row: list[str], where: str, index: dict[str, int]) -> int:
        """The row's label; DataError for a row of another width or a label not among the job's classes."""
        self.check_width(row, where)
        label = index.get(row[self.label_at].strip())
        if label is None:
            raise DataError(f"{where}, column {self.label_at + 1} ({self.label_column!r}): not one of the job's "
                            f"classes ({', '.join(index)})")
        return label

    def values(self, row: list[str], where: str) -> Iterator[float]:
        return (_parse_cell(row[i], where, i + 1) for i in self.features)


def csv_rows(path: Path, shape: tuple[int, ...], label_column: str,
             classes: Sequence[str]) -> Iterator[tuple[int, np.ndarray, int | None]]:
    """The rows of a CSV file to classify (``edgemesh predict``), one at a time: ``(line, features, label)``, the
    features of ``shape`` as float32 and the row's class index, None where the header has no ``label_column`` or the
    row's label is not one of ``classes``. The features are every column but ``label_column``, as many as ``shape``
    holds; DataError naming the file, line and column of what cannot be read."""
    name, index = str(path), {c: i for i, c in enumerate(classes)}
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            rows = _Rows(handle, MAX_CSV_CELL_CHARS * (math.prod(shape) + 1), name)
            reader = csv.reader(rows)
            columns = _Columns.of(next(reader, None), name, label_column, shape, labelled=False)
            rows.next_row()
            for row in reader:
                rows.next_row()
                if not row:
                    continue
                where = f"CSV file '{name}' line {reader.line_num}"
                columns.check_width(row, where)
                label = index.get(row[columns.label_at].strip()) if columns.label_at >= 0 else None
                yield reader.line_num, np.fromiter(columns.values(row, where), np.float32).reshape(shape), label
    except OSError as exc:
        raise DataError(f"CSV file '{name}' cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise DataError(f"CSV file '{name}' is not UTF-8") from exc
    except csv.Error as exc:
        raise DataError(f"CSV file '{name}': {exc}") from exc


def _parse_rows(reader: Reader, rows: _Rows, columns: _Columns, name: str,
                expected: Expected) -> tuple[array.array[float], array.array[int]]:
    """The rows after the header into a float32 buffer of features and an int64 one of labels, their bytes checked
    once there are more rows than ``expected.max_bytes`` holds."""
    shape, index = expected.shape, expected.index
    values = array.array("f")
    labels = array.array("q")
    most = expected.max_bytes // (4 * math.prod(shape) + LABEL_BYTES)  # rows
    for row in reader:
        rows.next_row()
        if not row:
            continue
        where = f"CSV file '{name}' line {reader.line_num}"
        label = columns.label(row, where, index)
        values.extend(columns.values(row, where))
        labels.append(label)
        if len(labels) > most:
            check_bytes(f"CSV file '{name}' by line {reader.line_num}", len(labels), shape, expected.max_bytes)
    return values, labels


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


def _parse_cell(cell: str, where: str, column: int) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise DataError(f"{where}, column {column}: not a number") from None
    if not abs(value) <= FLOAT32_MAX:  # NaN fails this too
        raise DataError(f"{where}, column {column}: not a finite number that float32 holds")
    return value


