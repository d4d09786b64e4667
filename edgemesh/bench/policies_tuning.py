"""``bench policies``' rule for a policy's learning rate (pure): the grid's rate with the best median time to target
over the tuning seeds.

A median over seeds, not one lucky run, so that the rate chosen is the one a policy trains best with typically; a
run that never reaches the target ranks after every run that does (its time is infinite), so a rate that diverges
on half the seeds loses to one that is slower but arrives. Ties go to the smaller rate (the stabler one); when no
rate reaches the target on half the seeds, the best median final accuracy decides.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from edgemesh.simulate import SimRun


def median_time(runs: Sequence[SimRun]) -> float:
    """Median time to target, a run that never reached it counting as infinitely slow."""
    return statistics.median(math.inf if r.time_to_target_s is None else r.time_to_target_s for r in runs)


def choose_lr(by_lr: Mapping[float, Sequence[SimRun]]) -> dict[str, Any]:
    """The rate the rule picks among ``by_lr`` (rate -> its tuning runs), and every rate's figures."""
    if not by_lr or any(not runs for runs in by_lr.values()):
        raise ValueError("every rate of the grid needs at least one tuning run")
    figures = {lr: (median_time(runs),
                    statistics.median(r.final_accuracy if r.final_accuracy is not None else 0.0 for r in runs))
               for lr, runs in by_lr.items()}
    if any(math.isfinite(t) for t, _ in figures.values()):
        chosen = min(figures, key=lambda lr: (figures[lr][0], lr))
        by = "median time to target"
    else:
        chosen = min(figures, key=lambda lr: (-figures[lr][1], lr))
        by = "median final accuracy (no rate reached the target)"
    return {"lr": chosen, "by": by,
            "grid": {f"{lr:g}": {"median_time_to_target_s": t if math.isfinite(t) else None,
                                 "median_final_accuracy": round(acc, 4),
                                 "times": [r.time_to_target_s for r in by_lr[lr]]}
                     for lr, (t, acc) in sorted(figures.items())}}
