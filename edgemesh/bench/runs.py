"""What the cluster benchmarks share: one run of a local cluster of emulated devices."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from edgemesh.common.bus import Bus, Route
from edgemesh.common.config import Config
from edgemesh.common.emulation.profiles import DeviceProfile, load_profiles
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import Event, Plan
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.processes import LocalCluster

GUARD_INTERVAL_S = 0.25
"""How often a run checks that its processes still run and whether it is done."""
PROGRESS_INTERVAL_S = 5.0
"""How often a run says how far it got."""


def fleet_profiles(fleet: list[str], single: str, overrides: dict[str, str],
                   extra: Mapping[str, DeviceProfile] | None = None) -> dict[str, DeviceProfile]:
    """The device profiles (``worker.emulation_profiles`` or the shipped ones, and ``extra``: boards by name, such as
    a running job's devices as measured); ConfigError naming any profile of ``fleet`` or the single board that is
    not among them."""
    profiles = {**load_profiles(overrides.get("worker.emulation_profiles") or None), **(extra or {})}
    unknown = sorted({p for p in [*fleet, single] if p not in profiles})
    if unknown:
        raise ConfigError(f"unknown device profile(s) {', '.join(unknown)}; known: {', '.join(sorted(profiles))}")
    return profiles


def device_names(fleet: list[str]) -> list[tuple[str, str]]:
    """(device name, profile) per device: ``pi3-0``, ``pi3-1``, ``pi4-0``, ..."""
    counts: dict[str, int] = {}
    out = []
    for profile in fleet:
        i = counts.get(profile, 0)
        counts[profile] = i + 1
        out.append((f"{profile}-{i}", profile))
    return out


async def drive(cluster: LocalCluster, devices: list[tuple[str, str]], watch: Coroutine[Any, Any, None], *,
                started: Callable[[], float | None], done: Callable[[float], bool], status: Callable[[float], str],
                progress: Callable[[str], None], start_timeout_s: float,
                run_timeout_s: float | None = None, flags: Mapping[str, list[str]] | None = None,
                tick: Callable[[float], Awaitable[None]] | None = None) -> str | None:
    """Start ``cluster``'s services and one ``--emulate`` worker per ``(device, profile)`` (a plain worker for
    an empty profile; with its ``flags``, if any), with ``watch`` (the run's bus observer) alongside, until
    ``done(seconds since started())``; then scrape every process's metrics and stop them all. Returns why the
    run failed, or None.

    ``started()`` is None until the run's clock starts (the plan names every device); the run fails
    if that takes over ``start_timeout_s`` or, once started, lasts over ``run_timeout_s``. Once started,
    ``tick(seconds since started())``, if given, is awaited before every check of ``done`` (a benchmark's
    own schedule: kills, samples); a child it stops must leave ``cluster.children``, or the run fails."""
    watcher = asyncio.create_task(watch)
    failure: str | None = None
    try:
        cluster.start_services(min_devices=len(devices))
        for name, profile in devices:
            emulate = ["--emulate", profile] if profile else []
            cluster.spawn("worker", name, ["--device", name, *emulate, *(flags or {}).get(name, [])])
        launched = time.monotonic()
        shown = 0.0
        while True:
            failure = cluster.failure()
            if failure is not None:
                break
            now = time.monotonic()
            t0 = started()
            if t0 is None:
                if now - launched > start_timeout_s:
                    failure = f"the plan did not name all {len(devices)} devices within {start_timeout_s:.0f}s"
                    break
            else:
                if tick is not None:
                    await tick(now - t0)
                if done(now - t0):
                    break
                if run_timeout_s is not None and now - t0 > run_timeout_s:
                    failure = f"not done within {run_timeout_s:.0f}s: {status(now - t0)}"
                    break
                if now - shown >= PROGRESS_INTERVAL_S:
                    shown = now
                    progress(f"  {status(now - t0)}")
            await asyncio.sleep(GUARD_INTERVAL_S)
        await asyncio.to_thread(cluster.scrape_all)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
        cluster.stop()
    return failure


@dataclass(slots=True)
class Timeline:
    """What a cluster benchmark's run sees of its timeline: t0, when the plan first names every
    device; the last plan; the evaluations after t0; and why it failed, if it did."""

    t0: float | None = None
    plan: Plan | None = None
    evaluations: list[tuple[float, int, float]] = field(default_factory=list)
    """(seconds since t0, model version, accuracy)."""
    failure: str | None = None

    def routes(self, topics: Topics, devices: set[str]) -> list[Route[Any]]:
        """Routes that keep this timeline: the plans (t0 once they name ``devices``) and the PS's evaluations."""
        async def on_plan(plan: Plan, _: TopicMatch) -> None:
            self.plan = plan
            if self.t0 is None and {d.device for d in plan.devices} >= devices:
                self.t0 = time.monotonic()

        async def on_event(event: Event, _: TopicMatch) -> None:
            if event.kind == "evaluation" and event.source == "ps" and self.t0 is not None:
                self.evaluations.append((time.monotonic() - self.t0, int(event.data.get("version") or 0),
                                         float(event.data.get("accuracy") or 0.0)))

        return [Route(topics.plan_filter(), Plan, on_plan), Route(topics.events_filter(), Event, on_event)]


async def observe(cfg: Config, *routes: Route[Any]) -> None:
    """Watch a run's topics through ``routes`` until cancelled."""
    bus = Bus(cfg.broker, client_id=f"edgemesh-bench-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("bench"),
              connect_first=False)
    for route in routes:
        bus.route(route.filter, route.message, route.handler)
    async with bus:
        await asyncio.Event().wait()  # routed until cancelled


def names(text: str) -> list[str]:
    """A comma-separated list from the command line."""
    return [p.strip() for p in text.split(",") if p.strip()]


def cluster_flags(parser: argparse.ArgumentParser, *, seed: str) -> None:
    """The flags every cluster benchmark takes: ``--seed`` (what it seeds), ``--keep-logs``, ``--set`` and
    ``--log-level``."""
    parser.add_argument("--seed", type=int, default=0, help=seed)
    parser.add_argument("--keep-logs", action="store_true", help="keep every process's log (failed runs always do)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any setting")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR")
