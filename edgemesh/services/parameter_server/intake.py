"""Gradients from the bus to the step loop's queue: what an update goes through before a scheduler judges it.

A gradient is checked against the plan and the model (a resend of one still owed an answer, an unknown device, rows
this process does not keep, a codec error, a NaN: a counted rejection and a ``discarded`` ack, or for a resend
nothing: the first copy's ack answers it), decoded (in a thread unless it is small), a model-parallel member's part
joined with its cluster's (``assembly``), then queued for the step loop. The shard role hears of every update
decoded (a sharded server's other shards tell shard 0 their part of its norm).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from edgemesh.common.codecs import quick_to_decode
from edgemesh.common.config import ParameterServerConfig
from edgemesh.common.errors import WireError
from edgemesh.common.messages import GradientUpdate, Plan
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch
from edgemesh.common.vocabulary import payload_reason
from edgemesh.services.parameter_server.acks import Acks
from edgemesh.services.parameter_server.assembly import Assembly, Outcome
from edgemesh.services.parameter_server.robust import Aggregator
from edgemesh.services.parameter_server.scheduler import Ack, Candidate
from edgemesh.services.parameter_server.shards import ShardRole
from edgemesh.services.parameter_server.step import Stepper


class Intake:
    """The queue of updates for the step loop, and the model-parallel steps waiting for their members' parts."""

    def __init__(self, ps: ParameterServerConfig, metrics: ServiceMetrics, *, role: ShardRole, stepper: Stepper,
                 acks: Acks, aggregator: Aggregator, wake: Callable[[], None]) -> None:
        self.cfg, self.metrics, self.role, self.stepper = ps, metrics, role, stepper
        self.acks, self.aggregator, self.wake = acks, aggregator, wake
        self.plan: Plan | None = None
        """The plan the updates are checked against (the service's latest)."""
        self.queue: deque[Candidate] = deque()
        self.assembly = Assembly({}, ps.mesh_assembly_timeout_s)
        self.m_assembling = metrics.gauge("mesh_assembling_steps", "Model-parallel steps waiting for members' shards")
        self.m_codec_bytes = metrics.counter("received_gradient_bytes", "Encoded gradient bytes received", ["codec"])

    async def on_gradient(self, update: GradientUpdate, match: TopicMatch) -> None:
        """Check an update against plan and model; queue it, or discard it with an ack."""
        state, clock = self.stepper.state, self.stepper.clock
        assert state is not None
        where = self.role.topics.grad(match.cluster, match.device)
        resent = self.assembly.taken(update, clock) if update.mesh_step else self.acks.owes(update)
        if resent:
            self.metrics.reject("queued", where, f"{update.device} seq {update.seq} is queued already", route="grad")
            await self.role.resent(update, self.aggregator.rule)
            return  # the queued copy's ack answers this resend too
        if self.plan is not None and self.plan.device(update.device) is None:
            self.metrics.reject("unknown_device", where, update.device, route="grad")
            await self.acks.send(Ack(update, "discarded", "unknown_device"), clock.version)
            return
        try:
            update = self.role.localize(update)
            shards = update.shards
            grads = state.decode(shards) if quick_to_decode(shards) else await asyncio.to_thread(state.decode, shards)
            buffers = state.decode(update.buffers, buffers=True)  # float32, a few values per channel
            if not update.mesh_step:  # a cluster's update is heard of once joined (``settle``)
                await self.role.arrived(update, grads, self.aggregator.rule)
        except WireError as exc:
            self.metrics.reject(exc.reason, where, exc, route="grad")
            await self.acks.send(Ack(update, "discarded", payload_reason(exc.reason)), clock.version)
            return
        for shard in (*update.shards, *update.buffers):
            self.m_codec_bytes.labels(codec=shard.codec).inc(len(shard.data))
        if update.need_snapshot and self.cfg.broadcast == "delta":
            self.stepper.request_snapshot(unless_current=True)  # the sender missed a delta
        item = Candidate(update, grads, time.monotonic(), buffers=buffers)
        if update.mesh_step:
            await self.settle(self.assembly.add(item, clock, self.plan.version if self.plan else 0, time.monotonic()))
            self.wake()  # a model-parallel step to time out
            return
        self.acks.owe(update)
        self.queue.append(item)
        self.wake()  # a paused server holds it: the pending gauge says so

    async def settle(self, outcome: Outcome) -> None:
        """An assembly outcome: the clusters' joined updates queued, the acks sent (rejected parts counted)."""
        self.m_assembling.set(len(self.assembly))
        for joined in outcome.joined:
            await self.role.arrived(joined.update, joined.grads, self.aggregator.rule)
            self.queue.append(joined)
        if outcome.joined:
            self.wake()
        for ack in outcome.rejected:
            u = ack.update
            self.metrics.reject(ack.reason, self.role.topics.grad(u.cluster, u.device),
                                f"step {u.mesh_step} of {u.cluster}: {ack.reason}", route="grad")
        version = self.stepper.clock.version
        await asyncio.gather(*(self.acks.send(ack, version) for ack in [*outcome.rejected, *outcome.acks]))

    def judged(self, acks: list[Ack]) -> None:
        """The acks a scheduler gave: a discarded cluster's update is how a member's resend of its part is answered."""
        for ack in acks:
            if ack.status == "discarded" and ack.reason:
                self.assembly.discarded(ack.update, ack.reason)

    def batch(self, most: int) -> list[Candidate]:
        """Up to ``most`` queued updates, oldest first, for a scheduler."""
        return [self.queue.popleft() for _ in range(min(len(self.queue), most))]
