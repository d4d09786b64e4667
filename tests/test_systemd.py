"""sd_notify readiness and the watchdog, received on a real unix datagram socket as systemd would."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from edgemesh.common import systemd
from edgemesh.common.config import load_config
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.compressor.service import Compressor

WAIT_S = 20.0


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> socket.socket:
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    return sock


async def receive(sock: socket.socket, wanted: str) -> list[str]:
    """Datagrams until one contains ``wanted``."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    async with asyncio.timeout(WAIT_S):
        while True:
            seen.append((await loop.sock_recv(sock, 4096)).decode())
            if wanted in seen[-1]:
                return seen


def test_no_systemd_means_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert systemd.notify("READY=1") is False
    assert systemd.watchdog_interval() is None


def test_watchdog_interval_is_half_the_timeout_and_only_for_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == pytest.approx(15.0)
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert systemd.watchdog_interval() is None


async def test_service_reports_ready_feeds_the_watchdog_and_says_stopping(
        mosquitto_broker: BrokerProcess, notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    cfg = load_config(env={}, overrides={"broker.url": mosquitto_broker.url, "job": "sd",
                                         "metrics.address": "127.0.0.1:0"})
    service = Compressor(cfg)
    task = asyncio.create_task(service.run())
    try:
        seen = await receive(notify_socket, "READY=1")
        seen += await receive(notify_socket, "WATCHDOG=1")
        seen += await receive(notify_socket, "WATCHDOG=1")  # fed again: a periodic ping, not a one-off
        service.stop.set()
        seen += await receive(notify_socket, "STOPPING=1")
        await asyncio.wait_for(task, WAIT_S)
    finally:
        service.stop.set()
        if not task.done():
            task.cancel()
    assert seen[0].startswith("READY=1")
