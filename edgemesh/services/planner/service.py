"""The planner: device registry and mesh layout (DESIGN.md §1, §4).

Backbone, top to bottom:
1. connect; subscribe to every device's hello, status and stats, to the retained plan (to
   continue its version after a restart) and to control;
2. consume: keep the registry (latest hello, status and stats per device) and mark the live
   set dirty when it changes;
3. replan loop: once retained state has settled after start-up, and then at most once per
   debounce window, compute the layout of the live, undrained devices (``layout``) with their
   batch sizes (``batching``) and publish it retained on ``plan`` with the next version, plus a
   ``replan`` event;
4. control: status, replan, drain-device, undrain-device, stop.

Batch sizes are uniform, or balanced to each device's measured speed (``planner.batching``;
``auto`` balances under the ``adaptive`` policy, read from the parameter server's retained
``sync`` state). Balanced batches follow the stats: a new plan goes out when a batch would move
by more than ``planner.rebalance_threshold``, at most once per ``planner.rebalance_interval_s``.
Devices the parameter server lists as slow get smaller batches.

A device whose memory holds no batch of the model, or that refused its share (its status
names the plan it refused), is left out of plans until it restarts with a new incarnation.

A device is *live* when its latest status is ``online`` and its hello has been seen with the
same incarnation (any hello when the status carries incarnation 0). Incarnations grow with
every worker start, so a status or hello older than the one known (a late will of a previous
run) is ignored.

``planner.min_devices`` gates the first plan (and the first after everyone left): no plan is
published before that many devices are live. Once a plan names devices, every change is
published, down to an empty plan when all devices have left, so the parameter server never
waits for a device that is gone.

This module must not import torch: the planner runs on small hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from edgemesh.common import costs, wire
from edgemesh.common.bus import Bus, Incoming
from edgemesh.common.codecs import bytes_per_value
from edgemesh.common.config import Config
from edgemesh.common.errors import BusError, ConfigError, ModelError, WireError
from edgemesh.common.messages import (
    ControlCommand,
    DeviceHello,
    DeviceStats,
    DeviceStatus,
    Plan,
    Scalar,
    SyncState,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics, valid_name
from edgemesh.services.operations import Operations, consume
from edgemesh.services.planner import batching, mesh
from edgemesh.services.planner.layout import DeviceInfo, plan_data_parallel, plan_mesh
from edgemesh.services.runtime import client_id, install_stop_signals, supervise

logger = logging.getLogger(__name__)

SERVICE = "planner"
RETAINED_SETTLE_S = 0.2
"""After connecting, wait at least this long (or the debounce, if longer) for retained hellos,
statuses and the previous plan before planning for the first time."""
UNKNOWN_INCARNATION = -1
"""Incarnation of a device named by a plan adopted from the broker (its incarnation is not in the plan)."""
LIST_MAX_CHARS = 2000
"""Longest list of device names in a ``status`` reply or ``replan`` event (wire strings are bounded);
the names that do not fit are counted instead."""
REPLAN_REASONS = ("join", "leave", "control", "start", "rebalance", "slowdown")
COMMANDS = ("status", "replan", "drain-device", "undrain-device", "stop")


class Planner:
    """One planner process. ``run()`` until ``stop`` is set."""

    def __init__(self, config: Config, *, stop: asyncio.Event | None = None) -> None:
        self.cfg = config
        self.topics = Topics(config.job)
        self.stop = stop or asyncio.Event()
        self.bus: Bus | None = None

        self.hellos: dict[str, DeviceHello] = {}
        self.statuses: dict[str, DeviceStatus] = {}
        self.stats: dict[str, DeviceStats] = {}
        """Latest measurements per device."""
        self.speeds = batching.SpeedTracker()
        """Step times and uploads each device reported, for balanced batches."""
        self.sync_state: SyncState | None = None
        """The parameter server's latest retained sync state (policy, slow devices)."""
        self._unfit: dict[str, int] = {}
        """Devices left out because their memory holds no batch, with the incarnation that said so."""
        self._last_rebalance = -math.inf
        self._rebalance_timer: asyncio.TimerHandle | None = None
        self.drained: set[str] = set()
        self.plan: Plan | None = None
        """The current plan: the last one published, or the retained one adopted at start."""
        self.version = 0
        self._planned: dict[str, int] = {}
        """Device -> incarnation of the live set the current plan was made for."""
        self.ready = asyncio.Event()
        """Set once retained state has settled and the first plan decision was made."""
        self._online = asyncio.Event()
        self._dirty = asyncio.Event()
        self._lock = asyncio.Lock()
        self.grid: mesh.Grid | None = None
        """Mesh parallelism: the training grid of the current plan."""
        self.wire = mesh_wire(config)
        """Mesh parallelism: bytes per value on the wire, from the configured codecs."""
        self._last_grid_check = -math.inf
        if config.planner.parallelism == "mesh":
            try:
                costs.layers(config.training.model_spec)
            except ModelError as exc:
                raise ConfigError(f"planner.parallelism = mesh: {exc}") from None

        m = self.metrics = ServiceMetrics(SERVICE)
        self.m_live = m.gauge("devices_live", "Devices online with a matching hello")
        self.m_drained = m.gauge("devices_drained", "Devices an operator drained out of the plan")
        self.m_version = m.gauge("plan_version", "Version of the current plan")
        self.m_replans = m.counter("replans", "Plans published, by cause", ["reason"])
        for reason in REPLAN_REASONS:
            self.m_replans.labels(reason=reason)
        self.m_excluded = m.gauge("devices_excluded", "Live devices left out of the plan: their memory holds "
                                  "no batch, or they refused their share")
        self.m_round = m.gauge("predicted_round_seconds", "Balanced plans: the iteration time the batches aim at")

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            self.metrics.serve(self.cfg.metrics.address, self.cfg.metrics.port_file)
            stack.callback(self.metrics.close)
            self.bus = await stack.enter_async_context(Bus(
                self.cfg.broker,
                client_id=client_id(SERVICE, self.cfg),
                metrics=self.metrics,
                subscriptions=[
                    self.topics.plan(), self.topics.sync(),
                    self.topics.all_hello(), self.topics.all_status(), self.topics.all_stats(),
                    self.topics.control(SERVICE), self.topics.control("all"),
                ],
                on_connect=self._on_connect,
            ))
            self.ops = Operations(source=SERVICE, bus=self.bus, topics=self.topics, metrics=self.metrics,
                                  stop=self.stop)
            self.metrics.up.set(1)
            logger.info("planner up: job %s, debounce %.2fs, min devices %d", self.cfg.job,
                        self.cfg.planner.replan_debounce_s, self.cfg.planner.min_devices)
            try:
                await supervise(self.stop, consume(self.bus, self.metrics, self._dispatch), self._replan_loop())
            finally:
                self.metrics.up.set(0)
                if self._rebalance_timer is not None:
                    self._rebalance_timer.cancel()

    async def _on_connect(self) -> None:
        """First connect: let the replan loop start. Reconnects: restore the retained plan
        (a broker restarted without persistence has lost it)."""
        assert self.bus is not None
        if self._online.is_set() and self.plan is not None and self.ready.is_set():
            with contextlib.suppress(BusError):
                await self.bus.publish(self.topics.plan(), self.plan, retain=True)
        self._online.set()

    # ------------------------------------------------------------------ consuming
    async def _dispatch(self, msg: Incoming) -> None:
        parts = self.topics.relative(msg.topic)
        match parts:
            case ["device", device, "hello"]:
                hello = _for_device(msg.decode(DeviceHello), device)
                self._registry_update(device, lambda: self._on_hello(hello))
            case ["device", device, "status"]:
                status = _for_device(msg.decode(DeviceStatus), device)
                self._registry_update(device, lambda: self._on_status(status))
            case ["device", device, "stats"]:
                self._on_stats(_for_device(msg.decode(DeviceStats), device))
            case ["plan"]:
                self._on_plan(msg.decode(Plan))
            case ["sync"]:
                self._on_sync(msg.decode(SyncState))
            case ["control", *_]:
                await self.ops.control(msg.decode(ControlCommand), self._apply_control)
            case _:
                raise WireError(f"no handler for topic {msg.topic}", "topic")

    def _registry_update(self, device: str, update: Callable[[], None]) -> None:
        """Apply ``update``; if it changed whether (or as which incarnation) ``device`` is
        plannable, mark the live set dirty for the replan loop."""
        before = self._plannable_incarnation(device)
        update()
        if self._plannable_incarnation(device) != before:
            self._dirty.set()
            self._update_gauges()

    def _on_hello(self, hello: DeviceHello) -> None:
        self.metrics.received_messages.labels(kind="hello").inc()
        known = self.hellos.get(hello.device)
        if known is not None and hello.incarnation < known.incarnation:
            logger.debug("ignoring hello of %s from old incarnation %d", hello.device, hello.incarnation)
            return
        self.hellos[hello.device] = hello

    def _on_status(self, status: DeviceStatus) -> None:
        self.metrics.received_messages.labels(kind="status").inc()
        known = self.statuses.get(status.device)
        if known is not None and 0 < status.incarnation < known.incarnation:
            logger.debug("ignoring %s status of %s from old incarnation %d", status.state, status.device,
                         status.incarnation)
            return
        self.statuses[status.device] = status

    def _on_stats(self, stats: DeviceStats) -> None:
        self.metrics.received_messages.labels(kind="stats").inc()
        hello = self.hellos.get(stats.device)
        if hello is not None and 0 < stats.incarnation < hello.incarnation:
            return  # a previous run's
        self.stats[stats.device] = stats
        self.speeds.observe(stats.device, stats.batch_size, stats.step_time_s, stats.upload_time_s)
        planned = self.plan is not None and self.plan.device(stats.device) is not None
        if self._batching() == "balanced" and planned:
            self._dirty.set()
        if self.cfg.planner.parallelism == "mesh" and planned and stats.compute_flops > 0:
            now = time.monotonic()
            if now - self._last_grid_check >= self.cfg.planner.rebalance_interval_s:
                self._last_grid_check = now
                self._dirty.set()  # the replan checks whether the measured speeds warrant a new grid

    def _on_sync(self, state: SyncState) -> None:
        """The parameter server's policy or its slow devices changed: batches may change."""
        self.metrics.received_messages.labels(kind="sync_state").inc()
        before = self.sync_state
        self.sync_state = state
        if before is None or (before.policy, before.slow) != (state.policy, state.slow):
            self._dirty.set()

    def _on_plan(self, plan: Plan) -> None:
        """A plan on the plan topic: our own echo, or the retained plan of a previous run."""
        self.metrics.received_messages.labels(kind="plan").inc()
        if plan.version <= self.version:
            return  # our own plan coming back, or an older one
        logger.info("continuing from plan version %d (%d devices)", plan.version, len(plan.devices))
        self.version = plan.version
        self.plan = plan
        self.drained = set(plan.drained)
        self._planned = {d.device: UNKNOWN_INCARNATION for d in plan.devices}
        self.m_version.set(self.version)
        self._dirty.set()

    # ------------------------------------------------------------------ registry
    def _live_hello(self, name: str) -> DeviceHello | None:
        """The hello of ``name`` if the device is live (online, hello of the same incarnation)."""
        status, hello = self.statuses.get(name), self.hellos.get(name)
        if status is None or hello is None or status.state != "online":
            return None
        if status.incarnation and status.incarnation != hello.incarnation:
            return None
        return hello

    def live(self) -> dict[str, DeviceHello]:
        """Live devices, drained ones included, by name."""
        out = {}
        for name in self.statuses:
            hello = self._live_hello(name)
            if hello is not None:
                out[name] = hello
        return out

    def _plannable(self) -> dict[str, DeviceHello]:
        return {name: hello for name, hello in self.live().items()
                if name not in self.drained and not self._excluded(name, hello)}

    def _plannable_incarnation(self, name: str) -> int | None:
        hello = self._live_hello(name)
        return None if hello is None or name in self.drained or self._excluded(name, hello) else hello.incarnation

    def _excluded(self, name: str, hello: DeviceHello) -> bool:
        """Whether a live device is left out: it refused a share, or its memory holds no batch."""
        status = self.statuses.get(name)
        if status is not None and status.refused_plan:
            return True
        return self._unfit.get(name) == hello.incarnation

    def _refusals(self) -> list[str]:
        return sorted(name for name, status in self.statuses.items()
                      if status.refused_plan and self._live_hello(name) is not None)

    # ------------------------------------------------------------------ batches
    def _policy(self) -> str:
        """The synchronization policy in force: the parameter server's, else the configured one."""
        return self.sync_state.policy if self.sync_state is not None else self.cfg.training.sync_policy

    def _batching(self) -> str:
        mode = self.cfg.planner.batching
        if mode == "auto":
            return "balanced" if self._policy() == "adaptive" else "uniform"
        return mode

    def _check_memory(self) -> None:
        """Mark live devices whose memory holds no batch of the model (they are left out of plans).
        Mesh parallelism leaves this to the grid: a device too small for the model may hold a share."""
        if self.cfg.planner.parallelism == "mesh":
            return
        spec = self.cfg.training.model_spec
        for name, hello in self.live().items():
            if self._unfit.get(name) == hello.incarnation:
                continue
            try:
                fits = costs.max_batch_for_memory(spec, hello.memory_bytes) >= 1
            except ModelError:
                return  # a model without cost figures: nothing to check against
            if not fits:
                logger.warning("%s: %.0f MiB cannot hold a batch of %s (one sample needs %.0f MiB); leaving it out",
                               name, hello.memory_bytes / 2**20, spec, costs.training_memory_bytes(spec, 1) / 2**20)
                self._unfit[name] = hello.incarnation

    def _speeds(self, devices: dict[str, DeviceHello]) -> list[batching.DeviceSpeed]:
        """Every device's speed (empty for a model without cost figures: batches stay uniform)."""
        spec = self.cfg.training.model_spec
        slow = self.sync_state.slow if self.sync_state is not None else ()
        lags = self.sync_state.delay_indices if self.sync_state is not None else {}
        out = []
        for name, hello in sorted(devices.items()):
            try:
                speed = self.speeds.speed(name, spec=spec, matmul_flops=hello.flops, memory_bytes=hello.memory_bytes,
                                          lag=lags.get(name, 0.0) if name in slow else 0.0,
                                          reference_batch=self.cfg.training.batch_size)
            except ModelError:
                return []
            if speed is not None:
                out.append(speed)
        return out

    def _batches(self, devices: dict[str, DeviceHello], current: Plan | None,
                 membership_changed: bool) -> tuple[str, batching.Batches | None]:
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
        live = self.live()
        self.m_live.set(len(live))
        self.m_drained.set(len(self.drained))
        self.m_excluded.set(sum(1 for name, hello in live.items() if self._excluded(name, hello)))

    # ------------------------------------------------------------------ planning
    async def _replan_loop(self) -> None:
        await self._online.wait()
        await asyncio.sleep(max(self.cfg.planner.replan_debounce_s, RETAINED_SETTLE_S))
        self._dirty.clear()
        await self._replan("start")
        self.ready.set()
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.cfg.planner.replan_debounce_s)
            self._dirty.clear()
            await self._replan(None)

    async def _replan(self, cause: str | None, *, force: bool = False) -> tuple[Plan | None, str]:
        """Publish a new plan if the plannable set or the layout changed (or ``force``).

        ``cause`` names the trigger (``start``, ``control``); None means the registry changed,
        and the reason becomes ``join`` or ``leave``. Returns the published plan (or None)
        and a sentence saying what happened.
        """
        assert self.bus is not None
        async with self._lock:
            self._check_memory()
            devices = self._plannable()
            current = {name: hello.incarnation for name, hello in devices.items()}
            joined = sorted(
                name for name, inc in current.items()
                if name not in self._planned or self._planned[name] not in (UNKNOWN_INCARNATION, inc)
            )
            left = sorted(name for name in self._planned if name not in current)
            active = self.plan is not None and bool(self.plan.devices)
            if not active and len(current) < self.cfg.planner.min_devices:
                if current:
                    logger.info("%d device(s) live; waiting for %d before planning", len(current),
                                self.cfg.planner.min_devices)
                return None, f"no plan: {len(current)} device(s) live, {self.cfg.planner.min_devices} needed"
            slowdown = False
            if self.cfg.planner.parallelism == "mesh":
                plan, slowdown = await self._plan_grid(devices, force or bool(joined or left))
            else:
                plan = self._plan_data(devices, bool(joined or left))
            plan = dataclasses.replace(plan, drained=tuple(sorted(self.drained)))
            if not (force or joined or left or not _same_layout(plan, self.plan)):
                self._planned = current  # learn incarnations of a plan adopted from the broker
                return None, f"plan version {self.version} is current"
            rebalanced = self.plan is not None and not (joined or left) and _same_members(plan, self.plan) \
                and _batch_sizes(plan) != _batch_sizes(self.plan)
            reason = cause or ("join" if joined else "leave" if left else "slowdown" if slowdown
                               else "rebalance" if rebalanced else "start")
            plan = dataclasses.replace(plan, reason=reason)
            if rebalanced:
                self._last_rebalance = time.monotonic()
            self.plan, self.version, self._planned = plan, plan.version, current
            self.m_round.set(plan.round_time_s)
            self.m_version.set(plan.version)
            self.m_replans.labels(reason=reason).inc()
            await self.bus.publish(self.topics.plan(), plan, retain=True)
            text = (f"plan version {plan.version} ({reason}): {len(plan.devices)} device(s) in "
                    f"{len(plan.clusters)} cluster(s); joined {_listing(joined) or '-'}; "
                    f"left {_listing(left) or '-'}")
            logger.info("%s", text)
            if plan.batching == "balanced":
                logger.info("batches for a %.1f ms round: %s", plan.round_time_s * 1e3,
                            _listing([f"{d.device}={d.batch_size}" for d in plan.devices]))
            meshes = [c for c in plan.clusters if len(c.members) > 1]
            if meshes:
                logger.info("model-parallel clusters, predicted %.1f ms per iteration: %s", plan.round_time_s * 1e3,
                            _listing([f"{c.cluster}={'+'.join(c.members)}" for c in meshes]))
            await self.ops.event("replan", text, version=plan.version, reason=reason, joined=_listing(joined),
                              left=_listing(left), devices=len(plan.devices), clusters=len(plan.clusters))
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
            batching=mode,  # type: ignore[arg-type]
            round_time_s=batches.round_time_s if batches is not None and mode == "balanced" else 0.0,
            sync_policy=self._policy(),
        )

    def _mesh_infos(self, devices: dict[str, DeviceHello]) -> list[DeviceInfo]:
        """What the grid plans with: each device's hello, its speed replaced by the one it measured;
        under ``adaptive``, a device the parameter server lists as slow ``1 + delay index`` times
        slower still, as balanced batching does (its cluster gets a smaller share of the batch)."""
        state = self.sync_state
        slow = set(state.slow) if state is not None and state.policy == "adaptive" else set()
        out = []
        for name, hello in sorted(devices.items()):
            info = DeviceInfo.from_hello(hello)
            stats = self.stats.get(name)
            if stats is not None and stats.compute_flops > 0 and stats.incarnation == hello.incarnation:
                info = dataclasses.replace(info, flops=stats.compute_flops / costs.TRAIN_EFFICIENCY)
            if name in slow and state is not None:
                lag = max(0.0, state.delay_indices.get(name, 0.0))
                info = dataclasses.replace(info, flops=info.flops / (1.0 + lag))
            out.append(info)
        return out

    async def _plan_grid(self, devices: dict[str, DeviceHello], changed: bool) -> tuple[Plan, bool]:
        """Mesh parallelism: the training grid of ``devices`` (kept while it is still good enough) as a
        plan, and whether a slowdown made a new grid."""
        p, t = self.cfg.planner, self.cfg.training
        batch = p.round_samples or t.batch_size  # the iteration's samples over all clusters
        infos = self._mesh_infos(devices)
        self._update_gauges()
        slowdown = False
        if changed or self.grid is None or not infos:
            grid = await asyncio.to_thread(mesh.training_grid, t.model_spec, infos, batch=batch,
                                           max_cluster_size=p.max_cluster_size, wire=self.wire,
                                           slack=p.grid_slack, min_batch=p.min_batch, max_batch=p.max_batch)
        elif await asyncio.to_thread(mesh.needs_replan, self.grid, infos, t.model_spec, batch,
                                     p.replan_threshold, max_cluster_size=p.max_cluster_size, wire=self.wire,
                                     slack=p.grid_slack, min_batch=p.min_batch, max_batch=p.max_batch):
            grid = await asyncio.to_thread(mesh.training_grid, t.model_spec, infos, batch=batch,
                                           max_cluster_size=p.max_cluster_size, wire=self.wire,
                                           slack=p.grid_slack, min_batch=p.min_batch, max_batch=p.max_batch)
            slowdown = True
            logger.info("measured speeds call for a new grid: %s", _listing([
                f"{i.device} {i.flops / 1e9:.2f}/{devices[i.device].flops / 1e9:.2f} GFLOP/s" for i in infos
                if abs(i.flops - devices[i.device].flops) > 0.05 * devices[i.device].flops]))
        else:
            grid = self.grid
        if grid.excluded and (self.grid is None or grid.excluded != self.grid.excluded):
            logger.warning("training grid leaves out %s: too little memory for even a share of %s",
                           _listing(list(grid.excluded)), t.model_spec)
        if grid.idle and (self.grid is None or grid.idle != self.grid.idle):
            logger.info("training grid leaves %s idle: they would slow their cluster down", _listing(list(grid.idle)))
        self.grid = grid
        self.m_round.set(grid.predicted_iteration_s)
        plan = plan_mesh(grid, version=self.version + 1, training=t, reason="", created=time.time(),
                         sync_policy=self._policy())
        return plan, slowdown

    # ------------------------------------------------------------------ control
    async def _apply_control(self, cmd: ControlCommand) -> tuple[bool, str, dict[str, Scalar]]:
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
                    self.drained.add(device)
                else:
                    self.drained.discard(device)
                self._update_gauges()
                text = f"{device} {'drained' if cmd.command == 'drain-device' else 'undrained'}"
                if device not in self.hellos:
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
        live = sorted(self.live())
        return {
            "live": _listing(live),
            "devices_live": len(live),
            "drained": _listing(sorted(self.drained)),
            "refused": _listing(self._refusals()),
            "unfit": _listing(sorted(self._unfit)),
            "batching": self.plan.batching if self.plan is not None else self._batching(),
            "policy": self._policy(),
            "known": len(self.hellos),
            "plan_version": self.version,
            "plan_devices": len(self.plan.devices) if self.plan is not None else 0,
        }


def mesh_wire(config: Config) -> mesh.Wire:
    """Bytes per value the cost model charges, from the configured codecs: activations as
    ``worker.mesh_dtype``, gradients as the compressor's default codec (the adaptive compressor may
    compress harder on slow links), model updates as the parameter server's delta codec."""
    c = config
    density = c.compressor.static_density if c.compressor.default_codec in ("topk", "threshold") else 1.0
    model = bytes_per_value(c.ps.delta_codec, c.ps.delta_density) if c.ps.broadcast == "delta" else \
        costs.FLOAT32_BYTES
    return mesh.Wire(activation=2.0 if c.worker.mesh_dtype == "float16" else float(costs.FLOAT32_BYTES),
                     gradient=bytes_per_value(c.compressor.default_codec, density), model=model)


def _listing(names: list[str]) -> str:
    """Comma-separated names, cut to about ``LIST_MAX_CHARS`` with a count of the rest."""
    shown: list[str] = []
    size = 0
    for name in names:
        if size + len(name) + 1 > LIST_MAX_CHARS:
            shown.append(f"...(+{len(names) - len(shown)} more)")
            break
        shown.append(name)
        size += len(name) + 1
    return ",".join(shown)


class _DeviceMessage(Protocol):
    @property
    def device(self) -> str: ...


M = TypeVar("M", bound=_DeviceMessage)


def _for_device(msg: M, topic_device: str) -> M:
    """``msg`` if its ``device`` field names the device of its topic; else a ``topic`` rejection."""
    if msg.device != topic_device:
        raise WireError(f"{wire.kind_of(msg)} for {msg.device!r} on the topic of {topic_device!r}", "topic")
    return msg


def _same_members(a: Plan, b: Plan) -> bool:
    return [d.device for d in a.devices] == [d.device for d in b.devices]


def _batch_sizes(plan: Plan) -> dict[str, int]:
    return {d.device: d.batch_size for d in plan.devices}


def _same_layout(new: Plan, old: Plan | None) -> bool:
    """Whether two plans say the same thing, ignoring version, timestamp and reason."""
    if old is None:
        return False
    return dataclasses.replace(new, version=0, created=0.0, reason="") == dataclasses.replace(
        old, version=0, created=0.0, reason=""
    )


async def run(config: Config, *, stop: asyncio.Event | None = None) -> None:
    """Run the planner until ``stop`` is set, SIGINT or SIGTERM."""
    stop = stop or asyncio.Event()
    install_stop_signals(stop)
    await Planner(config, stop=stop).run()
