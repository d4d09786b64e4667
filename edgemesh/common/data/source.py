"""What every reader of a device's own data shares (``local``): where it reads (:class:`DataSource`, inside the
host's data folder: :func:`data_path`), what the job expects of the data (:class:`Expected`), what a reader
returns (:class:`Samples`), and the bound on the bytes the samples take (:func:`check_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

from edgemesh.common.errors import DataError

LABEL_BYTES = 8
"""An int64 label per sample."""


@dataclass(frozen=True, slots=True)
class DataSource:
    """What :func:`load_local` reads: its real path, how errors name it, and the folder no file of it may leave."""

    path: Path
    shown: str
    """The path as errors name it: as the job wrote it (relative to the data folder), or as the caller gave it."""
    fence: Path | None
    """The host's data folder (its real path), in which every file read must lie; None: the caller's own path."""

    @classmethod
    def of(cls, path: str | Path, data_dir: str | Path | None) -> DataSource:
        """A job's ``path`` under the host's data folder ``data_dir``, or without one the caller's own ``path``."""
        if data_dir is None:
            return cls(Path(path), str(path), None)
        fence = real_path(Path(data_dir or "."), "this host's data folder")
        return cls(data_path(str(path), data_dir), PurePosixPath(str(path)).as_posix(), fence)

    def name(self, entry: Path) -> str:
        """``entry`` (``path`` or a file under it) as errors name it."""
        relative = entry.relative_to(self.path).as_posix()
        return self.shown if relative == "." else f"{self.shown}/{relative}"

    def check_inside(self, entry: Path) -> None:
        """DataError when ``entry``, symbolic links followed, lies outside the data folder."""
        if self.fence is not None and not real_path(entry, self.name(entry)).is_relative_to(self.fence):
            raise DataError(f"'{self.name(entry)}' leads out of this host's data folder (a symbolic link); data is "
                            "read only from inside it")

    def check_directory(self, fmt: str) -> None:
        if not self.path.is_dir():
            raise DataError(f"data path '{self.shown}' is not a directory; the {fmt} format needs one")

    def check_file(self, fmt: str) -> None:
        if not self.path.is_file():
            raise DataError(f"data path '{self.shown}' is not a file; the {fmt} format needs one")


@dataclass(frozen=True, slots=True)
class Expected:
    """What a job expects of a device's data, and the bounds it is read within."""

    shape: tuple[int, ...]
    """The model's input shape: one sample's."""
    classes: Sequence[str]
    """Class names; a label is the index of its name."""
    label_column: str
    """A CSV file's column of class names."""
    max_skipped_share: float
    """Share of an image folder's image files that may be unreadable (skipped)."""
    max_bytes: int
    """Most bytes the samples may take as float32 inputs and int64 labels."""

    @property
    def index(self) -> dict[str, int]:
        """Class name -> label."""
        return {name: i for i, name in enumerate(self.classes)}


@dataclass(frozen=True, slots=True)
class Samples:
    """What a reader returns: inputs, labels and the files it skipped as unreadable."""

    x: np.ndarray
    """float32, (N, *shape)."""
    y: np.ndarray
    """int64 labels."""
    skipped: list[str] = field(default_factory=list)
    """Image files skipped (relative to the folder, in reading order)."""


def data_path(path: str, data_dir: str | Path) -> Path:
    """The real path that a job's data ``path`` names on this host, under its data folder ``data_dir`` ('' is the
    working directory), symbolic links followed. DataError, naming ``path`` as the job wrote it, for an absolute
    path, a path through ``..`` and one that leads out of the folder."""
    written = PurePosixPath(path)
    if not path or "\0" in path or written.is_absolute() or ".." in written.parts:
        raise DataError(f"data path {path[:200]!r} must be relative to this host's data folder, without '..'")
    root = real_path(Path(data_dir or "."), "this host's data folder")
    real = real_path(root / written, repr(path))
    if not real.is_relative_to(root):
        raise DataError(f"data path {path!r} leads out of this host's data folder (a symbolic link); data is read "
                        "only from inside it")
    return real


def real_path(path: Path, shown: str) -> Path:
    """``path`` with every symbolic link followed (it need not exist); DataError naming it as ``shown``."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a loop of links (Python 3.11)
        raise DataError(f"{shown} cannot be followed to a file: {type(exc).__name__}") from exc


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def check_bytes(what: str, samples: int, input_shape: tuple[int, ...], max_bytes: int) -> None:
    """DataError when ``samples`` of ``input_shape`` (float32 inputs, int64 labels) take more than ``max_bytes``."""
    nbytes = samples * (4 * math.prod(input_shape) + LABEL_BYTES)
    if nbytes > max_bytes:
        raise DataError(f"{what}: {samples:,} samples of shape {input_shape} take {mib(nbytes)}, more than the "
                        f"{mib(max_bytes)} a device loads for a job; keep fewer samples on this device")


