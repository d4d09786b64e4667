"""Durable PS state: a checkpoint plus a write-ahead log of applied steps.

Every step the PS applies is appended to ``updates.wal`` and fsynced before any of its
updates is acked, so an acked update survives ``kill -9``. A full checkpoint (weights,
optimizer state, version, per-device high-water marks) is written every few hundred
versions with write, fsync, rename, fsync(dir); the log is then started afresh. On start
the PS loads the checkpoint and replays the log records newer than it; a torn last record
(never acked) ends the log, and the next record overwrites it.

Log file: ``magic | u64 generation``, then records framed ``u32 length | u32 crc32c | msgpack body``, the
checksum over the generation and the body; a checkpoint starts a new generation at the front of the same file
(``WriteAheadLog``). A log without the magic is one an earlier version wrote (zlib's crc32 over the body alone,
no generation): it is read as such, and rewritten in this format when the log is opened. Checkpoint framing:
``u32 length | u32 crc32 | msgpack body``. Tensors as (dtype, shape, bytes).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import msgpack
import numpy as np

from edgemesh.common.errors import CheckpointError

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
CHECKPOINT_NAME = "checkpoint.msgpack"
WAL_NAME = "updates.wal"
_HEADER = struct.Struct("<II")
_INLINE = 1 << 16
"""A logged buffer this long or longer is written from where it lies (``_pieces``), not copied."""
_IOV_MAX = 1024
"""Buffers one ``pwritev`` takes at most (Linux's IOV_MAX)."""
_WAL_MAGIC = b"EMWAL\x02\x00\x00"
"""A log file starts with this and its generation (u64): records follow."""
AHEAD_RECORDS = 16
"""A log that syncs is kept written with zeros past its last record, for this many records like the last (at
least ``AHEAD_MIN_BYTES``), by a thread of its own (:class:`_Ahead`): a record written where the file already is
costs a copy into cached pages and an ``fdatasync`` of data alone; appended at the file's end, it cost ten times
as long (13 ms against 1.2 for a 2.48 MB record here: new pages, new blocks, the file's size committed each time),
which a log that has not yet grown to a generation's size pays at every step."""
AHEAD_MIN_BYTES = 1 << 20
_ZEROS = bytes(1 << 20)


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


def _mark_in(mark: Any) -> tuple[int, int]:
    """A device's high-water mark as a checkpoint keeps it, ``{"incarnation", "seq"}``, or as an earlier version
    kept it, ``[incarnation, seq]``: ``(incarnation, seq)``."""
    if isinstance(mark, dict):
        return int(mark["incarnation"]), int(mark["seq"])
    incarnation, seq = mark
    return int(incarnation), int(seq)


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
        "high_water": {k: {"incarnation": v[0], "seq": v[1]} for k, v in snap.high_water.items()},
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
            high_water={k: _mark_in(v) for k, v in body["high_water"].items()},
            clocks={k: int(v) for k, v in body.get("clocks", {}).items()},
            settings=dict(body.get("settings", {})),
        )
    except (KeyError, TypeError, ValueError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


class WriteAheadLog:
    """Append-only log of applied steps; ``append`` returns once they are durable.

    The file is reused: ``reset`` starts a new generation at the front instead of a new file, and records
    overwrite the previous generation's, whose pages are already allocated and cached, so writing a step costs
    a copy into the page cache and ``fdatasync`` flushes data alone (an append to a fresh file also allocates
    blocks and commits the file's metadata, about three to ten times as long for a model-sized gradient). Where
    the file has not grown that far yet, a log that syncs writes zeros ahead of its records (:class:`_Ahead`).
    """

    def __init__(self, directory: Path, *, fsync: bool = True) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / WAL_NAME
        self._fsync = fsync
        log = _read(self.path)
        if log.generation is None and log.records:  # the log of an earlier version: rewritten in this format
            _convert(self.path, log.records)
            log = _read(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._ahead = _Ahead(self._fd, os.fstat(self._fd).st_size) if fsync else None
        if log.generation is None:
            self._start()
        else:
            self._generation, self._pos = log.generation, log.end

    def append(self, records: list[dict[str, Any]]) -> int:
        """Write records and make them durable; returns bytes written."""
        if not records:
            return 0
        written = 0
        for record in records:  # the gradients written from where they lie: no copy into the record's bytes
            pieces = _pieces(record)
            crc = crc32c.crc32c(self._generation.to_bytes(8, "little"))
            for piece in pieces:
                crc = crc32c.crc32c(piece, crc)
            written += self._write([_HEADER.pack(sum(len(p) for p in pieces), crc), *pieces])
        if self._fsync:  # one flush for the whole batch of steps (group commit): their acks wait for it
            os.fdatasync(self._fd)
        return written

    def reset(self) -> None:
        """Start an empty log (after a checkpoint made the old records redundant): a new generation, whose
        checksums the old records no longer match."""
        self._start()

    @property
    def end(self) -> int:
        """Where the next record goes: the bytes of the log so far (the file may be longer)."""
        return self._pos

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
        os.close(self._fd)

    def _start(self) -> None:
        self._generation = _new_generation()
        self._pos = 0
        self._write([_WAL_MAGIC, self._generation.to_bytes(8, "little")])
        os.fsync(self._fd)
        _fsync_dir(self.path.parent)

    def _write(self, parts: Sequence[bytes | memoryview]) -> int:
        size = sum(len(p) for p in parts)
        if self._ahead is not None:
            self._ahead.ensure(self._pos + size, max(AHEAD_MIN_BYTES, AHEAD_RECORDS * size))
        done = 0
        for first in range(0, len(parts), _IOV_MAX):
            group = parts[first:first + _IOV_MAX]
            wrote = os.pwritev(self._fd, group, self._pos + done)
            done += wrote
            if wrote < sum(len(p) for p in group):  # a short write (a full disk is an OSError): the rest at once
                rest = memoryview(b"".join(parts))
                while done < size:
                    done += os.pwrite(self._fd, rest[done:], self._pos + done)
                break
        self._pos += size
        return size



class _Ahead:
    """Zeros written and synced past a log's last record by a thread of its own, ahead of the records (see
    :data:`AHEAD_RECORDS`); a read of the log stops at them (a record is never empty). Records are written only
    below :attr:`written`, zeros only above it. Should the zeros fail (a full disk), records go on as before,
    growing the file themselves."""

    def __init__(self, fd: int, written: int) -> None:
        self._fd = fd
        self.written = written
        """The file is written (and synced) up to here: records, an earlier generation's, or zeros."""
        self._want = written
        self._changed = threading.Condition()
        self._closing = self._failed = False
        self._thread: threading.Thread | None = None

    def ensure(self, end: int, ahead: int) -> None:
        """Return once the file is written up to ``end``; past half of ``ahead`` beyond it, have the thread write
        ``ahead`` more (meanwhile the records go on into what is written)."""
        with self._changed:
            if self._failed:
                return
            if end + ahead // 2 > self._want:
                self._want = end + ahead
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="wal-ahead", daemon=True)
                    self._thread.start()
                self._changed.notify_all()
            while self.written < end and not (self._failed or self._closing):
                self._changed.wait()

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._closing and self._want <= self.written:
                    self._changed.wait()
                if self._closing:
                    return
                pos, end = self.written, self._want
            try:
                while pos < end:
                    pos += os.pwrite(self._fd, memoryview(_ZEROS)[:min(len(_ZEROS), end - pos)], pos)
                os.fsync(self._fd)
            except OSError as exc:
                logger.warning("write-ahead log: cannot write ahead of its records (%s); they grow the file", exc)
                with self._changed:
                    self._failed = True
                    self._changed.notify_all()
                return
            with self._changed:
                self.written = end
                self._changed.notify_all()


@dataclass(slots=True)
class _Log:
    records: list[dict[str, Any]]
    generation: int | None
    """None: no log of this format (none at all, or one an earlier version wrote)."""
    end: int


def _new_generation() -> int:
    return int.from_bytes(os.urandom(8), "little")


def _convert(path: Path, records: list[dict[str, Any]]) -> None:
    """Rewrite a log of an earlier format in this one: a new file beside it, then renamed over it."""
    generation = _new_generation()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(_WAL_MAGIC + generation.to_bytes(8, "little"))
        for record in records:
            data = msgpack.packb(record, use_bin_type=True)
            fh.write(_HEADER.pack(len(data), _crc(generation, data)))
            fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    logger.info("write-ahead log %s: %d records rewritten in the current format", path, len(records))


def _pieces(record: dict[str, Any]) -> list[bytes | memoryview]:
    """``msgpack.packb(record, use_bin_type=True)`` in pieces: the same bytes, with every buffer of ``_INLINE``
    bytes or more as itself (behind a bin 32 header, as msgpack writes it) instead of copied."""
    packer = msgpack.Packer(use_bin_type=True)
    pieces: list[bytes | memoryview] = []
    small = bytearray()

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            small.extend(packer.pack_map_header(len(obj)))
            for key, value in obj.items():
                walk(key)
                walk(value)
        elif isinstance(obj, list | tuple):
            small.extend(packer.pack_array_header(len(obj)))
            for value in obj:
                walk(value)
        elif isinstance(obj, bytes | bytearray | memoryview) and memoryview(obj).nbytes >= _INLINE:
            data = memoryview(obj).cast("B")
            small.extend(b"\xc6" + len(data).to_bytes(4, "big"))
            pieces.extend((bytes(small), data))
            small.clear()
        else:
            small.extend(packer.pack(obj))

    walk(record)
    if small:
        pieces.append(bytes(small))
    return pieces


def _crc(generation: int, data: bytes) -> int:
    """A record's checksum: over its generation and body, so an earlier generation's records do not match."""
    return crc32c.crc32c(data, crc32c.crc32c(generation.to_bytes(8, "little")))


def _read(path: Path) -> _Log:
    """The log's intact records of its current generation, and where the next one goes."""
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return _Log([], None, 0)
    with fh:
        head = fh.read(len(_WAL_MAGIC) + 8)
        legacy = not head.startswith(_WAL_MAGIC) or len(head) < len(_WAL_MAGIC) + 8
        if legacy:  # before generations: records from the start, checked with zlib's crc32
            fh.seek(0)
            generation = None
        else:
            generation = int.from_bytes(head[len(_WAL_MAGIC):], "little")
        records: list[dict[str, Any]] = []
        end, size = fh.tell(), os.fstat(fh.fileno()).st_size
        while len(header := fh.read(_HEADER.size)) == _HEADER.size:
            length, crc = _HEADER.unpack(header)
            if length == 0 or length > size - fh.tell():  # the zeros ahead; a torn length, or a stale one
                break
            data = fh.read(length)
            if len(data) != length or crc != (zlib.crc32(data) if generation is None else _crc(generation, data)):
                break  # a torn last record (never acked), or the previous generation's
            try:
                records.append(msgpack.unpackb(data, raw=False))
            except (ValueError, msgpack.ExtraData, msgpack.FormatError):
                break
            end += _HEADER.size + length
    return _Log(records, generation, end)


def read_wal(directory: Path) -> list[dict[str, Any]]:
    """All intact records of the log's generation; a torn or corrupt tail ends it (those steps were never
    acked), and the next record overwrites it."""
    return _read(directory / WAL_NAME).records
