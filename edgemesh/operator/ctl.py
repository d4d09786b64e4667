"""``edgemesh ctl``: send one control command and print the replies (docs/operations.md).

The command carries a request id, the requester's reply topic (``control-reply/{requester}``) and
an expiry time, so a late delivery is ignored. Replies are printed as JSON lines; the exit code is
0 when every reply says ok, 1 when one does not or none came within ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid

from edgemesh import cli
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.messages import ControlCommand, ControlReply, Scalar
from edgemesh.common.messages.operations import SERVICE_COMMANDS, target_of
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.operator.job import with_job

COMMAND_TTL_S = 60.0
"""A command from ``edgemesh ctl`` expires after this long (a late delivery is ignored)."""


def parse_value(text: str | None) -> Scalar:
    """``--value`` as the JSON scalar it spells (4 -> int, 0.1 -> float, true -> bool), else a string."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, (str, int, float, bool)) or value is None else text


async def send_command(config: Config, *, target: str, command: str, value: str | None, device: str,
                       timeout_s: float) -> int:
    """Publish a ControlCommand and print the replies that arrive within ``timeout_s``."""
    topics = Topics(config.job)
    requester = f"ctl-{uuid.uuid4().hex[:8]}"
    request_id = uuid.uuid4().hex
    cmd = ControlCommand(command=command, value=parse_value(value), device=device, request_id=request_id,
                         requester=requester, expires_at=time.time() + COMMAND_TTL_S)
    replies: asyncio.Queue[ControlReply] = asyncio.Queue()

    async def on_reply(reply: ControlReply, _: TopicMatch) -> None:
        if reply.request_id == request_id:
            await replies.put(reply)

    bus = Bus(config.broker, client_id=f"edgemesh-{requester}", metrics=ServiceMetrics("operator"))
    bus.route(topics.reply_filter(requester), ControlReply, on_reply)
    count, ok = 0, True
    async with bus:
        await bus.publish(topics.control(target), cmd)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while True:
                    reply = await replies.get()
                    count += 1
                    ok = ok and reply.ok
                    print(json.dumps({"source": reply.source, "ok": reply.ok, "message": reply.message,
                                      "result": reply.result}))
                    if target != "all":
                        break
    if not count:
        print(f"no reply from {target} within {timeout_s:.0f}s", file=sys.stderr)
        return 1
    return 0 if ok else 1


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh ctl COMMAND``: the configuration flags, the target, value, device and timeout."""
    cli.config_flags(parser)
    parser.add_argument("command", help="; ".join(f"{service}: {', '.join(commands)}"
                                                   for service, commands in SERVICE_COMMANDS.items()))
    parser.add_argument("--target", help="planner | ps | compressor | all | device/ID (default: the service that "
                        "answers COMMAND, ps for status and stop)")
    parser.add_argument("--value", help="command argument (numbers are sent as numbers)")
    parser.add_argument("--device", dest="device_name", help="device the command is about")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="how long to wait for the reply")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    config = with_job(cli.load(args))
    cli.setup_logging(config.log_level if args.log_level else "WARNING")
    target = args.target or target_of(args.command)
    return asyncio.run(send_command(config, target=target, command=args.command, value=args.value,
                                    device=args.device_name or "", timeout_s=args.timeout_s))
