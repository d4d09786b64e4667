"""What operators and services say to each other: control commands, replies, audit events."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from edgemesh.common.messages.checks import check_name
from edgemesh.common.vocabulary import MAX_TOPIC_CHARS, valid_topic
from edgemesh.common.wire import message

Scalar = str | int | float | bool | None
"""A control value or result, an event datum."""
LIST_MAX_CHARS = 2000
"""Longest list of names in a control reply or an event (wire strings are bounded); the names that
do not fit are counted instead."""
SERVICE_COMMANDS: Mapping[str, tuple[str, ...]] = {
    "ps": ("status", "pause", "resume", "set-sync-policy", "set-bound", "set-lr", "set-aggregation", "snapshot",
           "stop"),
    "planner": ("status", "replan", "drain-device", "undrain-device", "stop"),
    "compressor": ("status", "set-codec", "stop"),
}
"""The commands each service answers on ``control/{service}`` (and ``control/all``); a worker answers ``status`` and
``stop``."""


def target_of(command: str) -> str:
    """The service a command goes to when the operator names none: the one service that answers it, else ``ps``."""
    answering = [service for service, commands in SERVICE_COMMANDS.items() if command in commands]
    return answering[0] if len(answering) == 1 else "ps"


def listing(names: Sequence[str], limit: int = LIST_MAX_CHARS) -> str:
    """Comma-separated names, cut to about ``limit`` characters with a count of the rest."""
    shown: list[str] = []
    size = 0
    for name in names:
        if size + len(name) + 1 > limit:
            shown.append(f"...(+{len(names) - len(shown)} more)")
            break
        shown.append(name)
        size += len(name) + 1
    return ",".join(shown)


@message("control")
@dataclass(frozen=True, slots=True, kw_only=True)
class ControlCommand:
    """An operator's command on ``control/{target}``; also accepted as a UTF-8 JSON body."""

    command: str
    value: Scalar = None
    device: str = ""
    request_id: str = ""
    requester: str = "operator"
    reply_to: str = ""
    """Topic for the ControlReply; default ``control-reply/{requester}``. No wildcards, at most
    ``topics.MAX_TOPIC_CHARS`` characters."""
    expires_at: float = 0.0
    """Unix time after which the command is ignored (0 = never)."""

    def validate(self) -> None:
        if not self.command or len(self.command) > 64:
            raise ValueError("command length out of range")
        check_name("requester", self.requester)
        if self.device:
            check_name("device", self.device)
        if self.reply_to and not valid_topic(self.reply_to):
            raise ValueError(f"reply_to must be a topic of at most {MAX_TOPIC_CHARS} characters without wildcards")


@message("control_reply")
@dataclass(frozen=True, slots=True, kw_only=True)
class ControlReply:
    request_id: str
    source: str
    command: str
    ok: bool
    message: str = ""
    result: dict[str, Scalar] = field(default_factory=dict)


@message("event")
@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """An audit-trail entry on ``events``: replans, rejections, control actions, evaluations."""

    kind: str
    source: str
    time: float
    message: str = ""
    data: dict[str, Scalar] = field(default_factory=dict)
