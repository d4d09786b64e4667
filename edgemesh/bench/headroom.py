"""How much faster than ``sync`` a policy that waits for no one could train in a scenario: its *headroom*.

An asynchronous or adaptive rule gains on ``sync`` by not waiting: for the throttled board, the stalled
link, the device that dropped out. This module replays a scenario's seeded timelines (the very ones the
emulated boards follow, :mod:`edgemesh.common.emulation.dynamics`) over a fleet's workload and counts the
training samples per board second of two idealized fleets:

* **sync**: rounds. Every member computes its share of the round's batch, shares planned from the speeds
  its stats gave ``lag_s`` ago (the stats interval plus the planner's re-balance interval); sends its
  update (stalls and drop-outs hold the bytes, the link rate speeds or slows them); the round closes at
  the last update; the model goes down to every member; the bus adds its per-round overhead. A member
  that drops out is waited for ``detect_s`` (the planner's debounce and a new plan), then left out until
  it is back. Generous to sync: re-balancing is exact, a device that is back rejoins the next round.
* **free**: every device loops on its own (compute its batch at its current speed, send, receive, the
  same overhead) and waits for no one; an update counts as much however stale it is. Generous to every
  other policy.

``ratio = free / sync`` bounds the speed-up a policy can draw from not waiting, in samples per second:
no policy processes samples faster than ``free``. It does not bound a gain in sample efficiency (more,
smaller updates), which a policy could have in ``steady`` as well; ``dynamics_ratio`` (the scenario's
ratio over ``steady``'s on the same workload) is the part the scenario's events add.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edgemesh.common import costs
from edgemesh.common.emulation.dynamics import Timeline
from edgemesh.common.emulation.profiles import DeviceProfile
from edgemesh.common.emulation.scenarios import Scenario

LONG_RUN_S = 3600.0
"""Board seconds of the long-run figure (a run of the benchmark sees only its first seconds)."""


@dataclass(frozen=True, slots=True)
class Load:
    """One device's share of the workload, at full speed, in board seconds."""

    device: str
    samples_per_s: float
    """Training samples per second of compute at full speed."""
    batch: int
    """Its batch when nothing throttles (what the planner balances in a steady fleet)."""
    up_s: float
    """Sending one update at the profile's link rate."""
    down_s: float
    """Receiving one model at the profile's link rate."""


@dataclass(frozen=True, slots=True)
class Workload:
    """A fleet's workload: each device's load and the bus's overhead per round."""

    loads: tuple[Load, ...]
    overhead_s: float

    @property
    def round_samples(self) -> int:
        return sum(load.batch for load in self.loads)


def workload(model: str, profiles: Mapping[str, DeviceProfile], sync_entry: Mapping[str, Any]) -> Workload:
    """The workload of a fleet run: compute from the model's FLOPs and each profile's rate (what the emulated
    boards are held to), batches, link seconds and overhead as the ``sync`` run of a report measured them.
    ``profiles`` maps each device to its profile."""
    per_sample = costs.cost(model).train_flops_per_sample
    links = sync_entry["link_s"]
    ups, downs = sync_entry.get("link_up_s") or {}, sync_entry.get("link_down_s") or {}
    loads = []
    for device, profile in profiles.items():
        rate = profile.train_gflops * 1e9 * costs.TRAIN_EFFICIENCY / per_sample
        both = links.get(device, 0.0)
        up, down = (ups[device], downs[device]) if device in ups and device in downs else (both / 2, both / 2)
        loads.append(Load(device, rate, int(sync_entry["batch_sizes"][device]), up, down))
    return Workload(tuple(loads), float(sync_entry["bus_overhead_s"] or 0.0))


def _free_rate(workload: Workload, timelines: Mapping[str, Timeline], horizon_s: float) -> float:
    total = 0.0
    for load in workload.loads:
        tl = timelines[load.device]
        t, samples = 0.0, 0
        while t < horizon_s:
            drop = tl.drop_between(t, t)
            if drop is not None:  # a device that dropped out computes nothing until it is back
                t = drop.end_s
            done = tl.work_end(t, load.batch / load.samples_per_s)
            sent = tl.transfer_end(done, load.up_s)
            t = tl.transfer_end(sent, load.down_s) + workload.overhead_s
            samples += load.batch
        total += samples / t
    return total


def _sync_rate(workload: Workload, timelines: Mapping[str, Timeline], horizon_s: float, *, lag_s: float,
               detect_s: float) -> float:
    t, samples = 0.0, 0.0
    while t < horizon_s:
        members = []
        for load in workload.loads:
            drop = timelines[load.device].drop_between(t, t)
            if drop is None or t < drop.start_s + detect_s:
                members.append(load)
        if not members:  # every device is out: the round waits for the first one back
            t = min(d.end_s for load in workload.loads if (d := timelines[load.device].drop_between(t, t)))
            continue
        speeds = {m.device: m.samples_per_s * timelines[m.device].speed_at(max(0.0, t - lag_s)) for m in members}
        total = sum(speeds.values())
        closed, counted, stayed = t, 0.0, []
        for m in members:
            tl = timelines[m.device]
            share = workload.round_samples * speeds[m.device] / total
            sent = tl.transfer_end(tl.work_end(t, share / m.samples_per_s), m.up_s)
            drop = tl.drop_between(t, sent)
            if drop is not None:  # waited for until the planner leaves it out; its share is lost
                closed = max(closed, max(t, drop.start_s) + detect_s)
                continue
            closed = max(closed, sent)
            counted += share
            stayed.append(m)
        t = max((timelines[m.device].transfer_end(closed, m.down_s) for m in stayed), default=closed)
        t += workload.overhead_s
        samples += counted
    return samples / t


def headroom(scenario: Scenario, steady: Scenario, fleet: list[tuple[str, str]], load: Workload, seed: int,
             horizon_s: float, *, lag_s: float, detect_s: float) -> dict[str, Any]:
    """Samples per board second of ``sync`` and of ``free`` over ``horizon_s`` of ``scenario`` (seeded like the
    runs), their ratio, and the same ratio in ``steady``; ``fleet`` lists ``(device, profile)``."""
    out: dict[str, Any] = {}
    for name, s in (("scenario", scenario), ("steady", steady)):
        timelines = {device: Timeline.of(s, profile, device, seed) for device, profile in fleet}
        sync = _sync_rate(load, timelines, horizon_s, lag_s=lag_s, detect_s=detect_s)
        free = _free_rate(load, timelines, horizon_s)
        out[name] = {"sync_samples_per_s": round(sync, 1), "free_samples_per_s": round(free, 1),
                     "ratio": round(free / sync, 3)}
    return {"horizon_s": horizon_s, "ratio": out["scenario"]["ratio"],
            "dynamics_ratio": round(out["scenario"]["ratio"] / out["steady"]["ratio"], 3), **out}


def of_bench(result: Mapping[str, Any], *, scenario: Scenario, steady: Scenario, model: str,
             profiles: Mapping[str, DeviceProfile], steady_report: Mapping[str, Any] | None, lag_s: float,
             detect_s: float) -> dict[str, Any]:
    """The ``headroom`` section of a fleet report: over the run's budget and over ``LONG_RUN_S``. The workload is
    the ``sync`` run of the ``steady`` report (this one in ``steady``, else ``steady_report``: the one the
    learning rates came from), so that throttling and stalls do not leak into it."""
    source = result if scenario.name == steady.name else steady_report
    entry = (source or {}).get("policies", {}).get("sync")
    if not entry or not entry.get("link_s") or not entry.get("batch_sizes") or entry.get("bus_overhead_s") is None:
        return {"skipped": "needs the sync run of a steady report (run steady first, then --lr-from it)"}
    fleet = [(d["device"], d["profile"]) for d in result["fleet"]]
    if sorted(entry["batch_sizes"]) != sorted(device for device, _ in fleet):
        return {"skipped": "the steady report's sync run had another fleet"}
    load = workload(model, {device: profiles[profile] for device, profile in fleet}, entry)
    seed = int(result["seed"])
    figures: dict[str, Any] = {"workload_from": "this report" if source is result else "the steady report (--lr-from)",
               "lag_s": lag_s, "detect_s": detect_s, "overhead_s": load.overhead_s}
    for key, horizon in (("run", float(result["budget_s"])), ("long_run", LONG_RUN_S)):
        figures[key] = headroom(scenario, steady, fleet, load, seed, horizon, lag_s=lag_s, detect_s=detect_s)
    return figures
