"""The parameter server's ledger: every update it applied, once, across crashes.

``{ps.state_dir}/ledger.log`` holds one line per applied update, ``version device incarnation seq``, in the
order the steps were applied. A step is written to the write-ahead log first and to the ledger right after,
both before any of its acks go out; a crash between the two leaves the step in the log only, so on start
the ledger takes every logged step it lacks (the log holds the steps since the last checkpoint, and the
ledger's lines from that version on are read back to compare). For the same reason the ledger is not fsynced
with each step (the log is, and an entry the ledger lost to a power cut is still in the log) but before the log
is emptied at a checkpoint (``sync``) and when it closes. The ledger is never truncated: it is the
audit of the whole run (``edgemesh bench soak`` and the fault-injection test read it; so may an operator:
``read_ledger``). A line is ~40 bytes: a million updates make 40 MB.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, NamedTuple

from edgemesh.services.parameter_server import store
from edgemesh.services.parameter_server.scheduler import Step, UpdateId

logger = logging.getLogger(__name__)

FILE = "ledger.log"


class Entry(NamedTuple):
    """One applied update."""

    version: int
    device: str
    incarnation: int
    seq: int

    @property
    def key(self) -> UpdateId:
        return UpdateId.of(self)


def lines_of(path: Path, fields: int) -> list[list[str]]:
    """The lines of an append-only audit file (this ledger, a worker's ack log) that have ``fields`` words; a
    missing file has none. A line torn by a crash mid-write has fewer: it is left out."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [parts for line in text.splitlines() if len(parts := line.split()) == fields]


def read_ledger(path: Path) -> list[Entry]:
    """The entries of a ledger file (a torn last line, from a crash mid-write, is left out)."""
    entries = []
    for parts in lines_of(path, 4):
        with contextlib.suppress(ValueError):
            entries.append(Entry(int(parts[0]), parts[1], int(parts[2]), int(parts[3])))
    return entries


def _lines(entries: Iterable[Entry]) -> str:
    return "".join(f"{e.version} {e.device} {e.incarnation} {e.seq}\n" for e in entries)


class Ledger:
    """The append-only ledger of one parameter server's state directory."""

    def __init__(self, state_dir: Path, *, fsync: bool) -> None:
        self.path = state_dir / FILE
        self._fsync = fsync
        self._fh: IO[str] | None = None
        self.entries = 0

    def open(self) -> int:
        """Open for appending after catching up with the write-ahead log; returns the entries it added."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        logged = [Entry(int(r["version"]), str(e["device"]), int(e["incarnation"]), int(e["seq"]))
                  for r in store.read_wal(self.path.parent) for e in r.get("entries", [])]
        kept = read_ledger(self.path)
        since = min((e.version for e in logged), default=0)
        known = {e.key for e in kept if e.version >= since}
        missing = [e for e in logged if e.key not in known]
        self._fh = open(self.path, "a")  # noqa: SIM115 - held open for the server's life
        if self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            self._fh.write("\n")  # end a line torn by a crash: it is not an entry
        self._write(missing)
        self.entries = len(kept) + len(missing)
        if missing:
            logger.info("ledger: %d applied update(s) from the write-ahead log added", len(missing))
        return len(missing)

    def record(self, steps: Sequence[Step]) -> int:
        """Append every update of ``steps`` (after they are logged, before they are acked); entries added."""
        entries = [Entry(step.version, part.device, part.incarnation, part.seq)
                   for step in steps for item in step.items for part in item.updates]
        self._write(entries)
        self.entries += len(entries)
        return len(entries)

    def _write(self, entries: Sequence[Entry]) -> None:
        if not entries:
            return
        assert self._fh is not None, "open() first"
        self._fh.write(_lines(entries))
        self._fh.flush()  # in the OS's hands: a crash of the process loses nothing, a power cut only what the log has

    def sync(self) -> None:
        """Make every entry durable: before the write-ahead log that also holds them is emptied."""
        if self._fh is not None and self._fsync:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self.sync()
            self._fh.close()
            self._fh = None
