"""Ending tasks for certain: a task that drops one cancellation (as Python 3.11's ``asyncio.wait_for``
does under aiomqtt when its future completes just then) still ends, and so does a service whose way out
is itself cancelled."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from edgemesh.common.tasks import cancel_all
from edgemesh.services.runtime import supervise

WAIT_S = 5.0


async def stubborn(cancels_dropped: int, started: asyncio.Event | None = None) -> None:
    """Runs until cancelled ``cancels_dropped + 1`` times."""
    if started is not None:
        started.set()
    for _ in range(cancels_dropped):  # what wait_for's race does: the cancellation is gone
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
    await asyncio.Event().wait()


async def test_cancel_all_ends_a_task_that_dropped_a_cancellation() -> None:
    once = asyncio.create_task(stubborn(1))
    await asyncio.sleep(0)
    once.cancel()
    _, pending = await asyncio.wait([once], timeout=0.3)
    assert pending, "one cancel() ended it: the case this guards against did not happen"

    twice, plain = asyncio.create_task(stubborn(2)), asyncio.create_task(stubborn(0))
    await asyncio.sleep(0)
    async with asyncio.timeout(WAIT_S):
        await cancel_all([once, twice, plain])
    assert once.cancelled() and twice.cancelled() and plain.cancelled()


async def test_cancel_all_cancelled_itself_still_ends_every_task_then_says_so() -> None:
    tasks = [asyncio.create_task(stubborn(3)) for _ in range(2)]
    await asyncio.sleep(0)
    ending = asyncio.create_task(cancel_all(tasks))
    await asyncio.sleep(0.05)
    ending.cancel()
    async with asyncio.timeout(WAIT_S):
        with pytest.raises(asyncio.CancelledError):
            await ending
    assert all(t.done() for t in tasks)


async def test_a_service_cancelled_on_its_way_out_leaves_no_job_running() -> None:
    stop, closing = asyncio.Event(), asyncio.Event()
    job_started = asyncio.Event()
    job = stubborn(5, job_started)
    transport = stubborn(5)

    async def close() -> None:
        closing.set()
        await asyncio.Event().wait()  # a last publish that hangs

    service = asyncio.create_task(supervise(stop, job, transport=transport, close=close))
    async with asyncio.timeout(WAIT_S):
        await job_started.wait()
        stop.set()
        await closing.wait()
    service.cancel()  # whoever runs the service gives up on its way out
    async with asyncio.timeout(WAIT_S):
        with pytest.raises(asyncio.CancelledError):
            await service
    assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
