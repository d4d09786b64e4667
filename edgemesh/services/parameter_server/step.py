"""A step of the parameter server, in order: apply, log, broadcast, then publish the model and the acks
(docs/reliability.md#updates).

:class:`Stepper` holds the model state and the lock every change of the model takes. ``step`` applies the steps a
scheduler formed, logs them and encodes the model (``_step`` reads in that order); ``publish`` sends what they
made: the model, then their acks. The other changes of the model take the same lock: a checkpoint
(``checkpoint``) and the divergence guard's rollback (``restore``). The retained snapshot goes out from here too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgemesh.common.broadcast import Broadcaster, ModelMessage
from edgemesh.common.bus import Bus
from edgemesh.common.messages import Plan
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.vocabulary import SyncPolicy
from edgemesh.services.parameter_server.acks import Acks
from edgemesh.services.parameter_server.ledger import Ledger
from edgemesh.services.parameter_server.optimizer import ModelState, Summed
from edgemesh.services.parameter_server.recovery import Optimizer, Recovery, Resumed
from edgemesh.services.parameter_server.robust import Aggregator, Combined
from edgemesh.services.parameter_server.scheduler import Ack, Clock, Step
from edgemesh.services.parameter_server.shards import ShardRole

logger = logging.getLogger(__name__)

DELAY_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


@dataclass(frozen=True, slots=True)
class StepSettings:
    """What a batch's steps are applied with (logged with them) and the policy their model goes out under."""

    optimizer: Optimizer
    policy: SyncPolicy


class Stepper:
    """The model state, and every change of it: a step, a checkpoint, a rollback."""

    def __init__(self, role: ShardRole, clock: Clock, metrics: ServiceMetrics, *, recovery: Recovery, ledger: Ledger,
                 broadcast: Broadcaster, aggregator: Aggregator, acks: Acks, wake: Callable[[], None]) -> None:
        self.role, self.clock, self.recovery, self.ledger = role, clock, recovery, ledger
        self.broadcast, self.aggregator, self.acks, self.wake = broadcast, aggregator, acks, wake
        self.state: ModelState | None = None
        self.label = ""
        """What the checkpoint says it holds: the model, and which shard of it."""
        self.lock = threading.Lock()
        """Held by the thread that steps and logs and by the one that checkpoints: a step of a step loop cancelled at
        shutdown still runs in its thread while the final checkpoint is written."""
        self.bus: Bus | None = None
        self.since_checkpoint = 0
        self.snapshot_owed = False
        """The step loop publishes a snapshot next (model publishing is serialized with stepping)."""
        self.m_version = metrics.gauge("model_version", "Current global model version")
        self.m_delay = metrics.histogram("update_delay_versions", "Delay of accepted updates in versions",
                                         DELAY_BUCKETS)
        self.m_wal = metrics.counter("wal_bytes", "Bytes appended to the write-ahead log")
        self.m_checkpoints = metrics.counter("checkpoints", "Checkpoints written")

    def load(self, label: str, initial: Mapping[str, np.ndarray], buffers: Mapping[str, bool],
             momenta: Mapping[str, float]) -> Resumed:
        """The model as the checkpoint and the log after it left it (``initial``: without a checkpoint)."""
        self.label = label
        resumed = self.recovery.resume(label, initial, self.clock, buffers=buffers, momenta=momenta)
        self.state = resumed.state
        self.m_version.set(self.clock.version)
        return resumed

    # ------------------------------------------------------------------ a step
    async def step(self, steps: list[Step], plan: Plan | None, how: StepSettings) -> ModelMessage | None:
        """Apply, log and broadcast ``steps`` (``_step``, in one thread hop) for ``plan``, the plan they were judged
        under; shard 0 first hears the other shards' parts of what its rule judges whole updates by. The model's
        message, or None if no device listens."""
        for step in steps:
            for item in step.items:
                self.m_delay.observe(step.delay(item))
        elsewhere = await self.role.elsewhere(steps, self.aggregator.rule)
        message = await asyncio.to_thread(self._step, steps, elsewhere, plan, how)
        self.since_checkpoint += len(steps)
        return message

    def _step(self, steps: list[Step], elsewhere: list[list[float]], plan: Plan | None,
              how: StepSettings) -> ModelMessage | None:
        """One batch of steps, in this thread, holding the lock (no checkpoint lands between), in order:

        1. combine: each step's contributions by its aggregation rule (``robust``), summed;
        2. apply: the optimizer on the model, step by step (a step the model refuses leaves it as it was: counted);
        3. log: the steps to the write-ahead log (``recovery``), in the log's own thread, while ...
        4. broadcast: ... the model is encoded for the plan's devices (``common.broadcast``); the ``with`` block
           ends once the steps are durable;
        5. the ledger records them, and a sharded server's role keeps them for the other shards;
        6. the clock takes the version they made.

        Nothing leaves the process here: the model and the acks go out after (``publish``), so no ack precedes
        the durable log and the ledger, and shard 0's steps reach the others only once in its log.
        """
        assert self.state is not None
        state, version = self.state, steps[-1].version
        with self.lock:
            combined = [self.aggregator.combine(step.contributions(), rule=step.rule, elsewhere=far, chosen=step.chosen,
                                                gain_limit=step.gain_limit, samples=step.samples)
                        for step, far in zip(steps, elsewhere, strict=True)]
            sums = [state.sum(c.contributions, step.buffer_contributions()) for c, step in zip(combined, steps,
                                                                                              strict=True)]
            self._apply(steps, combined, sums, how.optimizer)
            with self.recovery.log(steps, how.optimizer, combined, [s.grads for s in sums]) as logged:
                message = self.broadcast.to_plan(state.params, version, how.policy, plan)
            self.m_wal.inc(logged.written)
            self.ledger.record(steps)
            self.role.stepped(steps, combined)
            self.clock.version = version
            self.m_version.set(version)
        return message

    def _apply(self, steps: Sequence[Step], combined: Sequence[Combined], sums: Sequence[Summed],
               optimizer: Optimizer) -> None:
        """Step the model on each sum; a step it refuses moves the version on and nothing else."""
        assert self.state is not None
        for step, c, summed in zip(steps, combined, sums, strict=True):
            refused = self.state.apply(summed, lr=optimizer.lr, momentum=optimizer.momentum,
                                       weight_decay=optimizer.weight_decay)
            if refused is not None:
                self.aggregator.step_refused(step.version, refused, c)

    # ------------------------------------------------------------------ publishing
    async def publish(self, message: ModelMessage | None, acks: list[Ack]) -> None:
        """What a batch made: its model, then its acks, after the previous batch's (``Acks.send_batch``). The acks go
        as soon as the model is handed to the client, not after its PUBACKs: on one connection the broker passes
        them on in that order, so a worker acked for version v usually has v. Without a model (no step, or no
        device listening) they go at once. Returns once the model is published (or raises why it was not; its acks
        went out all the same: their steps are logged)."""
        version = self.clock.version
        if message is None:
            self.acks.send_batch(acks, version)
            return
        handed = asyncio.Event()
        publishing = asyncio.ensure_future(self._publish_model(message, handed))
        waiting = asyncio.ensure_future(handed.wait())
        try:
            await asyncio.wait([publishing, waiting], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            self.acks.send_batch(acks, version)
        await publishing

    async def _publish_model(self, message: ModelMessage, handed: asyncio.Event) -> None:
        """The broadcast; ``handed`` set once it is handed to the client (with per-device parts: once sent)."""
        assert self.bus is not None
        topics = self.role.topics
        if message.snapshot:
            await self.bus.publish(topics.model(), message.payload, retain=True, kind="model", handed=handed)
            return
        await asyncio.gather(self.bus.publish(topics.model_delta(), message.payload, kind="model_delta",
                                              handed=None if message.parts else handed),
                             *(self.bus.publish(topics.model_delta_for(device), part, kind="model_delta")
                               for device, part in message.parts.items()))
        handed.set()

    def request_snapshot(self, *, unless_current: bool = False) -> None:
        """Have the step loop publish a snapshot (``unless_current``: unless the last one is of this version)."""
        if unless_current and self.broadcast.last_full == self.clock.version:
            return
        self.snapshot_owed = True
        self.wake()

    async def publish_snapshot(self, policy: SyncPolicy) -> None:
        """The whole model, retained (the step loop's, between steps)."""
        assert self.bus is not None and self.state is not None
        self.snapshot_owed = False
        payload = await asyncio.to_thread(self.broadcast.snapshot, self.state.params, self.clock.version, policy)
        await self.bus.publish(self.role.topics.model(), payload, retain=True, kind="model")

    # ------------------------------------------------------------------ the other changes of the model
    def copy(self) -> tuple[int, dict[str, np.ndarray]]:
        """The version and a copy of the weights, taken between steps (in a thread)."""
        assert self.state is not None
        with self.lock:
            return self.clock.version, {k: v.copy() for k, v in self.state.params.items()}

    def checkpoint(self, settings: Callable[[], dict[str, Any]]) -> None:
        """Write a checkpoint, with the ``settings()`` of that moment, and start a fresh log (in a thread, never
        during a step)."""
        if self.state is None:
            return
        with self.lock:
            self.checkpoint_held(settings())

    def checkpoint_held(self, settings: dict[str, Any]) -> None:
        """``checkpoint`` with the lock held."""
        assert self.state is not None
        self.ledger.sync()  # the log about to be emptied is what backs its entries up to now
        self.recovery.checkpoint(self.label, self.state, self.clock, settings)
        self.since_checkpoint = 0
        self.m_checkpoints.inc()

    def restore(self, params: Mapping[str, np.ndarray]) -> int:
        """``params`` in place of the model (weights and buffers; momentum cleared) as the next version, under which
        what was computed on the model left behind is not applied (``Clock.floor``); the lock held. The version."""
        assert self.state is not None
        self.state.restore(params)
        self.clock.version += 1
        self.clock.floor = self.clock.version
        self.m_version.set(self.clock.version)
        return self.clock.version
