"""Rounds of a benchmark that measures two sides on one shared host (``bench ddp``: EdgeMesh and torch DDP).

A host whose load drifts over a run weighs on whichever side runs at the busier moment: one pair run once has
swung a ratio by a quarter here. ``alternate`` runs the pair several times, each side first in turn (ABBA), and
keeps each round's figures; ``mean`` and ``ratio`` make the report's figures of them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import Any

DIGITS = 4
"""Decimal places of a mean in a report."""

Side = dict[str, Any]
"""One side's entry of a round: ``seconds_per_version`` or ``seconds_per_step``, ``final_loss``,
``final_version`` (EdgeMesh), ``failure``."""


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` to three places, or None if either is missing (or zero)."""
    return round(a / b, 3) if a and b else None


def mean(values: Iterable[float | None]) -> float | None:
    """The mean, or None if there is none or any is missing."""
    given = list(values)
    kept = [v for v in given if v is not None]
    return round(statistics.fmean(kept), DIGITS) if kept and len(kept) == len(given) else None


def alternate(first: tuple[Side, Side], more: int, again: Callable[[int, bool], tuple[Side, Side]]) -> list[Side]:
    """Each round's figures: the first (EdgeMesh, then DDP), then ``more`` rounds of ``again(i, ddp_first)``,
    DDP first in the second, so that a host growing busier or quieter over the run weighs on both. Stops at the
    first round that failed."""
    rounds = []
    for i in range(1 + more):
        ddp_first = i % 2 == 1
        edgemesh, ddp = first if i == 0 else again(i, ddp_first)
        rounds.append({"first": "ddp" if ddp_first else "edgemesh",
                       "edgemesh_seconds_per_version": edgemesh["seconds_per_version"],
                       "ddp_seconds_per_step": ddp.get("seconds_per_step"),
                       "step_time_ratio": ratio(edgemesh["seconds_per_version"], ddp.get("seconds_per_step")),
                       "final_version": edgemesh["final_version"], "edgemesh_final_loss": edgemesh["final_loss"],
                       "ddp_final_loss": ddp.get("final_loss"),
                       "failure": edgemesh["failure"] or ddp.get("failure")})
        if rounds[-1]["failure"]:
            break
    return rounds
