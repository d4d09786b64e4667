"""systemd integration without libsystemd: ``sd_notify`` readiness, status and watchdog pings.

Units run the services with ``Type=notify`` and ``WatchdogSec=``. The watchdog is fed from
the event loop itself, so a blocked loop (which would also miss MQTT keepalives) gets the
service restarted. Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

logger = logging.getLogger(__name__)

WATCHDOG_SHARE = 0.5
"""Ping the watchdog at this share of ``WatchdogSec`` (systemd's recommendation)."""


def notify(*states: str) -> bool:
    """Send ``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``STOPPING=1``...; False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(states).encode())
    except OSError as exc:
        logger.warning("sd_notify to %s failed: %s", address, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between pings if systemd asked for a watchdog for this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(0.01, int(usec) / 1e6 * WATCHDOG_SHARE)
    except ValueError:
        return None


async def watchdog() -> None:
    """Feed the systemd watchdog from the event loop until cancelled (returns at once if none)."""
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
