"""The worker's incarnation: a number that grows with every start of a device, even when its clock does not.

The parameter server applies each ``(device, incarnation, seq)`` at most once and takes anything at or below
the newest pair it applied for a device as a duplicate, so a restarted worker must come back with a larger
incarnation than any it had. The wall clock (microseconds) gives one on a device that keeps time; a
Raspberry Pi has no real-time clock and may boot with an earlier time than its last run, until NTP answers.
So the last incarnation is also kept in a file of the worker's state directory (systemd's ``StateDirectory``),
and a start takes the larger of the clock and the kept number plus one.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

FILE = "incarnation"


def next_incarnation(state_dir: str | Path, now_us: int | None = None, *, environ: bool = True) -> int:
    """This start's incarnation, kept in ``state_dir`` (empty: systemd's ``$STATE_DIRECTORY`` where ``environ``
    allows; none: the clock alone) before it is used."""
    clock = time.time_ns() // 1000 if now_us is None else now_us
    state_dir = state_dir or (os.environ.get("STATE_DIRECTORY", "").partition(":")[0] if environ else "")
    if not state_dir:
        return clock
    path = Path(state_dir) / FILE
    last = 0
    try:
        last = int(path.read_text().strip())
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        logger.warning("cannot read the last incarnation from %s (%s): starting from the clock", path, exc)
    incarnation = max(clock, last + 1)
    if incarnation != clock:
        logger.warning("the clock (%d) is behind this device's last start (%d): incarnation %d", clock, last,
                       incarnation)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    with open(partial, "w") as fh:
        fh.write(f"{incarnation}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(partial, path)
    return incarnation
