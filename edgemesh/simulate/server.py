"""The parameter server on the virtual clock: its own scheduler, aggregation, optimizer and broadcast encoder.

Every decision is the service's code: the scheduler of the policy (``make_scheduler``, as ``ParameterServer`` builds
it from ``ps.*``), the robust rule (``Aggregator``), the SGD step and its refusals (``ModelState``), the model
message (``Broadcaster``, whose encoded size is what the devices download). What it leaves out is what takes wall
time or disk in the service: the write-ahead log, checkpoints, the ledger, the MQTT client (``step.Stepper`` and
``recovery`` write files, so this module replays ``Stepper._step``'s order instead of calling it). The divergence
guard judges every evaluation as the service's does (``Guard``, with ``ps.guard``), and its rollback is
``Stepper.restore``'s and ``Divergence._go_back``'s: the best evaluated weights as a new version, momentum cleared,
the learning rate lowered, the model out whole. A step takes no virtual time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from edgemesh.common.broadcast import Broadcaster
from edgemesh.common.config import AdaptiveConfig, Config
from edgemesh.common.messages import GradientUpdate, Plan, PlanDevice
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.vocabulary import SyncPolicy
from edgemesh.common.wire.half import from_half, to_half
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay, compensated_momentum, quantile
from edgemesh.services.parameter_server.guard import Evaluated, Guard
from edgemesh.services.parameter_server.optimizer import ModelState
from edgemesh.services.parameter_server.robust import Aggregator
from edgemesh.services.parameter_server.scheduler import Ack, Candidate, Clock, Fleet, Scheduler, Step, make_scheduler
from edgemesh.simulate.fleet import Published
from edgemesh.simulate.reference import FEDBUFF_SHARE, FedBuffScheduler, ReferencePolicy

VERSIONS_KEPT = 64
"""Versions whose weights are kept before the ones no device can still start from are dropped."""


class CachedDelay(AdaptiveDelay):
    """The adaptive rule with each cluster's median cycle kept until the cluster's next arrival.

    ``AdaptiveDelay.deadline`` takes the median of every cluster's window of arrivals on every call, and the
    scheduler asks for it on every update: with 1,000 clusters, 1,000 sorts per update, which dominated a large
    fleet's run. The figures are the same (``tests/test_simulate.py`` compares them with the rule's own on random
    arrivals); only the medians of the clusters that did not move are not taken again."""

    def __init__(self, settings: AdaptiveConfig) -> None:
        super().__init__(settings)
        self._medians: dict[str, float] = {}

    def observe_arrival(self, cluster: str, seconds: float) -> None:
        super().observe_arrival(cluster, seconds)
        self._medians.pop(cluster, None)

    def restore_arrivals(self, kept: Mapping[str, Sequence[float]]) -> None:
        super().restore_arrivals(kept)
        self._medians.clear()

    def retain(self, devices: Iterable[str], clusters: Iterable[str]) -> None:
        super().retain(devices, clusters)
        self._medians = {c: m for c, m in self._medians.items() if c in self.arrivals}

    def _median(self, cluster: str) -> float:
        median = self._medians.get(cluster)
        if median is None:
            median = self._medians[cluster] = quantile(self.arrivals[cluster], 0.5)
        return median

    def deadline(self, live_clusters: Iterable[str] | None = None) -> float:
        """``AdaptiveDelay.deadline``, from the kept medians."""
        s = self.settings
        keys = self.arrivals.keys() if live_clusters is None else [c for c in live_clusters if c in self.arrivals]
        typical = [self._median(c) for c in keys if self.arrivals[c]]
        if not typical:
            return s.max_deadline_s
        return min(s.max_deadline_s, max(s.min_deadline_s, quantile(typical, s.deadline_quantile) * s.slack))


@dataclass(slots=True)
class Counts:
    """What the parameter server did with the updates it received."""

    accepted: int = 0
    duplicates: int = 0
    discarded: Counter[str] = field(default_factory=Counter)
    steps_refused: int = 0
    delays: list[int] = field(default_factory=list)
    """Delay in versions of every accepted update."""
    by_device: Counter[str] = field(default_factory=Counter)
    """Accepted updates per device."""
    bytes_in: int = 0
    bytes_out: int = 0
    """Bytes of every model message (each device downloads each one it follows)."""


class Server:
    """The parameter server's state and its step, driven by the simulation's events (module docstring)."""

    def __init__(self, config: Config, policy: SyncPolicy | ReferencePolicy, initial: Mapping[str, np.ndarray], *,
                 buffers: Mapping[str, bool], momenta: Mapping[str, float], classes: int | None = None,
                 buffer_share: float = FEDBUFF_SHARE) -> None:
        self.cfg = config
        self.clock = Clock()
        self.rule = CachedDelay(config.ps.adaptive)
        self.metrics = ServiceMetrics("ps")
        self.aggregator = Aggregator(config.ps, self.metrics)
        p = config.ps
        self.scheduler: Scheduler
        if policy == "fedbuff":  # a peer's rule for comparison (reference.py), not a service policy
            self.scheduler = FedBuffScheduler(self.clock, share=buffer_share)
        else:
            self.scheduler = make_scheduler(policy, self.clock, self.rule, staleness_weighting=p.staleness_weighting,
                                            round_scaling=p.round_scaling, staleness_rule=p.staleness_rule,
                                            round_warmup=p.round_warmup)
        self.policy: SyncPolicy = self.scheduler.policy
        """The service policy the broadcast and the optimizer see (a reference policy's nearest: ``async``)."""
        self.state = ModelState(initial, buffers=buffers, momenta=momenta)
        self.broadcast = Broadcaster(p, config.training.model_spec)
        self.bound = config.training.staleness_bound
        self.plan: Plan | None = None
        self.members: dict[str, PlanDevice] = {}
        self._fleet = Fleet.of(None, self.bound, 0.0, lr_batch=config.training.batch_size)
        self.versions: dict[int, dict[str, np.ndarray]] = {0: self._copy()}
        """Weights of the versions a device may still start a step from."""
        self.held: dict[int, dict[str, np.ndarray]] = {0: self.versions[0]}
        """What a device that follows the model messages holds of each of those versions (``held_weights``)."""
        self.published: list[Published] = []
        self.counts = Counts()
        self.lr = config.training.lr
        """The learning rate in force (a rollback lowers it)."""
        self.guard = Guard(config.ps.guard)
        self.guard.chance = 1 / classes if classes else None

    @property
    def version(self) -> int:
        return self.clock.version

    def fleet(self, now: float) -> Fleet:
        """``Fleet.of(plan, bound, now, lr_batch=training.batch_size)`` as the service builds it, once per plan."""
        return replace(self._fleet, now=now)

    # ------------------------------------------------------------------ what comes in
    def replanned(self, plan: Plan, now: float) -> list[Ack]:
        """A new plan (``ParameterServer._on_plan``): the adaptive rule keeps its devices' figures, a model that
        moved while no device listened goes out whole, and an open round the plan completes closes."""
        self.plan, self.members = plan, {d.device: d for d in plan.devices}
        self._fleet = Fleet.of(plan, self.bound, now, lr_batch=self.cfg.training.batch_size)
        self.rule.retain((d.device for d in plan.devices), plan.cluster_names)
        if plan.devices and self.broadcast.skipped:
            self.publish_snapshot(now)
        return self.take([], now)

    def receive(self, update: GradientUpdate, nbytes: int, now: float) -> list[Ack]:
        """An update arrives (``Intake.on_gradient``): one from a device the plan does not name is discarded, the
        others are decoded with the model's own shapes and judged."""
        self.counts.bytes_in += nbytes
        if self.plan is not None and update.device not in self.members:
            ack = Ack(update, "discarded", "unknown_device")
            self._count([ack])
            return [ack]
        grads = self.state.decode(update.shards)
        buffers = self.state.decode(update.buffers, buffers=True)
        return self.take([Candidate(update, grads, now, buffers=buffers)], now)

    def take(self, batch: list[Candidate], now: float) -> list[Ack]:
        """The step loop's turn (``ParameterServer._step``), again while a step releases updates SSP held."""
        acks: list[Ack] = []
        while True:
            fleet = self.fleet(now)
            decision = self.scheduler.take(batch, fleet)
            batch = []
            if decision.steps:
                self._apply(decision.steps, now)
            acks += decision.acks
            if not (decision.steps and self.scheduler.deferred):
                break
        self._count(acks)
        return acks

    def timeout(self, now: float) -> float | None:
        """Seconds until the scheduler must be asked again with no new update (an adaptive round's deadline)."""
        return self.scheduler.timeout(self.fleet(now))

    def evaluated(self, version: int, loss: float, accuracy: float, now: float) -> bool:
        """An evaluation of ``version`` (``Divergence.evaluated``): judged by the guard, and the model rolled back
        when it says so. True if it was."""
        if version < self.clock.floor or version not in self.versions:
            return False  # a model a rollback already left behind
        rollback = self.guard.judge(Evaluated(version, loss, accuracy, self.versions[version]))
        if rollback is None:
            return False
        assert rollback.to.params is not None
        self.state.restore(rollback.to.params)
        self.clock.version += 1
        self.clock.floor = self.clock.version
        self.lr *= self.cfg.ps.guard.lr_factor
        self.guard.rolled_back()
        self.versions[self.version] = self._copy()
        self.publish_snapshot(now)
        return True

    # ------------------------------------------------------------------ a step
    def _apply(self, steps: list[Step], now: float) -> None:
        """``Stepper._step`` without the log: combine each step's contributions by the rule, sum, apply (a step the
        model refuses is counted and moves the version alone); then the model message, the new version, and its
        weights kept for the devices that will start from it."""
        lr, momentum, weight_decay = self._optimizer()
        for step in steps:
            combined = self.aggregator.combine(step.contributions(), rule=step.rule, chosen=step.chosen,
                                               gain_limit=step.gain_limit, samples=step.samples)
            summed = self.state.sum(combined.contributions, step.buffer_contributions())
            refused = self.state.apply(summed, lr=lr, momentum=momentum, weight_decay=weight_decay)
            if refused is not None:
                self.aggregator.step_refused(step.version, refused, combined)
                self.counts.steps_refused += 1
            self.counts.delays += [step.delay(item) for item in step.items]
        version = steps[-1].version
        message = self.broadcast.to_plan(self.state.params, version, self.policy, self.plan)
        self.clock.version = version
        self.versions[version] = self._copy()
        self.held[version] = self.held_weights(version, snapshot=message is None or message.snapshot)
        if message is not None:
            self._published(Published(version, now, len(message.payload), message.snapshot))
            self.scheduler.model_published(now)  # an adaptive round's deadline runs from its model

    def _optimizer(self) -> tuple[float, float, float]:
        """(lr, momentum, weight decay) of the next steps (``ParameterServer._settings``)."""
        t = self.cfg.training
        momentum = t.momentum
        if self.cfg.ps.async_momentum == "compensated" and self.policy in ("async", "ssp") and self.plan is not None:
            momentum = compensated_momentum(momentum, len({d.cluster for d in self.plan.devices}))
        return self.lr, momentum, t.weight_decay

    def publish_snapshot(self, now: float) -> int:
        """The whole model, retained (a device that joins, or a model no one heard); its index among the
        published messages."""
        payload = self.broadcast.snapshot(self.state.params, self.version, self.policy)
        self.held[self.version] = self.held_weights(self.version, snapshot=True)
        self._published(Published(self.version, now, len(payload), True))
        return len(self.published) - 1

    def _published(self, message: Published) -> None:
        self.published.append(message)
        self.counts.bytes_out += message.nbytes * len(self.members)

    def _copy(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.state.params.items()}

    def held_weights(self, version: int, *, snapshot: bool) -> dict[str, np.ndarray]:
        """The weights a worker holds of ``version`` (``ModelView``'s): a delta's are the broadcast's view, the
        last snapshot plus the deltas since as a worker decodes them (``ps.delta_codec`` loses a little, and what
        it lost goes with the next delta); a snapshot's are exact in delta mode and of ``ps.snapshot_dtype``
        otherwise. The same arrays as the server's where nothing is lost."""
        exact = self.versions[version]
        view = self.broadcast.view
        if self.cfg.ps.broadcast == "delta":
            if snapshot or view is None:
                return exact
            return {k: v.copy() for k, v in view.items()}
        if self.cfg.ps.snapshot_dtype == "float16":
            return {k: from_half(to_half(v)) for k, v in exact.items()}
        return exact

    def forget_before(self, oldest: int) -> None:
        """Drop the weights of versions before ``oldest``: no device can start a step from them any more."""
        for v in [v for v in self.versions if v < min(oldest, self.version)]:
            del self.versions[v]
            self.held.pop(v, None)

    def _count(self, acks: list[Ack]) -> None:
        for ack in acks:
            if ack.status == "accepted":
                self.counts.accepted += 1
                self.counts.by_device[ack.update.device] += 1
            elif ack.status == "duplicate":
                self.counts.duplicates += 1
            else:
                self.counts.discarded[ack.reason or "unknown"] += 1
