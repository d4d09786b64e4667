"""A worker's uplink, without a broker: to a parameter server of one process an update goes whole (raw through
the compressor's gateway when the policy says so); to a sharded one every shard gets its rows of it, with that
shard's version and gap, and the answer that counts is the worst of the shards' acks. Every ack is counted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgemesh.common.bus import Route
from edgemesh.common.messages import CodecPolicy, GradientUpdate, ModelSnapshot, ShardUpdate, UpdateAck
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.shards import ShardedView, divide
from edgemesh.common.topics import Filter, Topics
from edgemesh.common.vocabulary import AckStatus, CodecName
from edgemesh.common.wire.tensors import Tensor
from edgemesh.services.worker.uplink import ShardedUplink, WholeUplink

SHAPES = {"w": (4, 3), "b": (4,)}
TOPICS = Topics("up")


@dataclass
class Sender:
    """Sends recorded, each answered at once with this shard's ack."""

    answers: dict[int, UpdateAck]
    sent: list[tuple[str, int, GradientUpdate]] = field(default_factory=list)
    bus: Any = None

    async def send(self, update: GradientUpdate, topic: str, shard: int = 0) -> UpdateAck:
        self.sent.append((topic, shard, update))
        return self.answers[shard]

    async def on_ack(self, ack: UpdateAck, match: Any) -> None: ...


@dataclass
class Bus:
    routes: list[Route[Any]] = field(default_factory=list)

    def route(self, filter_: Filter, message: type, handler: Any) -> Route[Any]:
        self.routes.append(Route(filter_, message, handler))
        return self.routes[-1]


def ack(status: AckStatus = "accepted", *, reason: str = "", delay: int = 0, resync: bool = False,
        version: int = 0) -> UpdateAck:
    return UpdateAck(device="d0", incarnation=1, seq=1, status=status, reason=reason,
                     delay=delay, resync=resync, version=version)


def rows(param: str, start: int, stop: int, codec: CodecName = "none") -> ShardUpdate:
    width = int(np.prod(SHAPES[param][1:]))
    return ShardUpdate(param=param, start=start, stop=stop, codec=codec,
                       data=np.zeros((stop - start) * width, np.float32).tobytes())


def update(*shards: ShardUpdate) -> GradientUpdate:
    return GradientUpdate(device="d0", cluster="c-d0", incarnation=1, seq=1, base_version=0, samples=8,
                          shards=shards)


def sharded_view(versions: tuple[int, ...]) -> ShardedView:
    """A view of two shards of the model at ``versions``."""
    view = ShardedView(len(versions))
    view.know(SHAPES)
    for shard, (run, version) in enumerate(zip(divide(SHAPES, len(versions)), versions, strict=True)):
        view.views[shard].load(ModelSnapshot(version=version, model_spec="tiny", tensors={
            s.param: Tensor.from_numpy(np.zeros((s.stop - s.start, *SHAPES[s.param][1:]), np.float32))
            for s in run}))
    return view


async def test_an_update_goes_whole_to_one_parameter_server_and_its_ack_is_the_answer() -> None:
    metrics = ServiceMetrics("worker")
    answer = ack(delay=2)
    sender = Sender({0: answer})
    uplink = WholeUplink(sender, TOPICS, "d0", metrics)
    sent = update(rows("w", 0, 4, "fp16"), rows("b", 0, 4))
    got = await uplink.send(sent, CodecPolicy(device="d0", codec="fp16"))
    assert got.ack == answer and got.acks == (answer,)
    assert sender.sent == [(TOPICS.grad("c-d0", "d0"), 0, sent)]
    assert metrics.value("edgemesh_worker_updates_total", status="accepted") == 1
    assert metrics.value("edgemesh_worker_gradient_bytes_total", codec="fp16") == len(sent.shards[0].data)


async def test_through_the_gateway_an_update_goes_raw_for_the_compressor() -> None:
    sender = Sender({0: ack()})
    uplink = WholeUplink(sender, TOPICS, "d0", ServiceMetrics("worker"))
    await uplink.send(update(rows("b", 0, 4)), CodecPolicy(device="d0", codec="none", gateway=True))
    assert [topic for topic, _, _ in sender.sent] == [TOPICS.grad_raw("c-d0", "d0")]


async def test_each_shard_gets_its_rows_with_its_version_and_the_worst_ack_counts() -> None:
    metrics = ServiceMetrics("worker")
    view = sharded_view((3, 5))
    view.views[1].gap = True
    stale = ack("discarded", reason="stale", delay=4, resync=True, version=9)
    sender = Sender({0: ack(delay=1), 1: stale})
    uplink = ShardedUplink(sender, TOPICS, "d0", metrics, view=view)
    cut = [rows(s.param, s.start, s.stop) for s in view.spans]
    got = await uplink.send(update(*cut), None)

    runs = divide(SHAPES, 2)
    assert [(topic, shard) for topic, shard, _ in sender.sent] == [
        (TOPICS.for_shard(i).grad("c-d0", "d0"), i) for i in range(2)]
    for shard, (_, _, part) in enumerate(sender.sent):
        assert [(s.param, s.start, s.stop) for s in part.shards] == [(s.param, s.start, s.stop) for s in runs[shard]]
    assert [(p.base_version, p.need_snapshot) for _, _, p in sender.sent] == [(3, False), (5, True)]
    assert got.acks == (ack(delay=1), stale)  # each shard's, for the source's resync
    assert (got.ack.status, got.ack.reason, got.ack.delay, got.ack.resync) == ("discarded", "stale", 4, False)
    assert metrics.value("edgemesh_worker_updates_total") == 2
    assert metrics.value("edgemesh_worker_updates_total", status="discarded", reason="stale") == 1


async def test_a_shard_holding_none_of_the_rows_still_gets_its_empty_part() -> None:
    view = sharded_view((1, 1))
    sender = Sender({0: ack(), 1: ack()})
    uplink = ShardedUplink(sender, TOPICS, "d0", ServiceMetrics("worker"), view=view)
    first = divide(SHAPES, 2)[0][0]  # a model-parallel member's rows, all within shard 0's
    got = await uplink.send(update(rows(first.param, first.start, first.stop)), None)
    assert [len(part.shards) for _, _, part in sender.sent] == [1, 0]
    assert got.ack.status == "accepted"


def test_the_uplink_consumes_the_acks_of_every_shard_it_sends_to() -> None:
    bus, sender = Bus(), Sender({})
    ShardedUplink(sender, TOPICS, "d0", ServiceMetrics("worker"), view=ShardedView(3)).route(bus)
    assert [r.filter for r in bus.routes] == [TOPICS.for_shard(i).ack_filter("d0") for i in range(3)]
    assert all(r.handler == sender.on_ack for r in bus.routes) and sender.bus is bus
    whole = Bus()
    WholeUplink(sender, TOPICS, "d0", ServiceMetrics("worker")).route(whole)
    assert [r.filter for r in whole.routes] == [TOPICS.ack_filter("d0")]
