"""Exactly-once, checked: what the workers saw acked against what the parameter server applied.

A worker with ``worker.ack_log`` writes down every update it saw acked applied (``accepted``, or
``duplicate``: the PS had applied it and the first ack was lost); the PS's ledger
(``{ps.state_dir}/ledger.log``) names every update it applied. An update acked and not in the ledger is
lost; one in the ledger twice was applied twice. The fault-injection test and ``edgemesh bench soak``
report both, and model versions that went back.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from edgemesh.services.parameter_server.ledger import Entry, lines_of, read_ledger


@dataclass(frozen=True, slots=True)
class Audit:
    applied: int
    """Updates in the ledger."""
    acked: int
    """Distinct updates the workers saw acked applied."""
    lost: list[tuple[str, int, int]]
    """Acked, and not in the ledger."""
    applied_twice: list[tuple[str, int, int]]
    """In the ledger more than once."""
    versions_back: int
    """Ledger entries whose version is below the one before (steps are applied in version order)."""

    def as_dict(self) -> dict[str, int]:
        return {"updates_applied": self.applied, "updates_acked": self.acked, "updates_lost": len(self.lost),
                "updates_applied_twice": len(self.applied_twice), "versions_back": self.versions_back}


def read_ack_log(path: Path) -> list[tuple[int, int]]:
    """``(incarnation, seq)`` of every line of a worker's ack log (a torn last line left out)."""
    out = []
    for parts in lines_of(path, 4):
        if parts[2] in ("accepted", "duplicate"):  # not a line torn by a kill and joined to the next run's
            with contextlib.suppress(ValueError):
                out.append((int(parts[0]), int(parts[1])))
    return out


def audit(ledger: Path | Iterable[Entry], ack_logs: Mapping[str, Path]) -> Audit:
    """Compare the PS's ledger with every device's ack log (device -> path)."""
    entries = read_ledger(ledger) if isinstance(ledger, Path) else list(ledger)
    counts = Counter(e.key for e in entries)
    acked = {(device, inc, seq) for device, path in ack_logs.items() for inc, seq in read_ack_log(path)}
    back = sum(1 for a, b in zip(entries, entries[1:], strict=False) if b.version < a.version)
    return Audit(applied=len(entries), acked=len(acked), lost=sorted(acked - counts.keys()),
                 applied_twice=sorted(k for k, n in counts.items() if n > 1), versions_back=back)
