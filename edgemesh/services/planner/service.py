"""The planner: the device registry and the mesh layout (docs/mesh.md).

Backbone, top to bottom:
1. ``attach``: consume every device's hello, status and stats (into the ``registry``), the retained
   plan (to continue its version after a restart) and the parameter server's ``sync`` state;
2. the replan loop: once retained state has settled after start-up, and then at most once per
   debounce window after the plannable devices changed, lay out the live, undrained devices
   (``layout``; with ``planner.parallelism = "mesh"`` the training grid of ``mesh``) with their
   batch sizes (``batching``) and publish the plan retained with the next version, plus a
   ``replan`` event;
3. control: status, replan, drain-device, undrain-device, stop.

Batch sizes are uniform, or balanced to each device's measured speed (``planner.batching``;
``auto`` balances under the ``adaptive`` policy, read from the parameter server's retained
``sync`` state). Balanced batches follow the stats: a new plan goes out when a batch would move
by more than ``planner.rebalance_threshold``, at most once per ``planner.rebalance_interval_s``.
Devices the parameter server lists as slow get smaller batches.

In mesh parallelism the grid plans with each device's hello, its speed and links replaced by what it measured
(``_mesh_infos``), and is laid out again when the measured speeds make a better layout worth it, or the measured
links move the current one's predicted iteration past ``planner.replan_threshold`` (``mesh.links_moved``).

``planner.min_devices`` gates the job's first plan: no plan goes out before that many devices are live. Once
a plan has named devices, every change is published, down to an empty plan when all devices have left (the
parameter server never waits for a device that is gone) and up again from any number: a stopping broker sends
every device's will, and training must go on after it even if fewer devices come back. After a reconnect the
planner waits ``broker.backoff_max_s`` for devices to announce themselves again before it plans (``_settled``).

This module must not import torch: the planner runs on small hosts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import time

from edgemesh import cli
from edgemesh.common import costs
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.errors import BusError, ConfigError, ModelError, WireError
from edgemesh.common.messages import ControlCommand, DeviceHello, DeviceStats, DeviceStatus, Plan, Scalar, SyncState
from edgemesh.common.messages.operations import listing
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics, valid_name
from edgemesh.common.vocabulary import Batching, SyncPolicy
from edgemesh.services.planner import batching, mesh
from edgemesh.services.planner.layout import batch_sizes, plan_data_parallel, plan_mesh, same_layout, same_members
from edgemesh.services.planner.mesh import DeviceInfo, wire_for
from edgemesh.services.planner.registry import Registry
from edgemesh.services.runtime import ControlResult, Endpoint, Events, Job, serve

logger = logging.getLogger(__name__)

RETAINED_SETTLE_S = 0.2
"""After connecting, wait at least this long (or the debounce, if longer) for retained hellos, statuses and
the previous plan, and for what devices announce on reconnecting, before planning."""
UNKNOWN_INCARNATION = -1
"""Incarnation of a device named by a plan adopted from the broker (its incarnation is not in the plan)."""
REPLAN_REASONS = ("join", "leave", "control", "start", "rebalance", "slowdown", "links")
COMMANDS = ("status", "replan", "drain-device", "undrain-device", "stop")


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
        self.registry = Registry()
        self.sync_state: SyncState | None = None
        """The parameter server's latest retained sync state (policy, slow devices)."""
        self._last_rebalance = -math.inf
        self._rebalance_timer: asyncio.TimerHandle | None = None
        self.plan: Plan | None = None
        """The current plan: the last one published, or the retained one adopted at start."""
        self.version = 0
        self._began, self._settle_until = False, 0.0  # a plan named devices (min_devices is done); see _settled
        self._planned: dict[str, int] = {}
        """Device -> incarnation of the live set the current plan was made for."""
        self.ready = asyncio.Event()
        """Set once retained state has settled and the first plan decision was made."""
        self._online = asyncio.Event()
        self._dirty = asyncio.Event()
        self._lock = asyncio.Lock()
        self.grid: mesh.Grid | None = None
        """Mesh parallelism: the training grid of the current plan."""
        self.grid_devices: tuple[DeviceInfo, ...] = ()
        """Mesh parallelism: the figures ``grid`` was laid out with (what moved links are measured against)."""
        self.wire = wire_for(config)
        """Mesh parallelism: bytes per value on the wire, from the configured codecs."""
        self._last_grid_check = -math.inf
        if config.planner.parallelism == "mesh":
            try:
                costs.layers(config.training.model_spec)
            except ModelError as exc:
                raise ConfigError(f"planner.parallelism = mesh: {exc}") from None

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
        if self._rebalance_timer is not None:
            self._rebalance_timer.cancel()

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
        if self._batching() == "balanced" and planned:
            self._dirty.set()
        measured = stats.compute_flops > 0 or stats.link_rate_bps > 0 or stats.downlink_rate_bps > 0 \
            or stats.latency_s > 0
        if self.cfg.planner.parallelism == "mesh" and planned and measured:
            now = time.monotonic()
            if now - self._last_grid_check >= self.cfg.planner.rebalance_interval_s:
                self._last_grid_check = now
                self._dirty.set()  # the replan checks whether the measured speeds or links warrant a new grid

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
        self.plan = plan
        self._began = self._began or bool(plan.devices)
        self.registry.drained = set(plan.drained)
        self._planned = {d.device: UNKNOWN_INCARNATION for d in plan.devices}
        self.m_version.set(self.version)
        self._dirty.set()

    # ------------------------------------------------------------------ batches
    def _policy(self) -> SyncPolicy:
        """The synchronization policy in force: the parameter server's, else the configured one."""
        return self.sync_state.policy if self.sync_state is not None else self.cfg.training.sync_policy

    def _batching(self) -> Batching:
        mode = self.cfg.planner.batching
        if mode == "auto":
            return "balanced" if self._policy() == "adaptive" else "uniform"
        return mode

    def _check_memory(self) -> None:
        """Mark live devices whose memory holds no batch of the model (left out of plans). Mesh
        parallelism leaves this to the grid: a device too small for the model may hold a share."""
        if self.cfg.planner.parallelism != "mesh":
            self.registry.check_memory(self.cfg.training.model_spec)

    def _speeds(self, devices: dict[str, DeviceHello]) -> list[batching.DeviceSpeed]:
        """Every device's speed (empty for a model without cost figures: batches stay uniform)."""
        spec = self.cfg.training.model_spec
        slow = self.sync_state.slow if self.sync_state is not None else ()
        lags = self.sync_state.delay_indices if self.sync_state is not None else {}
        out = []
        for name, hello in sorted(devices.items()):
            try:
                speed = self.registry.speeds.speed(
                    name, spec=spec, matmul_flops=hello.flops, memory_bytes=hello.memory_bytes,
                    lag=lags.get(name, 0.0) if name in slow else 0.0, reference_batch=self.cfg.training.batch_size)
            except ModelError:
                return []
            if speed is not None:
                out.append(speed)
        return out

    def _batches(self, devices: dict[str, DeviceHello], current: Plan | None,
                 membership_changed: bool) -> tuple[Batching, batching.Batches | None]:
        """(mode, batches) for ``devices``; None batches mean ``training.batch_size`` for all.

        A balanced proposal that moves no batch by more than the threshold keeps the current
        sizes; one that does, but comes sooner than the rebalance interval after the last, is
        put off (a timer marks the plan dirty when it is due).
        """
        mode = self._batching()
        speeds = self._speeds(devices)
        p = self.cfg.planner
        if mode != "balanced" or not speeds:
            return "uniform", batching.uniform(speeds, self.cfg.training.batch_size) if speeds else None
        total = p.round_samples or self.cfg.training.batch_size * len(speeds)
        proposal = batching.balanced(speeds, total=total, min_batch=p.min_batch, max_batch=p.max_batch)
        logger.debug("balanced batches for a %.1f ms round: %s", proposal.round_time_s * 1e3, ", ".join(
            f"{s.device} {proposal.sizes[s.device]} ({s.fixed_s * 1e3:.1f} ms + {s.sample_s * 1e3:.2f} ms/sample)"
            for s in speeds))
        if membership_changed or current is None or current.batching != "balanced":
            return mode, proposal
        sizes = {d.device: d.batch_size for d in current.devices}
        if not batching.needs_rebalance(sizes, proposal.sizes, p.rebalance_threshold):
            by_name = {s.device: s for s in speeds}
            return mode, batching.Batches(sizes, max(by_name[n].iteration_s(b) for n, b in sizes.items()))
        wait = self._last_rebalance + p.rebalance_interval_s - time.monotonic()
        if wait > 0:
            if self._rebalance_timer is None or self._rebalance_timer.when() <= asyncio.get_running_loop().time():
                self._rebalance_timer = asyncio.get_running_loop().call_later(wait, self._dirty.set)
            return mode, batching.Batches(sizes, current.round_time_s)
        return mode, proposal

    def _update_gauges(self) -> None:
        self.m_live.set(len(self.registry.live()))
        self.m_drained.set(len(self.registry.drained))
        self.m_excluded.set(self.registry.excluded_count())

    # ------------------------------------------------------------------ planning
    async def _replan_loop(self) -> None:
        await self._online.wait()
        await self._settled()
        self._dirty.clear()
        await self._replan("start")
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

    async def _replan(self, cause: str | None, *, force: bool = False) -> tuple[Plan | None, str]:
        """Publish a new plan if the plannable set or the layout changed (or ``force``).

        ``cause`` names the trigger (``start``, ``control``); None means the registry changed,
        and the reason becomes ``join`` or ``leave``. Returns the published plan (or None)
        and a sentence saying what happened.
        """
        assert self.bus is not None
        async with self._lock:
            self._check_memory()
            devices = self.registry.plannable()
            current = {name: hello.incarnation for name, hello in devices.items()}
            joined = sorted(
                name for name, inc in current.items()
                if name not in self._planned or self._planned[name] not in (UNKNOWN_INCARNATION, inc)
            )
            left = sorted(name for name in self._planned if name not in current)
            if not self._began and len(current) < self.cfg.planner.min_devices:
                if current:
                    logger.info("%d device(s) live; waiting for %d before planning", len(current),
                                self.cfg.planner.min_devices)
                return None, f"no plan: {len(current)} device(s) live, {self.cfg.planner.min_devices} needed"
            regrid = ""
            if self.cfg.planner.parallelism == "mesh":
                plan, regrid = await self._plan_grid(devices, force or bool(joined or left))
            else:
                plan = self._plan_data(devices, bool(joined or left))
            plan = dataclasses.replace(plan, drained=tuple(sorted(self.registry.drained)))
            if not (force or joined or left or not same_layout(plan, self.plan)):
                self._planned = current  # learn incarnations of a plan adopted from the broker
                return None, f"plan version {self.version} is current"
            rebalanced = self.plan is not None and not (joined or left) and same_members(plan, self.plan) \
                and batch_sizes(plan) != batch_sizes(self.plan)
            reason = cause or ("join" if joined else "leave" if left else regrid or ("rebalance" if rebalanced
                                                                                     else "start"))
            plan = dataclasses.replace(plan, reason=reason)
            if rebalanced:
                self._last_rebalance = time.monotonic()
            self.plan, self.version, self._planned = plan, plan.version, current
            self._began = self._began or bool(plan.devices)
            self.m_round.set(plan.round_time_s)
            self.m_version.set(plan.version)
            self.m_replans.labels(reason=reason).inc()
            await self.bus.publish(self.topics.plan(), plan, retain=True)
            text = (f"plan version {plan.version} ({reason}): {len(plan.devices)} device(s) in "
                    f"{len(plan.clusters)} cluster(s); joined {listing(joined) or '-'}; "
                    f"left {listing(left) or '-'}")
            logger.info("%s", text)
            if plan.batching == "balanced":
                logger.info("batches for a %.1f ms round: %s", plan.round_time_s * 1e3,
                            listing([f"{d.device}={d.batch_size}" for d in plan.devices]))
            meshes = [c for c in plan.clusters if len(c.members) > 1]
            if meshes:
                logger.info("model-parallel clusters, predicted %.1f ms per iteration: %s", plan.round_time_s * 1e3,
                            listing([f"{c.cluster}={'+'.join(c.members)}" for c in meshes]))
            assert self.events is not None
            await self.events.emit("replan", text, version=plan.version, reason=reason, joined=listing(joined),
                              left=listing(left), devices=len(plan.devices), clusters=len(plan.clusters))
            return plan, text

    def _plan_data(self, devices: dict[str, DeviceHello], membership_changed: bool) -> Plan:
        """Data parallelism: one cluster per device, batches uniform or balanced."""
        mode, batches = self._batches(devices, self.plan, membership_changed)
        self._update_gauges()
        return plan_data_parallel(
            [DeviceInfo.from_hello(h) for h in devices.values()],
            version=self.version + 1,
            training=self.cfg.training,
            reason="",
            created=time.time(),
            batches=batches.sizes if batches is not None else None,
            batching=mode,
            round_time_s=batches.round_time_s if batches is not None and mode == "balanced" else 0.0,
            sync_policy=self._policy(),
        )

    def _mesh_infos(self, devices: dict[str, DeviceHello]) -> list[DeviceInfo]:
        """What the grid plans with: each device's hello, its speed replaced by the one it measured and the
        link figures its hello left unknown by those it measured (``DeviceInfo.with_measured_links``); under
        ``adaptive``, a device the parameter server lists as slow ``1 + delay index`` times slower still, as
        balanced batching does (its cluster gets a smaller share of the batch)."""
        state = self.sync_state
        slow = set(state.slow) if state is not None and state.policy == "adaptive" else set()
        out = []
        for name, hello in sorted(devices.items()):
            info = DeviceInfo.from_hello(hello)
            stats = self.registry.stats.get(name)
            if stats is not None and stats.incarnation == hello.incarnation:
                info = info.with_measured_links(stats)
                if stats.compute_flops > 0:
                    info = dataclasses.replace(info, flops=stats.compute_flops / costs.TRAIN_EFFICIENCY)
            if name in slow and state is not None:
                lag = max(0.0, state.delay_indices.get(name, 0.0))
                info = dataclasses.replace(info, flops=info.flops / (1.0 + lag))
            out.append(info)
        return out

    async def _plan_grid(self, devices: dict[str, DeviceHello], changed: bool) -> tuple[Plan, str]:
        """Mesh parallelism: the training grid of ``devices`` (kept while it is still good enough) as a
        plan, and what made a new grid without a join or leave: ``slowdown`` (measured speeds), ``links``
        (measured links) or nothing."""
        p, t = self.cfg.planner, self.cfg.training
        batch = p.round_samples or t.batch_size  # the iteration's samples over all clusters
        infos = self._mesh_infos(devices)
        self._update_gauges()
        regrid = ""
        if changed or self.grid is None or not infos:
            regrid = "new"
        elif await asyncio.to_thread(mesh.links_moved, self.grid, self.grid_devices, infos, t.model_spec,
                                     p.replan_threshold, wire=self.wire):
            regrid = "links"
            planned = {d.device: d.links for d in self.grid_devices}
            logger.info("measured links call for a new grid: %s", listing([
                i.describe_links() for i in infos if planned.get(i.device) != i.links]))
        elif await asyncio.to_thread(mesh.needs_replan, self.grid, infos, t.model_spec, batch,
                                     p.replan_threshold, max_cluster_size=p.max_cluster_size, wire=self.wire,
                                     slack=p.grid_slack, min_batch=p.min_batch, max_batch=p.max_batch):
            regrid = "slowdown"
            logger.info("measured speeds call for a new grid: %s", listing([
                f"{i.device} {i.flops / 1e9:.2f}/{devices[i.device].flops / 1e9:.2f} GFLOP/s" for i in infos
                if abs(i.flops - devices[i.device].flops) > 0.05 * devices[i.device].flops]))
        grid = self.grid
        if regrid or grid is None:
            grid = await asyncio.to_thread(mesh.training_grid, t.model_spec, infos, batch=batch,
                                           max_cluster_size=p.max_cluster_size, wire=self.wire,
                                           slack=p.grid_slack, min_batch=p.min_batch, max_batch=p.max_batch)
            self.grid_devices = tuple(infos)
        if grid.excluded and (self.grid is None or grid.excluded != self.grid.excluded):
            logger.warning("training grid leaves out %s: too little memory for even a share of %s",
                           listing(list(grid.excluded)), t.model_spec)
        if grid.idle and (self.grid is None or grid.idle != self.grid.idle):
            logger.info("training grid leaves %s idle: they would slow their cluster down", listing(list(grid.idle)))
        self.grid = grid
        self.m_round.set(grid.predicted_iteration_s)
        plan = plan_mesh(grid, version=self.version + 1, training=t, reason="", created=time.time(),
                         sync_policy=self._policy())
        return plan, "" if regrid == "new" else regrid

    # ------------------------------------------------------------------ control
    async def control(self, cmd: ControlCommand) -> ControlResult:
        text = "ok"
        match cmd.command:
            case "status":
                pass
            case "replan":
                if not self.ready.is_set():
                    return False, "the planner is still collecting retained state; retry shortly", {}
                plan, text = await self._replan("control", force=True)
                if plan is None:
                    return False, text, self._status()
            case "drain-device" | "undrain-device":
                device = cmd.device or (cmd.value if isinstance(cmd.value, str) else "")
                if not valid_name(device):
                    return False, f"{cmd.command} needs a device name in 'device' or 'value'", {}
                if cmd.command == "drain-device":
                    self.registry.drained.add(device)
                else:
                    self.registry.drained.discard(device)
                self._update_gauges()
                text = f"{device} {'drained' if cmd.command == 'drain-device' else 'undrained'}"
                if device not in self.registry.hellos:
                    text += " (not seen yet)"
                if self.ready.is_set():
                    _, outcome = await self._replan("control")
                    text += f"; {outcome}"
            case "stop":
                text = "stopping"
            case _:
                return False, f"unknown command {cmd.command!r} ({', '.join(COMMANDS)})", {}
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
            "policy": self._policy(),
            "known": len(r.hellos),
            "plan_version": self.version,
            "plan_devices": len(self.plan.devices) if self.plan is not None else 0,
        }


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh planner``: the configuration flags."""
    cli.service_command(parser, run)


async def run(config: Config) -> None:
    """Run the planner: the job of the configuration, or without one the jobs operators submit."""
    from edgemesh.services.host import serve_or_host

    await serve_or_host("planner", config, Planner)
