"""``edgemesh devices``: the devices of a job, from their retained hello, status and stats, the plan
and the codec policies; below the table, the devices out of the job and why (their status: ``left``, or a
refused share of the plan), and why the plan was last re-planned: the planner's answer to ``status`` (which devices
joined, left or were drained, or which smoothed figures moved, with the predicted gain), else the plan's reason.

A device's stats are not retained: it publishes them every ``worker.stats_interval_s``. The command listens until
every online device's stats and the planner's answer are in, or ``--wait`` seconds (by default a little longer than
a stats interval); a device whose stats did not come shows ``-`` in the columns they give, not zeros."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

from edgemesh import cli
from edgemesh.common.bus import Bus
from edgemesh.common.config import Config
from edgemesh.common.health import SLOWED_FLAGS, flag_state
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    ControlReply,
    DeviceHello,
    DeviceStats,
    DeviceStatus,
    Plan,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.operator.job import with_job

M = TypeVar("M")


class Registry:
    """What the job's retained messages say about its devices."""

    def __init__(self) -> None:
        self.hello: dict[str, DeviceHello] = {}
        self.status: dict[str, DeviceStatus] = {}
        self.stats: dict[str, DeviceStats] = {}
        self.codec: dict[str, CodecPolicy] = {}
        self.plan: Plan | None = None
        self.planner: ControlReply | None = None
        """The planner's answer to ``status``, if it answered within the wait."""
        self.heard = asyncio.Event()
        """Set once the planner answered and every online device's stats are in: nothing more to wait for."""

    def check(self) -> None:
        online = {name for name, status in self.status.items() if status.state == "online"}
        if self.planner is not None and online <= set(self.stats):
            self.heard.set()

    def keep(self, into: dict[str, M]) -> Callable[[M, TopicMatch], Awaitable[None]]:
        """A route handler storing each message by the device its topic names."""
        async def store(msg: M, match: TopicMatch) -> None:
            into[match.device] = msg
            self.check()
        return store

    async def keep_plan(self, plan: Plan, _: TopicMatch) -> None:
        self.plan = plan

    async def keep_reply(self, reply: ControlReply, _: TopicMatch) -> None:
        if reply.source == "planner" and reply.ok:
            self.planner = reply
            self.check()


async def list_devices(config: Config, *, wait_s: float) -> int:
    """Print the job's devices; 1 if there are none."""
    topics = Topics(config.job)
    seen = Registry()
    bus = Bus(config.broker, client_id=f"edgemesh-devices-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("operator"))
    bus.route(topics.hello_filter(), DeviceHello, seen.keep(seen.hello))
    bus.route(topics.status_filter(), DeviceStatus, seen.keep(seen.status))
    bus.route(topics.stats_filter(), DeviceStats, seen.keep(seen.stats))
    bus.route(topics.codec_filter(), CodecPolicy, seen.keep(seen.codec))
    bus.route(topics.plan_filter(), Plan, seen.keep_plan)
    requester = f"devices-{uuid.uuid4().hex[:8]}"
    bus.route(topics.reply_filter(requester), ControlReply, seen.keep_reply)
    async with bus:
        await bus.publish(topics.control("planner"), ControlCommand(
            command="status", request_id=uuid.uuid4().hex, requester=requester, expires_at=time.time() + wait_s))
        with contextlib.suppress(TimeoutError):  # retained messages arrive at once, stats every stats interval
            await asyncio.wait_for(seen.heard.wait(), wait_s)
    names = sorted(set(seen.hello) | set(seen.status))
    if not names:
        print(f"no devices in job {config.job!r} on {config.broker.url}")
        return 1
    print(f"{'device':<16} {'state':<8} {'GFLOP/s':>8} {'mem MiB':>8} {'cluster':<14} {'batch':>5} "
          f"{'codec':<6} {'steps':>6} {'step ms':>8} {'version':>7} {'up Mbit':>8} {'down Mbit':>9} {'lat ms':>6} "
          f"{'temp C':>6} {'throttled':<10} {'undervolt':<10}")
    plan = seen.plan
    for name in names:
        h, st, s, c = seen.hello.get(name), seen.status.get(name), seen.stats.get(name), seen.codec.get(name)
        member = plan.device(name) if plan else None
        print(f"{name:<16} {st.state if st else '?':<8} "
              f"{h.flops / 1e9 if h else 0:>8.2f} {h.memory_bytes / 2**20 if h else 0:>8.0f} "
              f"{member.cluster if member else '-':<14} {member.batch_size if member else 0:>5} "
              f"{c.codec if c else '-':<6} {step_columns(s)} {link_columns(h, s)} {health_columns(s)}")
    silent = [name for name in names if name not in seen.stats and (st := seen.status.get(name)) is not None
              and st.state == "online"]
    if silent:
        print(f"\nno stats within {wait_s:g} s from {', '.join(silent)} ('-'; they come every worker.stats_interval_s: "
              "--wait longer)")
    out = [line for name in names if (line := why_out(seen.status.get(name)))]
    if out:
        print("\nout of the job:")
        for line in out:
            print(f"  {line}")
    if plan is not None:
        print(f"\nplan v{plan.version}: {len(plan.clusters)} clusters, policy {plan.sync_policy}, "
              f"bound {plan.staleness_bound}, model {plan.model_spec}")
        print(f"re-planned: {why_replanned(plan, seen.planner)}")
    return 0


def why_replanned(plan: Plan, planner: ControlReply | None) -> str:
    """Why the plan went out: the planner's cause when it answered for this version (``join: pi-b joined``, ``links:
    link moved: pi-a uplink 12.5 -> 0.4 MB/s; predicted ...``), else the plan's reason alone."""
    if planner is not None and planner.result.get("plan_version") == plan.version:
        cause = planner.result.get("replan_cause")
        if isinstance(cause, str) and cause:
            return cause
    return plan.reason or "not given"


def why_out(status: DeviceStatus | None) -> str:
    """Why a device is out of the job, from its status ('' while it is in): it left the job (its data is missing
    or broken, the model does not build there), or it refused its share of a plan (its memory)."""
    if status is None:
        return ""
    if status.state == "left":
        return f"{status.device} left the job: {status.reason or 'no reason given'}"
    if status.refused_plan and status.state == "online":
        return f"{status.device} refused its share of plan v{status.refused_plan}: {status.reason or 'no reason given'}"
    return ""


def step_columns(stats: DeviceStats | None) -> str:
    """The steps, step time and model version columns of a device's row (``-`` without stats)."""
    if stats is None:
        return f"{'-':>6} {'-':>8} {'-':>7}"
    return f"{stats.steps:>6} {stats.step_time_s * 1e3:>8.1f} {stats.model_version:>7}"


def link_columns(hello: DeviceHello | None, stats: DeviceStats | None) -> str:
    """The uplink, downlink and latency columns of a device's row: what it declared (its hello: the operator's
    or an emulated board's figures) where it did, else what it measured (its stats); ``-`` where neither."""
    def pick(declared: float, measured: float) -> float:
        return declared or measured

    up = pick(hello.link_rate_bps if hello else 0.0, stats.link_rate_bps if stats else 0.0)
    down = pick(hello.downlink_rate_bps if hello else 0.0, stats.downlink_rate_bps if stats else 0.0)
    latency = pick(hello.latency_s if hello else 0.0, stats.latency_s if stats else 0.0)

    def cell(value: float, scale: float, width: int, digits: int) -> str:
        return f"{value * scale:>{width}.{digits}f}" if value > 0 else f"{'-':>{width}}"

    return f"{cell(up, 8e-6, 8, 1)} {cell(down, 8e-6, 9, 1)} {cell(latency, 1e3, 6, 2)}"


def health_columns(stats: DeviceStats | None) -> str:
    """The temperature, throttled and under-voltage columns of a device's row: ``now``, ``since boot`` or
    ``no`` for a flag, ``-`` where the device cannot tell (it is not a Raspberry Pi, or sent no stats)."""
    temperature = stats.cpu_temp_c if stats is not None else None
    bits = stats.throttled_bits if stats is not None else None
    throttled, undervolt = flag_state(bits, *SLOWED_FLAGS), flag_state(bits, "undervoltage")
    return (f"{'-' if temperature is None else f'{temperature:.1f}':>6} {throttled or '-':<10} "
            f"{undervolt or '-':<10}").rstrip()


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh devices``: the configuration flags and ``--wait``."""
    cli.config_flags(parser)
    parser.add_argument("--wait", type=float, help="at most this many seconds to collect the devices' messages "
                        "(default: worker.stats_interval_s + 1, ending sooner once every online device's stats are in)")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    config = with_job(cli.load(args))
    cli.setup_logging(config.log_level if args.log_level else "WARNING")
    wait_s = args.wait if args.wait is not None else config.worker.stats_interval_s + 1.0
    return asyncio.run(list_devices(config, wait_s=wait_s))
