"""A shard of a sharded parameter server other than 0: it takes the steps shard 0 decides, whatever the policy
(docs/scale.md#a-sharded-parameter-server).

Every other shard (:class:`Follower`, whose scheduler is a :class:`FollowerScheduler` under every policy) holds the
updates it receives until a step of shard 0 names them (a model-parallel cluster's by its first member's part, as
every shard joins it: ``assembly``), then takes that step with those weights, making the same version, and answers
shard 0's discards as shard 0 did. Under ``sync`` this changes only when a shard's acks go; under the others it is
what makes the model one model.

* A follower that restarts (or reconnects) finds shard 0's retained message and takes the steps past what its own
  log recovered. News that leave a gap behind what it has (sent while it was away, after the retained message) are
  held until the next whole message fills it, within ``leader.WHOLE_EVERY_S``.
* A step naming an update the follower never got (its sender died between one shard's publish and the next's)
  waits ``ps.shard_wait_s``, then is taken without it; so is a step naming an update the follower refused (its
  rows were malformed or not finite here). Either part is counted (``shard_parts_missed``); the update, arriving
  later, is answered as shard 0 answered it and not applied.
* A model-parallel step of a replaced plan still joins here (shard 0 may have joined it before the plan reached
  it, while its last parts reached this shard after); one shard 0 discarded goes as it said (``Assembly.dismiss``).
* A follower further behind than the whole message's steps reach takes the oldest it can, its version jumping
  over the ones it cannot have (counted: ``shard_versions_skipped``, and logged).
* Under ``clip`` and ``krum`` it tells shard 0 its part of each update's squared norm and, under ``krum``, of its
  distance to every update it received before and has not stepped (a step's updates are all held at once until the
  step): ``ShardNorms`` on ``shard/{i}/norms``. Shard 0 keeps none of these parts: a resent update (its sender had
  no ack: shard 0 may have been down) has the follower tell it again.
* A step record names shard 0's rule, and the follower combines with it (``median`` and ``trimmed-mean`` work per
  coordinate, so each shard's rows come out as one process's would), even while a ``set-aggregation`` has yet to
  reach it; the updates shard 0 left out (Krum's, or refused by norm) it leaves out too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from edgemesh.common.bus import Bus
from edgemesh.common.messages import (
    GradientUpdate,
    NormPart,
    PairPart,
    Plan,
    ShardNorms,
    ShardSteps,
    StepDiscard,
    StepPart,
    StepRecord,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.common.vocabulary import AggregationRule, SyncPolicy
from edgemesh.services.parameter_server.optimizer import ShardGrad
from edgemesh.services.parameter_server.robust import Combined, pair_squared, squared
from edgemesh.services.parameter_server.scheduler import (
    SCHEDULERS,
    Ack,
    Candidate,
    Clock,
    Decision,
    Fleet,
    Scheduler,
    Step,
    UpdateId,
)
from edgemesh.services.parameter_server.shards.role import SchedulerFactory
from edgemesh.services.parameter_server.shards.sharded import Sharded

if TYPE_CHECKING:
    from edgemesh.common.broadcast import Broadcaster
    from edgemesh.services.parameter_server.assembly import Assembly
    from edgemesh.services.parameter_server.evaluation import Evaluator

logger = logging.getLogger(__name__)

REMEMBERED = 4096
"""Updates a follower remembers as discarded, missed or refused (a resend of one is answered at once)."""
MEASURED = 256
"""Updates a follower keeps measured until a step takes them (``krum``'s distances: a round of as many)."""


class Follower(Sharded):
    """A shard other than 0: its scheduler takes shard 0's steps, and it tells shard 0 its part of the norms."""

    decides = False  # shard 0 evaluates the whole model and publishes the sync state

    def __init__(self, topics: Topics, wake: Callable[[], None], shard: int, shards: int, wait_s: float,
                 metrics: ServiceMetrics, clock: Clock) -> None:
        super().__init__(topics, shard, shards)
        self.wake = wake
        self.steps = FollowerScheduler(clock, wait_s, metrics)
        self.bus: Bus | None = None
        self.assembly: Assembly | None = None
        """The model-parallel steps waiting here: those shard 0 discarded go as it said."""
        self._sending: set[asyncio.Task[int]] = set()

    # ------------------------------------------------------------------ construction and start
    def take_part(self, model: dict[str, np.ndarray], *, broadcast: Broadcaster, assembly: Assembly,
                  evaluator: Evaluator, plan: Callable[[], Plan | None]) -> dict[str, np.ndarray]:
        """``Sharded.take_part``; no evaluation here (shard 0 evaluates the whole model)."""
        evaluator.enabled = False
        assembly.follows = True  # shard 0's step records decide a step of a replaced plan
        self.assembly = assembly
        return super().take_part(model, broadcast=broadcast, assembly=assembly, evaluator=evaluator, plan=plan)

    def scheduler(self, policy: SyncPolicy, carry: Sequence[Candidate], make: SchedulerFactory) -> Scheduler:
        """Shard 0's steps, whatever the policy (the updates it holds stay with it)."""
        return self.steps

    def resume(self, kept: Mapping[str, Any], replayed: Sequence[StepRecord]) -> None:
        pass  # shard 0's retained message has its latest steps

    def kept(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ the bus
    def attach(self, bus: Bus) -> None:
        """Follow shard 0's steps, waking the step loop at each."""
        self.bus = bus

        async def steps(message: ShardSteps, _: TopicMatch) -> None:
            self.steps.follow(message)
            if self.assembly is not None and message.discards:
                self.assembly.dismiss(message.discards)
            self.wake()

        bus.route(self.topics.steps_filter(), ShardSteps, steps)

    # ------------------------------------------------------------------ an update
    async def arrived(self, update: GradientUpdate, grads: Sequence[ShardGrad], rule: AggregationRule) -> None:
        """Under ``clip`` and ``krum``, tell shard 0 this shard's part of ``update``'s norm (it clips by the whole's)
        and, under ``krum``, of its distance to every update measured before it and not yet stepped (it scores by
        the whole's). The distances are worked out on a thread; the message goes out without waiting for it."""
        if rule not in ("clip", "krum"):
            return
        measured = self.steps.measured
        earlier = list(measured.items()) if rule == "krum" else []
        # taken and joined at once on the event loop: of two updates at a time, the later one carries the pair
        measured[UpdateId.of(update)] = grads
        while len(measured) > MEASURED:
            measured.popitem(last=False)
        await self._tell(update, grads, earlier)

    async def resent(self, update: GradientUpdate, rule: AggregationRule) -> None:
        """``update`` came again while held here (its sender had no ack in time: shard 0 may have been down, and
        have lost what this shard told it): tell shard 0 its norm and, under ``krum``, its distance to every other
        update held here, again."""
        key = UpdateId.of(update)
        grads = self.steps.measured.get(key)
        if rule not in ("clip", "krum") or grads is None:
            return
        others = [(k, g) for k, g in self.steps.measured.items() if k != key] if rule == "krum" else []
        await self._tell(update, grads, others)

    async def _tell(self, update: GradientUpdate, grads: Sequence[ShardGrad],
                    others: Sequence[tuple[UpdateId, Sequence[ShardGrad]]]) -> None:
        if self.bus is None:
            return

        def part() -> NormPart:
            return NormPart(device=update.device, incarnation=update.incarnation, seq=update.seq,
                            squared=squared(grads), pairs=tuple(
                                PairPart(device=k.device, incarnation=k.incarnation, seq=k.seq,
                                         squared=pair_squared(grads, other)) for k, other in others))

        message = ShardNorms(shard=self.shard, parts=(await asyncio.to_thread(part),))
        task = asyncio.create_task(self.bus.publish(self.topics.norms(), message, kind="norms"))
        self._sending.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[int]) -> None:
        self._sending.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:  # shard 0 waits, then goes without
            logger.warning("a norm for shard 0 not published: %s", exc)

    def answered(self, ack: Ack) -> None:
        self.steps.answered(ack)

    # ------------------------------------------------------------------ a step: shard 0 decided it
    async def elsewhere(self, steps: Sequence[Step], rule: AggregationRule) -> list[list[float]]:
        return [[] for _ in steps]

    def stepped(self, steps: Sequence[Step], combined: Sequence[Combined]) -> None:
        pass  # shard 0 logged them first

    def publish(self, version: int, policy: SyncPolicy) -> None:
        pass

    async def whole_model(self, version: int, params: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        return params


class FollowerScheduler(Scheduler):
    """A follower's scheduler, under every policy: it takes shard 0's steps (see the module's docstring)."""

    policy = "sync"  # what it reports; shard 0's decides

    def __init__(self, clock: Clock, wait_s: float, metrics: ServiceMetrics) -> None:
        super().__init__(clock)
        self.wait_s = wait_s
        self.held: dict[UpdateId, Candidate] = {}
        self.records: dict[int, StepRecord] = {}
        """Shard 0's steps past this shard's version, by version."""
        self.kept_from: int | None = None
        """The oldest version shard 0 still keeps, from its last whole message (None: none yet)."""
        self.settled: OrderedDict[UpdateId, Ack] = OrderedDict()
        """Updates shard 0 discarded, or that this shard missed or refused: how a late or resent one is answered."""
        self.refused: OrderedDict[UpdateId, None] = OrderedDict()
        """Updates this shard refused (their rows did not decode here): a step naming one does not wait for it."""
        self.resync = False
        self.measured: OrderedDict[UpdateId, Sequence[ShardGrad]] = OrderedDict()
        """Under ``clip`` and ``krum``: the updates this shard measured for shard 0 (``Follower.arrived``) and has not
        stepped, discarded or refused (under ``krum`` a newcomer's message carries its distances to them; a resent
        one's are told again)."""
        self._waiting_since: float | None = None
        self._answers: list[Ack] = []
        self.m_missed = metrics.counter("shard_parts_missed", "Updates shard 0 applied that this shard did not have "
                                        "in time (or refused): its steps took them without")
        self.m_skipped = metrics.counter("shard_versions_skipped", "Versions of shard 0 this shard could not take "
                                         "(further behind than shard 0's retained steps reach)")

    def follow(self, message: ShardSteps) -> None:
        """Shard 0's news, or the whole of its latest steps and discards."""
        self.resync = SCHEDULERS[message.policy].resyncs
        steps = {r.version: r for r in message.steps if r.version > self.clock.version}
        if message.whole:  # every step shard 0 keeps: it replaces what came before (a retained message of an
            # earlier run of the job, say, whose steps this run's shard 0 does not have)
            self.records = steps
            self.kept_from = message.steps[0].version if message.steps else message.version + 1
        else:
            self.records.update(steps)
        for d in message.discards:
            key = UpdateId.of(d)
            if key in self.settled:
                continue
            held = self.held.pop(key, None)
            ack = Ack(held.update if held else _stand_in(d), "discarded", d.reason, d.delay, True)
            self._remember(key, ack)
            self.measured.pop(key, None)
            if held is not None:
                self._answers.append(ack)

    def answered(self, ack: Ack) -> None:
        """Every ack this shard sends: an update it discarded (its rows malformed or not finite here, say) is one a
        step of shard 0 takes without, at once."""
        if ack.status != "discarded":
            return
        key = UpdateId.of(ack.update)
        self.refused[key] = None
        self.measured.pop(key, None)
        while len(self.refused) > REMEMBERED:
            self.refused.popitem(last=False)

    def take(self, batch: Sequence[Candidate], fleet: Fleet) -> Decision:
        out = Decision(acks=self._answers)
        self._answers = []
        for item in batch:
            key = UpdateId.of(item.update)
            if key in self.settled:  # discarded by shard 0, or missed here: answered as before
                ack = self.settled[key]
                out.acks += [Ack(part, ack.status, ack.reason, ack.delay, ack.resync) for part in item.updates]
            else:
                self.held[key] = item
        for key, item in list(self.held.items()):
            if self.clock.seen(item.update):  # its sender has moved on (a later update of it was applied)
                del self.held[key]
                self.measured.pop(key, None)
                out.acks += [Ack(part, "duplicate") for part in item.updates]
        version = self.clock.version
        while (record := self._next(fleet.now, version)) is not None:
            self._take(record, out)
            version = record.version
        return out

    def pending(self) -> list[Candidate]:
        return list(self.held.values())

    def timeout(self, fleet: Fleet) -> float | None:
        if self._waiting_since is None:
            return None
        return max(0.0, self._waiting_since + self.wait_s - fleet.now)

    def _next(self, now: float, at: int) -> StepRecord | None:
        """Shard 0's step after version ``at``, once this shard holds every update it names (or waited enough)."""
        for old in [v for v in self.records if v <= at]:
            del self.records[old]
        if not self.records:
            return None
        version = min(self.records)
        if version > at + 1 and (self.kept_from is None or self.kept_from <= at + 1):
            return None  # the steps between were sent while this shard was away: the next whole message has them
        if version > at + 1:
            logger.error("versions %d to %d of shard 0 are not in its retained steps any more: this shard's rows "
                         "go without them", at + 1, version - 1)
            self.m_skipped.inc(version - 1 - at)
        record = self.records[version]
        missing = [p for p in record.parts if UpdateId.of(p) not in self.held and UpdateId.of(p) not in self.refused]
        if missing:
            if self._waiting_since is None:
                self._waiting_since = now
            if now - self._waiting_since < self.wait_s:
                return None
            logger.warning("version %d taken without %d of its updates, which did not arrive within "
                           "ps.shard_wait_s = %g s", version, len(missing), self.wait_s)
        self._waiting_since = None
        return record

    def _take(self, record: StepRecord, out: Decision) -> None:
        items: list[Candidate] = []
        weights: list[float] = []
        chosen: list[int] = []
        for part in record.parts:
            key = UpdateId.of(part)
            item = self.held.pop(key, None)
            self.measured.pop(key, None)
            if item is None:  # missed or refused here: a late copy is answered as shard 0 answered it
                self.m_missed.inc()
                self._remember(key, Ack(_stand_in(part), "accepted", "", 0, self.resync))
                continue
            if not part.excluded:
                chosen.append(len(items))
            items.append(item)
            weights.append(part.weight)
        # nothing of it here: a step of no update, which moves the version on and leaves the rows as they are;
        # under clip the weights carry shard 0's scales, under krum shard 0's choice is kept, and under every rule
        # the updates shard 0 refused by norm are left out
        step = Step(tuple(items), record.version, tuple(weights), "mean" if record.rule == "clip" else record.rule,
                    tuple(chosen) if record.rule == "krum" or len(chosen) < len(items) else None)
        self.clock.advance(step.items)
        out.steps.append(step)
        out.acks += [Ack(p, "accepted", "", step.delay(it), self.resync) for it in items for p in it.updates]

    def _remember(self, key: UpdateId, ack: Ack) -> None:
        self.settled[key] = ack
        while len(self.settled) > REMEMBERED:
            self.settled.popitem(last=False)


def _stand_in(part: StepPart | StepDiscard) -> GradientUpdate:
    """The update a step or discard names, for an ack to a copy of it that comes later."""
    return GradientUpdate(device=part.device, cluster="", incarnation=part.incarnation, seq=part.seq, base_version=0,
                          samples=1, shards=())
