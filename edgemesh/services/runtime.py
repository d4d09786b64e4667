"""What every service's ``run(config)`` shares: stop signals, supervised tasks, identities."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Coroutine
from typing import Any

from edgemesh.common import systemd
from edgemesh.common.config import Config

logger = logging.getLogger(__name__)


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` (a second SIGINT falls back to KeyboardInterrupt)."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set() and sig == signal.SIGINT:
            loop.remove_signal_handler(signal.SIGINT)
        logger.info("received %s; stopping", sig.name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)


async def supervise(stop: asyncio.Event, *jobs: Coroutine[Any, Any, None]) -> None:
    """Run ``jobs`` in one TaskGroup until ``stop`` is set (or one job fails, which stops all).

    Called once a service is set up: it tells systemd the service is ready (``Type=notify``),
    feeds the watchdog from the event loop while the jobs run, and says when it stops.
    """
    systemd.notify("READY=1", "STATUS=running")
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(job) for job in jobs]
        tasks.append(group.create_task(systemd.watchdog()))
        stopper = group.create_task(stop.wait())
        finished: asyncio.Future[list[None]] = asyncio.gather(*tasks)
        try:
            await asyncio.wait([stopper, finished], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        finally:
            systemd.notify("STOPPING=1", "STATUS=stopping")
            stopper.cancel()
            finished.cancel()
            await _cancel_all(tasks)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await finished


CANCEL_RETRY_S = 0.1
"""How often ``supervise`` repeats the cancellation of a job that has not ended yet."""


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait until all have ended, cancelling again any that swallowed it.

    Python 3.11's ``asyncio.wait_for`` (under aiomqtt's publish) drops a cancellation that
    arrives just as its future completes, so one ``cancel()`` may leave a job running.
    """
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=CANCEL_RETRY_S)


def client_id(service: str, config: Config, name: str = "") -> str:
    """A broker client id unique per job, service and process."""
    return f"edgemesh-{config.job}-{service}-{name or socket.gethostname()}-{os.getpid()}"[:128]


def now() -> float:
    return time.time()
