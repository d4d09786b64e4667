"""Progress output that reads well in a terminal and in a log file alike.

A terminal gets a bar redrawn in place (``edgemesh job status`` draws rich's, ``edgemesh demo`` a ``\\r`` line). A
file or a pipe would get every redraw, carriage returns and all: there :class:`ProgressLines` prints one plain line
when what it shows changed, at most one every ``LINE_INTERVAL_S`` (a later call carries the latest state), and the
final line whatever the time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Final, TextIO

LINE_INTERVAL_S: Final = 5.0
"""Most often a progress line is printed on an output that is not a terminal, seconds."""


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (a closed or detached stream is not)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class ProgressLines:
    """Progress as plain lines: one per change, at most one per ``interval_s``, the final one always."""

    def __init__(self, stream: TextIO, *, interval_s: float = LINE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.interval_s = interval_s
        self.clock = clock
        self._shown: str | None = None
        """What the last line printed showed."""
        self._at = -math.inf
        """When it was printed (``clock``)."""

    def show(self, what: str, line: str | None = None, *, final: bool = False) -> bool:
        """Print ``line`` (``what`` by default) if ``what`` changed since the last line printed and ``interval_s``
        passed since it, or if ``final`` and it changed; returns whether it printed. ``what`` is the state shown,
        ``line`` may add what changes without being news (the time elapsed)."""
        if what == self._shown:
            return False
        now = self.clock()
        if not final and now - self._at < self.interval_s:
            return False
        print(what if line is None else line, file=self.stream, flush=True)
        self._shown, self._at = what, now
        return True
