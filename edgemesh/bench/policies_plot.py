"""``bench policies``' plot and text tables: median time to target per policy and case, with its quartiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgemesh.bench.reporting import pyplot, save


def plot(result: dict[str, Any], png: Path) -> bool:
    """One panel per case: each policy's median time to target (bar), its quartiles (whisker), the share of runs
    that never reached the target (written on the bar), and the budget (dashed) where unreached runs sit."""
    plt = pyplot()
    if plt is None:
        return False
    cases = result["cases"]
    budget = result["settings"]["budget_s"]
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 4), squeeze=False)
    for ax, (case, data) in zip(axes[0], cases.items(), strict=True):
        names = list(data["policies"])
        medians, lows, highs = [], [], []
        for p in names:
            f = data["policies"][p]
            m = f["median_time_to_target_s"] if f["median_time_to_target_s"] is not None else budget
            q1, q3 = (budget if q is None else q for q in f["iqr_time_to_target_s"])
            medians.append(m)
            lows.append(max(0.0, m - q1))
            highs.append(max(0.0, q3 - m))
        bars = ax.bar(names, medians, yerr=[lows, highs], capsize=4, color="tab:blue", alpha=0.75)
        for bar, p in zip(bars, names, strict=True):
            f = data["policies"][p]
            ax.annotate(f"{f['never_reached_share']:.0%} miss\n{f['diverged_share']:.0%} div",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
        ax.axhline(budget, linestyle="--", color="grey", linewidth=0.8)
        ax.set_title(f"{case} (headroom x{data['headroom']['ratio']:g})")
        ax.set_ylabel(f"virtual s to {result['settings']['target']:g} (median, IQR)")
        ax.tick_params(axis="x", labelrotation=30)
    return save(fig, png)


def _fmt(x: Any, spec: str = ".1f", *, never: bool = False) -> str:
    """``x`` as ``spec``; None as ``never`` (a time of runs that did not reach the target) or ``-``."""
    if x is None:
        return "never" if never else "-"
    return format(x, spec)


def tables(result: dict[str, Any]) -> str:
    """The report's figures per case as Markdown tables (what docs/benchmarks.md shows)."""
    lines = []
    for case, data in result["cases"].items():
        lines += [f"{case}: headroom ratio {data['headroom']['ratio']} (seeds {data['headroom']['min_max'][0]}-"
                  f"{data['headroom']['min_max'][1]})", "",
                  "| policy | lr | median s | IQR s | min-max s | never reached | diverged | x sync | sooner than sync "
                  "| headroom share |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for p, f in data["policies"].items():
            q1, q3 = f["iqr_time_to_target_s"]
            mm = f["min_max_time_to_target_s"]
            iqr = f"{_fmt(q1, never=True)} to {_fmt(q3, never=True)}"
            lines.append(f"| `{p}` | {data['lr'][p]:g} | {_fmt(f['median_time_to_target_s'], never=True)} | {iqr} "
                         f"| {'-' if mm is None else f'{mm[0]:.1f} to {mm[1]:.1f}'} | {f['never_reached_share']:.0%} "
                         f"| {f['diverged_share']:.0%} | {_fmt(f['speedup_over_sync'], '.2f')} "
                         f"| {f['sooner_than_sync']}/{f['seeds_paired_with_sync']} "
                         f"| {_fmt(f['headroom_share'], '.2f')} |")
        lines.append("")
    if result.get("straggler"):
        lines.append("straggler: " + ", ".join(f"{k} {v}" for k, v in result["straggler"].items()))
    if result.get("scale"):
        s = result["scale"]
        lines.append(f"scale: {s['policy']} on {s['devices']} devices: {s['time_to_target_s']} virtual s to target, "
                     f"{s['versions']} versions, {s['gradients']} gradients, {s['wall_s']} wall s (fits: {s['fits']})")
    return "\n".join(lines)
