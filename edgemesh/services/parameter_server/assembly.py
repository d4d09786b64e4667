"""Model-parallel shard assembly: the members' shards of one cluster step, joined into one update (pure).

The members of a model-parallel cluster each push the gradient of their rows for the same step
(``GradientUpdate.mesh_step``), with the change of their rows of the running statistics (a batch norm divided
with a layer) and, from the first member alone, of the batch counters (``GradientUpdate.buffers``). The assembly
holds them by ``(cluster, plan version, step)`` until their shards tile every parameter exactly; then the
cluster's update, the members' gradient rows and buffer rows joined, goes to the scheduler like any other (which
moves the buffers by it as by a data-parallel worker's change). Buffer rows need not cover every buffer (constants
stay home), but no two members may send the same row. On a sharded parameter server (``members`` set) a
step also waits for a part from every member of its cluster, empty where the member has none of this shard's
rows: the joined update then takes the identity of the same member's part on every shard, which is how shard
0's steps name it to the others. A step whose shards, or buffer rows, overlap is discarded (``shape``); one
not complete within ``ps.mesh_assembly_timeout_s``, or one of a plan that has been replaced, is discarded too
(``incomplete``, ``replanned``: its members abandon it and resync). The last ``CLOSED_STEPS``
steps joined or discarded are remembered, so that a member's resend of its part opens no new one.

A shard other than 0 (``follows``) does not discard a step of a replaced plan: shard 0 may have joined it before
the new plan reached it, the step's last parts still on their way here, and shard 0's step record decides. Such a
step joins when its parts are in; one that shard 0 discarded goes as shard 0 said (``dismiss``), and one that
never completes expires uncounted (``replanned``): its members abandoned it.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, cast

from edgemesh.common.messages import GradientUpdate, Plan, StepDiscard
from edgemesh.common.vocabulary import DiscardReason
from edgemesh.services.parameter_server.optimizer import ShardGrad
from edgemesh.services.parameter_server.scheduler import Ack, Candidate, Clock

logger = logging.getLogger(__name__)

StepKey = tuple[str, int, int]
"""A model-parallel step: (cluster, plan version, mesh step)."""
CLOSED_STEPS = 1024
"""Model-parallel steps remembered as joined or discarded, against members' resends."""
Coverage = Literal["full", "partial", "overlap"]
COUNTED: tuple[DiscardReason, ...] = ("shape", "incomplete")
"""Why a step is discarded that the service counts as a rejection (the others, the scheduler's, are ack-only)."""


def members_in(plan: Plan | None, cluster: str, plan_version: int) -> frozenset[str] | None:
    """The members of ``cluster`` under ``plan`` if it is version ``plan_version`` (None: another plan)."""
    if plan is None or plan.version != plan_version:
        return None
    found = plan.cluster(cluster)
    return frozenset(found.members) if found is not None else frozenset()


@dataclass(slots=True)
class _Waiting:
    opened: float
    parts: dict[str, Candidate] = field(default_factory=dict)
    verdict: DiscardReason | None = None
    """Shard 0's reason, when it discarded the step (a follower's)."""


@dataclass(slots=True)
class Outcome:
    """What a call settled: the cluster's joined update, acks to send, and acks of rejected parts
    (the service counts those as rejections)."""

    joined: list[Candidate] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    rejected: list[Ack] = field(default_factory=list)


class Assembly:
    """Model-parallel steps waiting for the rest of their members' shards."""

    def __init__(self, rows: Mapping[str, int], timeout_s: float) -> None:
        self.rows = dict(rows)
        """Length along dim 0 of every parameter: the shards of a step must tile them."""
        self.timeout_s = timeout_s
        self.members: Callable[[str, int], frozenset[str] | None] | None = None
        """A sharded parameter server's: the members of a cluster under a plan version (None: that plan is not
        known yet, and its steps wait for it); every one of them sends each shard a part of every step."""
        self._waiting: dict[StepKey, _Waiting] = {}
        self._closed: OrderedDict[StepKey, DiscardReason | Literal[""]] = OrderedDict()
        """Steps joined ('') or discarded (the reason)."""
        self.follows = False
        """A shard other than 0: steps of a replaced plan wait for their parts (see the module's docstring)."""

    def __len__(self) -> int:
        return len(self._waiting)

    def taken(self, update: GradientUpdate, clock: Clock) -> bool:
        """Whether ``update`` is a resend that the ack of what it resends will answer: its step holds a part
        from its device already, or was joined and not applied yet (another update for the step is not taken
        either). A part of a step applied is a duplicate, and one of a step discarded hears why: ``add``."""
        key = (update.cluster, update.plan_version, update.mesh_step)
        waiting = self._waiting.get(key)
        if waiting is not None:
            return update.device in waiting.parts
        return self._closed.get(key) == "" and not clock.seen(update)

    def add(self, item: Candidate, clock: Clock, plan_version: int, now: float) -> Outcome:
        """Hold a member's part; the cluster's update once the step's parts cover the whole model."""
        u = item.update
        out = Outcome()
        if clock.seen(u):
            out.acks.append(Ack(u, "duplicate"))
            return out
        key = (u.cluster, u.plan_version, u.mesh_step)
        if key in self._closed:  # a resend of a part of a step joined or discarded
            closed = self._closed[key]
            if closed:  # answered as the step was, and counted alike
                ack = Ack(u, "discarded", closed, resync=True)
                (out.rejected if closed in COUNTED else out.acks).append(ack)
            return out  # joined and not judged yet: acked with the cluster's update (``taken`` counts it)
        if plan_version and u.plan_version < plan_version and not self.follows:
            # its members abandon a step when the plan changes: the rest of it will not come
            self._close(key, "replanned")
            out.acks.append(Ack(u, "discarded", "replanned", resync=True))
            return out
        waiting = self._waiting.setdefault(key, _Waiting(now))
        waiting.parts[u.device] = item
        self._settle(key, out)
        return out

    def _settle(self, key: StepKey, out: Outcome) -> None:
        """Join step ``key`` if its parts are all in, or discard it if two overlap; else leave it waiting."""
        waiting = self._waiting[key]
        coverage = self._coverage([g for part in waiting.parts.values() for g in part.grads])
        if _overlap([b for part in waiting.parts.values() for b in part.buffers]):
            coverage = "overlap"  # two members sent one row of a buffer (a counter twice)
        if coverage == "partial":
            return
        if coverage == "full" and self.members is not None:
            members = self.members(key[0], key[1])
            if members is None or not members <= waiting.parts.keys():
                return  # a member's empty part (or the plan saying who the members are) is still to come
        del self._waiting[key]
        parts = sorted(waiting.parts.values(), key=lambda part: part.update.device)
        if coverage == "overlap":
            self._close(key, "shape")
            out.rejected += [Ack(part.update, "discarded", "shape", resync=True) for part in parts]
            return
        self._close(key, "")
        first = parts[0].update
        merged = replace(first, base_version=min(part.update.base_version for part in parts),
                         need_snapshot=any(part.update.need_snapshot for part in parts),
                         shards=tuple(sh for part in parts for sh in part.update.shards),
                         buffers=tuple(sh for part in parts for sh in part.update.buffers))
        out.joined.append(Candidate(merged, [g for part in parts for g in part.grads],
                                    max(part.received for part in parts), parts=tuple(p.update for p in parts),
                                    buffers=[g for part in parts for g in part.buffers]))

    def expire(self, now: float, plan_version: int = 0) -> Outcome:
        """Discard the steps whose members did not all report in time (one left or lags; on a follower, a step
        of a plan older than ``plan_version`` is one its members abandoned, not counted), and those shard 0
        discarded (``dismiss``), as it did."""
        out = Outcome()
        for key in [k for k, w in self._waiting.items() if now - w.opened >= self.timeout_s]:
            reason = self._waiting[key].verdict or ("replanned" if key[1] < plan_version else "incomplete")
            done = self._discard([key], reason, counted=reason in COUNTED)
            out.acks += done.acks
            out.rejected += done.rejected
        return out

    def dismiss(self, discards: Iterable[StepDiscard]) -> bool:
        """A follower: the waiting steps holding a part shard 0 discarded expire at the next ``expire``, with its
        reason (shard 0 dropped a replaced plan's step that this shard still waits on). Whether any did."""
        named = {(d.device, d.incarnation, d.seq): cast(DiscardReason, d.reason) for d in discards if d.reason}
        found = False
        for waiting in self._waiting.values():
            reasons = [named[k] for p in waiting.parts.values()
                       if (k := (p.update.device, p.update.incarnation, p.update.seq)) in named]
            if reasons:
                waiting.opened, waiting.verdict, found = -math.inf, reasons[0], True
        return found

    def replanned(self, plan_version: int) -> Outcome:
        """A new plan: steps of older plans still waiting are discarded at once. Members abandon a
        step when the plan changes, so the rest of it will not come, and the members that did send
        would otherwise wait ``ps.mesh_assembly_timeout_s`` for their acks."""
        stale = [] if self.follows else [k for k in self._waiting if k[1] < plan_version]
        for key in stale:
            logger.info("step %d of %s discarded: plan version %d replaced %d", key[2], key[0], plan_version, key[1])
        out = self._discard(stale, "replanned", counted=False)
        for key in [k for k in self._waiting if k[1] == plan_version]:  # waiting to know who the members are
            self._settle(key, out)
        return out

    def timeout(self, now: float) -> float | None:
        """Seconds until the oldest waiting step times out (None: none waits)."""
        if not self._waiting:
            return None
        oldest = min(w.opened for w in self._waiting.values())
        return max(0.0, oldest + self.timeout_s - now)

    def discarded(self, update: GradientUpdate, reason: DiscardReason) -> None:
        """A joined step the scheduler discarded: a member's resend hears why."""
        key = (update.cluster, update.plan_version, update.mesh_step)
        if update.mesh_step and key in self._closed:
            self._closed[key] = reason

    def _discard(self, keys: list[StepKey], reason: DiscardReason, *, counted: bool) -> Outcome:
        out = Outcome()
        for key in keys:
            waiting = self._waiting.pop(key)
            self._close(key, reason)
            acks = [Ack(part.update, "discarded", reason, resync=True) for part in waiting.parts.values()]
            (out.rejected if counted else out.acks).extend(acks)
        return out

    def _close(self, key: StepKey, reason: DiscardReason | Literal[""]) -> None:
        self._closed[key] = reason
        while len(self._closed) > CLOSED_STEPS:
            self._closed.popitem(last=False)

    def _coverage(self, grads: list[ShardGrad]) -> Coverage:
        """``full`` if the shards tile every parameter exactly, ``overlap`` if two cover one row, else ``partial``."""
        if _overlap(grads):
            return "overlap"
        spans = _spans(grads)
        full = len(spans) == len(self.rows)
        for param, ranges in spans.items():
            end = 0
            for start, stop in ranges:
                full = full and start == end
                end = stop
            full = full and end == self.rows[param]
        return "full" if full else "partial"


def _spans(shards: list[ShardGrad]) -> dict[str, list[tuple[int, int]]]:
    """Each tensor's ``(start, stop)`` rows among ``shards``, in order."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for g in shards:
        spans.setdefault(g.param, []).append((g.start, g.stop))
    return {name: sorted(ranges) for name, ranges in spans.items()}


def _overlap(shards: list[ShardGrad]) -> bool:
    """Whether two of ``shards`` cover one row of a tensor."""
    return any(start < stop_before for ranges in _spans(shards).values()
               for (_, stop_before), (start, _) in zip(ranges, ranges[1:], strict=False))
