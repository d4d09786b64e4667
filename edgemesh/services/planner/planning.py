"""What a replan decides: which devices joined or left (``Membership``), the layout of the plannable devices by the
configured parallelism, and the plan's cause (``Membership.cause``: a ``stability.Cause``, whose label is the first
word of the plan's ``reason`` and the ``replans`` counter's label, and whose detail names devices and figures).

The two parallelisms are one interface (``Parallelism``), chosen once from ``planner.parallelism``:

* ``DataParallel``: one cluster per device (``layout.plan_data_parallel``), batches uniform or balanced to each
  device's measured speed (``batching``). A balanced proposal that moves no batch by more than
  ``planner.rebalance_threshold`` keeps the current sizes; one that does, but comes sooner than
  ``planner.rebalance_interval_s`` after the last rebalance, is put off (a timer wakes the planner when it is due).
  Devices the parameter server lists as slow get smaller batches.
* ``MeshParallel``: the training grid of ``mesh`` (``layout.plan_mesh``), planned with each device's hello, its speed
  and links replaced by the medians of what it measured (``infos``, ``stability.Smoother``), and kept until a
  device's smoothed figure moves beyond ``planner.replan_band``, no re-plan for measurements came in the last
  ``planner.replan_min_interval_s``, and a new grid predicts an iteration ``planner.replan_threshold`` shorter
  (``stability.review``): ``slowdown`` when a speed moved, else ``links``.

No bus here: the planner service feeds these what it consumes and publishes what they return. No torch either: the
planner runs on small hosts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from prometheus_client import Gauge

from edgemesh.common import costs
from edgemesh.common.config import Config, TrainingConfig
from edgemesh.common.data import DATA_FORMATS
from edgemesh.common.errors import ConfigError, ModelError
from edgemesh.common.messages import DeviceHello, DeviceStats, Plan, SyncState
from edgemesh.common.messages.operations import listing
from edgemesh.common.vocabulary import Batching, SyncPolicy
from edgemesh.services.planner import batching, mesh, stability
from edgemesh.services.planner.layout import batch_sizes, plan_data_parallel, plan_mesh, same_members
from edgemesh.services.planner.mesh import DeviceInfo, wire_for
from edgemesh.services.planner.registry import Registry
from edgemesh.services.planner.stability import Cause

logger = logging.getLogger(__name__)

UNKNOWN_INCARNATION = -1
"""Incarnation of a device named by a plan adopted from the broker (its incarnation is not in the plan)."""


def policy_in_force(sync: SyncState | None, training: TrainingConfig) -> SyncPolicy:
    """The synchronization policy in force: the parameter server's, else the configured one."""
    return sync.policy if sync is not None else training.sync_policy


def batching_in_force(sync: SyncState | None, config: Config) -> Batching:
    """``planner.batching``, ``auto`` resolved: balanced under the ``adaptive`` policy, else uniform."""
    mode = config.planner.batching
    if mode == "auto":
        return "balanced" if policy_in_force(sync, config.training) == "adaptive" else "uniform"
    return mode


# --------------------------------------------------------------------------- who joined and left


@dataclasses.dataclass(frozen=True, slots=True)
class Membership:
    """The plannable devices against those the current plan was made for."""

    current: dict[str, int]
    """Plannable device -> incarnation."""
    joined: list[str]
    """New devices, and devices back with another incarnation."""
    left: list[str]

    @classmethod
    def of(cls, planned: Mapping[str, int], devices: Mapping[str, DeviceHello]) -> Membership:
        """``devices`` against ``planned`` (device -> incarnation; ``UNKNOWN_INCARNATION`` matches any)."""
        current = {name: hello.incarnation for name, hello in devices.items()}
        joined = sorted(name for name, inc in current.items()
                        if name not in planned or planned[name] not in (UNKNOWN_INCARNATION, inc))
        left = sorted(name for name in planned if name not in current)
        return cls(current, joined, left)

    @property
    def changed(self) -> bool:
        return bool(self.joined or self.left)

    def rebalanced(self, plan: Plan, current: Plan | None) -> bool:
        """Whether ``plan`` only moves the batches of ``current``'s devices."""
        return current is not None and not self.changed and same_members(plan, current) \
            and batch_sizes(plan) != batch_sizes(current)

    def cause(self, trigger: Cause | None, regrid: Cause | None, rebalanced: bool, plan: Plan,
              current: Plan | None) -> Cause:
        """Why ``plan`` goes out: the trigger named (``start``, ``control``), else ``join`` or ``leave``
        (with the devices), what made a new grid from measurements (``slowdown``, ``links``, with the figures),
        ``rebalance`` (with the batches that moved), or ``start``."""
        if trigger is not None:
            return trigger
        if self.joined:
            left = f"; {listing(self.left)} left" if self.left else ""
            return Cause("join", f"{listing(self.joined)} joined{left}")
        if self.left:
            return Cause("leave", f"{listing(self.left)} left")
        if regrid is not None:
            return regrid
        if rebalanced and current is not None:
            before, after = batch_sizes(current), batch_sizes(plan)
            return Cause("rebalance", "batches " + listing(
                [f"{d} {before[d]} -> {b}" for d, b in sorted(after.items()) if before.get(d) != b]))
        return Cause("start")

    def describe(self, plan: Plan, why: Cause) -> str:
        """What happened, for the log and the ``replan`` event."""
        return (f"plan version {plan.version} ({why.describe()}): {len(plan.devices)} device(s) in "
                f"{len(plan.clusters)} cluster(s); joined {listing(self.joined) or '-'}; "
                f"left {listing(self.left) or '-'}")


# --------------------------------------------------------------------------- the parallelisms


class Parallelism(Protocol):
    """How the planner lays out the plannable devices."""

    def check_memory(self) -> None:
        """Mark live devices whose memory holds nothing they could train (left out of plans)."""

    def stats_call_for_replan(self, stats: DeviceStats, *, balanced: bool) -> bool:
        """Whether the stats of a planned device may call for a new plan (``balanced``: batches follow the stats)."""

    async def plan(self, devices: dict[str, DeviceHello], *, changed: bool, force: bool, current: Plan | None,
                   version: int, sync: SyncState | None) -> tuple[Plan, Cause | None]:
        """The plan of ``devices`` as version ``version`` (its reason left blank; ``changed``: devices joined or
        left since ``current``; ``force``: an operator asked for a new plan), and what made a new layout without a
        join or leave (``slowdown``, ``links``; None for nothing)."""

    def rebalanced(self) -> None:
        """A plan that only moved batches went out."""

    def close(self) -> None:
        """Cancel what is pending."""


class DataParallel:
    """Data parallelism: one cluster per device, batches uniform or balanced (module docstring)."""

    def __init__(self, config: Config, registry: Registry, wake: Callable[[], None]) -> None:
        self.cfg, self.registry = config, registry
        self.wake = wake
        """Marks the plan dirty: when a rebalance put off is due."""
        self._last_rebalance = -math.inf
        self._timer: asyncio.TimerHandle | None = None

    def check_memory(self) -> None:
        self.registry.check_memory(self.cfg.training.model_spec)

    def stats_call_for_replan(self, stats: DeviceStats, *, balanced: bool) -> bool:
        return balanced

    async def plan(self, devices: dict[str, DeviceHello], *, changed: bool, force: bool, current: Plan | None,
                   version: int, sync: SyncState | None) -> tuple[Plan, Cause | None]:
        mode, batches = self._batches(devices, current, changed, sync)
        plan = plan_data_parallel(
            [DeviceInfo.from_hello(h) for h in devices.values()],
            version=version,
            training=self.cfg.training,
            reason="",
            created=time.time(),
            batches=batches.sizes if batches is not None else None,
            batching=mode,
            round_time_s=batches.round_time_s if batches is not None and mode == "balanced" else 0.0,
            sync_policy=policy_in_force(sync, self.cfg.training),
        )
        return plan, None

    def rebalanced(self) -> None:
        self._last_rebalance = time.monotonic()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _speeds(self, devices: dict[str, DeviceHello], sync: SyncState | None) -> list[batching.DeviceSpeed]:
        """Every device's speed (empty for a model without cost figures: batches stay uniform)."""
        spec = self.cfg.training.model_spec
        slow = sync.slow if sync is not None else ()
        lags = sync.delay_indices if sync is not None else {}
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

    def _batches(self, devices: dict[str, DeviceHello], current: Plan | None, membership_changed: bool,
                 sync: SyncState | None) -> tuple[Batching, batching.Batches | None]:
        """(mode, batches) for ``devices``; None batches mean ``training.batch_size`` for all.

        A balanced proposal that moves no batch by more than the threshold keeps the current
        sizes; one that does, but comes sooner than the rebalance interval after the last, is
        put off (a timer marks the plan dirty when it is due).
        """
        mode = batching_in_force(sync, self.cfg)
        speeds = self._speeds(devices, sync)
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
            self._wake_in(wait)
            return mode, batching.Batches(sizes, current.round_time_s)
        return mode, proposal

    def _wake_in(self, wait: float) -> None:
        """Wake the planner in ``wait`` seconds, unless a wake-up is already pending."""
        loop = asyncio.get_running_loop()
        if self._timer is None or self._timer.when() <= loop.time():
            self._timer = loop.call_later(wait, self.wake)


def mesh_refusal(config: Config) -> str:
    """Why ``config`` under ``planner.parallelism = "mesh"`` plans data parallel instead ('' when it lays out a
    training grid, or plans data parallel anyway): its model has a layer the grid cannot divide and
    ``planner.mesh_fallback`` allows that. ConfigError when it does not."""
    if config.planner.parallelism != "mesh":
        return ""
    try:
        costs.layers(config.training.model_spec)
    except ModelError as exc:
        if not config.planner.mesh_fallback:
            raise ConfigError(f"planner.parallelism = mesh: {exc} (planner.mesh_fallback = true trains such a "
                              "model data parallel)") from None
        return f"planner.parallelism = mesh, but {exc}: trained data parallel (planner.mesh_fallback)"
    return ""


class MeshParallel:
    """Mesh parallelism: the training grid of the plannable devices, kept while it is still good enough (module
    docstring)."""

    def __init__(self, config: Config, registry: Registry, predicted_round: Gauge) -> None:
        self.cfg, self.registry = config, registry
        self.predicted_round = predicted_round
        """The planner's gauge of the predicted iteration: the grid's, whenever one is laid out or kept."""
        self.grid: mesh.Grid | None = None
        """The training grid of the current plan."""
        self.grid_devices: tuple[DeviceInfo, ...] = ()
        """The figures ``grid`` was laid out with, or last weighed against (what the band measures moves from)."""
        self.wire = wire_for(config)
        """Bytes per value on the wire, from the configured codecs."""
        p = config.planner
        self.rule = stability.Rule.of(p, spec=config.training.model_spec,
                                      batch=p.round_samples or config.training.batch_size, wire=self.wire)
        """When measurements alone make a new grid, and how a grid is laid out."""
        self._last_check = -math.inf
        self._last_measured = -math.inf
        """When the last re-plan for measurements went out (``time.monotonic``)."""

    def check_memory(self) -> None:
        """Nothing to mark: a device too small for the model may hold a share of it."""

    def stats_call_for_replan(self, stats: DeviceStats, *, balanced: bool) -> bool:
        """Measured figures call for a check of the grid, at most once per ``planner.rebalance_interval_s``."""
        measured = stats.compute_flops > 0 or stats.link_rate_bps > 0 or stats.downlink_rate_bps > 0 \
            or stats.latency_s > 0
        due = False
        if measured:
            now = time.monotonic()
            if now - self._last_check >= self.cfg.planner.rebalance_interval_s:
                self._last_check = now
                due = True  # the replan checks whether the measured speeds or links warrant a new grid
        return due or balanced

    async def plan(self, devices: dict[str, DeviceHello], *, changed: bool, force: bool, current: Plan | None,
                   version: int, sync: SyncState | None) -> tuple[Plan, Cause | None]:
        """The grid of ``devices`` (kept while it is still good enough) as a plan, and what made a new grid without
        a join or leave: ``slowdown`` (smoothed speeds), ``links`` (smoothed links) or None (``stability.review``)."""
        t = self.cfg.training
        infos = self.infos(devices, sync)
        cause = None
        if force or changed or self.grid is None or not infos:
            grid = await asyncio.to_thread(self.rule.lay_out, infos)
            self.grid_devices = tuple(infos)
        else:
            now = time.monotonic()
            spread = stability.Measured(infos, self.infos(devices, sync, stability.LOW_QUANTILE),
                                        self.infos(devices, sync, stability.HIGH_QUANTILE))
            found = await asyncio.to_thread(stability.review, self.grid, self.grid_devices, spread, now=now,
                                            last_s=self._last_measured, rule=self.rule)
            if found.grid is None:
                logger.debug("grid kept: %s", found.note)
                grid = self.grid
                if found.reviewed:
                    self.grid_devices = tuple(infos)  # weighed: the next moves are measured from these figures
            else:
                logger.info("measurements call for a new grid: %s", found.note)
                grid, cause, self._last_measured, self.grid_devices = found.grid, found.cause, now, tuple(infos)
        self._log_left_out(grid)
        self.grid = grid
        self.predicted_round.set(grid.predicted_iteration_s)
        plan = plan_mesh(grid, version=version, training=t, reason="", created=time.time(),
                         sync_policy=policy_in_force(sync, t))
        return plan, cause

    def rebalanced(self) -> None:
        pass

    def close(self) -> None:
        pass

    def infos(self, devices: dict[str, DeviceHello], sync: SyncState | None,
              quantile: float = 0.5) -> list[DeviceInfo]:
        """What the grid plans with: each device's hello with the medians of what it measured
        (``stability.measured_info``; another ``quantile`` of its recent measurements for the band); under
        ``adaptive``, a device the parameter server lists as slow ``1 + delay index`` times slower still, as balanced
        batching does (its cluster gets a smaller share of the batch)."""
        slow = set(sync.slow) if sync is not None and sync.policy == "adaptive" else set()
        out = []
        for name, hello in sorted(devices.items()):
            info = stability.measured_info(hello, self.registry.smoothed(name, quantile))
            if name in slow and sync is not None:
                lag = max(0.0, sync.delay_indices.get(name, 0.0))
                info = dataclasses.replace(info, flops=info.flops / (1.0 + lag))
            out.append(info)
        return out

    def _log_left_out(self, grid: mesh.Grid) -> None:
        """Say which devices ``grid`` leaves out or idle, when that changed."""
        spec = self.cfg.training.model_spec
        if grid.excluded and (self.grid is None or grid.excluded != self.grid.excluded):
            logger.warning("training grid leaves out %s: too little memory for even a share of %s",
                           listing(list(grid.excluded)), spec)
        if grid.idle and (self.grid is None or grid.idle != self.grid.idle):
            if self.cfg.training.dataset in DATA_FORMATS:  # a job whose data lives on the devices
                logger.warning("training grid leaves %s idle: they would slow their cluster down, and the data they "
                               "hold is not trained on while they are (planner.parallelism = \"data\" trains every "
                               "device on its own data)", listing(list(grid.idle)))
            else:
                logger.info("training grid leaves %s idle: they would slow their cluster down",
                            listing(list(grid.idle)))


def parallelism_of(config: Config, registry: Registry, *, wake: Callable[[], None], predicted_round: Gauge,
                   refusal: str) -> Parallelism:
    """The parallelism ``planner.parallelism`` names: data parallel where ``refusal`` (:func:`mesh_refusal` of
    ``config``) says the grid cannot divide the model."""
    if config.planner.parallelism == "mesh" and not refusal:
        return MeshParallel(config, registry, predicted_round)
    return DataParallel(config, registry, wake)

