"""Shared pytest fixtures for EdgeMesh tests.

Brokers
    Every test that needs MQTT starts its OWN broker on a free port of 127.0.0.1 and
    stops it afterwards; no test uses the machine's broker on 1883. Each fixture yields
    a started :class:`edgemesh.local.broker.BrokerProcess`: connect to ``broker.host``
    and ``broker.port`` (or ``broker.url``), and call ``broker.kill()`` /
    ``broker.restart()`` to simulate a crash and recovery on the same address.

    * ``mosquitto_broker`` - Mosquitto (MQTT 5 and 3.1.1).
    * ``amqtt_broker`` - the embedded amqtt broker in a child process (MQTT 3.1.1 only).
    * ``broker`` - both of the above, one test run each (ids ``mosquitto`` and ``amqtt``).

    The Mosquitto fixtures fail (not skip) when the ``mosquitto`` binary is missing:
    CI machines have it, and a silently skipped broker would hide a gap.

Add new shared fixtures below, grouped under a comment header with a one-line docstring each.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
from collections.abc import Iterator

# hypothesis is imported while collecting, not first by its plugin's end-of-run summary: there, Python 3.11's
# ast.parse (under pytest's rewriting) sometimes failed with "AST constructor recursion depth mismatch" after
# a run of tests that never imported it.
import hypothesis  # noqa: F401
import pytest

from edgemesh.common.bus import forget_protocols
from edgemesh.local.broker import BrokerProcess

# --- brokers ---------------------------------------------------------------------------------

BROKER_KINDS = ("mosquitto", "amqtt")
"""Parameter ids of the ``broker`` fixture, one per broker implementation."""


def _new_broker(kind: str) -> BrokerProcess:
    """A new broker of ``kind`` on a free port, not yet started (BrokerError if unavailable)."""
    if kind == "mosquitto":
        return BrokerProcess.mosquitto()
    if kind == "amqtt":
        return BrokerProcess.embedded()
    raise ValueError(f"unknown broker kind {kind!r}")


@pytest.fixture
def mosquitto_broker() -> Iterator[BrokerProcess]:
    """A Mosquitto broker of this test alone, started on a free port."""
    with _new_broker("mosquitto") as broker:
        yield broker


@pytest.fixture
def amqtt_broker() -> Iterator[BrokerProcess]:
    """The embedded amqtt broker of this test alone, in a child process on a free port."""
    with _new_broker("amqtt") as broker:
        yield broker


@pytest.fixture(params=BROKER_KINDS)
def broker(request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    """Each broker kind in turn (ids ``mosquitto``, ``amqtt``), started for this test alone."""
    with _new_broker(request.param) as started:
        yield started


# --- diagnosis of a hung test ----------------------------------------------------------------

HANG_REPORT_S = 10.0
"""How long before pytest-timeout ends a test its asyncio tasks' stacks are printed: pytest-timeout shows only
threads, and a hung async test is one thread waiting in its selector."""


@pytest.fixture(autouse=True)
def _protocols_probed_afresh() -> None:
    """Each test's buses find out their broker's MQTT version themselves: a port an amqtt broker used in an earlier
    test may be a Mosquitto's now."""
    forget_protocols()


@pytest.fixture(autouse=True)
def _report_hung_tasks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print every running event loop's pending tasks (where each one waits) shortly before the test's timeout."""
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)
    if limit <= HANG_REPORT_S:
        yield
        return
    timer = threading.Timer(limit - HANG_REPORT_S, _print_pending_tasks, args=(request.node.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _print_pending_tasks(test: str) -> None:
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
    print(f"\n~~~ {test} is about to time out; pending asyncio tasks ~~~", file=sys.stderr)
    for loop in loops:
        for task in list(asyncio.all_tasks(loop)):
            task.print_stack(limit=8, file=sys.stderr)
