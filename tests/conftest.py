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

    Without the ``mosquitto`` binary the Mosquitto fixtures skip their test, saying what to install
    (``requires_binary`` below).

Programs outside Python
    A test that runs one (``mosquitto_pub``, ``prometheus``, ``ip``, ...) says so with
    ``@pytest.mark.requires_binary(name, ...)``, one that needs root with ``@pytest.mark.requires_root(what)``
    (helpers: ``require_binary``, ``require_root``): when it is missing the test is reported as skipped with
    the reason and the package to install, and fails under ``CI=true`` (CI must run them all). Run as root
    where ``apt-get`` is, the test run first installs the missing packages, once (``TESTS_INSTALL=0`` opts out).

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
from helpers import install_programs, missing_packages, require_binary, require_root, what_missing_does

from edgemesh.common.bus import forget_protocols
from edgemesh.local.broker import BrokerProcess

# --- brokers ---------------------------------------------------------------------------------

BROKER_KINDS = ("mosquitto", "amqtt")
"""Parameter ids of the ``broker`` fixture, one per broker implementation."""


def _new_broker(kind: str) -> BrokerProcess:
    """A new broker of ``kind`` on a free port, not yet started (BrokerError if unavailable)."""
    if kind == "mosquitto":
        require_binary("mosquitto")
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


# --- programs outside Python ----------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """The markers of required programs; the run's first process (not an xdist worker) installs missing ones."""
    config.addinivalue_line("markers", "requires_binary(*names): programs the test runs; skipped without them "
                                       "(failed under CI=true)")
    config.addinivalue_line("markers", "requires_root(what): the test needs root; skipped without it "
                                       "(failed under CI=true)")
    if hasattr(config, "workerinput") or config.option.help:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")

    def log(line: str) -> None:
        if reporter is not None:
            reporter.write_line(f"tests/conftest.py: {line}")
        else:
            print(f"tests/conftest.py: {line}", file=sys.stderr)

    install_programs(log)


def pytest_report_header(config: pytest.Config) -> str:
    """Which packages of the tests' programs are missing, and what that does to the tests that need them."""
    missing = missing_packages()
    if not missing:
        return "programs: every one the tests run is installed"
    return f"programs: packages {' '.join(missing)} not installed: {what_missing_does()}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test's ``requires_binary`` and ``requires_root`` markers, checked before any of its fixtures starts."""
    for marker in item.iter_markers("requires_root"):
        require_root(*marker.args)
    for marker in item.iter_markers("requires_binary"):
        for name in marker.args:
            require_binary(name)


# --- the order the suite's two processes take the files in --------------------------------------

LONG_FIRST = ("test_bench_fleet.py", "test_bench.py", "test_jobs_fleet.py", "test_bench_mesh.py",
              "test_bench_fast_path.py", "test_end_to_end.py", "test_faults.py", "test_robust_ps.py",
              "test_sharded_ps.py", "test_emulation.py")
"""Files whose tests take minutes in all, longest first (``--durations``): handed out before the rest, so that the run
does not end on one of them while the other process idles (``--dist loadfile`` hands files out in collection order
with ``--no-loadscope-reorder``; xdist's own order puts the files of fewest tests, these among them, last)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of ``LONG_FIRST`` first, in its order; the others after them, as collected."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))


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
