"""Reference policies the simulator runs beside the services' own: peers' rules, for comparison only (pure).

None of these is a policy of the parameter server (``training.sync_policy`` cannot name one): they exist so that
``bench policies`` can say how far the service's policies are from a published rule on the same simulated fleet.
Each is built on the service's :class:`Scheduler` base and its :class:`Step` and :class:`Decision` types, so the
simulated parameter server applies its steps with the same aggregation and optimizer code as any other.

* ``fedbuff``: buffered asynchronous aggregation (Nguyen et al., "Federated Learning with Buffered Asynchronous
  Aggregation", AISTATS 2022). Devices never wait: every update within the staleness bound is acknowledged on
  arrival (no resync) and buffered; once ``K`` updates are buffered the server applies their sample-weighted average,
  each damped by ``1 / sqrt(1 + d)`` (the paper's polynomial staleness scaling with exponent 1/2), as one step.
  ``K`` is a share of the plan's devices (the paper uses K = 10 at a concurrency of 100-1000; a small fleet takes a
  larger share so that a step still averages several devices).
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal, get_args

from edgemesh.common.vocabulary import SyncPolicy
from edgemesh.services.parameter_server.scheduler import (
    Ack,
    Candidate,
    Clock,
    Decision,
    Fleet,
    Scheduler,
    Step,
    Verdict,
)

ReferencePolicy = Literal["fedbuff"]
REFERENCE_POLICIES: tuple[ReferencePolicy, ...] = get_args(ReferencePolicy)

FEDBUFF_SHARE = 0.25
"""FedBuff's buffer ``K`` as a share of the plan's devices (at least 1): 2 of 8 devices, 250 of 1,000."""


def fedbuff_damping(delay: int) -> float:
    """FedBuff's staleness scaling ``1 / sqrt(1 + d)``: gentler than the service's ``1 / (1 + d)`` on large delays."""
    return 1.0 / math.sqrt(1.0 + max(0, delay))


class FedBuffScheduler(Scheduler):
    """FedBuff (module docstring): acknowledge on arrival, apply every ``K`` buffered updates as one damped average.

    Its ``policy`` is ``async`` for everything the service derives from a policy (the broadcast's label, the worker
    that never waits for a round); ``name`` says what it is."""

    policy: ClassVar[SyncPolicy] = "async"
    name: ClassVar[ReferencePolicy] = "fedbuff"

    def __init__(self, clock: Clock, *, share: float = FEDBUFF_SHARE) -> None:
        super().__init__(clock, staleness_weighting=True)
        if not 0 < share <= 1:
            raise ValueError("the buffer's share of the devices must be in (0, 1]")
        self.share = share
        self.buffer: list[Candidate] = []

    def size(self, fleet: Fleet) -> int:
        """``K``: the buffer's share of the plan's devices, at least 1."""
        devices = len(fleet.devices) if fleet.devices else max(1, len(fleet.clusters))
        return max(1, round(self.share * devices))

    def pending(self) -> list[Candidate]:
        return [*self.buffer, *self.deferred]

    def weights(self, step: Step, fleet: Fleet) -> list[float]:
        """Each buffered update's share of the buffer's samples, damped by ``1 / sqrt(1 + d)``."""
        total = sum(item.update.samples for item in step.items)
        return [item.update.samples / total * fedbuff_damping(step.delay(item)) for item in step.items]

    def _place(self, item: Candidate, verdict: Verdict, version: int, fleet: Fleet, out: Decision) -> int:
        # the sender goes on at once: acknowledged now, applied when the buffer fills
        out.acks += [Ack(part, "accepted", "", verdict.delay, False) for part in item.updates]
        self.buffer.append(item)
        if len(self.buffer) < self.size(fleet):
            return version
        items, self.buffer = self.buffer, []
        step = Step(tuple(items), version + 1)
        step = Step(step.items, step.version, tuple(self.weights(step, fleet)))
        self.clock.advance(step.items)
        out.steps.append(step)
        return step.version
