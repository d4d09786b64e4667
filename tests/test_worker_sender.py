"""How long a worker waits for an ack before it resends its update: at least ``worker.ack_timeout_s``, longer when
the parameter server's acks take longer (a round a slow device holds open), doubled after each timeout. A resend
carries a whole gradient over the device's uplink, so a worker whose acks always come late must stop resending."""

from __future__ import annotations

import asyncio
import uuid

from helpers import WAIT_S, gradient, make_config, until

from edgemesh.common.bus import Bus
from edgemesh.common.messages import GradientUpdate, UpdateAck
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.worker.link import LinkMeter
from edgemesh.services.worker.sender import MAX_ACK_WAIT_S, AckTimer, Sender

JOB = "acks"
FLOOR_S = 0.2
"""The test's ``worker.ack_timeout_s``."""
HOLD_S = 0.5
"""How long the test's parameter server holds every update before acking it: a round open past the timeout."""


def test_the_wait_follows_the_acks_times_and_never_drops_below_the_configured_timeout() -> None:
    timer = AckTimer(10.0)
    assert timer.wait_s == 10.0
    timer.acked(0.01)  # the usual ack, in milliseconds: the configured timeout stays the wait
    assert timer.wait_s == 10.0
    for _ in range(5):
        timer.acked(15.0)  # a sync round a Pi 3 holds for 15 s
    assert 15.0 < timer.wait_s <= MAX_ACK_WAIT_S
    for _ in range(40):
        timer.acked(0.02)  # the slow device left: the wait comes back down to the floor
    assert timer.wait_s == 10.0


def test_each_timeout_doubles_the_wait_up_to_a_ceiling_until_an_ack_measures_it_again() -> None:
    timer = AckTimer(10.0)
    waits = []
    for _ in range(5):
        timer.timed_out()
        waits.append(timer.wait_s)
    assert waits == [20.0, 40.0, MAX_ACK_WAIT_S, MAX_ACK_WAIT_S, MAX_ACK_WAIT_S]
    timer.acked(1.0)
    assert timer.wait_s == 10.0
    patient = AckTimer(90.0)  # a timeout set above the ceiling is kept as it is
    patient.timed_out()
    assert patient.wait_s == 90.0


async def test_a_worker_whose_acks_come_late_stops_resending_its_updates(broker: BrokerProcess) -> None:
    """A parameter server that answers every update ``HOLD_S`` after it came (as a round held open does), past a
    worker's ``worker.ack_timeout_s``: the first updates are resent, then the worker's wait has learned the acks'
    time and the updates go once each. With a fixed timeout every update would go three times."""
    cfg = make_config(broker, job=JOB, **{"worker.ack_timeout_s": FLOOR_S})
    topics = Topics(JOB)
    received: list[GradientUpdate] = []
    ps = Bus(cfg.broker, client_id=f"ps-{uuid.uuid4().hex[:6]}", metrics=ServiceMetrics("ps"))

    async def hold_then_ack(update: GradientUpdate, _: TopicMatch) -> None:
        received.append(update)
        if sum(u.seq == update.seq for u in received) == 1:  # the PS holds a resend, it does not answer twice
            await asyncio.sleep(HOLD_S)  # the round a slow device holds open (the route's handler waits)
            await ps.publish(topics.ack(update.device), UpdateAck(device=update.device, incarnation=1,
                                                                  seq=update.seq, status="accepted",
                                                                  version=update.seq))

    ps.route(topics.grad_filter(), GradientUpdate, hold_then_ack)
    metrics = ServiceMetrics("worker")
    sender = Sender(device="d0", incarnation=1, config=cfg.worker, link=LinkMeter(), metrics=metrics)
    worker = Bus(cfg.broker, client_id=f"d0-{uuid.uuid4().hex[:6]}", metrics=metrics)
    worker.route(topics.ack_filter("d0"), UpdateAck, sender.on_ack)
    sender.bus = worker

    def resends() -> float:
        return metrics.value("edgemesh_worker_resends_total")

    async with ps, worker:
        await until("both clients connected", lambda: ps.is_connected and worker.is_connected)
        streak, seq = 0, 0
        async with asyncio.timeout(WAIT_S * 4):
            while streak < 5 and seq < 15:  # until five updates in a row went once each
                seq += 1
                before = resends()
                ack = await sender.send(gradient("d0", seq, 0), topics.grad("c-d0", "d0"))
                assert ack.seq == seq and ack.status == "accepted"
                streak = streak + 1 if resends() == before else 0
        assert streak == 5, f"the worker went on resending: {resends():g} resends in {seq} updates"
        assert resends() >= 1  # the first update went before any ack was measured
        assert sender.timer(0).wait_s > HOLD_S
        assert metrics.value("edgemesh_worker_ack_timeout_seconds") == sender.timer(0).wait_s
        assert len({u.seq for u in received}) == seq and len(received) == seq + resends()
