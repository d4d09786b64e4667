"""Operator tools: ``edgemesh devices`` and ``edgemesh ctl``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid

from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.errors import WireError
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    ControlReply,
    DeviceHello,
    DeviceStats,
    DeviceStatus,
    Plan,
    Scalar,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics

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


async def list_devices(config: Config, *, wait_s: float) -> int:
    """Print the job's devices from their retained hello/status, the plan and the codec policies."""
    topics = Topics(config.job)
    hello: dict[str, DeviceHello] = {}
    status: dict[str, DeviceStatus] = {}
    stats: dict[str, DeviceStats] = {}
    codec: dict[str, CodecPolicy] = {}
    plan: Plan | None = None
    metrics = ServiceMetrics("operator")
    async with Bus(config.broker, client_id=f"edgemesh-devices-{uuid.uuid4().hex[:8]}", metrics=metrics,
                   subscriptions=[topics.all_hello(), topics.all_status(), topics.all_stats(), topics.plan(),
                                  topics.all_codec()]) as bus:
        await bus.wait_connected()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                async for msg in bus.messages():
                    try:
                        match topics.relative(msg.topic):
                            case ["device", name, "hello"]:
                                hello[name] = msg.decode(DeviceHello)
                            case ["device", name, "status"]:
                                status[name] = msg.decode(DeviceStatus)
                            case ["device", name, "stats"]:
                                stats[name] = msg.decode(DeviceStats)
                            case ["codec", name]:
                                codec[name] = msg.decode(CodecPolicy)
                            case ["plan"]:
                                plan = msg.decode(Plan)
                    except WireError:
                        continue
    names = sorted(set(hello) | set(status))
    if not names:
        print(f"no devices in job {config.job!r} on {config.broker.url}")
        return 1
    header = f"{'device':<16} {'state':<8} {'GFLOP/s':>8} {'mem MiB':>8} {'cluster':<14} {'batch':>5} " \
             f"{'codec':<6} {'steps':>6} {'step ms':>8} {'version':>7}"
    print(header)
    for name in names:
        h, st, s, c = hello.get(name), status.get(name), stats.get(name), codec.get(name)
        member = plan.device(name) if plan else None
        print(f"{name:<16} {st.state if st else '?':<8} "
              f"{h.flops / 1e9 if h else 0:>8.2f} {h.memory_bytes / 2**20 if h else 0:>8.0f} "
              f"{member.cluster if member else '-':<14} {member.batch_size if member else 0:>5} "
              f"{c.codec if c else '-':<6} {s.steps if s else 0:>6} {s.step_time_s * 1e3 if s else 0:>8.1f} "
              f"{s.model_version if s else 0:>7}")
    if plan is not None:
        print(f"\nplan v{plan.version}: {len(plan.clusters)} clusters, policy {plan.sync_policy}, "
              f"bound {plan.staleness_bound}, model {plan.model_spec}")
    return 0


async def send_command(config: Config, *, target: str, command: str, value: str | None, device: str,
                       timeout_s: float) -> int:
    """Publish a ControlCommand and print the replies that arrive within ``timeout_s``."""
    topics = Topics(config.job)
    requester = f"ctl-{uuid.uuid4().hex[:8]}"
    request_id = uuid.uuid4().hex
    cmd = ControlCommand(command=command, value=parse_value(value), device=device, request_id=request_id,
                         requester=requester, expires_at=time.time() + COMMAND_TTL_S)
    metrics = ServiceMetrics("operator")
    replies = 0
    ok = True
    async with Bus(config.broker, client_id=f"edgemesh-{requester}", metrics=metrics,
                   subscriptions=[topics.control_reply(requester)]) as bus:
        await bus.wait_connected()
        await bus.publish(topics.control(target), cmd)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                async for msg in bus.messages():
                    try:
                        reply = msg.decode(ControlReply)
                    except WireError:
                        continue
                    if reply.request_id != request_id:
                        continue
                    replies += 1
                    ok = ok and reply.ok
                    print(json.dumps({"source": reply.source, "ok": reply.ok, "message": reply.message,
                                      "result": reply.result}))
                    if target != "all":
                        break
    if not replies:
        print(f"no reply from {target} within {timeout_s:.0f}s", file=sys.stderr)
        return 1
    return 0 if ok else 1
