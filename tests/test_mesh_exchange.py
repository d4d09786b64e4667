"""The members' exchange of slices over a real broker (``BusExchange``): members on their own
connections compute what one process does, book every layer's bytes, and time out a member that
never shows up."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
from helpers import UNEVEN, assert_matches_one_process, make_config, reference

from edgemesh.common.bus import Bus
from edgemesh.common.messages import MeshSlice
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.worker.mesh.exchange import BusExchange, MeshTimeout
from edgemesh.services.worker.mesh.member import MeshMember

STEP_WAIT_S = 30.0
"""How long the members' step over the broker may take."""


@contextlib.asynccontextmanager
async def member_buses(broker: BrokerProcess, job: str, cluster: str, devices: list[str], counts: dict,
                       timeout_s: float = 10.0, dtype: str = "float32",
                       batch: int = 12) -> AsyncIterator[list[BusExchange]]:
    """One MQTT connection and :class:`BusExchange` per member, routing to it the other members'
    forward slices and the backward slices addressed to it."""
    cfg = make_config(broker, job=job)
    topics = Topics(job)
    order = list(counts)
    async with contextlib.AsyncExitStack() as stack:
        exchanges = []
        for device in devices:
            bus = Bus(cfg.broker, client_id=f"{device}-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("worker"))
            ex = BusExchange(bus, topics, cluster=cluster, device=device, members=devices, counts=counts,
                             order=order, plan_version=1, timeout_s=timeout_s, dtype=dtype)
            ex.begin(1, batch)

            async def deliver(msg: MeshSlice, where: TopicMatch, ex: BusExchange = ex) -> None:
                ex.deliver(msg, where.device)

            for other in devices:
                if other != device:
                    bus.route(topics.mesh_filter(cluster, "+", "fwd", other), MeshSlice, deliver)
            bus.route(topics.backward_filter(cluster, device), MeshSlice, deliver)
            await stack.enter_async_context(bus)
            exchanges.append(ex)
        yield exchanges


async def test_members_over_mqtt_compute_what_one_process_does(broker: BrokerProcess) -> None:
    spec = "digits-cnn"
    params, x, y, loss, logits, grads = reference(spec, seed=5, batch=12)
    devices = ["m0", "m1", "m2"]
    members = [MeshMember(spec, UNEVEN[spec], i, seed=5) for i in range(3)]
    for m in members:
        m.load(params, version=0)
    async with member_buses(broker, "meshx", "m-m0", devices, UNEVEN[spec]) as exchanges:
        results = await asyncio.wait_for(asyncio.gather(
            *(m.step(1, x, y, ex) for m, ex in zip(members, exchanges, strict=True))), STEP_WAIT_S)
    assert_matches_one_process(list(results), loss, logits, grads)
    # the member without units of fc2 sends nothing for it
    assert all(ex.bytes_sent > 0 for ex in exchanges)
    # a layer's exchanges are booked to it: its all-gather and the reduce-scatter of its output gradient
    # (sent with the next layer), both sized by the member's units of it, as the cost model charges them
    for ex in exchanges:
        sent, received = (sum(b[d] for b in ex.layer_bytes.values()) for d in (0, 1))
        assert sent > 0 and received > 0
    # member 1 holds 4 of fc1's 64 units and none of fc2's (12 samples, float32): for fc2 it only receives
    # the others' 10 units; fc1's bytes are its all-gather (its 4 units out, the others' 60 in) and the
    # reduce-scatter of fc1's output gradient on fc2's topics (its 4 channels in from the 2 fc2 holders)
    assert exchanges[1].layer_bytes["fc2"] == [0, 10 * 12 * 4]
    assert exchanges[1].layer_bytes["fc1"] == [4 * 12 * 4, 60 * 12 * 4 + 2 * 4 * 12 * 4]


async def test_a_missing_member_times_the_step_out(mosquitto_broker: BrokerProcess) -> None:
    spec = "digits-cnn"
    params, x, y, *_ = reference(spec, seed=5, batch=4)
    devices = ["m0", "m1", "m2"]
    members = [MeshMember(spec, UNEVEN[spec], i, seed=5) for i in range(2)]  # m2 never shows up
    for m in members:
        m.load(params, version=0)
    async with member_buses(mosquitto_broker, "meshy", "m-m0", devices, UNEVEN[spec], timeout_s=0.5,
                            batch=4) as exchanges:
        with pytest.raises(MeshTimeout, match="from m2"):
            await asyncio.gather(*(m.step(1, x, y, ex) for m, ex in zip(members, exchanges[:2], strict=True)))
