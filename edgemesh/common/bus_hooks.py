"""What a service does on every (re)connect of its bus (``Bus.on_connect``): announce itself, publish its retained
state again. The hooks run in order, in a task of their own beside the reading of messages (``Bus`` cancels it
if the connection is lost, and the next connection runs them all again); one that fails is logged, not fatal."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import aiomqtt

from edgemesh.common.errors import BusError

logger = logging.getLogger("edgemesh.common.bus")

Hook = Callable[[], Awaitable[None]]


class ConnectHooks:
    """The ``on_connect`` hooks of one bus."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self._hooks: list[Hook] = []

    def add(self, hook: Hook) -> None:
        self._hooks.append(hook)

    async def run(self) -> None:
        """Every hook, in order; a failure is logged and the next hook runs."""
        for hook in self._hooks:
            name = getattr(hook, "__qualname__", repr(hook))
            try:
                await hook()
            except (BusError, aiomqtt.MqttError) as exc:
                logger.warning("%s: %s after connecting failed: %s", self.client_id, name, exc)
            except Exception:
                logger.exception("%s: %s after connecting failed", self.client_id, name)
