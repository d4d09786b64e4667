"""Broker processes on this machine: Mosquitto or the embedded broker in a child process.

:class:`BrokerProcess` runs Mosquitto or the embedded broker (``edgemesh.local.embedded``) on a
port fixed at construction, so a test or ``edgemesh demo`` can kill it and restart it on the same
address. The helpers find free ports and wait for a port to accept connections.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
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
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, Self

from edgemesh.common.errors import BrokerError
from edgemesh.local.processes import parent_death_signal

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
MOSQUITTO_SEARCH_PATH = os.pathsep.join(["/usr/sbin", "/usr/local/sbin"])
"""Where :func:`find_mosquitto` looks when ``mosquitto`` is not on PATH (Debian installs it in sbin)."""
PORT_POLL_INTERVAL = 0.05
"""Seconds between two connection attempts while waiting for a port to accept."""
PORT_CONNECT_TIMEOUT = 0.5
"""Timeout of one connection attempt while waiting for a port."""
STDERR_TAIL_LINES = 20
"""Lines of a child's log quoted in a :class:`BrokerError`."""
RESTART_BACKOFF = 0.1
"""Seconds between two spawn attempts while the old socket still holds the port."""
KEPT_LOG_BYTES = 64 * 1024
"""How much of an exited child's log :meth:`BrokerProcess.log_text` keeps (its end)."""
MAX_PACKET_SIZE = 1024 * 1024
"""The ``max_packet_size`` of the Mosquitto a local cluster runs on (``default``: the demo, the benchmarks),
the shipped ``production.conf``'s: the services' chunks grow up to it on loopback."""
MOSQUITTO_MALLOC = "glibc.malloc.mmap_threshold=16777216:glibc.malloc.trim_threshold=67108864"
"""``GLIBC_TUNABLES`` of a Mosquitto started here, as ``deploy/systemd/mosquitto.service.d/edgemesh.conf`` sets for
the system's. Mosquitto allocates every packet it reads and frees it once passed on; glibc gives a freed block of
a megabyte back to the kernel, so each chunk of a gradient or a model was faulted in page by page again (2,200
page faults per version of ``edgemesh bench ddp``, a third of the broker's CPU). Blocks up to 16 MiB now come
from the heap, and up to 64 MiB of it is kept when free: after the first packets, none."""
READY_LINE = "edgemesh broker listening on"
"""Printed to stdout by ``python -m edgemesh.local.embedded``, then the URL, once clients can connect."""

BrokerKind = Literal["mosquitto", "amqtt"]


def _mosquitto_env() -> dict[str, str]:
    """This process's environment, with :data:`MOSQUITTO_MALLOC` after any ``GLIBC_TUNABLES`` of its own."""
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES", ""), MOSQUITTO_MALLOC) if t)
    return env


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


def client_host(host: str) -> str:
    """The address a local client uses to reach a listener bound to ``host``."""
    return LOCALHOST if host in ("", "0.0.0.0") else host  # noqa: S104 - comparing, not binding


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
        max_packet_size: int = 0,
    ) -> None:
        self.kind: BrokerKind = kind
        self.max_packet_size = max_packet_size
        """Mosquitto's ``max_packet_size`` (0: left out)."""
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
        cls, port: int | None = None, extra_config: str = "", workdir: Path | None = None,
        max_packet_size: int = 0,
    ) -> BrokerProcess:
        """Mosquitto: ``listener PORT 127.0.0.1``, anonymous clients, no persistence, ``max_packet_size`` (0: none,
        Mosquitto's default, which takes any size and says no limit), then ``extra_config``.

        ``mosquitto.conf`` is written to ``workdir`` (a temporary directory by default).
        When this process is root, Mosquitto stays root (``user root``) so that it dies
        with its parent; if ``extra_config`` sets ``user``, files it names must be
        readable by that user.
        """
        return cls("mosquitto", port, extra_config=extra_config, workdir=workdir, max_packet_size=max_packet_size)

    @classmethod
    def embedded(cls, port: int | None = None) -> BrokerProcess:
        """The embedded amqtt broker, run as ``python -m edgemesh.local.embedded``."""
        return cls("amqtt", port)

    @classmethod
    def default(cls, port: int | None = None, max_packet_size: int = MAX_PACKET_SIZE) -> BrokerProcess:
        """Mosquitto when it is installed (with ``production.conf``'s ``max_packet_size`` unless told another),
        else the embedded broker."""
        if find_mosquitto() is not None:
            return cls.mosquitto(port, max_packet_size=max_packet_size)
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
                "edgemesh.local.embedded",
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
            # said in every MQTT 5 CONNACK: the services' chunks grow up to it on a fast link
            *([f"max_packet_size {self.max_packet_size}"] if self.max_packet_size else []),
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
            env=_mosquitto_env() if self.kind == "mosquitto" else None,
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
