"""One runtime for every service: ``serve(service, config)`` (docs/architecture.md).

A service is an object with typed components and a few seams (:class:`Service`); ``serve`` does
the rest, the same way for all four:

1. ``service.prepare(stack)``: what comes before the broker (load a checkpoint, measure the
   device); it says how to connect (:class:`Endpoint`: broker, client name, will);
2. ``/metrics`` on the service's own registry;
3. the bus, with ``control/{target}`` and ``control/all`` routed to the control protocol
   (:class:`Control`: expiry, apply, reply, audit event); ``service.attach(bus, events)``
   declares what the service consumes;
4. the ``up`` gauge (and ``on_up()``: a job host marks the job running), ``READY=1`` to systemd, then the bus,
   the watchdog, the host's health readings (``edgemesh_device_*``, unless a job host reads them) and
   ``service.jobs()`` in one TaskGroup until ``stop`` is set or one of them fails (its error ends ``serve``:
   an EdgeMeshError as itself, anything else, ``MemoryError`` or ``RecursionError`` in a step, in its group);
5. ``STOPPING=1`` and ``service.close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from edgemesh.common import systemd
from edgemesh.common.bus import Bus
from edgemesh.common.config import BrokerConfig, Config
from edgemesh.common.errors import EdgeMeshError
from edgemesh.common.health import DeviceHealth, HealthSources
from edgemesh.common.messages import ControlCommand, ControlReply, Event, Scalar
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.tasks import cancel_all
from edgemesh.common.topics import TopicMatch, Topics

logger = logging.getLogger(__name__)

ControlResult = tuple[bool, str, dict[str, Scalar]]
"""(ok, message, result) of one control command."""
Job = Coroutine[Any, Any, None]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How a service connects: its broker (an emulated board's goes through its link), the name in
    its client id, and its will (topic, payload)."""

    broker: BrokerConfig
    name: str = ""
    will: tuple[str, bytes] | None = None


class Service(Protocol):
    """What ``serve`` needs of a service."""

    name: str
    """``ps``, ``planner``, ``compressor`` or ``worker``: metric prefix and client id."""
    control_target: str
    """Its control topic below ``control/``, and the source of its events: ``ps`` or ``device/{id}``."""
    metrics: ServiceMetrics
    stop: asyncio.Event

    async def prepare(self, stack: contextlib.AsyncExitStack) -> Endpoint: ...

    def attach(self, bus: Bus, events: Events) -> None: ...

    async def control(self, cmd: ControlCommand) -> ControlResult: ...

    def jobs(self) -> Sequence[Job]: ...

    async def close(self) -> None: ...


class Events:
    """A service's audit trail on ``events``: replans, evaluations, control actions, refusals."""

    def __init__(self, bus: Bus, topics: Topics, source: str) -> None:
        self.bus, self.topics, self.source = bus, topics, source

    async def emit(self, kind: str, message: str, **data: Scalar) -> None:
        await self.bus.publish(self.topics.events(), Event(kind=kind, source=self.source, time=time.time(),
                                                           message=message, data=data))


class Control:
    """A service's side of the control protocol (docs/operations.md): a command past its expiry is
    ignored, any other is applied, answered on its ``reply_to`` topic (default
    ``control-reply/{requester}``; a device's: that topic, then its name) and logged as an event; ``stop`` is
    honoured once the reply is out."""

    def __init__(self, service: Service, bus: Bus, topics: Topics, events: Events) -> None:
        self.service, self.bus, self.topics, self.events = service, bus, topics, events
        device = service.control_target.removeprefix("device/")
        self.device = device if device != service.control_target else ""

    async def on_command(self, cmd: ControlCommand, match: TopicMatch) -> None:
        if self.device and match.target == "all" and cmd.device and cmd.device != self.device:
            return  # a broadcast command about another device
        metrics, where = self.service.metrics, self.topics.control(match.target)
        if cmd.expires_at and time.time() > cmd.expires_at:
            metrics.reject("expired", where, f"{cmd.command} expired", route="control")
            await self.events.emit("control_expired", f"ignored expired command {cmd.command}", command=cmd.command,
                                   requester=cmd.requester)
            return
        ok, text, result = await self.service.control(cmd)
        if not ok:
            metrics.reject("bad_command", where, text, route="control")
        reply = ControlReply(request_id=cmd.request_id, source=self.service.control_target, command=cmd.command,
                             ok=ok, message=text, result=result)
        topic = cmd.reply_to or self.topics.control_reply(cmd.requester)
        await self.bus.publish(Topics.device_reply(topic, self.device) if self.device else topic, reply)
        await self.events.emit("control", f"{cmd.command} from {cmd.requester}: {text}", command=cmd.command,
                               requester=cmd.requester, ok=ok)
        if ok and cmd.command == "stop":
            self.service.stop.set()


async def serve(service: Service, config: Config, *, signals: bool = False, health: DeviceHealth | None = None,
                on_up: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run ``service`` until its ``stop`` is set (with ``signals``: or SIGINT/SIGTERM).

    ``health``: the host's health readings, exported and kept fresh by a job host serving this service; without
    it the service exports and reads its own. ``on_up``: awaited once the service is prepared and attached, before
    its jobs run.
    """
    if signals:
        install_stop_signals(service.stop)
    topics = Topics(config.job)
    reads_health = health is None
    if health is None:
        health = service.metrics.export_health(HealthSources.of(config.metrics))
    service.metrics.health = health
    async with contextlib.AsyncExitStack() as stack:
        endpoint = await service.prepare(stack)
        service.metrics.serve(config.metrics.address, config.metrics.port_file)
        stack.callback(service.metrics.close)
        bus = Bus(endpoint.broker, client_id=client_id(service.name, config, endpoint.name), metrics=service.metrics,
                  will=endpoint.will, connect_first=False, zero_copy=True)
        events = Events(bus, topics, service.control_target)
        control = Control(service, bus, topics, events)
        for target in (service.control_target, "all"):
            bus.route(topics.control_filter(target), ControlCommand, control.on_command, json_body=True)
        service.attach(bus, events)
        await stack.enter_async_context(bus)  # its routes declared: connecting, while the service runs
        service.metrics.up.set(1)
        try:
            if on_up is not None:
                await on_up()
            readings = [health.watch(config.metrics.health_interval_s)] if reads_health else []
            await supervise(service.stop, *service.jobs(), *readings, transport=bus.wait_closed(),
                            close=service.close)
        finally:
            service.metrics.up.set(0)


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


async def supervise(stop: asyncio.Event, *jobs: Job, transport: Job | None = None,
                    close: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run ``jobs`` and ``transport`` (the bus) in one TaskGroup until ``stop`` is set or one of them
    fails (which stops all and is raised: the first EdgeMeshError as itself, anything else in its
    ExceptionGroup). On the way out the jobs end first, then ``close()`` runs while the transport
    still does (a last checkpoint, an ``offline`` status), then the transport ends.

    It tells systemd the service is ready (``Type=notify``), feeds the watchdog from the event loop
    while the jobs run, and says when it stops.
    """
    systemd.notify("READY=1", "STATUS=running")
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(job) for job in jobs]
            tasks.append(group.create_task(systemd.watchdog()))
            carrier = [group.create_task(transport)] if transport is not None else []
            stopper: asyncio.Future[Any] = group.create_task(stop.wait())
            finished: asyncio.Future[Any] = asyncio.gather(*tasks, *carrier)
            # its outcome is the tasks' (the group raises their errors): read, so that none is "never retrieved"
            # when the way out below is itself cancelled before it awaits it
            finished.add_done_callback(lambda f: f.cancelled() or f.exception())
            try:
                await asyncio.wait([stopper, finished], return_when=asyncio.FIRST_COMPLETED)
            finally:
                systemd.notify("STOPPING=1", "STATUS=stopping")
                try:
                    await cancel_all([stopper, *tasks])  # not ``finished.cancel()``: that would end the transport too
                    if close is not None:
                        await close()
                finally:  # a way out that is itself cancelled still leaves nothing running for the group to wait on
                    await cancel_all([stopper, *tasks, *carrier])
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await finished
    except* EdgeMeshError as failed:
        raise _first(failed) from None


def _first(group: BaseExceptionGroup[EdgeMeshError]) -> EdgeMeshError:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, EdgeMeshError)
    return error


def client_id(service: str, config: Config, name: str = "") -> str:
    """A broker client id unique per job, service and process."""
    return f"edgemesh-{config.job}-{service}-{name or socket.gethostname()}-{os.getpid()}"[:128]

