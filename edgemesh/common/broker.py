"""Local MQTT brokers: the embedded amqtt broker and broker child processes.

Three ways to get a broker on this machine:

* :class:`EmbeddedBroker` runs the amqtt broker inside the current event loop
  (``async with EmbeddedBroker() as broker: ... broker.url``).
* :func:`run_embedded_broker` runs it until cancelled or signalled; it backs
  ``edgemesh broker`` and ``python -m edgemesh.common.broker --host H --port P``.
* :class:`BrokerProcess` runs Mosquitto or the embedded broker in a child process on
  a port fixed at construction, so a test or the ``edgemesh demo`` orchestrator can
  kill it and restart it on the same address.

The embedded broker speaks MQTT 3.1.1 only: a v5 CONNECT is answered with a 3.1.1
CONNACK carrying return code 1 ("unacceptable protocol version"). amqtt sets no
payload-size limit of its own on TCP listeners: a PUBLISH may carry up to the MQTT
maximum remaining length of 268,435,455 bytes (its websocket listeners, unused
here, inherit the ``websockets`` default frame limit of 1 MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, Self

from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session

from edgemesh.common.errors import BrokerError

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
MOSQUITTO_SEARCH_PATH = os.pathsep.join(["/usr/sbin", "/usr/local/sbin"])
"""Where :func:`find_mosquitto` looks when ``mosquitto`` is not on PATH (Debian installs it in sbin)."""

PORT_POLL_INTERVAL = 0.05
"""Seconds between two connection attempts while waiting for a port to accept."""
PORT_CONNECT_TIMEOUT = 0.5
"""Timeout of one connection attempt while waiting for a port."""
EMBEDDED_BIND_ATTEMPTS = 5
"""Free ports tried by :class:`EmbeddedBroker` with ``port=0`` before giving up."""
EMBEDDED_SESSION_EXPIRY = 3600
"""Seconds the embedded broker keeps a disconnected persistent (clean_session=False) session."""
STDERR_TAIL_LINES = 20
"""Lines of a child's log quoted in a :class:`BrokerError`."""
RESTART_BACKOFF = 0.1
"""Seconds between two spawn attempts while the old socket still holds the port."""
KEPT_LOG_BYTES = 64 * 1024
"""How much of an exited child's log :meth:`BrokerProcess.log_text` keeps (its end)."""

READY_LINE = "edgemesh broker listening on"
"""Printed to stdout by `python -m edgemesh.common.broker`, then the URL, once clients can connect."""

BrokerKind = Literal["mosquitto", "amqtt"]


# ---------------------------------------------------------------------------------------------
# ports


def free_port(host: str = LOCALHOST) -> int:
    """Return a TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_accepts(host: str, port: int, timeout: float = PORT_CONNECT_TIMEOUT) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted now."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_port(host: str, port: int, timeout: float) -> None:
    """Block until ``host:port`` accepts a TCP connection; raise :class:`BrokerError` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not port_accepts(host, port, min(PORT_CONNECT_TIMEOUT, max(timeout, 0.01))):
        if time.monotonic() >= deadline:
            raise BrokerError(f"nothing accepted connections on {host}:{port} within {timeout:g} s")
        time.sleep(PORT_POLL_INTERVAL)


async def wait_port_async(host: str, port: int, timeout: float) -> None:  # noqa: ASYNC109 - mirrors wait_port
    """Wait until ``host:port`` accepts a TCP connection; raise :class:`BrokerError` after ``timeout`` s."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    async with asyncio.timeout(PORT_CONNECT_TIMEOUT):
                        _, writer = await asyncio.open_connection(host, port)
                except (OSError, TimeoutError):
                    await asyncio.sleep(PORT_POLL_INTERVAL)
                    continue
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return
    except TimeoutError:
        raise BrokerError(f"nothing accepted connections on {host}:{port} within {timeout:g} s") from None


def _client_host(host: str) -> str:
    """The address a local client uses to reach a listener bound to ``host``."""
    return LOCALHOST if host in ("", "0.0.0.0") else host  # noqa: S104 - comparing, not binding


# ---------------------------------------------------------------------------------------------
# embedded amqtt broker


class OpenAuthPlugin(BaseAuthPlugin):
    """amqtt auth plugin that admits every client as a regular, non-anonymous session.

    amqtt's ``AnonymousAuthPlugin`` marks every session it admits as anonymous, and amqtt
    drops anonymous sessions on disconnect even with ``clean_session=False``, so QoS 1
    messages for an offline persistent subscriber are lost. This plugin keeps the
    Mosquitto behaviour (``allow_anonymous true``): persistent sessions survive a
    reconnect, bounded by :data:`EMBEDDED_SESSION_EXPIRY`.
    """

    async def authenticate(self, *, session: Session) -> bool:
        return True


_OPEN_AUTH_PLUGIN = "edgemesh.common.broker.OpenAuthPlugin"


def embedded_broker_config(host: str, port: int) -> dict[str, Any]:
    """amqtt ``BrokerConfig`` dict: one TCP listener, anonymous clients, no ``$SYS`` and no packet logger.

    Listing ``plugins`` explicitly replaces amqtt's defaults (event logger, packet logger,
    anonymous auth, ``$SYS`` publisher); an empty auth list would reject every client.
    """
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        "session_expiry_interval": EMBEDDED_SESSION_EXPIRY,
        "plugins": {_OPEN_AUTH_PLUGIN: {}},
    }


class EmbeddedBroker:
    """The amqtt broker, run in the current event loop for the life of an ``async with`` block.

    ``port=0`` picks a free port; the chosen one is in :attr:`port` once entered.
    """

    def __init__(self, host: str = LOCALHOST, port: int = 0) -> None:
        self.host = host
        self.port = port
        self._broker: Any = None

    @property
    def url(self) -> str:
        return f"mqtt://{_client_host(self.host)}:{self.port}"

    async def __aenter__(self) -> Self:
        from amqtt.broker import Broker

        attempts = EMBEDDED_BIND_ATTEMPTS if self.port == 0 else 1
        last_error: Exception | None = None
        for _ in range(attempts):
            port = self.port or free_port(self.host)
            try:
                broker = Broker(embedded_broker_config(self.host, port))
                await broker.start()
            except Exception as exc:  # amqtt wraps bind and plugin failures in its own errors
                last_error = exc
                logger.debug("embedded broker could not start on %s:%s: %s", self.host, port, exc)
                continue
            self.port = port
            self._broker = broker
            logger.info("embedded MQTT broker listening on %s:%s", self.host, port)
            return self
        raise BrokerError(f"embedded broker could not start on {self.host}:{self.port}: {last_error}") from (
            last_error
        )

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        broker, self._broker = self._broker, None
        if broker is not None:
            await broker.shutdown()
            logger.info("embedded MQTT broker on %s:%s stopped", self.host, self.port)


async def run_embedded_broker(host: str, port: int, *, ready: Callable[[str], None] | None = None) -> None:
    """Serve the embedded broker on ``host:port`` until cancelled, SIGTERM or SIGINT.

    ``ready`` is called with the URL once the listener accepts connections. A signal
    makes this coroutine return normally after shutting the broker down.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no Unix signals
            continue
        handled.append(sig)
    try:
        async with EmbeddedBroker(host, port) as broker:
            if ready is not None:
                ready(f"mqtt://{host}:{broker.port}")
            await stop.wait()
            logger.info("signal received, stopping the embedded broker")
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


# ---------------------------------------------------------------------------------------------
# broker child processes


def find_mosquitto() -> str | None:
    """Path of the ``mosquitto`` binary: PATH first, then the sbin directories."""
    return shutil.which("mosquitto") or shutil.which("mosquitto", path=MOSQUITTO_SEARCH_PATH)


_live: set[BrokerProcess] = set()
_live_lock = threading.Lock()


@atexit.register
def _kill_leftovers() -> None:
    """Safety net: kill every broker child a forgotten ``stop()`` left running."""
    with _live_lock:
        leftovers = list(_live)
    for proc in leftovers:
        proc.kill()


def parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes Linux SIGTERM the child if this process dies without cleanup.

    The signal follows the thread that forked, so it is armed only for children started
    from the main thread (a worker thread of ``asyncio.to_thread`` may end any time).
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def arm() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)

    return arm


class BrokerProcess:
    """An MQTT broker in a child process on a fixed local port.

    Build one with :meth:`mosquitto`, :meth:`embedded` or :meth:`default`; then
    ``start()``/``stop()``/``kill()``/``restart()``, or use it as a context manager.
    The port is chosen at construction and kept across restarts. The child runs in its
    own session, so a Ctrl-C in a terminal reaches only the parent, which stops it; its
    output goes to a temporary log file (read it with :meth:`log_text`).
    """

    def __init__(
        self,
        kind: BrokerKind,
        port: int | None = None,
        *,
        extra_config: str = "",
        workdir: Path | None = None,
    ) -> None:
        self.kind: BrokerKind = kind
        self.host = LOCALHOST
        self.port = port or free_port(self.host)
        self._extra_config = extra_config
        self._workdir = Path(workdir) if workdir is not None else None
        self._tmpdir: Path | None = None
        self._mosquitto = find_mosquitto() if kind == "mosquitto" else None
        if kind == "mosquitto" and self._mosquitto is None:
            raise BrokerError("the mosquitto binary is not on PATH nor in /usr/sbin; install mosquitto")
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._exited_log = ""

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def mosquitto(
        cls, port: int | None = None, extra_config: str = "", workdir: Path | None = None
    ) -> BrokerProcess:
        """Mosquitto: ``listener PORT 127.0.0.1``, anonymous clients, no persistence, then ``extra_config``.

        ``mosquitto.conf`` is written to ``workdir`` (a temporary directory by default).
        When this process is root, Mosquitto stays root (``user root``) so that it dies
        with its parent; if ``extra_config`` sets ``user``, files it names must be
        readable by that user.
        """
        return cls("mosquitto", port, extra_config=extra_config, workdir=workdir)

    @classmethod
    def embedded(cls, port: int | None = None) -> BrokerProcess:
        """The embedded amqtt broker, run as ``python -m edgemesh.common.broker``."""
        return cls("amqtt", port)

    @classmethod
    def default(cls, port: int | None = None) -> BrokerProcess:
        """Mosquitto when it is installed, else the embedded broker."""
        if find_mosquitto() is not None:
            return cls.mosquitto(port)
        return cls.embedded(port)

    # -- properties ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the running child, or None."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def returncode(self) -> int | None:
        """Exit code of the last child; None while it runs or before the first start."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __repr__(self) -> str:
        return f"<BrokerProcess {self.kind} {self.url} pid={self.pid}>"

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 10) -> None:
        """Start the child and wait until its port accepts connections.

        While the previous socket of this port is still held (a child that was just
        killed), spawning is retried until ``timeout``. Raises :class:`BrokerError`
        with the tail of the child's log if it exits or does not listen in time.
        """
        if self.running:
            raise BrokerError(f"{self!r} is already running")
        self._reap()
        if port_accepts(self.host, self.port):
            raise BrokerError(f"another process already listens on {self.host}:{self.port}")
        deadline = time.monotonic() + timeout
        while True:
            proc = self._spawn()
            while proc.poll() is None and not self._listening():
                if time.monotonic() >= deadline:
                    self.kill()
                    raise BrokerError(
                        f"{self.kind} broker did not listen on {self.host}:{self.port} within {timeout:g} s"
                        f"\n{self._log_tail()}"
                    )
                time.sleep(PORT_POLL_INTERVAL)
            if proc.poll() is None:
                logger.info("%s broker started on %s (pid %s)", self.kind, self.url, proc.pid)
                return
            tail = self._log_tail()
            self._reap()
            if "address already in use" in tail.lower() and time.monotonic() + RESTART_BACKOFF < deadline:
                logger.debug("port %s still in use, retrying", self.port)
                time.sleep(RESTART_BACKOFF)
                continue
            raise BrokerError(
                f"{self.kind} broker exited with code {proc.returncode} before listening on "
                f"{self.host}:{self.port}\n{tail}"
            )

    def stop(self, timeout: float = 5) -> None:
        """SIGTERM the child, then SIGKILL it if it has not exited within ``timeout`` s."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s broker pid %s ignored SIGTERM, killing it", self.kind, proc.pid)
                self._signal(signal.SIGKILL)
                proc.wait()
            logger.info("%s broker on %s stopped", self.kind, self.url)
        self._reap()

    def kill(self) -> None:
        """SIGKILL the child (a crash, as far as clients can tell) and wait for it."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._signal(signal.SIGKILL)
            proc.wait()
            logger.info("%s broker on %s killed", self.kind, self.url)
        self._reap()

    def restart(self, timeout: float = 10) -> None:
        """Stop the child if it runs, then start a new one on the same port."""
        self.stop()
        self.start(timeout)

    def log_text(self) -> str:
        """What the running child wrote to stdout and stderr, or the end of the last child's."""
        if self._log is None:
            return self._exited_log
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ----------------------------------------------------------------------------

    def _command(self) -> list[str]:
        if self.kind == "amqtt":
            return [
                sys.executable,
                "-m",
                "edgemesh.common.broker",
                "--host",
                self.host,
                "--port",
                str(self.port),
            ]
        directory = self._workdir
        if directory is None:
            directory = self._tmpdir = Path(tempfile.mkdtemp(prefix="edgemesh-mosquitto-"))
            directory.chmod(0o755)  # readable after Mosquitto drops to a `user` from extra_config
        directory.mkdir(parents=True, exist_ok=True)
        conf = directory / "mosquitto.conf"
        # Run as root, Mosquitto switches to the mosquitto user, and that change of
        # credentials clears the parent-death signal: keep the parent's user instead.
        keep_root = os.geteuid() == 0 and not re.search(r"^\s*user\s", self._extra_config, re.MULTILINE)
        lines = [
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            "persistence false",
            "set_tcp_nodelay true",
            "log_dest stderr",
            *(["user root"] if keep_root else []),
            self._extra_config,
        ]
        conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
        conf.chmod(0o644)
        assert self._mosquitto is not None
        return [self._mosquitto, "-c", str(conf)]

    def _spawn(self) -> subprocess.Popen[bytes]:
        command = self._command()
        self._exited_log = ""
        self._log = tempfile.TemporaryFile(prefix="edgemesh-broker-", suffix=".log")
        logger.debug("starting %s", " ".join(command))
        self._proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=parent_death_signal(),
        )
        with _live_lock:
            _live.add(self)
        return self._proc

    def _listening(self) -> bool:
        """Whether the child accepts connections yet.

        The embedded broker prints a ready line once its listener is bound; waiting for
        it spares amqtt a probe connection that it would log as an error.
        """
        if self.kind == "amqtt":
            return READY_LINE in self.log_text()
        return port_accepts(self.host, self.port)

    def _signal(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        # The child leads its own process group (start_new_session): signal the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, sig)

    def _reap(self) -> None:
        """Forget an exited child: keep the end of its log, remove the temporary config directory."""
        if self._proc is not None and self._proc.poll() is None:
            return
        with _live_lock:
            _live.discard(self)
        if self._log is not None:
            self._exited_log = self.log_text()[-KEPT_LOG_BYTES:]
            self._log.close()
            self._log = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _log_tail(self, lines: int = STDERR_TAIL_LINES) -> str:
        text = self.log_text().strip()
        return "\n".join(text.splitlines()[-lines:]) if text else "(no output)"


# ---------------------------------------------------------------------------------------------
# python -m edgemesh.common.broker


def main(argv: Sequence[str] | None = None) -> int:
    """Run the embedded broker in the foreground; log to stderr, print the ready line to stdout."""
    parser = argparse.ArgumentParser(
        prog="python -m edgemesh.common.broker",
        description="Run the embedded MQTT 3.1.1 broker (amqtt) until SIGTERM or SIGINT.",
    )
    parser.add_argument("--host", default=LOCALHOST, help="address to listen on (default %(default)s)")
    parser.add_argument(
        "--port", type=int, default=1883, help="TCP port, 0 for a free one (default %(default)s)"
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (default %(default)s; amqtt's own logs stay at WARNING and above)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # amqtt logs every connection at INFO; keep its warnings only.
    for name in ("amqtt", "transitions"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))

    def ready(url: str) -> None:
        print(f"{READY_LINE} {url}", flush=True)

    try:
        asyncio.run(run_embedded_broker(args.host, args.port, ready=ready))
    except BrokerError as exc:
        logger.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
