"""What ``bench models`` makes of its cells: each cell's median over its seeds, the summary, the plot.

Pure functions of the report's dictionaries (no I/O but the PNG), called after every cell so that the report on
disk is whole at any moment.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from edgemesh.bench.reporting import pyplot, save

MEDIAN_FIELDS = ("reported_accuracy", "exported_accuracy", "last_evaluated_accuracy", "reference_accuracy",
                 "reference_best_accuracy", "gap_pt", "gap_last_pt", "time_to_target_s", "training_s", "model_version",
                 "versions", "samples_seen", "samples_to_target", "reference_samples_to_target", "accepted_updates",
                 "gradient_bytes_received", "bytes_published_by_services", "round_batch_reference_best_accuracy",
                 "gap_round_batch_pt")
"""The figures of a cell's seed whose median over the seeds the cell gives."""
WITHIN_PT = 2.0
"""A cell is within reach of the reference when its median gap is at most this many points either way."""
CHANCE_MARGIN = 0.05
"""A cell is at chance when its median exported accuracy is at most 1 / classes + this."""
EQUAL_EXPORT = 0.005
"""The exported model's held-out accuracy is the job's reported accuracy when within this."""


def gap_pt(exported: float | None, reference: float | None) -> float | None:
    """``exported - reference`` in points (percent), or None when either is missing."""
    return None if exported is None or reference is None else round(100.0 * (exported - reference), 2)


def median(values: list[Any]) -> Any:
    """The median of the values that are numbers; None when there are none."""
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    if not numbers:
        return None
    middle = statistics.median(numbers)
    return round(middle, 4) if isinstance(middle, float) else middle


def cell_median(seeds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A cell's figures over its seeds: the median of each of MEDIAN_FIELDS, how many seeds reached the target,
    how many failed."""
    runs = list(seeds.values())
    out = {name: median([run.get(name) for run in runs]) for name in MEDIAN_FIELDS}
    out["reached_target"] = f"{sum(bool(run.get('reached_target')) for run in runs)}/{len(runs)}"
    out["failed"] = sum(run.get("failure") is not None for run in runs)
    return out


def summary(cells: dict[str, dict[str, Any]], classes: int) -> dict[str, Any]:
    """Which cells (``model/policy``) the fleet trains as well as the reference, which sit at chance, the worst gap,
    which seeds failed and whether every export scored what its job reported."""
    chance = round(1.0 / classes + CHANCE_MARGIN, 4)
    gaps: dict[str, float] = {}
    round_gaps: dict[str, float] = {}  # round policies' gaps to one process at the round's batch
    at_chance, failed = [], {}
    exported_equal, exported = 0, 0
    for model, policies in cells.items():
        for policy, cell in policies.items():
            key = f"{model}/{policy}"
            middle = cell["median"]
            if middle["gap_pt"] is not None:
                gaps[key] = middle["gap_pt"]
            if middle.get("gap_round_batch_pt") is not None:
                round_gaps[key] = middle["gap_round_batch_pt"]
            if middle["exported_accuracy"] is not None and middle["exported_accuracy"] <= chance:
                at_chance.append(key)
            for seed, run in cell["seeds"].items():
                if run.get("failure") is not None:
                    failed[f"{key}/s{seed}"] = run["failure"]
                if run.get("exported_accuracy") is not None and run.get("reported_accuracy") is not None:
                    exported += 1
                    exported_equal += abs(run["exported_accuracy"] - run["reported_accuracy"]) <= EQUAL_EXPORT
    worst = min(gaps, key=gaps.__getitem__, default=None)
    return {
        "cells": sum(len(p) for p in cells.values()),
        "cells_with_a_gap": len(gaps),
        f"within_{WITHIN_PT:g}pt": sorted(k for k, g in gaps.items() if abs(g) <= WITHIN_PT),
        f"below_reference_by_over_{WITHIN_PT:g}pt": sorted(k for k, g in gaps.items() if g < -WITHIN_PT),
        f"above_reference_by_over_{WITHIN_PT:g}pt": sorted(k for k, g in gaps.items() if g > WITHIN_PT),
        f"round_policies_within_{WITHIN_PT:g}pt_of_the_round_batch_reference": sorted(
            k for k, g in round_gaps.items() if abs(g) <= WITHIN_PT),
        f"round_policies_below_the_round_batch_reference_by_over_{WITHIN_PT:g}pt": sorted(
            k for k, g in round_gaps.items() if g < -WITHIN_PT),
        "chance_accuracy": chance,
        "at_chance": sorted(at_chance),
        "worst_gap": {"cell": worst, "gap_pt": gaps[worst]} if worst is not None else None,
        "exported_equals_reported": f"{exported_equal}/{exported}",
        "failed": failed,
    }


SAME_SETTINGS = ("policies", "workers", "per_class", "held_out_per_class", "target_accuracy", "max_minutes",
                 "max_versions", "quick", "eval_every", "overrides", "samples_budget")
"""What the runs of a merge must share: the same cells trained on the same data for the same budget."""


def merge(parts: list[dict[str, Any]], *, classes: int, command: str) -> dict[str, Any]:
    """One report of the runs ``parts`` of other seeds (``--first-seed``) of the same matrix: every seed's cells and
    references, each cell's median and the summary anew. ValueError when the runs differ in what they trained or
    both trained a seed. ``complete``: every cell of every model holds every seed some run trained."""
    _check_mergeable(parts)
    first = parts[0]
    merged: dict[str, Any] = {**first, "cells": {}, "references": {}, "models": {}, "failure": None}
    for part in parts:
        merged["models"].update(part["models"])
        for model, policies in part["cells"].items():
            for policy, cell in policies.items():
                into = merged["cells"].setdefault(model, {}).setdefault(policy, {"median": {}, "seeds": {}})
                twice = sorted(set(cell["seeds"]) & set(into["seeds"]))
                if twice:
                    raise ValueError(f"{model}/{policy}: seed(s) {', '.join(twice)} in two of the runs")
                into["seeds"].update(cell["seeds"])
        for model, seeds in part["references"].items():
            merged["references"].setdefault(model, {}).update(seeds)
        merged["failure"] = merged["failure"] or part.get("failure")
    for policies in merged["cells"].values():
        for cell in policies.values():
            cell["seeds"] = dict(sorted(cell["seeds"].items(), key=lambda item: int(item[0])))
            cell["median"] = cell_median(cell["seeds"])
    seeds = _seeds_of(merged)
    models = sorted({m for part in parts for m in part["settings"]["models"]})
    merged["complete"] = all(
        set(merged["cells"].get(m, {})) == set(first["settings"]["policies"])
        and all(sorted(int(k) for k in cell["seeds"]) == seeds for cell in merged["cells"][m].values())
        and {int(s) for s in merged["references"].get(m, {})} == set(seeds) for m in models)
    merged["settings"] = {**first["settings"], "models": models, "seeds": len(seeds), "first_seed": seeds[0]}
    merged["summary"] = summary(merged["cells"], classes)
    merged["command"] = command
    merged["merged_from"] = [{"command": part["command"], "seeds": _seeds_of(part), "complete": part.get("complete"),
                              "wall_seconds": part.get("wall_seconds"), "host": part.get("host")} for part in parts]
    merged["wall_seconds"] = round(sum(part.get("wall_seconds") or 0.0 for part in parts), 1)
    merged["same_processes"] = all(part.get("same_processes") for part in parts)
    return merged


def _check_mergeable(parts: list[dict[str, Any]]) -> None:
    """ValueError unless there are two runs or more of the same cells on the same data and budget."""
    if len(parts) < 2:
        raise ValueError("--merge needs two reports or more")
    first = parts[0]
    for part in parts[1:]:
        differ = [k for k in SAME_SETTINGS if part["settings"].get(k) != first["settings"].get(k)]
        if differ or part["data"] != first["data"]:
            raise ValueError(f"the runs differ in {', '.join(differ) or 'their data'}: they do not merge")


def _seeds_of(report: dict[str, Any]) -> list[int]:
    """The seeds any cell of ``report`` holds."""
    return sorted({int(s) for policies in report["cells"].values() for cell in policies.values()
                   for s in cell["seeds"]})


def plot(result: dict[str, Any], png: Path) -> bool:
    """A heat map of each cell's median gap (exported minus reference, points), annotated with the median exported
    and reference accuracies."""
    plt = pyplot()
    cells = result.get("cells") or {}
    if plt is None or not cells:
        return False
    import numpy as np

    models = list(cells)
    policies = list(dict.fromkeys(p for by_policy in cells.values() for p in by_policy))
    grid = np.full((len(models), len(policies)), np.nan)
    fig, ax = plt.subplots(figsize=(2.2 * len(policies) + 3, 0.9 * len(models) + 2))
    texts: list[tuple[int, int, str, float | None]] = []
    for i, model in enumerate(models):
        for j, policy in enumerate(policies):
            cell = cells[model].get(policy)
            middle = cell["median"] if cell else {}
            gap = middle.get("gap_pt")
            if gap is not None:
                grid[i, j] = gap
            exported, reference = middle.get("exported_accuracy"), middle.get("reference_best_accuracy")  # the gap's
            text = "failed" if cell and middle.get("failed") else "-"
            if gap is not None:
                text = f"{gap:+.1f} pt\n{exported:.2f} / {reference:.2f}"
            elif exported is not None:
                text = f"{exported:.2f} / -"
            texts.append((j, i, text, gap))
    limit = max(5.0, float(np.nanmax(np.abs(grid)))) if not np.all(np.isnan(grid)) else 5.0
    for j, i, text, gap in texts:
        dark = gap is not None and abs(gap) > 0.7 * limit
        ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
    image = ax.imshow(grid, cmap="RdYlGn", vmin=-limit, vmax=limit, aspect="auto")
    fig.colorbar(image, ax=ax, label="exported - reference (points)")
    ax.set_xticks(range(len(policies)), policies)
    ax.set_yticks(range(len(models)), models)
    seeds = result.get("settings", {}).get("seeds")
    ax.set_title(f"fleet's exported model vs one PyTorch process, same samples (median of {seeds} seed(s));\n"
                 "each cell: gap, exported / reference accuracy", fontsize=9)
    return save(fig, png)
