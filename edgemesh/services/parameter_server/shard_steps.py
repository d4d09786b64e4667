"""The steps shard 0 of a sharded parameter server decides and every other shard takes: what keeps the policies
exact when the model's rows are split among processes (docs/scale.md#a-sharded-parameter-server).

Were each shard to run the policy on its own, the same updates reaching two shards in another order would be
judged differently: under ``async`` and ``ssp`` one shard would apply A then B and the other B then A, with other
delays, weights and verdicts; under ``adaptive`` a round's deadline would close on other updates at each shard.
So shard 0 (the :class:`Leader`) runs the policy, and once a step is in its log it publishes on ``shard/0/steps``
(:class:`ShardSteps`) what is new: the steps (the version each made, the updates it took and their weights) and
the discards since its last message. At most :data:`WHOLE_EVERY_S` after news, and whenever it (re)connects or a
message failed, it publishes the whole of what it keeps instead, retained: its latest steps and discards (news
cost only what is new to encode and decode; the whole, 64 steps, cost 3 ms at every step). Every other shard
(:class:`Follower`, its scheduler whatever the policy) holds the updates it receives until a step of shard 0
names them (a model-parallel cluster's by its first member's part, as every shard joins it: ``assembly``), then
takes that step with those weights, making the same version, and answers shard 0's discards as shard 0 did.
Under ``sync`` this changes only when a shard's acks go; under the others it is what makes the model one model.

* A follower that restarts (or reconnects) finds the retained message and takes the steps past what its own log
  recovered. News that leave a gap behind what it has (sent while it was away, after the retained message) are
  held until the next whole message fills it, within :data:`WHOLE_EVERY_S`. Shard 0 keeps its latest steps in its
  checkpoint (and its log has those since), and publishes them again when it starts: a step logged just before a
  crash is not lost to the others with the message it never sent.
* A step naming an update the follower never got (its sender died between one shard's publish and the next's)
  waits ``ps.shard_wait_s``, then is taken without it; so is a step naming an update the follower refused (its
  rows were malformed or not finite here). Either part is counted (``shard_parts_missed``); the update, arriving
  later, is answered as shard 0 answered it and not applied.
* A follower further behind than the whole message's steps reach takes the oldest it can, its version jumping
  over the ones it cannot have (counted: ``shard_versions_skipped``, and logged).
* Under ``clip`` every other shard tells shard 0 its part of each update's squared norm (:class:`ShardNorms` on
  ``shard/{i}/norms``, ``Follower.measured``); shard 0 waits for them (``Leader.elsewhere``), clips by the norm
  of the whole update, and its step records carry each weight times its clip factor, which the others sum with.
* Under ``krum`` every other shard also tells shard 0, with each update, its part of the squared distance to
  every update it received before and has not stepped (a step's updates are all held at once until the step);
  shard 0 waits for every pair of a step's updates, scores them over the whole model, and marks the updates
  Krum left out in its step record: the others average the rest, as it did. Shard 0 keeps none of these parts:
  a resent update (its sender had no ack: shard 0 may have been down) has the others tell it again
  (``Follower.remeasured``).
* An update shard 0's norm filter refused (every rule but ``clip``; it judges the norm of the update's rows it
  holds, the others do not send theirs) is marked left out in its step record, as Krum's are: the others leave it
  out too.
* A step record names shard 0's rule, and the others combine with it (``median`` and ``trimmed-mean`` work per
  coordinate, so each shard's rows come out as one process's would), even while a ``set-aggregation`` has yet
  to reach them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from edgemesh.common.bus import Bus
from edgemesh.common.errors import WireError
from edgemesh.common.messages import (
    GradientUpdate,
    NormPart,
    PairPart,
    ShardNorms,
    ShardSteps,
    StepDiscard,
    StepPart,
    StepRecord,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.common.vocabulary import AGGREGATION_RULES, AggregationRule, SyncPolicy
from edgemesh.services.parameter_server.acks import Key, key_of
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
)

logger = logging.getLogger(__name__)

KEPT_STEPS = 64
"""Steps the retained message holds: a follower that many versions behind still catches up exactly."""
WHOLE_EVERY_S = 0.5
"""Longest lag of shard 0's retained message (all its kept steps) behind its news: a (re)started follower's wait."""
KEPT_PARTS = 2048
"""Most updates those steps name in all (64 clusters' rounds would otherwise make every message 250 kB)."""
KEPT_DISCARDS = 256
"""Discards the retained message holds: a restarted follower still answers the recent ones."""
REMEMBERED = 4096
"""Keys a follower remembers as discarded, missed or refused (a resend of one is answered at once)."""
KEPT_PAIRS = 65536
"""Pairs' distances shard 0 keeps under ``krum`` (a round of 256 updates has 32,640)."""
MEASURED = 256
"""Updates a follower keeps measured until a step takes them (``krum``'s distances: a round of as many)."""


def _key(part: StepPart | StepDiscard | NormPart | PairPart) -> Key:
    return part.device, part.incarnation, part.seq


def _pair(a: Key, b: Key) -> tuple[Key, Key]:
    return (a, b) if a <= b else (b, a)


class Leader:
    """Shard 0: the steps and discards it publishes for the other shards."""

    def __init__(self, topics: Topics, wake: Callable[[], None], shards: int, wait_s: float,
                 metrics: ServiceMetrics) -> None:
        self.topics, self.wake, self.shards, self.wait_s = topics, wake, shards, wait_s
        self.steps: deque[StepRecord] = deque()
        self.partials: OrderedDict[Key, dict[int, float]] = OrderedDict()
        """Under ``clip``: each update's squared norm over the other shards' rows, by shard (``ShardNorms``)."""
        self.pairs: OrderedDict[tuple[Key, Key], dict[int, float]] = OrderedDict()
        """Under ``krum``: the squared distance of two updates over the other shards' rows, by shard."""
        self._arrived = asyncio.Event()
        self.m_unmeasured = metrics.counter(
            "shard_norms_missing", "Updates clip judged without another shard's part of their norm, or pairs of "
            "updates Krum judged without another shard's part of their distance (not in within ps.shard_wait_s)")
        self.discards: OrderedDict[Key, StepDiscard] = OrderedDict()
        self.owed = False
        """A discard or step not yet published."""
        self.whole_owed = True
        """The next message is the whole of what is kept, retained (the first, after a connect, news lost)."""
        self.bus: Bus | None = None
        self._news: list[StepRecord] = []
        self._news_discards: list[StepDiscard] = []
        self._whole_timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[int]] = set()

    def attach(self, bus: Bus) -> None:
        """Publish on ``bus``; after every (re)connect again (a restarted broker lost the retained message). The
        step loop sends it: the service wakes it on connect."""
        self.bus = bus

        async def connected() -> None:
            self.owed = self.whole_owed = True

        async def measured(message: ShardNorms, match: TopicMatch) -> None:
            if not 0 < match.shard < self.shards or message.shard != match.shard:
                raise WireError(f"norms of shard {message.shard} on shard {match.shard}'s topic", "field")
            for part in message.parts:
                self.partials.setdefault(_key(part), {})[match.shard] = part.squared
                self.partials.move_to_end(_key(part))
                for pair in part.pairs:
                    both = _pair(_key(part), _key(pair))
                    self.pairs.setdefault(both, {})[match.shard] = pair.squared
                    self.pairs.move_to_end(both)
            while len(self.partials) > REMEMBERED:
                self.partials.popitem(last=False)
            while len(self.pairs) > KEPT_PAIRS:
                self.pairs.popitem(last=False)
            self._arrived.set()

        bus.on_connect(connected)
        bus.route(self.topics.norms_filter(), ShardNorms, measured)

    async def elsewhere(self, steps: Sequence[Step], rule: AggregationRule) -> list[list[float]]:
        """What ``rule`` judges the whole updates by, over the other shards' rows, once every shard told it
        (waiting up to ``wait_s`` in all; a part still missing counts as 0, and is counted): under ``clip`` each
        contribution's squared norm, under ``krum`` the squared distance of every pair of a step's contributions
        (``Aggregation.elsewhere``); nothing under the other rules."""
        table: OrderedDict[Any, dict[int, float]]
        keys: list[list[list[Any]]]  # per step, per contribution (clip) or pair (krum): the table's keys to sum
        if rule == "clip":
            table = self.partials
            keys = [[[key_of(item.update)] for item in step.items] for step in steps]  # a cluster's: as joined
        elif rule == "krum":
            table = self.pairs
            keys = [[[_pair(key_of(a.update), key_of(b.update))]
                     for a, b in itertools.combinations(step.items, 2)] if len(step.items) > 2 else []  # noqa: PLR2004
                    for step in steps]  # Krum takes every one of two or fewer: no distance needed
        else:
            return []
        others = set(range(1, self.shards))

        def missing() -> list[Any]:
            return [k for step in keys for item in step for k in item if set(table.get(k, ())) < others]

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.wait_s):
                while missing():
                    self._arrived.clear()
                    await self._arrived.wait()
        if lacking := missing():
            logger.warning("%s judged %d %s without every shard's part of them", rule, len(lacking),
                           "updates' norms" if rule == "clip" else "pairs of updates' distances")
            self.m_unmeasured.inc(len(lacking))
        return [[sum((sum(table.get(k, {}).values(), 0.0) for k in item), 0.0) for item in step] for step in keys]

    def resume(self, kept: object, replayed: Sequence[StepRecord]) -> None:
        """The steps a checkpoint kept (``kept()``) and those replayed from the log after it: published again at
        the first chance, for a shard that missed them while this one was down."""
        records = [StepRecord(version=int(v), parts=tuple(
            StepPart(device=str(d), incarnation=int(i), seq=int(q), weight=float(w), excluded=excluded == [True])
            for d, i, q, w, *excluded in parts), rule=_rule(rule[0] if rule else "mean"))
            for v, parts, *rule in (kept if isinstance(kept, list) else [])]
        self._keep([*records, *replayed])
        self.owed = True  # even none: the retained message may be an earlier run's, which the others must not take

    def kept(self) -> list[list[object]]:
        """The steps to keep in a checkpoint."""
        return [[r.version, [[p.device, p.incarnation, p.seq, p.weight, p.excluded] for p in r.parts], r.rule]
                for r in self.steps]

    def stepped(self, steps: Sequence[Step], combined: Sequence[Combined] = ()) -> None:
        """``steps`` are in the log: the other shards take them next (``publish`` sends them). ``combined``: what
        the rule made of each (``clip``'s scales, ``krum``'s choice; none: each a ``mean``)."""
        records = []
        for step, c in zip(steps, combined or [Combined([])] * len(steps), strict=True):
            factors = c.scales or [1.0] * len(step.items)
            chosen = set(range(len(step.items)) if c.how.chosen is None else c.how.chosen)
            parts = enumerate(zip(step.items, step.weights, factors, strict=True))  # a cluster's: its first member's
            records.append(record_of(step.version, [(it.update, w * f, i not in chosen) for i, (it, w, f) in parts],
                                     rule=c.how.rule))
        self._keep(records)

    def _keep(self, records: Sequence[StepRecord]) -> None:
        self.steps.extend(records)
        self._news.extend(records)
        while len(self.steps) > KEPT_STEPS or (len(self.steps) > 1 and
                                                sum(len(s.parts) for s in self.steps) > KEPT_PARTS):
            self.steps.popleft()
        self.owed = self.owed or bool(records)

    def answered(self, ack: Ack) -> None:
        """Every ack this shard sends: its discards are the other shards' too."""
        if ack.status != "discarded":
            return
        u = ack.update
        self.discards[key_of(u)] = StepDiscard(device=u.device, incarnation=u.incarnation, seq=u.seq,
                                               reason=ack.reason, delay=max(0, ack.delay))
        self.discards.move_to_end(key_of(u))
        while len(self.discards) > KEPT_DISCARDS:
            self.discards.popitem(last=False)
        self._news_discards.append(self.discards[key_of(u)])
        self.owed = True
        self.wake()

    def publish(self, version: int, policy: SyncPolicy) -> None:
        """Send what is new since the last message, or the whole of what is kept (retained) when that is owed; in
        order behind the previous send (one connection keeps it), without waiting here for the broker."""
        if not self.owed or self.bus is None:
            return
        self.owed = False
        whole = self.whole_owed
        if whole:
            message = ShardSteps(version=version, policy=policy, steps=tuple(self.steps),
                                 discards=tuple(self.discards.values()))
            self.whole_owed = False
            if self._whole_timer is not None:
                self._whole_timer.cancel()
                self._whole_timer = None
        else:  # the retained message follows within WHOLE_EVERY_S, for a shard that (re)subscribes meanwhile
            message = ShardSteps(version=version, policy=policy, steps=tuple(self._news),
                                 discards=tuple(self._news_discards), whole=False)
            if self._whole_timer is None:
                self._whole_timer = asyncio.get_running_loop().call_later(WHOLE_EVERY_S, self._whole_due)
        self._news, self._news_discards = [], []
        task = asyncio.create_task(self.bus.publish(self.topics.steps(), message, retain=whole, kind="steps"))
        self._sending.add(task)
        task.add_done_callback(self._sent)

    def _whole_due(self) -> None:
        self._whole_timer = None
        self.owed = self.whole_owed = True
        self.wake()

    def _sent(self, task: asyncio.Task[int]) -> None:
        self._sending.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.warning("shard 0's steps not published: %s", exc)
            self.owed = self.whole_owed = True  # the next step or discard sends everything kept


class Follower(Scheduler):
    """A shard other than 0, under every policy: it takes shard 0's steps (see the module's docstring)."""

    policy = "sync"  # what it reports; shard 0's decides

    def __init__(self, clock: Clock, wait_s: float, metrics: ServiceMetrics) -> None:
        super().__init__(clock)
        self.wait_s = wait_s
        self.held: dict[Key, Candidate] = {}
        self.records: dict[int, StepRecord] = {}
        """Shard 0's steps past this shard's version, by version."""
        self.kept_from: int | None = None
        """The oldest version shard 0 still keeps, from its last whole message (None: none yet)."""
        self.settled: OrderedDict[Key, Ack] = OrderedDict()
        """Updates shard 0 discarded, or that this shard missed or refused: how a late or resent one is answered."""
        self.refused: OrderedDict[Key, None] = OrderedDict()
        """Updates this shard refused (their rows did not decode here): a step naming one does not wait for it."""
        self.resync = False
        self.bus: Bus | None = None
        self.topics: Topics | None = None
        self._sending: set[asyncio.Task[int]] = set()
        self._waiting_since: float | None = None
        self._answers: list[Ack] = []
        self._measured: OrderedDict[Key, Sequence[ShardGrad]] = OrderedDict()
        """Under ``clip`` and ``krum``: the updates measured and not yet stepped (under ``krum`` a newcomer's message
        carries its distances to them; a resent one's are told again)."""
        self.m_missed = metrics.counter("shard_parts_missed", "Updates shard 0 applied that this shard did not have "
                                        "in time (or refused): its steps took them without")
        self.m_skipped = metrics.counter("shard_versions_skipped", "Versions of shard 0 this shard could not take "
                                         "(further behind than shard 0's retained steps reach)")

    # ------------------------------------------------------------------ from shard 0 and from this shard
    def attach(self, bus: Bus, topics: Topics, wake: Callable[[], None]) -> None:
        """Follow shard 0's steps, ``wake`` the step loop at each."""
        self.bus, self.topics = bus, topics

        async def steps(message: ShardSteps, _: TopicMatch) -> None:
            self.follow(message)
            wake()

        bus.route(topics.steps_filter(), ShardSteps, steps)

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
            key = _key(d)
            if key in self.settled:
                continue
            held = self.held.pop(key, None)
            ack = Ack(held.update if held else _stand_in(d), "discarded", d.reason, d.delay, True)
            self._remember(key, ack)
            self._measured.pop(key, None)
            if held is not None:
                self._answers.append(ack)

    async def measured(self, update: GradientUpdate, grads: Sequence[ShardGrad], rule: AggregationRule) -> None:
        """Under ``clip`` and ``krum``, tell shard 0 this shard's part of ``update``'s norm (it clips by the whole's)
        and, under ``krum``, of its distance to every update measured before it and not yet stepped (it scores by
        the whole's). The distances are worked out on a thread; the message goes out without waiting for it."""
        if rule not in ("clip", "krum"):
            return
        earlier = list(self._measured.items()) if rule == "krum" else []
        # taken and joined at once on the event loop: of two updates at a time, the later one carries the pair
        self._measured[key_of(update)] = grads
        while len(self._measured) > MEASURED:
            self._measured.popitem(last=False)
        await self._tell(update, grads, earlier)

    async def remeasured(self, update: GradientUpdate, rule: AggregationRule) -> None:
        """``update`` came again while held here (its sender had no ack in time: shard 0 may have been down, and
        have lost what this shard told it): tell shard 0 its norm and, under ``krum``, its distance to every other
        update held here, again."""
        grads = self._measured.get(key_of(update))
        if rule not in ("clip", "krum") or grads is None:
            return
        others = [(k, g) for k, g in self._measured.items() if k != key_of(update)] if rule == "krum" else []
        await self._tell(update, grads, others)

    async def _tell(self, update: GradientUpdate, grads: Sequence[ShardGrad],
                    others: Sequence[tuple[Key, Sequence[ShardGrad]]]) -> None:
        if self.bus is None or self.topics is None or self.topics.shard is None:
            return

        def part() -> NormPart:
            return NormPart(device=update.device, incarnation=update.incarnation, seq=update.seq,
                            squared=squared(grads), pairs=tuple(
                                PairPart(device=k[0], incarnation=k[1], seq=k[2], squared=pair_squared(grads, other))
                                for k, other in others))

        message = ShardNorms(shard=self.topics.shard, parts=(await asyncio.to_thread(part),))
        task = asyncio.create_task(self.bus.publish(self.topics.norms(), message, kind="norms"))
        self._sending.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[int]) -> None:
        self._sending.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:  # shard 0 waits, then goes without
            logger.warning("a norm for shard 0 not published: %s", exc)

    def answered(self, ack: Ack) -> None:
        """Every ack this shard sends: an update it discarded (its rows malformed or not finite here, say) is one
        a step of shard 0 takes without, here."""
        if ack.status != "discarded":
            return
        self.refused[key_of(ack.update)] = None
        self._measured.pop(key_of(ack.update), None)
        while len(self.refused) > REMEMBERED:
            self.refused.popitem(last=False)

    # ------------------------------------------------------------------ the scheduler's part
    def take(self, batch: Sequence[Candidate], fleet: Fleet) -> Decision:
        out = Decision(acks=self._answers)
        self._answers = []
        for item in batch:
            key = key_of(item.update)
            if key in self.settled:  # discarded by shard 0, or missed here: answered as before
                ack = self.settled[key]
                out.acks += [Ack(part, ack.status, ack.reason, ack.delay, ack.resync) for part in item.updates]
            else:
                self.held[key] = item
        for key, item in list(self.held.items()):
            if self.clock.seen(item.update):  # its sender has moved on (a later update of it was applied)
                del self.held[key]
                self._measured.pop(key, None)
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
        missing = [p for p in record.parts if _key(p) not in self.held and _key(p) not in self.refused]
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
            key = _key(part)
            item = self.held.pop(key, None)
            self._measured.pop(key, None)
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

    def _remember(self, key: Key, ack: Ack) -> None:
        self.settled[key] = ack
        while len(self.settled) > REMEMBERED:
            self.settled.popitem(last=False)


def record_of(version: int, parts: Sequence[tuple[GradientUpdate, float, bool]], *,
              rule: AggregationRule = "mean") -> StepRecord:
    """The step that made ``version`` of ``(update, weight, excluded)`` ``parts`` under ``rule``, as shard 0
    publishes it."""
    return StepRecord(version=version, rule=rule, parts=tuple(
        StepPart(device=u.device, incarnation=u.incarnation, seq=u.seq, weight=w, excluded=excluded)
        for u, w, excluded in parts))


def _rule(kept: object) -> AggregationRule:
    """A rule a checkpoint kept with a step (an earlier version kept whether ``clip`` scaled it)."""
    if kept is True:
        return "clip"
    return next((r for r in AGGREGATION_RULES if r == kept), "mean")


def _stand_in(part: StepPart | StepDiscard) -> GradientUpdate:
    """The update a step or discard names, for an ack to a copy of it that comes later."""
    return GradientUpdate(device=part.device, cluster="", incarnation=part.incarnation, seq=part.seq, base_version=0,
                          samples=1, shards=())

