"""Durable PS state: a checkpoint plus a write-ahead log of applied steps.

Every step the PS applies is appended to ``updates.wal`` and fsynced before any of its
updates is acked, so an acked update survives ``kill -9``. A full checkpoint (weights,
optimizer state, version, per-device high-water marks) is written every few hundred
versions with write, fsync, rename, fsync(dir); the log is then started afresh. On start
the PS loads the checkpoint and replays the log records newer than it; a torn last record
(never acked) is cut off.

Record framing: ``u32 length | u32 crc32 | msgpack body``. Tensors as (dtype, shape, bytes).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from edgemesh.common.errors import CheckpointError

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
CHECKPOINT_NAME = "checkpoint.msgpack"
WAL_NAME = "updates.wal"
_HEADER = struct.Struct("<II")


@dataclass(slots=True)
class Snapshot:
    """Everything needed to resume: the checkpoint's content."""

    model_spec: str
    version: int
    params: dict[str, np.ndarray]
    momentum: dict[str, np.ndarray]
    high_water: dict[str, tuple[int, int]] = field(default_factory=dict)
    clocks: dict[str, int] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


def _array_out(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return {"dtype": "float32", "shape": list(a.shape), "data": a.tobytes()}


def _array_in(d: Any, where: str) -> np.ndarray:
    try:
        arr = np.frombuffer(d["data"], dtype="<f4").reshape(d["shape"]).copy()
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: bad tensor: {exc}") from None
    return arr


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(directory: Path, snap: Snapshot) -> Path:
    """Atomically replace the checkpoint in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    body = {
        "format": CHECKPOINT_FORMAT,
        "model_spec": snap.model_spec,
        "version": snap.version,
        "params": {k: _array_out(v) for k, v in snap.params.items()},
        "momentum": {k: _array_out(v) for k, v in snap.momentum.items()},
        "high_water": {k: list(v) for k, v in snap.high_water.items()},
        "clocks": dict(snap.clocks),
        "settings": dict(snap.settings),
    }
    data = msgpack.packb(body, use_bin_type=True)
    final = directory / CHECKPOINT_NAME
    tmp = directory / (CHECKPOINT_NAME + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(_HEADER.pack(len(data), zlib.crc32(data)))
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(directory)
    return final


def read_checkpoint(directory: Path) -> Snapshot | None:
    """The checkpoint in ``directory``, or None if there is none."""
    path = directory / CHECKPOINT_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(raw) < _HEADER.size:
        raise CheckpointError(f"{path} is truncated")
    length, crc = _HEADER.unpack_from(raw)
    data = raw[_HEADER.size : _HEADER.size + length]
    if len(data) != length or zlib.crc32(data) != crc:
        raise CheckpointError(f"{path} is corrupt (length or checksum mismatch)")
    try:
        body = msgpack.unpackb(data, raw=False)
        if body.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path}: unsupported checkpoint format {body.get('format')!r}")
        return Snapshot(
            model_spec=str(body["model_spec"]),
            version=int(body["version"]),
            params={k: _array_in(v, f"{path}:{k}") for k, v in body["params"].items()},
            momentum={k: _array_in(v, f"{path}:{k}") for k, v in body["momentum"].items()},
            high_water={k: (int(v[0]), int(v[1])) for k, v in body["high_water"].items()},
            clocks={k: int(v) for k, v in body.get("clocks", {}).items()},
            settings=dict(body.get("settings", {})),
        )
    except (KeyError, TypeError, ValueError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


class WriteAheadLog:
    """Append-only log of applied steps; ``append`` returns after fsync."""

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / WAL_NAME
        self._fsync = fsync
        self._fh = open(self.path, "ab")  # noqa: SIM115 - held open for the service's life

    def append(self, records: list[dict[str, Any]]) -> int:
        """Write records and make them durable; returns bytes written."""
        if not records:
            return 0
        written = 0
        for record in records:  # header and body written as they are: no copy of the gradients into one buffer
            data = msgpack.packb(record, use_bin_type=True)
            written += self._fh.write(_HEADER.pack(len(data), zlib.crc32(data)))
            written += self._fh.write(data)
        self._fh.flush()
        if self._fsync:  # one fsync for the whole batch of steps (group commit): their acks wait for it
            os.fsync(self._fh.fileno())
        return written

    def reset(self) -> None:
        """Start an empty log (after a checkpoint made the old records redundant)."""
        self._fh.close()
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as fh:
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self._fh = open(self.path, "ab")  # noqa: SIM115

    def close(self) -> None:
        self._fh.close()


def read_wal(directory: Path) -> list[dict[str, Any]]:
    """All intact records; a torn or corrupt tail is cut off (those steps were never acked)."""
    path = directory / WAL_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    records: list[dict[str, Any]] = []
    pos = 0
    while pos + _HEADER.size <= len(raw):
        length, crc = _HEADER.unpack_from(raw, pos)
        data = raw[pos + _HEADER.size : pos + _HEADER.size + length]
        if len(data) != length or zlib.crc32(data) != crc:
            break
        try:
            records.append(msgpack.unpackb(data, raw=False))
        except (ValueError, msgpack.ExtraData, msgpack.FormatError):
            break
        pos += _HEADER.size + length
    if pos != len(raw):
        logger.warning("write-ahead log %s: cutting a torn tail of %d bytes", path, len(raw) - pos)
        with open(path, "r+b") as fh:
            fh.truncate(pos)
            fh.flush()
            os.fsync(fh.fileno())
    return records
