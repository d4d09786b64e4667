"""What ``edgemesh bench fleet`` makes of its runs: the scenario's events every policy met, how much sooner
``adaptive`` reached the target than the others, the issue's acceptance checks, the report and the PNG.

One report holds the latest run of each scenario (``{"scenarios": {"steady": run, "dynamic": run, ...}}``): a run
replaces its scenario's earlier one and keeps the others, so that ``bench/reports/fleet.json`` is the benchmark's
current evidence (earlier runs live in git). A report of one run alone (the layout before) still reads as one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgemesh.bench.reporting import pyplot, save
from edgemesh.bench.rounds import ratio
from edgemesh.common.emulation.dynamics import Timeline
from edgemesh.common.emulation.scenarios import Scenario

logger = logging.getLogger(__name__)


def scenario_events(scenario: Scenario, fleet: list[tuple[str, str]], seed: int, until_s: float) -> dict[str, Any]:
    """The scenario's throttled spells, stalls and drop-outs per device over ``until_s`` board seconds, and
    their totals (what every policy's run met)."""
    per_device = {}
    totals = {"throttled_share": 0.0, "stalls": 0, "stalled_s": 0.0, "drops": 0, "dropped_s": 0.0}
    for device, profile in fleet:
        timeline = Timeline.of(scenario, profile, device, seed)
        events = timeline.until(until_s)
        per_device[device] = [e.summary() for e in events]
        totals["throttled_share"] += timeline.share("throttle", until_s) / len(fleet)
        for e in events:
            length = min(e.end_s, until_s) - e.start_s
            if e.kind == "stall":
                totals["stalls"] += 1
                totals["stalled_s"] += length
            elif e.kind == "drop":
                totals["drops"] += 1
                totals["dropped_s"] += length
    return {"totals": {k: round(v, 3) for k, v in totals.items()}, "devices": per_device}


def ratios(policies: dict[str, dict[str, Any]], budget_s: float) -> dict[str, Any]:
    """How much sooner ``adaptive`` reaches the target than each other policy (time ratios); for a policy that
    never reached it, at least ``budget_s`` over adaptive's time (``..._at_least``)."""
    ours = policies.get("adaptive", {}).get("time_to_target_s")
    out: dict[str, Any] = {}
    for other in policies:
        if other == "adaptive":
            continue
        theirs = policies[other].get("time_to_target_s")
        out[f"{other}_over_adaptive_time_to_target"] = ratio(theirs, ours)
        if theirs is None and ours:
            out[f"{other}_over_adaptive_time_to_target_at_least"] = ratio(budget_s, ours)
    return out


def acceptance(scenario: str, policies: dict[str, dict[str, Any]], budget_s: float) -> dict[str, bool | None]:
    """The issue's acceptance checks that apply to this scenario (None: a figure is missing)."""
    out: dict[str, bool | None] = {"every_run_valid": all(e["valid"] for e in policies.values())}
    a = policies.get("adaptive")
    if a is None:
        return out
    def time_ratio(other: str) -> float | None:  # a policy that never reached the target: at least the budget
        if other not in policies or not a["time_to_target_s"]:
            return None
        return ratio(policies[other]["time_to_target_s"] or budget_s, a["time_to_target_s"])
    if scenario == "steady" and "sync" in policies:
        r = time_ratio("sync")
        out["adaptive_within_10pct_of_sync"] = None if r is None else 1 / r <= 1.1
    elif scenario != "steady":
        r_sync, r_single = time_ratio("sync"), time_ratio("single")
        out["adaptive_2x_sooner_than_sync"] = None if r_sync is None else r_sync >= 2
        out["adaptive_3.2x_sooner_than_single"] = None if r_single is None else r_single >= 3.2
        if "sync" in policies and a["final_accuracy"] is not None and policies["sync"]["final_accuracy"] is not None:
            out["final_accuracy_within_1pt_of_sync"] = a["final_accuracy"] >= policies["sync"]["final_accuracy"] - 0.01
        for other in ("async", "ssp"):
            if other in policies:
                o = policies[other]
                sooner = a["time_to_target_s"] is not None and (o["time_to_target_s"] is None
                                                                or a["time_to_target_s"] < o["time_to_target_s"])
                better = (a["final_accuracy"] or 0) > (o["final_accuracy"] or 0)
                out[f"beats_{other}"] = sooner or better
    return out


def runs_of(report: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Scenario -> run of a fleet report, in either layout ({} when ``report`` is neither)."""
    if isinstance(report.get("scenarios"), dict):
        return {name: run for name, run in report["scenarios"].items() if isinstance(run, dict)}
    scenario = report.get("scenario")
    if isinstance(scenario, dict) and isinstance(scenario.get("scenario"), str) and "policies" in report:
        return {scenario["scenario"]: dict(report)}
    return {}


def read_runs(path: Path | None) -> dict[str, dict[str, Any]]:
    """The runs of the fleet report at ``path`` ({} when there is none, or it is no fleet report: logged)."""
    if path is None or not path.exists():
        return {}
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("%s: not a fleet report (%s)", path, exc)
        return {}
    runs = runs_of(report) if isinstance(report, dict) else {}
    if not runs:
        logger.warning("%s: not a fleet report: no scenario's run in it", path)
    return runs


def merged(path: Path, scenario: str, run: dict[str, Any]) -> dict[str, Any]:
    """The report to write at ``path``: its runs of other scenarios, and ``run`` as ``scenario``'s."""
    runs = {name: old for name, old in read_runs(path).items() if name != scenario}
    return {"benchmark": "fleet", "scenarios": {**runs, scenario: run}}


COLOURS = {"throttle": "tab:orange", "stall": "tab:red", "drop": "black"}
POLICY_COLOURS = {"single": "tab:blue", "sync": "tab:orange", "async": "tab:green", "ssp": "tab:red",
                  "adaptive": "tab:purple"}
"""One colour per policy in every scenario's panel."""


def plot(report: dict[str, Any], path: Path) -> bool:
    """Per scenario, one below the other: accuracy against board time per policy above the events the devices met."""
    plt = pyplot()
    if plt is None:
        return False
    runs = runs_of(report)
    fig, axes = plt.subplots(2 * len(runs), 1, figsize=(9, 7 * len(runs)), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2] * len(runs)})
    for row, result in enumerate(runs.values()):
        _draw(axes[2 * row][0], axes[2 * row + 1][0], result)
    return save(fig, path)


def _draw(ax: Any, events: Any, result: dict[str, Any]) -> None:
    """One scenario's run: its accuracy curves on ``ax``, its devices' events on ``events``."""
    for policy, entry in result["policies"].items():
        curve = entry["curve"]
        if curve:
            mark = "" if entry["valid"] else " (invalid)"
            ax.plot([c[0] for c in curve], [c[2] for c in curve], label=f"{policy} (lr {entry['lr']:g}){mark}",
                    linewidth=1.5, color=POLICY_COLOURS.get(policy))
    ax.axhline(result["target_accuracy"], color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0.5, 1.0)
    ax.set_xlim(0, result["budget_s"])
    kinds = ", ".join(sorted({d["profile"] for d in result["fleet"]}))
    ax.set_title(f"scenario {result['scenario']['scenario']}: emulated fleet of {len(result['fleet'])} ({kinds}); "
                 f"single = one {result['single']['profile']}")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    devices = list(result["events"]["devices"])
    for row, device in enumerate(devices):
        for e in result["events"]["devices"][device]:
            events.barh(row, e["length_s"], left=e["start_s"], color=COLOURS[e["kind"]], height=0.6)
    events.set_yticks(range(len(devices)), devices, fontsize=8)
    events.set_xlim(0, result["budget_s"])
    events.set_xlabel("board seconds since the plan named every device")
    events.set_title("events: throttled (orange), link stalled (red), dropped out (black)", fontsize=9)
