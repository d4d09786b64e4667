"""The planner: the device registry and the mesh layout (docs/mesh.md).

Backbone, top to bottom:
1. ``attach``: consume every device's hello, status and stats (into the ``registry``), the retained
   plan (to continue its version after a restart) and the parameter server's ``sync`` state;
2. the replan loop: once retained state has settled after start-up, and then at most once per
   debounce window after the plannable devices changed, lay out the live, undrained devices by the
   configured parallelism (``planning``: data parallel with its batch sizes, or the training grid of ``mesh``)
   and publish the plan retained with the next version, plus a ``replan`` event; the plan's ``reason`` and the event
   say why (``stability.Cause``: who joined, left or was drained, or which smoothed figures moved and the gain);
3. control: status, replan, drain-device, undrain-device, stop.

Balanced batches follow the devices' stats, and the training grid what they measure, smoothed (``planning``,
``stability``): a stats message of a planned device may call for a replan (``Parallelism.stats_call_for_replan``),
which the training grid makes only for a move beyond the band, worth the margin, after the minimum interval.

``planner.min_devices`` gates the job's first plan: no plan goes out before that many devices are live. Once
a plan has named devices, every change is published, down to an empty plan when all devices have left (the
parameter server never waits for a device that is gone) and up again from any number: a stopping broker sends
every device's will, and training must go on after it even if fewer devices come back. After a reconnect the
planner waits ``broker.backoff_max_s`` for devices to announce themselves again before it plans (``_settled``).

This module must not import torch: the planner runs on small hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.errors import BusError, WireError
from edgemesh.common.messages import ControlCommand, DeviceHello, DeviceStats, DeviceStatus, Plan, Scalar, SyncState
from edgemesh.common.messages.operations import SERVICE_COMMANDS, listing
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics, valid_name
from edgemesh.common.vocabulary import Batching
from edgemesh.services.planner.layout import same_layout
from edgemesh.services.planner.planning import (
    UNKNOWN_INCARNATION,
    Membership,
    batching_in_force,
    mesh_refusal,
    parallelism_of,
    policy_in_force,
)
from edgemesh.services.planner.registry import Registry
from edgemesh.services.planner.stability import REPLAN_REASONS, Cause
from edgemesh.services.runtime import ControlResult, Endpoint, Events, Job, serve

logger = logging.getLogger(__name__)

RETAINED_SETTLE_S = 0.2
"""After connecting, wait at least this long (or the debounce, if longer) for retained hellos, statuses and
the previous plan, and for what devices announce on reconnecting, before planning."""
COMMANDS = SERVICE_COMMANDS["planner"]


class Planner:
    """One planner process. ``run()`` until ``stop`` is set."""

    name = "planner"
    control_target = "planner"

    def __init__(self, config: Config, *, stop: asyncio.Event | None = None) -> None:
        self.cfg = config
        self.topics = Topics(config.job)
        self.stop = stop or asyncio.Event()
        self.bus: Bus | None = None
        self.events: Events | None = None
        self.registry = Registry(smoothing_window=config.planner.smoothing_window)
        self.sync_state: SyncState | None = None
        """The parameter server's latest retained sync state (policy, slow devices)."""
        self.plan: Plan | None = None
        """The current plan: the last one published, or the retained one adopted at start."""
        self.cause: Cause | None = None
        """Why the planner published the current plan (None for a plan adopted from the broker)."""
        self.version = 0
        self._began, self._settle_until = False, 0.0  # a plan named devices (min_devices is done); see _settled
        self._planned: dict[str, int] = {}
        """Device -> incarnation of the live set the current plan was made for."""
        self.ready = asyncio.Event()
        """Set once retained state has settled and the first plan decision was made."""
        self._online = asyncio.Event()
        self._dirty = asyncio.Event()
        self._lock = asyncio.Lock()

        m = self.metrics = ServiceMetrics(self.name)
        self.m_live = m.gauge("devices_live", "Devices online with a matching hello")
        self.m_drained = m.gauge("devices_drained", "Devices an operator drained out of the plan")
        self.m_version = m.gauge("plan_version", "Version of the current plan")
        self.m_replans = m.counter("replans", "Plans published, by cause", ["reason"])
        for reason in REPLAN_REASONS:
            self.m_replans.labels(reason=reason)
        self.m_excluded = m.gauge("devices_excluded", "Live devices left out of the plan: their memory holds "
                                  "no batch, or they refused their share")
        self.m_round = m.gauge("predicted_round_seconds", "Balanced plans: the iteration time the batches aim at")
        self.fallback = mesh_refusal(config)
        """Why the devices are planned data parallel where ``planner.parallelism`` asks for mesh ('' when not)."""
        self.parallelism = parallelism_of(config, self.registry, wake=self._dirty.set, predicted_round=self.m_round,
                                          refusal=self.fallback)
        """How the plannable devices are laid out: data parallel, or the training grid (``planner.parallelism``)."""

    async def run(self, *, signals: bool = False) -> None:
        await serve(self, self.cfg, signals=signals)

    # ------------------------------------------------------------------ the runtime's seams
    async def prepare(self, stack: contextlib.AsyncExitStack) -> Endpoint:
        logger.info("planner up: job %s, debounce %.2fs, min devices %d", self.cfg.job,
                    self.cfg.planner.replan_debounce_s, self.cfg.planner.min_devices)
        return Endpoint(self.cfg.broker)

    def attach(self, bus: Bus, events: Events) -> None:
        self.bus, self.events = bus, events
        t = self.topics
        bus.route(t.plan_filter(), Plan, self._on_plan)
        bus.route(t.sync_filter(), SyncState, self._on_sync)
        bus.route(t.hello_filter(), DeviceHello, self._on_hello)
        bus.route(t.status_filter(), DeviceStatus, self._on_status)
        bus.route(t.stats_filter(), DeviceStats, self._on_stats)
        bus.on_connect(self._on_connect)

    def jobs(self) -> list[Job]:
        return [self._replan_loop()]

    async def close(self) -> None:
        self.parallelism.close()

    async def _on_connect(self) -> None:
        """First connect: let the replan loop start. Reconnects: restore the retained plan (a broker restarted
        without persistence has lost it). Both: plans wait for what devices retain or announce (``_settled``)."""
        assert self.bus is not None
        wait = self.cfg.broker.backoff_max_s if self._online.is_set() else 0.0  # devices' longest: back by then
        if wait:
            logger.info("reconnected: plans wait %.1fs for the devices to announce themselves again", wait)
        self._settle_until = time.monotonic() + max(self.cfg.planner.replan_debounce_s, RETAINED_SETTLE_S, wait)
        if self._online.is_set() and self.plan is not None and self.ready.is_set():
            with contextlib.suppress(BusError):
                await self.bus.publish(self.topics.plan(), self.plan, retain=True)
        if not self._online.is_set() and self.fallback and self.events is not None:  # first connect: say why no grid
            logger.warning("%s", self.fallback)
            with contextlib.suppress(BusError):
                await self.events.emit("mesh_fallback", self.fallback)
        self._online.set()

    # ------------------------------------------------------------------ consuming
    async def _on_hello(self, hello: DeviceHello, _: TopicMatch) -> None:
        if self.registry.hello(hello):
            self._changed()

    async def _on_status(self, status: DeviceStatus, _: TopicMatch) -> None:
        if self.registry.status(status):
            self._changed()

    def _changed(self) -> None:
        """The plannable set changed: the replan loop has work."""
        self._dirty.set()
        self._update_gauges()

    async def _on_stats(self, stats: DeviceStats, _: TopicMatch) -> None:
        if stats.device not in self.registry.hellos:
            raise WireError(f"stats of {stats.device}, which has not said hello", "unknown_device")
        if not self.registry.measured(stats):
            return  # a previous run's
        planned = self.plan is not None and self.plan.device(stats.device) is not None
        if planned and self.parallelism.stats_call_for_replan(stats, balanced=self._batching() == "balanced"):
            self._dirty.set()

    async def _on_sync(self, state: SyncState, _: TopicMatch) -> None:
        """The parameter server's policy or its slow devices changed: batches may change."""
        before = self.sync_state
        self.sync_state = state
        if before is None or (before.policy, before.slow) != (state.policy, state.slow):
            self._dirty.set()

    async def _on_plan(self, plan: Plan, _: TopicMatch) -> None:
        """A plan on the plan topic: our own echo, or the retained plan of a previous run."""
        if plan.version <= self.version:
            return  # our own plan coming back, or an older one
        logger.info("continuing from plan version %d (%d devices)", plan.version, len(plan.devices))
        self.version = plan.version
        self.plan, self.cause = plan, None
        self._began = self._began or bool(plan.devices)
        self.registry.drained = set(plan.drained)
        self._planned = {d.device: UNKNOWN_INCARNATION for d in plan.devices}
        self.m_version.set(self.version)
        self._dirty.set()

    def _batching(self) -> Batching:
        return batching_in_force(self.sync_state, self.cfg)

    def _update_gauges(self) -> None:
        self.m_live.set(len(self.registry.live()))
        self.m_drained.set(len(self.registry.drained))
        self.m_excluded.set(self.registry.excluded_count())

    # ------------------------------------------------------------------ planning
    async def _replan_loop(self) -> None:
        await self._online.wait()
        await self._settled()
        self._dirty.clear()
        await self._replan(Cause("start"))
        self.ready.set()
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.cfg.planner.replan_debounce_s)
            await self._settled()
            self._dirty.clear()
            await self._replan(None)

    async def _settled(self) -> None:
        """Return once connected and settled: what devices retained, or announced again after a reconnect, is in."""
        assert self.bus is not None
        while True:
            wait = self._settle_until - time.monotonic() if self.bus.is_connected else RETAINED_SETTLE_S
            if wait <= 0:
                return
            await asyncio.sleep(wait)

    async def _replan(self, cause: Cause | None, *, force: bool = False) -> tuple[Plan | None, str]:
        """Publish a new plan if the plannable set or the layout changed (or ``force``).

        ``cause`` names the trigger (``start``; ``control``: a drain or an operator's replan); None means the
        registry or the measurements changed, and the cause becomes ``join``, ``leave``, ``slowdown``, ``links`` or
        ``rebalance`` (``Membership.cause``). Returns the published plan (or None) and a sentence saying what happened.
        """
        async with self._lock:
            self.parallelism.check_memory()
            self._update_gauges()
            devices = self.registry.plannable()
            members = Membership.of(self._planned, devices)
            if not self._began and len(devices) < self.cfg.planner.min_devices:
                if devices:
                    logger.info("%d device(s) live; waiting for %d before planning", len(devices),
                                self.cfg.planner.min_devices)
                return None, f"no plan: {len(devices)} device(s) live, {self.cfg.planner.min_devices} needed"
            plan, regrid = await self.parallelism.plan(devices, changed=members.changed, force=force,
                                                       current=self.plan, version=self.version + 1,
                                                       sync=self.sync_state)
            plan = dataclasses.replace(plan, drained=tuple(sorted(self.registry.drained)))
            if not (force or members.changed or not same_layout(plan, self.plan)):
                self._planned = members.current  # learn incarnations of a plan adopted from the broker
                return None, f"plan version {self.version} is current"
            rebalanced = members.rebalanced(plan, self.plan)
            why = members.cause(cause, regrid, rebalanced, plan, self.plan)
            plan = dataclasses.replace(plan, reason=why.label)
            if rebalanced:
                self.parallelism.rebalanced()
            return plan, await self._publish(plan, members, why)

    async def _publish(self, plan: Plan, members: Membership, why: Cause) -> str:
        """Make ``plan`` the current one: publish it retained, log it, emit the ``replan`` event (its ``reason`` the
        cause's label, its ``cause`` the devices and figures); what happened."""
        assert self.bus is not None and self.events is not None
        self.plan, self.version, self._planned, self.cause = plan, plan.version, members.current, why
        self._began = self._began or bool(plan.devices)
        self.m_round.set(plan.round_time_s)
        self.m_version.set(plan.version)
        self.m_replans.labels(reason=why.label).inc()
        await self.bus.publish(self.topics.plan(), plan, retain=True)
        text = members.describe(plan, why)
        logger.info("%s", text)
        if plan.batching == "balanced":
            logger.info("batches for a %.1f ms round: %s", plan.round_time_s * 1e3,
                        listing([f"{d.device}={d.batch_size}" for d in plan.devices]))
        meshes = [c for c in plan.clusters if len(c.members) > 1]
        if meshes:
            logger.info("model-parallel clusters, predicted %.1f ms per iteration: %s", plan.round_time_s * 1e3,
                        listing([f"{c.cluster}={'+'.join(c.members)}" for c in meshes]))
        await self.events.emit("replan", text, version=plan.version, reason=why.label, cause=why.detail,
                               joined=listing(members.joined), left=listing(members.left), devices=len(plan.devices),
                               clusters=len(plan.clusters))
        return text

    # ------------------------------------------------------------------ control
    async def control(self, cmd: ControlCommand) -> ControlResult:
        match cmd.command:
            case "status":
                return True, "ok", self._status()
            case "replan":
                return await self._replan_now(cmd)
            case "drain-device" | "undrain-device":
                return await self._drain(cmd)
            case "stop":
                return True, "stopping", self._status()
            case _:
                return False, f"unknown command {cmd.command!r} ({', '.join(COMMANDS)})", {}

    async def _replan_now(self, cmd: ControlCommand) -> ControlResult:
        """``replan``: a new plan now, whether or not anything changed."""
        if not self.ready.is_set():
            return False, "the planner is still collecting retained state; retry shortly", {}
        plan, text = await self._replan(Cause("control", f"{cmd.requester} asked for a new plan"), force=True)
        return plan is not None, text, self._status()

    async def _drain(self, cmd: ControlCommand) -> ControlResult:
        """``drain-device``, ``undrain-device``: take a device out of plans, or let it back, and plan again."""
        device = cmd.device or (cmd.value if isinstance(cmd.value, str) else "")
        if not valid_name(device):
            return False, f"{cmd.command} needs a device name in 'device' or 'value'", {}
        drain = cmd.command == "drain-device"
        if drain:
            self.registry.drained.add(device)
        else:
            self.registry.drained.discard(device)
        self._update_gauges()
        text = f"{device} {'drained' if drain else 'undrained'}"
        if device not in self.registry.hellos:
            text += " (not seen yet)"
        if self.ready.is_set():
            why = Cause("control", f"{device} {'drained' if drain else 'undrained'} by {cmd.requester}")
            _, outcome = await self._replan(why)
            text += f"; {outcome}"
        return True, text, self._status()

    def _status(self) -> dict[str, Scalar]:
        r = self.registry
        live = sorted(r.live())
        return {
            "live": listing(live),
            "devices_live": len(live),
            "drained": listing(sorted(r.drained)),
            "refused": listing(r.refusals()),
            "unfit": listing(sorted(r.unfit)),
            "batching": self.plan.batching if self.plan is not None else self._batching(),
            "policy": policy_in_force(self.sync_state, self.cfg.training),
            "known": len(r.hellos),
            "plan_version": self.version,
            "replan_cause": self.cause.describe() if self.cause is not None else "",
            "plan_devices": len(self.plan.devices) if self.plan is not None else 0,
        }
