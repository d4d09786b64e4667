"""Shard 0 of a sharded parameter server: it runs the policy for every shard and publishes the steps it takes, which
the others follow (docs/scale.md#a-sharded-parameter-server).

Once a step is in its log, shard 0 publishes on ``shard/0/steps`` (:class:`ShardSteps`) what is new: the steps (the
version each made, the updates it took and their weights) and the discards since its last message. At most
:data:`WHOLE_EVERY_S` after news, and whenever it (re)connects or a message failed, it publishes the whole of what it
keeps instead, retained: its latest steps and discards (news cost only what is new to encode and decode; the whole,
64 steps, cost 3 ms at every step). It keeps its latest steps in its checkpoint, as :class:`StepRecord` maps (and its
log has those since), and publishes them again when it starts: a step logged just before a crash is not lost to the
others with the message it never sent. A checkpoint of an earlier version kept them as lists: read all the same.

* Under ``clip`` every other shard tells shard 0 its part of each update's squared norm (``ShardNorms`` on
  ``shard/{i}/norms``); shard 0 waits for them (``Leader.elsewhere``), clips by the norm of the whole update, and
  its step records carry each weight times its clip factor, which the others sum with.
* Under ``krum`` the others also tell it their part of the squared distance between every two updates they hold;
  shard 0 scores a step's updates over the whole model and marks those Krum left out in its step record.
* An update shard 0's norm filter refused is marked left out in its step record too, and a record names shard 0's
  rule, which the others combine with.
* It evaluates the whole model: its own rows and every other shard's broadcast at the same version (``peers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np

from edgemesh.common.bus import Bus
from edgemesh.common.errors import CheckpointError, WireError
from edgemesh.common.messages import (
    GradientUpdate,
    Plan,
    ShardNorms,
    ShardSteps,
    StepDiscard,
    StepPart,
    StepRecord,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.common.vocabulary import AGGREGATION_RULES, AggregationRule, SyncPolicy
from edgemesh.services.parameter_server.optimizer import ShardGrad
from edgemesh.services.parameter_server.peers import Peers
from edgemesh.services.parameter_server.robust import Combined
from edgemesh.services.parameter_server.scheduler import Ack, Candidate, Scheduler, Step, UpdateId
from edgemesh.services.parameter_server.shards.role import SchedulerFactory
from edgemesh.services.parameter_server.shards.sharded import Sharded

if TYPE_CHECKING:
    from edgemesh.common.broadcast import Broadcaster
    from edgemesh.services.parameter_server.assembly import Assembly
    from edgemesh.services.parameter_server.evaluation import Evaluator

logger = logging.getLogger(__name__)

KEPT_STEPS = 64
"""Steps the retained message holds: a follower that many versions behind still catches up exactly."""
WHOLE_EVERY_S = 0.5
"""Longest lag of shard 0's retained message (all its kept steps) behind its news: a (re)started follower's wait."""
KEPT_PARTS = 2048
"""Most updates those steps name in all (64 clusters' rounds would otherwise make every message 250 kB)."""
KEPT_DISCARDS = 256
"""Discards the retained message holds: a restarted follower still answers the recent ones."""
KEPT_NORMS = 4096
"""Updates whose norm parts shard 0 keeps under ``clip``."""
KEPT_PAIRS = 65536
"""Pairs' distances shard 0 keeps under ``krum`` (a round of 256 updates has 32,640)."""
CHECKPOINT_KEY = "shard_steps"
"""Where the checkpoint's settings keep shard 0's latest steps."""

Pair = tuple[UpdateId, UpdateId]


def pair(a: UpdateId, b: UpdateId) -> Pair:
    """Two updates, in the one order either shard names them in."""
    return (a, b) if a <= b else (b, a)


class Leader(Sharded):
    """Shard 0: the steps and discards it publishes for the other shards, and what they tell it of their rows."""

    decides = True

    def __init__(self, topics: Topics, wake: Callable[[], None], shards: int, wait_s: float,
                 metrics: ServiceMetrics) -> None:
        super().__init__(topics, 0, shards)
        self.wake, self.wait_s = wake, wait_s
        self.steps: deque[StepRecord] = deque()
        self.partials: OrderedDict[UpdateId, dict[int, float]] = OrderedDict()
        """Under ``clip``: each update's squared norm over the other shards' rows, by shard (``ShardNorms``)."""
        self.pairs: OrderedDict[Pair, dict[int, float]] = OrderedDict()
        """Under ``krum``: the squared distance of two updates over the other shards' rows, by shard."""
        self.peers = Peers(shards)
        """Every other shard's broadcast, to evaluate the whole model."""
        self._arrived = asyncio.Event()
        self.m_unmeasured = metrics.counter(
            "shard_norms_missing", "Updates clip judged without another shard's part of their norm, or pairs of "
            "updates Krum judged without another shard's part of their distance (not in within ps.shard_wait_s)")
        self.discards: OrderedDict[UpdateId, StepDiscard] = OrderedDict()
        self.owed = False
        """A discard or step not yet published."""
        self.whole_owed = True
        """The next message is the whole of what is kept, retained (the first, after a connect, news lost)."""
        self.bus: Bus | None = None
        self._news: list[StepRecord] = []
        self._news_discards: list[StepDiscard] = []
        self._whole_timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[int]] = set()

    # ------------------------------------------------------------------ construction and start
    def take_part(self, model: dict[str, np.ndarray], *, broadcast: Broadcaster, assembly: Assembly,
                  evaluator: Evaluator, plan: Callable[[], Plan | None]) -> dict[str, np.ndarray]:
        """``Sharded.take_part``; the evaluator evaluates the whole model, put together from the others' rows."""
        self.peers.know({name: v.shape for name, v in model.items()})
        evaluator.assemble = self.peers.whole_model
        return super().take_part(model, broadcast=broadcast, assembly=assembly, evaluator=evaluator, plan=plan)

    def scheduler(self, policy: SyncPolicy, carry: Sequence[Candidate], make: SchedulerFactory) -> Scheduler:
        return make(policy, carry)

    def resume(self, kept: Mapping[str, Any], replayed: Sequence[StepRecord]) -> None:
        """The steps a checkpoint kept (``kept()``) and those replayed from the log after it: published again at
        the first chance, for a shard that missed them while this one was down."""
        steps = kept.get(CHECKPOINT_KEY)
        self._keep([*(kept_step(step) for step in (steps if isinstance(steps, list) else [])), *replayed])
        self.owed = True  # even none: the retained message may be an earlier run's, which the others must not take

    def kept(self) -> dict[str, Any]:
        """The steps to keep in a checkpoint, each a :class:`StepRecord` as a map."""
        return {CHECKPOINT_KEY: [asdict(record) for record in self.steps]}

    # ------------------------------------------------------------------ the bus
    def attach(self, bus: Bus) -> None:
        """Publish on ``bus``; after every (re)connect again (a restarted broker lost the retained message). The
        step loop sends it: the service wakes it on connect. Hear the other shards' norms, and follow their
        broadcasts (``peers``)."""
        self.bus = bus

        async def connected() -> None:
            self.owed = self.whole_owed = True

        bus.on_connect(connected)
        bus.route(self.topics.norms_filter(), ShardNorms, self._measured)
        self.peers.attach(bus, self.topics)

    async def _measured(self, message: ShardNorms, match: TopicMatch) -> None:
        if not 0 < match.shard < self.shards or message.shard != match.shard:
            raise WireError(f"norms of shard {message.shard} on shard {match.shard}'s topic", "field")
        for part in message.parts:
            key = UpdateId.of(part)
            self.partials.setdefault(key, {})[match.shard] = part.squared
            self.partials.move_to_end(key)
            for other in part.pairs:
                both = pair(key, UpdateId.of(other))
                self.pairs.setdefault(both, {})[match.shard] = other.squared
                self.pairs.move_to_end(both)
        while len(self.partials) > KEPT_NORMS:
            self.partials.popitem(last=False)
        while len(self.pairs) > KEPT_PAIRS:
            self.pairs.popitem(last=False)
        self._arrived.set()

    # ------------------------------------------------------------------ an update: shard 0 judges it itself
    async def arrived(self, update: GradientUpdate, grads: Sequence[ShardGrad], rule: AggregationRule) -> None:
        pass

    async def resent(self, update: GradientUpdate, rule: AggregationRule) -> None:
        pass

    def answered(self, ack: Ack) -> None:
        """Every ack this shard sends: its discards are the other shards' too."""
        if ack.status != "discarded":
            return
        u, key = ack.update, UpdateId.of(ack.update)
        self.discards[key] = StepDiscard(device=u.device, incarnation=u.incarnation, seq=u.seq, reason=ack.reason,
                                         delay=max(0, ack.delay))
        self.discards.move_to_end(key)
        while len(self.discards) > KEPT_DISCARDS:
            self.discards.popitem(last=False)
        self._news_discards.append(self.discards[key])
        self.owed = True
        self.wake()

    # ------------------------------------------------------------------ a step
    async def elsewhere(self, steps: Sequence[Step], rule: AggregationRule) -> list[list[float]]:
        """What ``rule`` judges the whole updates by, over the other shards' rows, once every shard told it
        (waiting up to ``wait_s`` in all; a part still missing counts as 0, and is counted): under ``clip`` each
        contribution's squared norm, under ``krum`` the squared distance of every pair of a step's contributions
        (``Aggregation.elsewhere``); nothing under the other rules."""
        table: OrderedDict[Any, dict[int, float]]
        keys: list[list[list[Any]]]  # per step, per contribution (clip) or pair (krum): the table's keys to sum
        if rule == "clip":
            table = self.partials
            keys = [[[UpdateId.of(item.update)] for item in step.items] for step in steps]  # a cluster's: as joined
        elif rule == "krum":
            table = self.pairs
            keys = [[[pair(UpdateId.of(a.update), UpdateId.of(b.update))]
                     for a, b in itertools.combinations(step.items, 2)] if len(step.items) > 2 else []  # noqa: PLR2004
                    for step in steps]  # Krum takes every one of two or fewer: no distance needed
        else:
            return [[] for _ in steps]
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

    def stepped(self, steps: Sequence[Step], combined: Sequence[Combined] = ()) -> None:
        """``steps`` are in the log: the other shards take them next (``publish`` sends them). ``combined``: what
        the rule made of each (``clip``'s scales, ``krum``'s choice, the round's measured gain; none: each a
        ``mean``)."""
        records = []
        for step, c in zip(steps, combined or [Combined([])] * len(steps), strict=True):
            factors = c.scales or [1.0] * len(step.items)
            chosen = set(range(len(step.items)) if c.how.chosen is None else c.how.chosen)
            parts = enumerate(zip(step.items, step.weights, factors, strict=True))  # a cluster's: its first member's
            records.append(record_of(step.version, [(it.update, w * f * c.how.gain, i not in chosen)
                                                    for i, (it, w, f) in parts],
                                     rule=c.how.rule))
        self._keep(records)

    def _keep(self, records: Sequence[StepRecord]) -> None:
        self.steps.extend(records)
        self._news.extend(records)
        while len(self.steps) > KEPT_STEPS or (len(self.steps) > 1 and
                                                sum(len(s.parts) for s in self.steps) > KEPT_PARTS):
            self.steps.popleft()
        self.owed = self.owed or bool(records)

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

    async def whole_model(self, version: int, params: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Its rows and every other shard's, from their broadcasts once they reach ``version``."""
        return await self.peers.whole_model(version, params)


def record_of(version: int, parts: Sequence[tuple[GradientUpdate, float, bool]], *,
              rule: AggregationRule = "mean") -> StepRecord:
    """The step that made ``version`` of ``(update, weight, excluded)`` ``parts`` under ``rule``, as shard 0
    publishes it."""
    return StepRecord(version=version, rule=rule, parts=tuple(
        StepPart(device=u.device, incarnation=u.incarnation, seq=u.seq, weight=w, excluded=excluded)
        for u, w, excluded in parts))


def kept_step(kept: object) -> StepRecord:
    """A step a checkpoint kept: a :class:`StepRecord` as a map (``Leader.kept``), or as an earlier version kept it,
    a list ``[version, [[device, incarnation, seq, weight(, excluded)], ...](, rule)]``. CheckpointError if it is
    neither."""
    try:
        if isinstance(kept, Mapping):
            return StepRecord(version=int(kept["version"]), rule=_rule(kept.get("rule", "mean")), parts=tuple(
                StepPart(device=str(p["device"]), incarnation=int(p["incarnation"]), seq=int(p["seq"]),
                         weight=float(p["weight"]), excluded=p.get("excluded") is True) for p in kept["parts"]))
        if not isinstance(kept, list):
            raise TypeError(f"a {type(kept).__name__}, not a map or a list")
        version, parts, *rule = kept
        return StepRecord(version=int(version), rule=_rule(rule[0] if rule else "mean"), parts=tuple(
            StepPart(device=str(d), incarnation=int(i), seq=int(q), weight=float(w), excluded=excluded == [True])
            for d, i, q, w, *excluded in parts))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"a step shard 0's checkpoint kept is malformed ({exc!r}): {kept!r:.200}") from None


def _rule(kept: object) -> AggregationRule:
    """A rule a checkpoint kept with a step (an earlier version kept whether ``clip`` scaled it)."""
    if kept is True:
        return "clip"
    return next((r for r in AGGREGATION_RULES if r == kept), "mean")
