"""What every service does the same way: consume with counted rejections, publish events,
and answer control commands (DESIGN.md §7)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from edgemesh.common.bus import Bus, Incoming
from edgemesh.common.errors import WireError
from edgemesh.common.messages import ControlCommand, ControlReply, Event, Scalar
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics

ControlResult = tuple[bool, str, dict[str, Scalar]]
"""(ok, message, result) of one command."""


async def consume(bus: Bus, metrics: ServiceMetrics, dispatch: Callable[[Incoming], Awaitable[None]]) -> None:
    """Hand every message to ``dispatch``; a WireError is counted by reason and the loop goes on."""
    async for msg in bus.messages():
        try:
            await dispatch(msg)
        except WireError as exc:
            metrics.reject(exc.reason, msg.topic, exc)


class Operations:
    """A service's audit events and its side of the control protocol."""

    def __init__(self, *, source: str, bus: Bus, topics: Topics, metrics: ServiceMetrics,
                 stop: asyncio.Event) -> None:
        self.source = source
        self.bus = bus
        self.topics = topics
        self.metrics = metrics
        self.stop = stop

    async def event(self, kind: str, message: str, **data: Any) -> None:
        await self.bus.publish(self.topics.events(), Event(kind=kind, source=self.source, time=time.time(),
                                                           message=message, data=data))

    async def control(self, cmd: ControlCommand, apply: Callable[[ControlCommand], Awaitable[ControlResult]]) -> None:
        """Check expiry, apply, reply (on ``reply_to`` or ``control-reply/{requester}``), log an event.

        ``stop`` is honoured after the reply went out, since stopping cancels the caller.
        """
        self.metrics.received_messages.labels(kind="control").inc()
        where = self.topics.control(self.source)
        if cmd.expires_at and time.time() > cmd.expires_at:
            self.metrics.reject("expired", where, f"{cmd.command} expired")
            await self.event("control_expired", f"ignored expired command {cmd.command}", command=cmd.command,
                             requester=cmd.requester)
            return
        ok, text, result = await apply(cmd)
        if not ok:
            self.metrics.reject("bad_command", where, text)
        reply = ControlReply(request_id=cmd.request_id, source=self.source, command=cmd.command, ok=ok,
                             message=text, result=result)
        await self.bus.publish(cmd.reply_to or self.topics.control_reply(cmd.requester), reply)
        await self.event("control", f"{cmd.command} from {cmd.requester}: {text}", command=cmd.command,
                         requester=cmd.requester, ok=ok)
        if ok and cmd.command == "stop":
            self.stop.set()
