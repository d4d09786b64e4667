"""``edgemesh bench transport``: how close the parameter server's ingest comes to what the broker itself carries.

In one run, through one broker of its own, for each payload size (``--payloads``: 1 MB and the model's whole
gradient, 2.48 MB for ``cifar-cnn``) and each number of messages in flight (``--in-flight``: 1 and 8), for
``--seconds`` each:

* **raw** (the broker and the client library alone): N aiomqtt clients each publish the payload at QoS 1 and
  wait for a small QoS 1 answer from one subscriber that does nothing else, then publish the next: the request
  and ack of a worker and the parameter server, with no work between. The subscriber runs in a process of its
  own, as the parameter server does (sharing the devices' process and event loop, it took their wake-ups for
  free and, streamed to, fell behind them);
* **stream**: N aiomqtt clients publish at QoS 1 back to back (each waits only for the broker's PUBACK) to one
  subscriber (its own process) that counts the bytes until it has the last: what a plain publisher pushes
  through the broker;
* **ps**: a real parameter server (its own process: ``async``, codec ``none``, its write-ahead log and
  checkpoints as configured, no held-out evaluation: ``ps.eval_every = 0``, as the evaluation is no part of
  ingest and runs beside it on its own thread and budget; ``--set ps.eval_every=5`` puts it back) and N
  load-generating devices on EdgeMesh's own bus. They *replay*
  one recorded gradient instead of computing one (small random values, rows of the model's largest
  parameters up to the payload size) and each waits for its ack before sending the next, computed on the
  version the last ack named. Receive, join the chunks, decode, validate, apply, log, ack. No plan is
  published: no device listens to the model, so the PS broadcasts none (as it does while no plan names a
  device), and every device is taken.

* **sharded** (``--shards``, default 1 and 2): the same with the parameter server split into n processes
  (``edgemesh ps --shard i/n``); each device sends every shard its rows of the replayed gradient (an equal
  part of the payload from each shard's rows) and waits for every shard's ack.

Each side runs ``--rounds`` times (3) at each payload and number in flight, in the order above and then in the
reverse one, in turn; its figures pool its rounds (``trials.Pooled``), and ``rounds`` keeps each round's MB/s.
Per side: MB/s of payload acked (stream: received), messages/s, and publish-to-ack p50/p99 (ms).
``ps_ingest_ratio`` is the parameter server's MB/s over raw's at the same payload and number in flight, for
each pair, and ``ps_ingest_ratio_vs_stream`` the same over stream's; the PS's CPU seconds per update and its
step, decode and log figures from its metrics are its parts. ``cpu_cores`` says, per trial, how many of the
host's cores were busy (``host``, of ``host_cores``) and how many the broker, the devices (this process), the
raw side's ``subscriber`` and the parameter server's processes took: a host near all its cores busy limits
every side alike, whatever the parameter server does. Under ``sharded``, per shard count, the same figures (CPU
summed over the shards) and ``speedup_vs_1``: its MB/s over one process's in the same pair.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import aiomqtt
import numpy as np

from edgemesh import cli
from edgemesh.bench.reporting import finish, pyplot, save
from edgemesh.bench.runs import names
from edgemesh.bench.trials import MB, Pooled, Trial, cpu_now
from edgemesh.common import models
from edgemesh.common.bus import Bus, paho_layer
from edgemesh.common.config import Config, load_config
from edgemesh.common.errors import EdgeMeshError
from edgemesh.common.messages import GradientUpdate, ModelSnapshot, ShardUpdate, UpdateAck
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.shards import divide
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.common.wire.chunks import CHUNK_HEADROOM
from edgemesh.local.broker import BrokerProcess
from edgemesh.local.processes import LocalCluster

logger = logging.getLogger(__name__)

MODEL = "cifar-cnn"
DATASET = "synthetic-cifar"
DEFAULT_PAYLOADS = ("1MB", "model")
DEFAULT_IN_FLIGHT = (1, 8)
DEFAULT_SHARDS = (1, 2)
DEFAULT_SECONDS = 10.0
DEFAULT_ROUNDS = 3
MAX_PACKET_BYTES = 16 * 1024 * 1024 + CHUNK_HEADROOM
"""The broker's ``max_packet_size``: raw's model-sized packets pass, and the services' chunks grow to 16 MiB."""
ACK_TIMEOUT_S = 30.0
"""Longest wait for one answer; a trial whose answer does not come fails."""
REPORT_TIMEOUT_S = 120.0
"""Longest wait for the raw side's subscriber to drain what the broker queued for it and report."""
STOP_REPEAT_S = 1.0
"""Seconds between two stops said to the raw side's subscriber."""
SUBSCRIBER_START_S = 60.0
"""Longest wait for the raw side's subscriber process to subscribe."""
PS_START_TIMEOUT_S = 120.0
"""Longest wait for the parameter server's first model."""
GRADIENT_SCALE = 1e-4
"""Size of the replayed gradient's values: the model moves, and stays finite, for a whole run."""
JOB = "transport"
RAW_TOPIC = "bench/raw"


def payload_bytes(spec: str, gradient_bytes: int) -> int:
    """``1MB``-style sizes, or ``model`` (the whole gradient)."""
    if spec == "model":
        return gradient_bytes
    units = {"KB": 1_000, "MB": MB}
    for unit, scale in units.items():
        if spec.upper().endswith(unit):
            return int(float(spec[:-len(unit)]) * scale)
    return int(spec)


# ------------------------------------------------------------------ the broker alone
def _client(host: str, port: int, identifier: str) -> aiomqtt.Client:
    """An aiomqtt client as a service's bus makes one: MQTT 5, TCP_NODELAY (without it every answer waits out Nagle
    and the broker's delayed ACK, ~40 ms), packets read into buffers of their size (``paho_layer``, on the paho it
    was written for)."""
    client = aiomqtt.Client(host, port, identifier=identifier, protocol=aiomqtt.ProtocolVersion.V5,
                            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    paho_layer.enable(client._client)  # noqa: SLF001 - as a service's bus reads and writes (``zero_copy``)
    return client


def _raw(host: str, port: int, size: int, n: int, seconds: float, *, stream: bool, pool: Pooled,
         broker_pid: int | None) -> Trial:
    """One trial of the broker alone: the subscriber in a process of its own, as the parameter server is one,
    so that neither side's receiving shares the devices' process (and its core)."""
    run = uuid.uuid4().hex[:6]
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    subscriber = spawn.Process(
        target=_subscriber_main, args=(host, port, run, stream, child), name="bench-subscriber", daemon=True)
    subscriber.start()
    try:
        if _heard(parent, SUBSCRIBER_START_S) != "ready":
            raise TimeoutError(f"the raw subscriber did not subscribe (it failed, or took over "
                               f"{SUBSCRIBER_START_S:.0f} s)")
        before, start = {**cpu_now(broker_pid, []), "subscriber": 0.0}, time.perf_counter()
        trial = asyncio.run(_raw_devices(host, port, run, size, n, seconds, stream=stream))
        report = asyncio.run(_stop(host, port, run, parent, subscriber))
        if not isinstance(report, tuple):
            said = (f"it exited with code {subscriber.exitcode}" if subscriber.exitcode is not None
                    else f"it took over {REPORT_TIMEOUT_S:.0f} s")
            raise TimeoutError(f"the raw subscriber did not report what it received ({said})")
        messages, payload, cpu = report
        after = {**cpu_now(broker_pid, []), "subscriber": cpu}
        if stream:  # what the subscriber received (what the broker carried through), until it had the last
            trial.messages, trial.payload_bytes, trial.seconds = messages, payload, time.perf_counter() - start
    finally:
        subscriber.join(ACK_TIMEOUT_S)
        if subscriber.is_alive():
            subscriber.kill()
    return pool.add(trial, before, after)


async def _stop(host: str, port: int, run: str, conn: Connection, subscriber: BaseProcess) -> object:
    """Tell the subscriber to stop, after every payload, and wait for its report (None: it died, or said nothing
    within ``REPORT_TIMEOUT_S``). The stop is said again each second: a subscriber that fell behind the devices has
    a queue at the broker's limit (Mosquitto's ``max_queued_messages``), which drops what arrives while it is full,
    the stop as well; once the queue drains, a later stop gets in behind the payloads."""
    deadline = time.monotonic() + REPORT_TIMEOUT_S
    async with _client(host, port, f"bench-stop-{run}") as stopper:
        while time.monotonic() < deadline:
            await stopper.publish(f"{RAW_TOPIC}-stop/{run}", b"stop", qos=1)
            heard = await asyncio.to_thread(_heard, conn, STOP_REPEAT_S)
            if heard is not None or not subscriber.is_alive():  # what it sent before it ended is read first
                return heard
    return None


def _heard(conn: Connection, timeout_s: float) -> object:
    """What the subscriber process sent within ``timeout_s`` (None: nothing, or it died)."""
    try:
        return conn.recv() if conn.poll(timeout_s) else None
    except EOFError:
        return None


def _subscriber_main(host: str, port: int, run: str, stream: bool, conn: Connection) -> None:
    """The raw side's subscriber (its own process): answers each payload (raw), or counts them (stream), until
    the devices say stop; then reports the messages and payload bytes received, and its CPU seconds since it
    subscribed."""

    async def subscribe() -> tuple[int, int, float]:
        messages = payload = 0
        cpu = 0.0
        async with _client(host, port, f"bench-sub-{run}") as sub, asyncio.TaskGroup() as answers:
            await sub.subscribe(f"{RAW_TOPIC}/{run}/+", qos=1)
            await sub.subscribe(f"{RAW_TOPIC}-stop/{run}", qos=1)
            conn.send("ready")
            cpu = time.process_time()
            async for msg in sub.messages:
                if str(msg.topic).startswith(f"{RAW_TOPIC}-stop/"):
                    return messages, payload, time.process_time() - cpu
                if stream:
                    messages += 1
                    payload += len(msg.payload) if isinstance(msg.payload, (bytes, bytearray)) else 0
                    continue
                device = str(msg.topic).rsplit("/", 1)[1]
                answers.create_task(sub.publish(f"{RAW_TOPIC}-ack/{run}/{device}", b"ok", qos=1))
        return messages, payload, time.process_time() - cpu

    conn.send(asyncio.run(subscribe()))


async def _raw_devices(host: str, port: int, run: str, size: int, n: int, seconds: float, *,
                       stream: bool) -> Trial:
    trial = Trial()
    payload = np.random.default_rng(0).bytes(size)
    start = time.perf_counter()
    async with asyncio.TaskGroup() as devices:
        for i in range(n):
            devices.create_task(_raw_device(host, port, run, i, payload, start + seconds, trial, stream=stream))
    trial.seconds = time.perf_counter() - start
    return trial


async def _raw_device(host: str, port: int, run: str, i: int, payload: bytes, until: float, trial: Trial, *,
                      stream: bool) -> None:
    async with _client(host, port, f"bench-dev-{run}-{i}") as client:
        topic = f"{RAW_TOPIC}/{run}/{i}"
        if stream:
            while time.perf_counter() < until:
                await client.publish(topic, payload, qos=1)
            return
        await client.subscribe(f"{RAW_TOPIC}-ack/{run}/{i}", qos=1)
        answers = aiter(client.messages)
        while time.perf_counter() < until:
            sent = time.perf_counter()
            await client.publish(topic, payload, qos=1)
            async with asyncio.timeout(ACK_TIMEOUT_S):
                await anext(answers)
            trial.latencies.append(time.perf_counter() - sent)
            trial.messages += 1
            trial.payload_bytes += len(payload)


# ------------------------------------------------------------------ the parameter server
def recorded_gradient(size: int, shards: int = 1) -> list[tuple[ShardUpdate, ...]]:
    """The replayed gradient for a parameter server of ``shards`` processes: for each, shards of ``cifar-cnn``
    holding about ``size / shards`` bytes of float32 values from its rows, whole rows of its largest parameters
    first."""
    model = models.build_model(MODEL)
    shapes = {name: shape for name, (shape, _) in models.param_layout(model).items()}  # as the PS divides them
    parameters = models.gradient_layout(model)
    rng = np.random.default_rng(1)
    parts = []
    for run in divide(shapes, shards):
        part, left = [], size // shards
        for span in sorted((s for s in run if s.param in parameters),  # a gradient has no buffer rows
                           key=lambda s: -(s.stop - s.start) * int(np.prod(shapes[s.param][1:]))):
            row = int(np.prod(shapes[span.param][1:])) * 4
            rows = min(span.stop - span.start, max(1, left // row)) if left > 0 else 0
            if rows == 0:
                break
            values = (rng.standard_normal(rows * row // 4) * GRADIENT_SCALE).astype(np.float32)
            part.append(ShardUpdate(param=span.param, start=span.start, stop=span.start + rows, codec="none",
                                    data=values.tobytes()))
            left -= rows * row
        parts.append(tuple(part))
    return parts


def gradient_bytes() -> int:
    layout = models.gradient_layout(models.build_model(MODEL))
    return sum(int(np.prod(shape)) * 4 for shape, _ in layout.values())


def ps_config(broker_url: str, workdir: Path, overrides: dict[str, str], max_in_flight: int, shards: int) -> Config:
    job = JOB if shards == 1 else f"{JOB}-{shards}"
    return load_config(env={}, overrides={
        "job": job, "broker.url": broker_url, "log_level": "INFO", "training.model_spec": MODEL,
        "training.dataset": DATASET, "training.sync_policy": "async", "training.lr": "0.01",
        "training.staleness_bound": str(4 * max_in_flight), "ps.state_dir": str(workdir / job),
        "ps.shards": str(shards), "ps.eval_every": "0", **overrides})


class _LoadDevices:
    """``n`` devices on one bus, as a service's (``zero_copy``), each sending every shard of the parameter server its
    part of the replayed gradient and waiting for every shard's ack."""

    def __init__(self, cfg: Config, parts: list[tuple[ShardUpdate, ...]], n: int, run: str) -> None:
        self.parts = parts
        shards = len(parts)
        self.topics = [Topics(cfg.job, i if shards > 1 else None) for i in range(shards)]
        self.names = [f"d{run}-{i}" for i in range(n)]
        self.size = sum(len(s.data) for part in parts for s in part)
        """Payload bytes of one update: every shard's part."""
        self.bus = Bus(cfg.broker, client_id=f"bench-devices-{run}", metrics=ServiceMetrics("bench"), zero_copy=True)
        self.acks: dict[tuple[str, int], asyncio.Queue[UpdateAck]] = {
            (d, i): asyncio.Queue() for d in self.names for i in range(shards)}
        self.seqs = dict.fromkeys(self.names, 0)
        self.bases = dict.fromkeys(self.acks, 0)
        """The version each device's last ack from each shard named: what its next update is computed on."""
        self.first_models = asyncio.Event()
        """Set once every shard's first model is in."""
        self._modelled: set[int] = set()
        for t in self.topics:
            for d in self.names:
                self.bus.route(t.ack_filter(d), UpdateAck, self._on_ack)
            self.bus.route(t.model_filter(), ModelSnapshot, self._on_model)

    async def _on_ack(self, ack: UpdateAck, match: TopicMatch) -> None:
        queue = self.acks.get((ack.device, max(match.shard, 0)))
        if queue is not None:
            queue.put_nowait(ack)

    async def _on_model(self, _: ModelSnapshot, match: TopicMatch) -> None:
        self._modelled.add(max(match.shard, 0))
        if len(self._modelled) == len(self.parts):
            self.first_models.set()

    async def run(self, until: float, into: Trial) -> None:
        """Every device sends updates until ``until`` (one each at least), counted into ``into``."""
        await asyncio.gather(*(self._device(d, until, into) for d in self.names))

    async def _device(self, name: str, until: float, into: Trial) -> None:
        while True:
            self.seqs[name] += 1
            sent = time.perf_counter()
            answers = await asyncio.gather(*(self._send(name, shard) for shard in range(len(self.parts))))
            into.latencies.append(time.perf_counter() - sent)
            if all(ack.status == "accepted" for ack in answers):
                into.messages += 1
                into.payload_bytes += self.size
            if time.perf_counter() >= until:
                return

    async def _send(self, name: str, shard: int) -> UpdateAck:
        """One update to ``shard`` and its ack."""
        update = GradientUpdate(device=name, cluster=f"c-{name}", incarnation=1, seq=self.seqs[name],
                                base_version=self.bases[name, shard], samples=32, shards=self.parts[shard],
                                sent_at=time.time(), plan_version=1)
        await self.bus.publish(self.topics[shard].grad(update.cluster, name), update, qos=1, kind="grad")
        async with asyncio.timeout(ACK_TIMEOUT_S):
            ack = await self.acks[name, shard].get()
        self.bases[name, shard] = max(self.bases[name, shard], ack.version)
        return ack


async def _ps_trial(cfg: Config, parts: list[tuple[ShardUpdate, ...]], n: int, seconds: float, run: str) -> Trial:
    """``n`` devices each sending every shard its part of the replayed gradient and waiting for every ack."""
    devices, trial = _LoadDevices(cfg, parts, n, run), Trial()
    async with devices.bus:
        async with asyncio.timeout(PS_START_TIMEOUT_S):
            await devices.first_models.wait()
        await devices.run(0.0, Trial())  # one update from each first: the plan reached the PS, its buffers are in
        start = time.perf_counter()
        await devices.run(start + seconds, trial)
        trial.seconds = time.perf_counter() - start
    return trial


def _measure(pool: Pooled, cfg: Config, cluster: LocalCluster, parts: list[tuple[ShardUpdate, ...]], n: int,
             seconds: float, broker_pid: int | None) -> Trial:
    """One parameter server trial (every shard of it), pooled into ``pool``."""
    cluster.scrape_all()
    before = [dict(c.samples) for c in cluster.children]
    pids = [c.proc.pid for c in cluster.children]
    busy = cpu_now(broker_pid, pids)
    trial = asyncio.run(_ps_trial(cfg, parts, n, seconds, uuid.uuid4().hex[:4]))
    after = cpu_now(broker_pid, pids)
    cluster.scrape_all()
    moved: dict[Any, float] = {}
    for child, was in zip(cluster.children, before, strict=True):
        for k, v in child.samples.items():
            moved[k] = moved.get(k, 0.0) + v - was.get(k, 0.0)
    return pool.add(trial, busy, after, moved)


Servers = dict[int, tuple[Config, LocalCluster]]
"""Each shard count's parameter server: its configuration, and its processes."""


def run_bench(report: Path, *, payloads: list[str], in_flight: list[int], seconds: float, overrides: dict[str, str],
              progress: Callable[[str], None], keep_logs: bool = False,
              shard_counts: list[int] | None = None, rounds: int = DEFAULT_ROUNDS) -> dict[str, Any]:
    whole = gradient_bytes()
    sizes = {spec: payload_bytes(spec, whole) for spec in payloads}
    workdir = Path(tempfile.mkdtemp(prefix="edgemesh-bench-transport-"))
    broker = BrokerProcess.default(max_packet_size=MAX_PACKET_BYTES)
    broker.start()
    result: dict[str, Any] = {"model": MODEL, "gradient_bytes": whole, "broker": broker.kind,
                              "broker_max_packet_size": broker.max_packet_size, "seconds": seconds,
                              "payloads": sizes, "in_flight": in_flight, "replayed_gradients": True,
                              "raw": {}, "stream": {}, "ps": {}, "ps_cpu_s_per_update": {}, "ps_parts": {},
                              "sharded": {}, "cpu_cores": {"raw": {}, "stream": {}, "ps": {}},
                              "host_cores": os.cpu_count(), "rounds_per_key": rounds, "rounds": {}}
    failure = None
    try:
        # every shard count's parameter server up at once (a job each), so each pair's trials run back to back
        servers = _start_servers(result, broker, workdir, overrides, max(in_flight),
                                 sorted({1, *(shard_counts or DEFAULT_SHARDS)}))
        try:
            for spec, size in sizes.items():
                gradients = {count: recorded_gradient(size, count) for count in servers}
                for n in in_flight:
                    key = f"{spec}/{n}"
                    pooled = _rounds(result, key, broker, servers, gradients, size, n, seconds, rounds)
                    _record(result, key, pooled, servers)
                    progress(_said(result, key))
        finally:
            for _, cluster in servers.values():
                cluster.stop()
    except (EdgeMeshError, OSError, TimeoutError, aiomqtt.MqttError) as exc:
        failure = f"{type(exc).__name__}: {exc}"
        progress(f"FAILED: {failure}")
    finally:
        broker.stop()
    result["failure"] = failure
    _ratios(result)
    finish(report, result, plot, progress, workdir, keep_logs=keep_logs or failure is not None)
    return result


def _start_servers(result: dict[str, Any], broker: BrokerProcess, workdir: Path, overrides: dict[str, str],
                   max_in_flight: int, counts: list[int]) -> Servers:
    """A parameter server of each shard count in ``counts``, a job each, its processes spawned; their settings and
    the sharded ones' entries in ``result``."""
    servers: Servers = {}
    for count in counts:
        cfg = ps_config(broker.url, workdir, overrides, max_in_flight, count)
        cluster = LocalCluster(cfg, workdir)
        for i in range(count):
            cluster.spawn("ps", "ps" if count == 1 else f"ps-{i}", ["--shard", f"{i}/{count}"] if count > 1 else [])
        servers[count] = (cfg, cluster)
        if count > 1:
            result["sharded"][str(count)] = {"ps": {}, "ps_cpu_s_per_update": {}, "ps_parts": {},
                                             "speedup_vs_1": {}, "cpu_cores": {"ps": {}}}
    ps = servers[1][0].ps  # every shard count's server is configured alike
    result["ps_settings"] = {"ps.eval_every": ps.eval_every, "ps.fsync": ps.fsync,
                             "ps.checkpoint_every": ps.checkpoint_every}
    return servers


def _rounds(result: dict[str, Any], key: str, broker: BrokerProcess, servers: Servers,
            gradients: dict[int, list[tuple[ShardUpdate, ...]]], size: int, n: int, seconds: float,
            rounds: int) -> dict[str, Pooled]:
    """Every side's ``rounds`` trials at one payload and number in flight, pooled by side: the sides back to back
    (broker alone, streamed, the PS in each shard count), then again in the other order, so that a host growing
    busier or quieter weighs on every side alike. Each round's MB/s go into ``result["rounds"][key]``."""
    sides = ["raw", "stream", *(f"ps/{count}" for count in servers)]
    pooled = {side: Pooled() for side in sides}
    result["rounds"][key] = []
    for r in range(rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        got: dict[str, Any] = {"first": order[0]}
        for side in order:
            if side in ("raw", "stream"):
                trial = _raw(broker.host, broker.port, size, n, seconds, stream=side == "stream", pool=pooled[side],
                             broker_pid=broker.pid)
            else:
                count = int(side.split("/")[1])
                cfg, cluster = servers[count]
                trial = _measure(pooled[side], cfg, cluster, gradients[count], n, seconds, broker.pid)
            got[side] = trial.summary()["mb_per_s"]
        result["rounds"][key].append(got)
    return pooled


def _record(result: dict[str, Any], key: str, pooled: dict[str, Pooled], servers: Servers) -> None:
    """Every side's pooled figures at ``key`` into ``result`` (a shard count's under ``sharded``)."""
    for side in ("raw", "stream"):
        result[side][key] = pooled[side].trial.summary()
        result["cpu_cores"][side][key] = pooled[side].cores()
    for count in servers:
        into, pool = (result if count == 1 else result["sharded"][str(count)]), pooled[f"ps/{count}"]
        into["ps"][key] = pool.trial.summary()
        into.setdefault("cpu_cores", {}).setdefault("ps", {})[key] = pool.cores()
        into["ps_cpu_s_per_update"][key] = pool.cpu_per_message()
        into["ps_parts"][key] = pool.per_update()


def _said(result: dict[str, Any], key: str) -> str:
    """The progress line of one payload and number in flight."""
    raw, ours = result["raw"][key], result["ps"][key]
    shown = ", ".join(f"{c} shards {e['ps'][key]['mb_per_s']} MB/s" for c, e in result["sharded"].items())
    return (f"{key}: raw {raw['mb_per_s']} MB/s (p50 {raw['p50_ms']} ms), stream "
            f"{result['stream'][key]['mb_per_s']} MB/s, ps {ours['mb_per_s']} MB/s "
            f"(p50 {ours['p50_ms']} ms){'; ' + shown if shown else ''}")


def _ratios(result: dict[str, Any]) -> None:
    """Each shard count's ``speedup_vs_1``, and the parameter server's ingest over raw's and stream's, per key."""
    for entry in result["sharded"].values():
        entry["speedup_vs_1"] = {key: round(ps["mb_per_s"] / result["ps"][key]["mb_per_s"], 3)
                                 for key, ps in entry["ps"].items() if ps["mb_per_s"]
                                 and result["ps"].get(key, {}).get("mb_per_s")}
    for other in ("raw", "stream"):
        suffix = "" if other == "raw" else "_vs_stream"
        result[f"ps_ingest_ratio{suffix}"] = {
            key: round(ps["mb_per_s"] / result[other][key]["mb_per_s"], 3)
            for key, ps in result["ps"].items() if ps["mb_per_s"] and result[other].get(key, {}).get("mb_per_s")}


def plot(result: dict[str, Any], png: Path) -> bool:
    plt = pyplot()
    if plt is None or not result["ps"]:
        return False
    keys = list(result["ps"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for i, kind in enumerate(("stream", "raw", "ps")):
        values = [result[kind].get(k, {}).get("mb_per_s") or 0 for k in keys]
        ax.bar([x + (i - 1) * width for x in range(len(keys))], values, width, label=kind)
    ax.set_xticks(range(len(keys)), [f"{k.split('/')[0]}, {k.split('/')[1]} in flight" for k in keys])
    ax.set_ylabel("MB/s")
    ax.set_title(f"{MODEL} gradients through {result['broker']}: the broker alone and the parameter server")
    ax.legend()
    return save(fig, png)


def register(parser: argparse.ArgumentParser) -> None:
    """``edgemesh bench transport``."""
    parser.add_argument("--report", default="bench/reports/transport.json", help="JSON report path (PNG beside it)")
    parser.add_argument("--payloads", default=",".join(DEFAULT_PAYLOADS),
                        help="payload sizes, comma-separated: 1MB, 500KB, or model (the whole gradient)")
    parser.add_argument("--in-flight", default=",".join(map(str, DEFAULT_IN_FLIGHT)),
                        help="messages in flight (devices each waiting for its answer), comma-separated")
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="length of each trial")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help="times each side runs at each payload and number in flight, first and last in turn; "
                             "the report pools them")
    parser.add_argument("--shards", default=",".join(map(str, DEFAULT_SHARDS)),
                        help="parameter server shard counts to measure, comma-separated (1 always)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the parameter server and the devices (repeatable), e.g. ps.fsync=false, "
                             "ps.eval_every=5 (evaluation is off by default), broker.chunk_bytes=4194304")
    parser.add_argument("--keep-logs", action="store_true", help="keep the parameter server's log")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cli.setup_logging(args.log_level or "WARNING")
    try:
        in_flight = [int(x) for x in names(args.in_flight)]
        shard_counts = [int(x) for x in names(args.shards)]
        payloads = names(args.payloads)
        for spec in payloads:
            payload_bytes(spec, 1)
    except ValueError:
        print("edgemesh bench transport: --in-flight takes whole numbers, --payloads sizes such as 1MB or model",
              file=sys.stderr)
        return 2
    if not in_flight or min(in_flight) < 1 or args.seconds <= 0 or not payloads or min(shard_counts, default=1) < 1 \
            or args.rounds < 1:
        print("edgemesh bench transport: --in-flight >= 1, --shards >= 1, --seconds > 0, --rounds >= 1, at least one "
              "payload", file=sys.stderr)
        return 2
    try:
        result = run_bench(Path(args.report), payloads=payloads, in_flight=in_flight, seconds=args.seconds,
                           overrides=cli.overrides(args), keep_logs=args.keep_logs, shard_counts=shard_counts,
                           rounds=args.rounds,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    except EdgeMeshError as exc:
        print(f"edgemesh bench transport: {exc}", file=sys.stderr)
        return 2
    return 1 if result["failure"] else 0
