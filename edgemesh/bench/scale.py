"""``edgemesh bench scale``: many devices on one broker, for minutes: does the parameter server keep up?

One broker of its own, the real planner, parameter server and compressor (each its own process, as in
``bench soak``), and ``--workers`` light *load-generating* devices in this process, each with its own MQTT
connection. A load device does what a worker does on the wire, without torch:

* it announces itself (retained ``online`` status and hello: a Pi 4's compute and memory) and sends stats every
  ``worker.stats_interval_s`` (the nominal step time, so the planner's batch balancing sees equal devices);
* it follows the plan, subscribes to the model (the broker fans every broadcast out to all of them);
* it *replays* one recorded gradient instead of computing one: the job's whole model, random values of
  ``GRADIENT_SCALE``, encoded once with ``--codec`` (the report says ``replayed_gradients: true``). Each step
  it waits ``--step-s`` (an emulated compute time, jittered by ``STEP_JITTER`` so the devices drift apart), then
  publishes the update at QoS 1, computed on the latest version it had heard of (a broadcast or its last ack)
  when the step began, and waits for its ack before the next step. One update in flight per device, as a
  worker: the PS's queue cannot exceed ``--workers`` unless it loses track of updates.

Every ``--sample-s`` the run samples each process's CPU seconds and resident size (the services, the broker and
this load generator) and the PS's queue (``edgemesh_ps_pending_updates``, its bus inbox). The report: updates
per second accepted, publish-to-ack p50/p99, discards by reason, CPU share and peak RSS per process, the queue's
time series; ``acceptance`` says whether the queue stayed bounded (the pending updates and the bus inbox never
above ``--workers``: one update in flight per device; its means in the first and last fifth of the run show any
drift) and whether no update was discarded or left unanswered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edgemesh import cli
from edgemesh.bench.reporting import finish, pyplot, save
from edgemesh.bench.runs import cluster_flags
from edgemesh.common import models, wire
from edgemesh.common.bus import Bus
from edgemesh.common.codecs import codec_for
from edgemesh.common.config import Config, load_config
from edgemesh.common.errors import BusError, EdgeMeshError
from edgemesh.common.messages import (
    DeviceHello,
    DeviceStats,
    DeviceStatus,
    GradientUpdate,
    ModelDelta,
    ModelSnapshot,
    Plan,
    ShardUpdate,
    UpdateAck,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import LocalCluster, cpu_seconds, rss_kb

logger = logging.getLogger(__name__)
T = TypeVar("T")

JOB = "scale"
DEFAULT_WORKERS = 64
DEFAULT_MINUTES = 5.0
DEFAULT_STEP_S = 1.0
"""A Pi 4's step of the digits CNN at batch 32 is about 0.2-0.3 s; a second leaves room for a larger batch or
model and keeps the broker's fan-out (every device receives every version) what a real fleet of this size sends."""
DEFAULT_SAMPLE_S = 5.0
STEP_JITTER = 0.2
"""Each emulated step lasts ``step_s`` times a uniform factor in [1 - jitter, 1 + jitter]."""
GRADIENT_SCALE = 1e-4
"""Size of the replayed gradient's values: the model moves, and stays finite, for the whole run."""
PI4_FLOPS, PI4_MEMORY = 6e9, 2 * 2**30
"""What every load device announces (a Pi 4 with 2 GiB for EdgeMesh)."""
START_TIMEOUT_S = 120.0
"""Longest wait for a plan naming every device."""
STOP_TIMEOUT_S = 10.0
"""Longest wait for the load devices to disconnect at the end."""
RUN_MARGIN_S = 120.0
"""How long past its start timeout and measured minutes a run may take before it is called failed (a hang)."""
ACK_TIMEOUT_S = 60.0
"""Longest wait for one ack; a device that waits longer counts it lost and sends its next update."""


def recorded_gradient(model_spec: str, codec: str) -> tuple[tuple[ShardUpdate, ...], int]:
    """The replayed gradient: every parameter of ``model_spec``, random values encoded with ``codec`` (the
    codec a worker's policy would use for a tensor of that size); and its payload bytes."""
    layout = models.gradient_layout(models.build_model(model_spec))
    rng = np.random.default_rng(0)
    shards = []
    for name, (shape, _) in layout.items():
        values = (rng.standard_normal(int(np.prod(shape))) * GRADIENT_SCALE).astype(np.float32)
        chosen = codec_for(codec, values.size)  # type: ignore[arg-type]  # checked by the caller
        shards.append(ShardUpdate(param=name, start=0, stop=int(shape[0]), codec=chosen.name,
                                  data=chosen.encode(values, None)))
    return tuple(shards), sum(len(s.data) for s in shards)


@dataclass(slots=True)
class Tally:
    """What the load devices saw, together."""

    sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    """Acks by status, and discards by ``discarded:<reason>``."""
    lost: int = 0
    """Updates whose ack did not come within ``ACK_TIMEOUT_S``."""
    latencies: list[float] = field(default_factory=list)
    """Publish-to-ack seconds of every update answered after the warm-up."""
    model_messages: int = 0
    versions: set[int] = field(default_factory=set)
    measuring: bool = False


class LoadDevice:
    """One light device: a worker's messages, a replayed gradient, an emulated compute time."""

    def __init__(self, cfg: Config, name: str, shards: tuple[ShardUpdate, ...], step_s: float, tally: Tally,
                 seed: int) -> None:
        self.cfg, self.name, self.shards, self.step_s, self.tally = cfg, name, shards, step_s, tally
        self.topics = Topics(cfg.job)
        self.rng = random.Random(seed)
        self.incarnation = time.time_ns() // 1000
        self.plan: Plan | None = None
        self.planned = asyncio.Event()
        self.acks: asyncio.Queue[UpdateAck] = asyncio.Queue()
        self.version = 0
        self.seq = 0
        self.steps = 0
        offline = DeviceStatus(device=name, state="offline", incarnation=self.incarnation)
        self.bus = Bus(cfg.broker, client_id=f"edgemesh-load-{name}", metrics=ServiceMetrics("load"),
                       will=(self.topics.status(name), wire.encode(offline)))
        self.bus.route(self.topics.plan_filter(), Plan, self._on_plan)
        self.bus.route(self.topics.ack_filter(name), UpdateAck, self._on_ack)
        self.bus.route(self.topics.model_filter(), ModelSnapshot, self._on_model)
        self.bus.route(self.topics.delta_filter(), ModelDelta, self._on_model)

    async def _on_plan(self, plan: Plan, _: TopicMatch) -> None:
        if self.plan is None or plan.version >= self.plan.version:
            self.plan = plan
            if plan.device(self.name) is not None:
                self.planned.set()

    async def _on_ack(self, ack: UpdateAck, _: TopicMatch) -> None:
        self.acks.put_nowait(ack)

    async def _on_model(self, message: ModelSnapshot | ModelDelta, _: TopicMatch) -> None:
        """A broadcast: the next step computes on it, as a worker's next step trains the model it holds."""
        self.version = max(self.version, message.version)
        self.tally.model_messages += 1
        self.tally.versions.add(message.version)

    async def run(self) -> None:
        async with self.bus:
            await self.bus.publish(self.topics.status(self.name), DeviceStatus(
                device=self.name, state="online", incarnation=self.incarnation, time=time.time()), retain=True)
            await self.bus.publish(self.topics.hello(self.name), DeviceHello(
                device=self.name, incarnation=self.incarnation, flops=PI4_FLOPS, memory_bytes=PI4_MEMORY,
                cores=4, platform="load", profile="pi4"), retain=True)
            async with asyncio.TaskGroup() as group:
                group.create_task(self._report())
                group.create_task(self._train())

    async def _report(self) -> None:
        while True:
            me = self.plan.device(self.name) if self.plan is not None else None
            with contextlib.suppress(BusError):
                await self.bus.publish(self.topics.stats(self.name), DeviceStats(
                    device=self.name, incarnation=self.incarnation, time=time.time(), steps=self.steps,
                    step_time_s=self.step_s, batch_size=me.batch_size if me else 0, model_version=self.version))
            await asyncio.sleep(self.cfg.worker.stats_interval_s)

    async def _train(self) -> None:
        await self.planned.wait()
        while True:
            base = self.version  # the model the step trains, as a worker's step starts from the model it holds
            await asyncio.sleep(self.step_s * self.rng.uniform(1 - STEP_JITTER, 1 + STEP_JITTER))
            plan = self.plan
            me = plan.device(self.name) if plan is not None else None
            if plan is None or me is None:
                self.planned.clear()
                await self.planned.wait()
                continue
            self.seq += 1
            update = GradientUpdate(device=self.name, cluster=me.cluster, incarnation=self.incarnation, seq=self.seq,
                                    base_version=base, samples=me.batch_size, shards=self.shards,
                                    step_time_s=self.step_s, sent_at=time.time(), plan_version=plan.version)
            sent = time.monotonic()
            try:
                await self.bus.publish(self.topics.grad(me.cluster, self.name), update, qos=1, kind="grad")
            except BusError:
                continue
            self.steps += 1
            measuring = self.tally.measuring
            if measuring:
                self.tally.sent += 1
            try:
                async with asyncio.timeout(ACK_TIMEOUT_S):
                    while (ack := await self.acks.get()).seq != self.seq:
                        pass
            except TimeoutError:
                self.tally.lost += measuring
                continue
            self.version = max(self.version, ack.version)
            if measuring:
                self.tally.latencies.append(time.monotonic() - sent)
                self.tally.statuses[ack.status if ack.status != "discarded" else f"discarded:{ack.reason}"] += 1


def config(broker_url: str, policy: str, model_spec: str, overrides: dict[str, str]) -> Config:
    return load_config(env={}, overrides={
        "job": JOB, "broker.url": broker_url, "log_level": "WARNING", "training.model_spec": model_spec,
        "training.dataset": "digits", "training.sync_policy": policy, **overrides})


@dataclass(slots=True)
class Sampler:
    """CPU seconds and RSS per process, and the PS's queue, every ``interval_s``."""

    cluster: LocalCluster
    broker: BrokerProcess
    t0: float
    rows: list[dict[str, Any]] = field(default_factory=list)

    def pids(self) -> dict[str, int | None]:
        pids: dict[str, int | None] = {c.role: c.proc.pid for c in self.cluster.children}
        pids["broker"] = self.broker.pid
        pids["load"] = os.getpid()
        return pids

    def sample(self) -> dict[str, Any]:
        self.cluster.scrape_all()
        ps = next((c.samples for c in self.cluster.children if c.role == "ps"), {})
        row = {"t": round(time.monotonic() - self.t0, 2),
               "ps_pending": _metric(ps, "edgemesh_ps_pending_updates"),
               "ps_inbox": _metric(ps, "edgemesh_ps_inbox_messages"),
               "cpu_s": {k: cpu_seconds(p) for k, p in self.pids().items()},
               "rss_mib": {k: round(rss_kb(p) / 1024, 1) if p else 0.0 for k, p in self.pids().items()}}
        self.rows.append(row)
        return row


def _metric(samples: dict[Any, float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


async def _drive(cfg: Config, cluster: LocalCluster, broker: BrokerProcess, *, workers: int, seconds: float,
                 step_s: float, sample_s: float, shards: tuple[ShardUpdate, ...], tally: Tally, seed: int,
                 progress: Callable[[str], None]) -> tuple[Sampler, float]:
    devices = [LoadDevice(cfg, f"load-{i:03d}", shards, step_s, tally, seed * 1000 + i) for i in range(workers)]
    tasks = [asyncio.create_task(d.run()) for d in devices]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(d.planned.is_set() for d in devices):
            if (failure := cluster.failure()) is not None:
                raise EdgeMeshError(failure)
            if time.monotonic() > deadline:
                raise EdgeMeshError(f"the plan named {sum(d.planned.is_set() for d in devices)} of {workers} "
                                    f"devices after {START_TIMEOUT_S:.0f}s")
            if any(t.done() for t in tasks):
                next(t for t in tasks if t.done()).result()
            await asyncio.sleep(0.25)
        await asyncio.sleep(2 * step_s)  # warm-up: every device has sent, the PS has its buffers
        progress(f"{workers} devices planned; measuring for {seconds:.0f}s")
        sampler = Sampler(cluster, broker, time.monotonic())
        tally.measuring = True
        started = time.monotonic()
        await asyncio.to_thread(sampler.sample)
        while (elapsed := time.monotonic() - started) < seconds:
            await asyncio.sleep(min(sample_s, seconds - elapsed))
            if (failure := cluster.failure()) is not None:
                raise EdgeMeshError(failure)
            row = await asyncio.to_thread(sampler.sample)
            progress(f"  {row['t']:.0f}s: {tally.statuses['accepted']} updates accepted, "
                     f"ps queue {row['ps_pending']:.0f}, inbox {row['ps_inbox']:.0f}")
        tally.measuring = False
        return sampler, time.monotonic() - started
    finally:
        for t in tasks:
            t.cancel()
        _, stuck = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        if stuck:
            logger.warning("%d load devices did not stop within %.0fs", len(stuck), STOP_TIMEOUT_S)


async def _bounded(run: Coroutine[Any, Any, T], timeout_s: float) -> T:
    try:
        async with asyncio.timeout(timeout_s):
            return await run
    except TimeoutError:
        raise EdgeMeshError(f"the run did not end within {timeout_s:.0f}s") from None


def summarize(sampler: Sampler, tally: Tally, seconds: float, workers: int) -> dict[str, Any]:
    rows = sampler.rows
    first, last = rows[0], rows[-1]
    span = max(last["t"] - first["t"], 1e-9)
    lat = sorted(tally.latencies)

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 1) if lat else None

    pending = [r["ps_pending"] for r in rows]
    fifth = max(1, len(rows) // 5)
    head, tail = statistics.fmean(pending[:fifth]), statistics.fmean(pending[-fifth:])
    accepted = tally.statuses.get("accepted", 0)
    discarded = sum(v for k, v in tally.statuses.items() if k.startswith("discarded"))
    inbox = max(r["ps_inbox"] for r in rows)
    bounded = max(pending) <= workers and inbox <= workers
    return {
        "updates_sent": tally.sent, "updates_accepted": accepted, "updates_discarded": discarded,
        "updates_lost": tally.lost, "updates_in_flight_at_end": tally.sent - len(lat) - tally.lost,
        "acks": dict(tally.statuses),
        "updates_per_s": round(accepted / seconds, 2),
        "ack_p50_ms": pct(0.5), "ack_p99_ms": pct(0.99),
        "model_versions": len(tally.versions), "model_messages_received": tally.model_messages,
        "cpu_share": {k: round((last["cpu_s"][k] - first["cpu_s"][k]) / span, 3) for k in last["cpu_s"]},
        "rss_mib_peak": {k: max(r["rss_mib"][k] for r in rows) for k in last["rss_mib"]},
        "ps_pending": {"max": max(pending), "mean_first_fifth": round(head, 2), "mean_last_fifth": round(tail, 2)},
        "ps_inbox_max": inbox,
        "acceptance": {"queue_bounded": bounded, "no_update_discarded": discarded == 0 and tally.lost == 0},
        "samples": [{"t": r["t"], "ps_pending": r["ps_pending"], "ps_inbox": r["ps_inbox"], "rss_mib": r["rss_mib"]}
                    for r in rows],
    }


def run_bench(report: Path, *, workers: int, minutes: float, step_s: float, sample_s: float, policy: str,
              model_spec: str, codec: str, seed: int, overrides: dict[str, str], progress: Callable[[str], None],
              keep_logs: bool = False) -> dict[str, Any]:
    shards, payload = recorded_gradient(model_spec, codec)
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-scale-"))
    broker = BrokerProcess.default()
    broker.start()
    result: dict[str, Any] = {"workers": workers, "minutes": minutes, "step_s": step_s, "policy": policy,
                              "model": model_spec, "codec": codec, "gradient_payload_bytes": payload,
                              "replayed_gradients": True, "broker": broker.kind, "seed": seed}
    failure = None
    try:
        cfg = config(broker.url, policy, model_spec, overrides)
        cluster = LocalCluster(cfg, workdir)
        tally = Tally()
        try:
            cluster.start_services(min_devices=workers)
            sampler, seconds = asyncio.run(_bounded(
                _drive(cfg, cluster, broker, workers=workers, seconds=minutes * 60, step_s=step_s,
                       sample_s=sample_s, shards=shards, tally=tally, seed=seed, progress=progress),
                START_TIMEOUT_S + minutes * 60 + RUN_MARGIN_S))
            result.update(summarize(sampler, tally, seconds, workers))
            result["seconds"] = round(seconds, 1)
        finally:
            cluster.stop()
    except (EdgeMeshError, OSError) as exc:
        failure = f"{type(exc).__name__}: {exc}"
        progress(f"FAILED: {failure}")
    finally:
        broker.stop()
    result["failure"] = failure
    finish(report, result, plot, progress, workdir, keep_logs=keep_logs or failure is not None)
    return result


def plot(result: dict[str, Any], png: Path) -> bool:
    plt = pyplot()
    if plt is None or not result.get("samples"):
        return False
    t = [s["t"] for s in result["samples"]]
    fig, (queue, rss) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    queue.plot(t, [s["ps_pending"] for s in result["samples"]], label="PS pending updates")
    queue.plot(t, [s["ps_inbox"] for s in result["samples"]], label="PS bus inbox")
    queue.axhline(result["workers"], color="grey", linestyle=":", label="devices")
    queue.set_ylabel("messages")
    queue.legend()
    queue.set_title(f"{result['workers']} load devices, {result['policy']}, {result['codec']}: "
                    f"{result['updates_per_s']} updates/s, ack p99 {result['ack_p99_ms']} ms")
    for name in result["samples"][0]["rss_mib"]:
        rss.plot(t, [s["rss_mib"][name] for s in result["samples"]], label=name)
    rss.set_ylabel("RSS (MiB)")
    rss.set_xlabel("seconds")
    rss.legend(fontsize="small")
    return save(fig, png)


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench scale``."""
    parser.add_argument("--report", default="bench/reports/scale.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="load-generating devices")
    parser.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="length of the measured run")
    parser.add_argument("--step-s", type=float, default=DEFAULT_STEP_S, help="each device's emulated compute per step")
    parser.add_argument("--sample-s", type=float, default=DEFAULT_SAMPLE_S,
                        help="how often CPU, RSS and queues are read")
    parser.add_argument("--policy", default="sync", help="the job's training.sync_policy")
    parser.add_argument("--model", default="digits-cnn", help="the model spec whose gradient is replayed")
    parser.add_argument("--codec", default="fp16", help="the codec the replayed gradient is encoded with")
    cluster_flags(parser, seed="seeds the devices' step jitter")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    if args.workers < 1 or args.minutes <= 0 or args.step_s <= 0 or args.sample_s <= 0:
        print("edgemesh bench scale: --workers >= 1; --minutes, --step-s and --sample-s > 0", file=sys.stderr)
        return 2
    try:
        config("mqtt://127.0.0.1:1883", args.policy, args.model, cli.overrides(args))  # bad settings: exit 2
        models.build_model(args.model)
        codec_for(args.codec, 1 << 20)
        result = run_bench(Path(args.report), workers=args.workers, minutes=args.minutes, step_s=args.step_s,
                           sample_s=args.sample_s, policy=args.policy, model_spec=args.model, codec=args.codec,
                           seed=args.seed, overrides=cli.overrides(args), keep_logs=args.keep_logs,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    except EdgeMeshError as exc:
        print(f"edgemesh bench scale: {exc}", file=sys.stderr)
        return 2
    return 1 if result["failure"] else 0
