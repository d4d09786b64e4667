"""Ending asyncio tasks for certain.

Python 3.11's ``asyncio.wait_for`` (under aiomqtt's connect, subscribe, publish and disconnect) drops
a cancellation that arrives just as the future it waits on completes, so one ``task.cancel()`` may
leave a task running, and an ``await task`` after it may never return. Every place that ends a task
it started (a service's jobs, a bus's connection, a test's services) ends it with :func:`cancel_all`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

CANCEL_RETRY_S = 0.1
"""How often :func:`cancel_all` repeats the cancellation of a task that has not ended yet."""


async def cancel_all(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again any that swallowed it.

    Their outcomes are left on them (read ``result()`` or ``exception()`` afterwards). A cancellation of
    the caller while it waits is kept: the tasks are still all ended first, then it is raised.
    """
    pending = {task for task in tasks if not task.done()}
    cancelled = False
    while pending:
        for task in pending:
            task.cancel()
        try:
            _, pending = await asyncio.wait(pending, timeout=CANCEL_RETRY_S)
        except asyncio.CancelledError:
            cancelled = True  # asyncio.wait leaves its tasks alone: go on ending them
            pending = {task for task in pending if not task.done()}
    if cancelled:
        raise asyncio.CancelledError
