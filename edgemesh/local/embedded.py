"""The embedded MQTT broker (amqtt): the default broker when Mosquitto is not installed.

It speaks MQTT 3.1.1 only: a v5 CONNECT is answered with a 3.1.1 CONNACK carrying return code 1
("unacceptable protocol version"). amqtt sets no payload-size limit of its own on TCP listeners:
a PUBLISH may carry up to the MQTT maximum remaining length of 268,435,455 bytes.

* :class:`EmbeddedBroker` runs it inside the current event loop (``async with EmbeddedBroker() as b``).
* :func:`run_embedded_broker` runs it until cancelled or signalled; it backs ``edgemesh broker`` and
  ``python -m edgemesh.local.embedded --host H --port P`` (what ``BrokerProcess.embedded`` starts).

This is the only module that imports amqtt: nothing a service runs imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self

from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session

from edgemesh.common.errors import BrokerError
from edgemesh.local.broker import LOCALHOST, READY_LINE, client_host, free_port

logger = logging.getLogger(__name__)

EMBEDDED_BIND_ATTEMPTS = 5
"""Free ports tried by :class:`EmbeddedBroker` with ``port=0`` before giving up."""
EMBEDDED_SESSION_EXPIRY = 3600
"""Seconds the embedded broker keeps a disconnected persistent (clean_session=False) session."""


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


_OPEN_AUTH_PLUGIN = "edgemesh.local.embedded.OpenAuthPlugin"


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
        return f"mqtt://{client_host(self.host)}:{self.port}"

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the embedded broker in the foreground; log to stderr, print the ready line to stdout."""
    parser = argparse.ArgumentParser(
        prog="python -m edgemesh.local.embedded",
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


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh broker``: where to listen."""
    parser.add_argument("--host", default=LOCALHOST)
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=lambda args: main(["--host", args.host, "--port", str(args.port),
                                                "--log-level", args.log_level]))


if __name__ == "__main__":
    sys.exit(main())
