"""Which updates the parameter server applies, when, and with which weights: one class per policy (pure).

The PS keeps a version clock ``v``; an update computed on version ``b`` has delay ``d = v - b``
(docs/synchronization.md). A scheduler takes candidates (decoded, shape-checked updates) and gives
back a :class:`Decision`: the steps to apply, each the version it makes, and an ack for every update
it settled (accepted, discarded with a reason, or a duplicate). An update it neither applies nor
discards stays with it (an open round, an SSP wait) for the next call.

* ``sync`` (BSP): one update per live cluster per round, all computed on the current version.
* ``async`` (ASP): every update with ``d <= bound`` on arrival.
* ``ssp``: like ``async``; a cluster more than ``bound`` accepted updates ahead of the slowest live
  one waits.
* ``adaptive``: rounds like ``sync`` that close at a deadline; bound, deadline and weights from the
  delay indices (:mod:`edgemesh.services.parameter_server.adaptive`).

Every update is applied at most once: the :class:`Clock` keeps each device's high-water mark
``(incarnation, seq)``, advanced when a step forms, and anything at or below it is a duplicate. An update is named
everywhere in the parameter server (owed acks, the ledger, a sharded server's steps, norms and discards) by one
:class:`UpdateId`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Protocol

from edgemesh.common.messages import GradientUpdate, Plan, SyncState
from edgemesh.common.vocabulary import AckReason, AckStatus, AggregationRule, RoundScaling, StalenessRule, SyncPolicy
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay, round_weights, staleness_weight
from edgemesh.services.parameter_server.optimizer import ShardGrad


class Named(Protocol):
    """Anything that names one update: the update itself, a step's part, a discard, a shard's norm of it."""

    @property
    def device(self) -> str: ...
    @property
    def incarnation(self) -> int: ...
    @property
    def seq(self) -> int: ...


class UpdateId(NamedTuple):
    """One update, wherever the parameter server names it: its sender, the sender's incarnation and its seq."""

    device: str
    incarnation: int
    seq: int

    @classmethod
    def of(cls, named: Named) -> UpdateId:
        return cls(named.device, named.incarnation, named.seq)


@dataclass(slots=True)
class Candidate:
    """A decoded, shape-checked update waiting for the scheduler."""

    update: GradientUpdate
    grads: list[ShardGrad]
    received: float
    parts: tuple[GradientUpdate, ...] = ()
    """A model-parallel cluster's update: the members' updates it joins (``update`` is the first's)."""
    buffers: list[ShardGrad] = field(default_factory=list)
    """The change of the model's buffers over the sender's step (batch norm's statistics); ``grads`` holds the
    parameters' gradients alone."""

    @property
    def updates(self) -> tuple[GradientUpdate, ...]:
        return self.parts or (self.update,)


@dataclass(frozen=True, slots=True)
class Ack:
    """What to tell one update's sender."""

    update: GradientUpdate
    status: AckStatus
    reason: AckReason = ""
    delay: int = 0
    resync: bool = False


@dataclass(frozen=True, slots=True)
class Step:
    """Candidates applied together, the version their step makes, and each one's weight in it."""

    items: tuple[Candidate, ...]
    version: int
    weights: tuple[float, ...] = ()
    rule: AggregationRule | None = None
    """The aggregation this step must use whatever the rule in force (a shard's step of shard 0's clipped one:
    ``mean``, its weights already scaled; of its Krum step: ``krum`` with shard 0's ``chosen``)."""
    chosen: tuple[int, ...] | None = None
    """The items to combine, as shard 0 chose them (under ``rule = krum``, those its Krum averaged; under any rule,
    not those its norm filter refused); None: every item."""
    gain_limit: float = 1.0
    """Under ``ps.round_scaling = "adascale"``, the batches of ``training.batch_size`` a round step averages: the most
    its measured gain may multiply it by (``gain``); 1: no gain is measured (every other step)."""

    def delay(self, item: Candidate) -> int:
        return self.version - 1 - item.update.base_version

    @property
    def samples(self) -> tuple[int, ...]:
        return tuple(item.update.samples for item in self.items)

    def contributions(self) -> list[tuple[float, list[ShardGrad]]]:
        """``(weight, gradient)`` of each item: what the step combines."""
        return list(zip(self.weights, (item.grads for item in self.items), strict=True))

    def buffer_contributions(self) -> list[tuple[float, list[ShardGrad]]]:
        """``(sample share, buffer change)`` of each item that carries one: a step moves the buffers by the
        sample-weighted mean of its updates' changes, whatever the policy's weights or the robust rule (which bound
        gradients), so that a step of several updates moves running statistics as one batch of all their samples
        would. The same on every shard of a sharded server and in a replay of the log (``buffer_mean``)."""
        return buffer_mean([(item.update.samples, item.buffers) for item in self.items])


def buffer_mean(changes: Sequence[tuple[int, list[ShardGrad]]]) -> list[tuple[float, list[ShardGrad]]]:
    """``(samples, buffer change)`` of a step's updates as the contributions that move its buffers: each change
    weighted by its share of the samples of the updates that carry one."""
    carried = [(n, change) for n, change in changes if change]
    total = sum(n for n, _ in carried)
    return [(n / total, change) for n, change in carried] if total else []


@dataclass(slots=True)
class Decision:
    steps: list[Step] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)


@dataclass(slots=True)
class Clock:
    """The version clock and what the PS remembers per device and cluster (checkpointed)."""

    version: int = 0
    high_water: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Device -> the newest (incarnation, seq) applied."""
    clocks: dict[str, int] = field(default_factory=dict)
    """Cluster -> steps it contributed to (SSP compares them)."""
    floor: int = 0
    """Updates computed on a version before this are discarded as stale whatever their delay: the divergence guard
    rolled that model back (``guard``), and their gradients are of the model it left."""

    def seen(self, u: GradientUpdate) -> bool:
        mark = self.high_water.get(u.device)
        return mark is not None and (u.incarnation, u.seq) <= mark

    def advance(self, items: Iterable[Candidate]) -> None:
        """A step of ``items`` formed: each cluster ticks once, each member's update is applied."""
        for cluster in {item.update.cluster for item in items}:
            self.clocks[cluster] = self.clocks.get(cluster, 0) + 1
        for item in items:
            for part in item.updates:
                self.high_water[part.device] = (part.incarnation, part.seq)


@dataclass(frozen=True, slots=True)
class Verdict:
    accept: bool
    delay: int
    reason: AckReason = ""


def judge(version: int, base_version: int, bound: int) -> Verdict:
    """Accept an update computed on ``base_version`` at ``version`` if its delay is within ``bound``."""
    delay = version - base_version
    if delay < 0:
        return Verdict(False, delay, "future")
    if delay > bound:
        return Verdict(False, delay, "stale")
    return Verdict(True, delay)


@dataclass(frozen=True, slots=True)
class Fleet:
    """What the plan says, for one call: its clusters (empty: none yet), its version, its devices,
    the configured bound and the samples it expects per round; the batch the learning rate is given for; and the
    time."""

    clusters: tuple[str, ...] = ()
    plan_version: int = 0
    devices: frozenset[str] | None = None
    bound: int = 0
    planned_samples: int = 0
    now: float = 0.0
    lr_batch: int = 0
    """``training.batch_size``: the batch the learning rate is given for, the unit of ``round_scale`` (0: the
    plan's mean batch per cluster)."""

    @classmethod
    def of(cls, plan: Plan | None, bound: int, now: float, *, lr_batch: int = 0) -> Fleet:
        """What ``plan`` (None: none yet) says, the configured ``bound``, at ``now``."""
        if plan is None:
            return cls(bound=bound, now=now, lr_batch=lr_batch)
        return cls(clusters=plan.cluster_names, plan_version=plan.version,
                   devices=frozenset(d.device for d in plan.devices), bound=bound,
                   # one batch per cluster (its members share it)
                   planned_samples=sum({d.cluster: d.batch_size for d in plan.devices}.values()), now=now,
                   lr_batch=lr_batch)

    @property
    def batch_unit(self) -> float:
        """The batch one step of the learning rate is for: ``lr_batch``, else the plan's mean batch per cluster (0:
        no plan)."""
        if not self.clusters or not self.planned_samples:
            return 0.0
        return self.lr_batch or self.planned_samples / len(self.clusters)


class Scheduler:
    """The policy-independent part: duplicates, judging, acks, deferral."""

    policy: ClassVar[SyncPolicy]
    resyncs: ClassVar[bool] = False
    """Whether an accepted update's sender fetches the model before its next one (round policies)."""
    adapts: ClassVar[bool] = False
    """Whether every batch may move what the planner hears (``adaptive``: the rule's bound, deadline and slow
    devices): the sync state and its gauges are refreshed after each."""

    def __init__(self, clock: Clock, *, staleness_weighting: bool = True, round_scaling: RoundScaling = "none",
                 staleness_rule: StalenessRule = "inverse", round_warmup: int = 0) -> None:
        self.clock = clock
        self.staleness_weighting = staleness_weighting
        self.staleness_rule: StalenessRule = staleness_rule
        """How an applied update is damped by its delay (``ps.staleness_rule``)."""
        self.round_scaling: RoundScaling = round_scaling
        """Round policies: how a round's step grows with the batches it averages (``ps.round_scaling``)."""
        self.round_warmup = round_warmup
        """Versions over which that growth ramps up from none (``ps.round_warmup``)."""
        self.deferred: list[Candidate] = []

    def take(self, batch: Sequence[Candidate], fleet: Fleet) -> Decision:
        """Judge the updates deferred so far and ``batch``; the steps to apply and the acks."""
        out = Decision()
        candidates, self.deferred = [*self.deferred, *batch], []
        version = self._before(fleet, out)
        for item in candidates:
            if self.clock.seen(item.update):
                out.acks += [Ack(part, "duplicate") for part in item.updates]
                continue
            verdict = self._judge(version, item.update, fleet)
            if not verdict.accept:
                self._discarded(item, verdict, fleet)
                out.acks += [Ack(p, "discarded", verdict.reason, verdict.delay, True) for p in item.updates]
                continue
            version = self._place(item, verdict, version, fleet, out)
        self._after(version, fleet, out)
        return out

    def pending(self) -> list[Candidate]:
        """Updates held for later (carried over when the policy changes)."""
        return list(self.deferred)

    def timeout(self, fleet: Fleet) -> float | None:
        """Seconds until this scheduler must be asked again with no new update (None: not before one)."""
        return None

    def model_published(self, now: float) -> None:
        """The model of the last step went out."""

    def weights(self, step: Step, fleet: Fleet) -> list[float]:
        """Each item's weight in ``step``: its samples over ``fleet.batch_unit`` (the batch the
        learning rate is for: a device the planner gave half the batch moves the model half as far, as one process
        would per sample), damped by its delay under ``ps.staleness_weighting``. Without a plan, its share of the
        step's samples."""
        unit = fleet.batch_unit or sum(item.update.samples for item in step.items)
        shares = [item.update.samples / unit for item in step.items]
        if not self.staleness_weighting:
            return shares
        return [w * staleness_weight(step.delay(i), self.staleness_rule)
                for w, i in zip(shares, step.items, strict=True)]

    def gain_limit(self, step: Step, fleet: Fleet) -> float:
        """The most ``step``'s measured gain may scale it by (``Step.gain_limit``): 1, but for a round."""
        return 1.0

    def live(self, fleet: Fleet) -> tuple[str, ...]:
        """The clusters a round waits for: the plan's, else every cluster seen."""
        return fleet.clusters or tuple(sorted(set(self.clock.clocks)))

    def sync_state(self, fleet: Fleet, *, bound: int, time: float) -> SyncState:
        """What the parameter server tells the planner about synchronization now (``time``: Unix seconds)."""
        return SyncState(policy=self.policy, version=self.clock.version, time=time, bound=bound)

    # --- what each policy refines ----------------------------------------------------------
    def _bound(self, fleet: Fleet) -> int:
        return fleet.bound

    def _before(self, fleet: Fleet, out: Decision) -> int:
        return self.clock.version

    def _judge(self, version: int, u: GradientUpdate, fleet: Fleet) -> Verdict:
        if u.base_version < self.clock.floor:
            return Verdict(False, version - u.base_version, "stale")
        return judge(version, u.base_version, self._bound(fleet))

    def _discarded(self, item: Candidate, verdict: Verdict, fleet: Fleet) -> None:
        """A discarded update, for rules that learn from delays."""

    def _place(self, item: Candidate, verdict: Verdict, version: int, fleet: Fleet, out: Decision) -> int:
        return self._step([item], version, out, fleet)

    def _after(self, version: int, fleet: Fleet, out: Decision) -> None:
        """After every candidate was judged."""

    def _step(self, items: Sequence[Candidate], version: int, out: Decision, fleet: Fleet) -> int:
        """``items`` form the next step, weighted: tick the clock, ack them accepted; the new version."""
        step = Step(tuple(items), version + 1)
        step = Step(step.items, step.version, tuple(self.weights(step, fleet)), gain_limit=self.gain_limit(step, fleet))
        self.clock.advance(step.items)
        out.steps.append(step)
        out.acks += [Ack(part, "accepted", "", step.delay(item), self.resyncs) for item in items
                     for part in item.updates]
        return step.version


class AsyncScheduler(Scheduler):
    """ASP: every update within the bound, applied on arrival. A version is one cluster's update, so the bound
    counts rounds of the fleet (``rounds_bound``), as it does under the round policies, where a version is a round."""

    policy = "async"

    def _bound(self, fleet: Fleet) -> int:
        return rounds_bound(fleet.bound, len(self.live(fleet)))


class SSPScheduler(Scheduler):
    """Stale synchronous parallel: a cluster more than ``bound`` steps ahead of the slowest live one waits; an
    update is applied within ``bound`` rounds of the fleet, as under ``async``."""

    policy = "ssp"

    def _bound(self, fleet: Fleet) -> int:
        return rounds_bound(fleet.bound, len(self.live(fleet)))

    def _place(self, item: Candidate, verdict: Verdict, version: int, fleet: Fleet, out: Decision) -> int:
        if must_wait(item.update.cluster, self.clock.clocks, self.live(fleet), fleet.bound):
            self.deferred.append(item)
            return version
        return self._step([item], version, out, fleet)


class RoundScheduler(Scheduler):
    """Rounds of one update per live cluster; what closes a round is the policy's."""

    resyncs = True

    def __init__(self, clock: Clock, *, staleness_weighting: bool = True, round_scaling: RoundScaling = "none",
                 staleness_rule: StalenessRule = "inverse", round_warmup: int = 0) -> None:
        super().__init__(clock, staleness_weighting=staleness_weighting, round_scaling=round_scaling,
                         staleness_rule=staleness_rule, round_warmup=round_warmup)
        self.round: dict[str, Candidate] = {}

    def pending(self) -> list[Candidate]:
        return [*self.round.values(), *self.deferred]

    def live(self, fleet: Fleet) -> tuple[str, ...]:
        return fleet.clusters or tuple(sorted({i.update.cluster for i in self.round.values()} | set(self.clock.clocks)))

    def gain_limit(self, step: Step, fleet: Fleet) -> float:
        if self.round_scaling != "adascale":
            return 1.0
        return round_batches(self._round_samples(step, fleet), fleet)

    def _round_samples(self, step: Step, fleet: Fleet) -> int:
        """The samples a round step is scaled for: those it holds."""
        return sum(step.samples)

    def _complete(self, fleet: Fleet) -> bool:
        """Every live cluster has contributed to the open round (and there is one)."""
        return bool(self.round) and set(self.live(fleet)) <= set(self.round)

    def _close(self, version: int, out: Decision, fleet: Fleet) -> int:
        """The open round becomes a step."""
        items, self.round = list(self.round.values()), {}
        return self._step(items, version, out, fleet)


class SyncScheduler(RoundScheduler):
    """BSP: a round waits for every live cluster; an update from a cluster the plan dropped is let go."""

    policy = "sync"

    def _bound(self, fleet: Fleet) -> int:
        return 0

    def _before(self, fleet: Fleet, out: Decision) -> int:
        for cluster in [c for c, item in self.round.items() if _left_the_plan(item.update, fleet)]:
            out.acks += [Ack(part, "discarded", "replanned", 0, True) for part in self.round.pop(cluster).updates]
        return self.clock.version

    def _place(self, item: Candidate, verdict: Verdict, version: int, fleet: Fleet, out: Decision) -> int:
        u = item.update
        if _left_the_plan(u, fleet):
            out.acks += [Ack(part, "discarded", "replanned", verdict.delay, True) for part in item.updates]
            return version
        if u.cluster in self.round:  # the cluster already contributed to this round: a second member or a repeat
            out.acks += [Ack(part, "discarded", "round_full", verdict.delay, True) for part in item.updates]
            return version
        self.round[u.cluster] = item
        return self._close(version, out, fleet) if self._complete(fleet) else version

    def _after(self, version: int, fleet: Fleet, out: Decision) -> None:
        if self._complete(fleet):  # a round can also complete because a cluster left the plan
            self._close(version, out, fleet)

    def weights(self, step: Step, fleet: Fleet) -> list[float]:
        total = sum(step.samples)
        scale = round_scale(self.round_scaling, self._round_samples(step, fleet), fleet, version=step.version,
                            warmup=self.round_warmup)
        return [item.update.samples / total * scale for item in step.items]


class AdaptiveScheduler(RoundScheduler):
    """Adaptive bounded delay: a round closes when every cluster is in or at its deadline τ, whoever
    is missing; updates with ``d <= D`` are applied, weighted by their share of the planned samples
    and their delay; each delay moves its device's index."""

    policy = "adaptive"
    adapts = True

    def __init__(self, clock: Clock, rule: AdaptiveDelay, *, staleness_weighting: bool = True,
                 round_scaling: RoundScaling = "none", staleness_rule: StalenessRule = "inverse",
                 round_warmup: int = 0) -> None:
        super().__init__(clock, staleness_weighting=staleness_weighting, round_scaling=round_scaling,
                         staleness_rule=staleness_rule, round_warmup=round_warmup)
        self.rule = rule
        self.opened: float | None = None
        """When the open round began (its model went out, or its first update came); its deadline runs from here."""
        self.published: dict[int, float] = {}
        """When each recent version's model went out: a cluster's cycle (from the model it trained on to its
        update) is measured from here, whichever round its update lands in."""
        self._bound_now = 0

    def deadline(self, fleet: Fleet) -> float:
        return self.rule.deadline(self.live(fleet))

    def sync_state(self, fleet: Fleet, *, bound: int, time: float) -> SyncState:
        """Also the rule's bound, deadline, the live devices' delay indices and the slow devices."""
        live = self.rule.live_devices
        return SyncState(policy=self.policy, version=self.clock.version, time=time, bound=self.rule.bound(),
                         deadline_s=self.deadline(fleet),
                         delay_indices={d: round(i, 3) for d, i in self.rule.indices.items()
                                        if live is None or d in live},
                         slow=tuple(self.rule.slow_devices()))

    def timeout(self, fleet: Fleet) -> float | None:
        if self.opened is None or not self.round:
            return None
        return max(0.0, self.opened + self.deadline(fleet) - fleet.now)

    def model_published(self, now: float) -> None:
        self.opened = now  # the next round's deadline runs from its model
        version = self.clock.version
        self.published[version] = now
        for old in [v for v in self.published if v < version - PUBLISHED_KEPT]:
            del self.published[old]

    def _round_samples(self, step: Step, fleet: Fleet) -> int:
        """The samples the plan expects of a round, or more if the round holds more: a round the deadline cut short
        still scales as a whole one, its missing clusters' weight left out (``round_weights``)."""
        return max(fleet.planned_samples, sum(step.samples))

    def weights(self, step: Step, fleet: Fleet) -> list[float]:
        scale = round_scale(self.round_scaling, self._round_samples(step, fleet), fleet, version=step.version,
                            warmup=self.round_warmup)
        return [w * scale for w in round_weights(list(step.samples), [step.delay(i) for i in step.items],
                                                    fleet.planned_samples, self.staleness_rule)]

    def _before(self, fleet: Fleet, out: Decision) -> int:
        self.rule.follow(fleet.bound, fleet.devices)
        self._bound_now = self.rule.bound()
        return self.clock.version

    def _bound(self, fleet: Fleet) -> int:
        return self._bound_now

    def _discarded(self, item: Candidate, verdict: Verdict, fleet: Fleet) -> None:
        if verdict.reason == "stale":
            # "later than the bound" is what a discard says; a device back from a long outage would
            # otherwise carry a huge index for many rounds
            for part in item.updates:
                self.rule.observe_delay(part.device, min(verdict.delay, self._bound_now + 1))

    def _place(self, item: Candidate, verdict: Verdict, version: int, fleet: Fleet, out: Decision) -> int:
        u = item.update
        if u.cluster in self.round:
            self.deferred.append(item)  # the cluster's next update: it goes into the next round
            return version
        if self.opened is None:
            self.opened = fleet.now
        sent = self.published.get(u.base_version)
        if sent is not None:  # how long the cluster takes from the model it trained on to its update
            self.rule.observe_arrival(u.cluster, item.received - sent)
        self.round[u.cluster] = item
        return self._close(version, out, fleet) if self._complete(fleet) else version

    def _after(self, version: int, fleet: Fleet, out: Decision) -> None:
        if self.round and (self._complete(fleet) or (
                self.opened is not None and fleet.now - self.opened >= self.deadline(fleet))):
            self._close(version, out, fleet)

    def _close(self, version: int, out: Decision, fleet: Fleet) -> int:
        version = super()._close(version, out, fleet)
        self.opened = None
        step = out.steps[-1]
        for item in step.items:
            for part in item.updates:
                self.rule.observe_delay(part.device, step.delay(item))
        return version


PUBLISHED_KEPT = 256
"""Versions whose publish time the adaptive scheduler remembers (an update older than that is stale anyway)."""

SCHEDULERS: Mapping[SyncPolicy, type[Scheduler]] = {
    "sync": SyncScheduler, "async": AsyncScheduler, "ssp": SSPScheduler, "adaptive": AdaptiveScheduler}


def round_scale(scaling: RoundScaling, samples: int, fleet: Fleet, *, version: int = 0, warmup: int = 0) -> float:
    """What a round step of ``samples`` samples making ``version`` is scaled by: the batches of ``training.batch_size``
    (``fleet.lr_batch``, the batch the learning rate is given for) it averages (``linear``, the linear scaling rule
    of large-batch SGD), their square root (``sqrt``), or 1; over the first ``warmup`` versions the scale ramps from
    1 up to that, a step per version (Goyal et al.'s gradual warm-up: the early steps, where the loss moves fastest,
    are those a scaled rate overshoots).

    The unit is the learning rate's batch, not a cluster's: model parallelism splits one iteration's batch of
    ``training.batch_size`` among its clusters, so a round of four clusters of 8 samples is one batch of 32, not
    four (counting clusters made the demo's mesh job step four times its rate, and diverge)."""
    if scaling in ("none", "adascale") or not fleet.clusters or not fleet.planned_samples:
        return 1.0  # adascale: the step is scaled by the gain its gradients measure (``gain``), within round_batches
    batches = round_batches(samples, fleet)
    full = batches if scaling == "linear" else math.sqrt(batches)
    return full if warmup <= 0 or version >= warmup else 1.0 + (full - 1.0) * max(0, version) / warmup


def round_batches(samples: int, fleet: Fleet) -> float:
    """The batches of ``fleet.batch_unit`` (``training.batch_size``) a round step of ``samples`` samples averages, at
    least 1 (1 without a plan)."""
    if not fleet.clusters or not fleet.planned_samples:
        return 1.0
    return max(1.0, samples / fleet.batch_unit)


def make_scheduler(policy: SyncPolicy, clock: Clock, rule: AdaptiveDelay, *, staleness_weighting: bool,
                   round_scaling: RoundScaling = "none", staleness_rule: StalenessRule = "inverse",
                   round_warmup: int = 0, carry: Iterable[Candidate] = ()) -> Scheduler:
    """The scheduler of ``policy``; updates another one held (``carry``) are judged again under it."""
    scheduler: Scheduler
    if policy == "adaptive":
        scheduler = AdaptiveScheduler(clock, rule, staleness_weighting=staleness_weighting,
                                      round_scaling=round_scaling, staleness_rule=staleness_rule,
                                      round_warmup=round_warmup)
    else:
        scheduler = SCHEDULERS[policy](clock, staleness_weighting=staleness_weighting, round_scaling=round_scaling,
                                       staleness_rule=staleness_rule, round_warmup=round_warmup)
    scheduler.deferred = list(carry)
    return scheduler


def rounds_bound(bound: int, clusters: int) -> int:
    """The delay in versions of an update at most ``bound`` rounds of a fleet of ``clusters`` late, when each of its
    updates is a version (``async``, ``ssp``): ``(bound + 1) x clusters - 1``. With one cluster, ``bound``; with
    N, an update computed while every other cluster's was applied once (a delay of N - 1, the delay of asynchrony
    itself) is 0 rounds late, so a fleet of any size keeps its updates (``training.staleness_bound`` = 4 in versions
    would discard most of 20 devices' updates)."""
    return (bound + 1) * max(1, clusters) - 1


def must_wait(cluster: str, clocks: Mapping[str, int], live: Iterable[str], bound: int) -> bool:
    """SSP gate: True when ``cluster`` is more than ``bound`` accepted updates ahead of the slowest live one."""
    others = [clocks.get(c, 0) for c in live if c != cluster]
    if not others:
        return False
    return clocks.get(cluster, 0) - min(others) > bound


def _left_the_plan(u: GradientUpdate, fleet: Fleet) -> bool:
    """Sync: ``u`` comes from a cluster the plan no longer has, computed under an older plan. No
    round waits for that cluster, and its devices, now in others, must not wait for its ack (a
    sender ahead of the PS, under a plan the PS has not received yet, is not one)."""
    return bool(fleet.clusters) and u.cluster not in fleet.clusters and 0 < u.plan_version < fleet.plan_version

