"""The parameter server: global model, version clock, synchronization policy, durability.

Backbone, top to bottom:
1. load the checkpoint and replay the write-ahead log (``store``);
2. connect; publish the retained model snapshot;
3. consume: plan, gradients, control; each gradient is decoded and checked against the model
   (unknown device, wrong shard, codec errors, NaN -> counted rejection and a ``discarded`` ack);
4. step loop: take the queued updates, judge each under the policy (``policy``), apply the
   accepted ones (``optimizer``), log them durably, ack, publish a snapshot, evaluate, checkpoint;
5. publish the retained ``sync`` state (policy, bound, and under ``adaptive`` the deadline, the
   delay indices and the slow devices) for the planner, which shrinks slow devices' batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgemesh.common import costs, models, wire
from edgemesh.common.bus import Bus, Incoming
from edgemesh.common.codecs import codec_for, get_codec
from edgemesh.common.config import Config
from edgemesh.common.data import load_dataset
from edgemesh.common.errors import ConfigError, WireError
from edgemesh.common.messages import (
    CodecPolicy,
    ControlCommand,
    GradientUpdate,
    ModelDelta,
    ModelSnapshot,
    Plan,
    ShardUpdate,
    SyncState,
    UpdateAck,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.operations import ControlResult, Operations, consume
from edgemesh.services.parameter_server import policy as rules
from edgemesh.services.parameter_server import store
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay, AdaptiveSettings, round_weights
from edgemesh.services.parameter_server.optimizer import ModelState, ShardGrad
from edgemesh.services.runtime import client_id, install_stop_signals, supervise

logger = logging.getLogger(__name__)

SERVICE = "ps"
DELAY_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)
ModelMessage = tuple[bytes, bool, dict[str, bytes]]
"""An encoded model message: payload, whether it is a snapshot, and the model-parallel members' parts
of a delta (device -> payload)."""
StepKey = tuple[str, int, int]
"""A model-parallel step: (cluster, plan version, mesh step)."""
CLOSED_STEPS = 1024
"""Model-parallel steps remembered as joined or discarded, against members' resends."""
MAX_DELTA_BLOCKS = 64
"""Most row blocks one parameter's delta is cut into for the model-parallel members' rows (each block
costs the broadcast a shard header); a plan that would cut finer keeps evenly spaced ones of its
cut points (``delta_cuts``), and a member's part then holds rows beyond its own in at most the two
blocks its slice ends fall in."""


@dataclass(slots=True)
class Pending:
    """A decoded, shape-checked update waiting for the step loop."""

    update: GradientUpdate
    grads: list[ShardGrad]
    received: float
    parts: tuple[GradientUpdate, ...] = ()
    """A model-parallel cluster's update: the members' updates it joins (``update`` is the first's)."""

    @property
    def updates(self) -> tuple[GradientUpdate, ...]:
        return self.parts or (self.update,)


@dataclass(slots=True)
class Assembly:
    """The members' shards of one model-parallel step, until they cover the whole model."""

    opened: float
    parts: dict[str, Pending] = field(default_factory=dict)


class ParameterServer:
    """One parameter server process. ``run()`` until ``stop`` is set."""

    def __init__(self, config: Config, *, stop: asyncio.Event | None = None) -> None:
        self.cfg = config
        self.topics = Topics(config.job)
        self.stop = stop or asyncio.Event()
        t = config.training
        if t.sync_policy not in rules.POLICIES:
            raise ConfigError(
                f"training.sync_policy: {t.sync_policy!r} is not implemented by this parameter server "
                f"(available: {', '.join(rules.POLICIES)})"
            )
        self.policy: rules.Policy = t.sync_policy
        self.bound = t.staleness_bound
        self.lr = t.lr
        self.paused = False
        self.state_dir = Path(config.ps.state_dir)
        self.plan: Plan | None = None
        self.version = 0
        self.high_water: dict[str, tuple[int, int]] = {}
        self.clocks: dict[str, int] = {}
        self._queue: deque[Pending] = deque()
        self._wake = asyncio.Event()
        self._round: dict[str, Pending] = {}
        self._round_opened: float | None = None
        """Adaptive: monotonic time the open round began, when the model of the previous one went out (or
        its first update, for the first round); its deadline and the clusters' arrival times run from here."""
        self._deferred: list[Pending] = []
        self._assembling: dict[StepKey, Assembly] = {}
        """Model-parallel steps waiting for the rest of their members' shards, by (cluster, plan, step)."""
        self._closed_steps: OrderedDict[StepKey, str] = OrderedDict()
        """The last CLOSED_STEPS model-parallel steps joined ('') or discarded (the reason): a member's
        resend of its part must not open the step again."""
        p = config.ps
        self.adaptive = AdaptiveDelay(AdaptiveSettings(
            alpha=p.adaptive_alpha, quantile=p.adaptive_quantile, slack=p.adaptive_slack,
            min_deadline_s=p.adaptive_min_deadline_s, max_deadline_s=p.adaptive_max_deadline_s,
            min_bound=p.adaptive_min_bound, slow_factor=p.adaptive_slow_factor))
        self._since_checkpoint = 0
        self._state_lock = threading.Lock()
        """Held by the thread that steps and logs and by the one that checkpoints: a step of a step loop
        cancelled at shutdown still runs in its thread while the final checkpoint is written."""
        self._last_eval_version = -1
        self._last_eval_time = -float("inf")
        self._eval_wake = asyncio.Event()
        self._to_evaluate: tuple[int, dict[str, np.ndarray]] | None = None
        """(version, weights) the evaluation loop is to evaluate next."""
        self._sync_published: tuple[object, ...] | None = None
        """(policy, bound, slow devices, delay indices) of the last published sync state."""
        self._sync_published_at = -float("inf")
        self.last_accuracy: float | None = None
        self._model: Any = None
        self._test_set: Any = None
        self.bus: Bus | None = None
        self.state: ModelState | None = None
        self._wal: store.WriteAheadLog | None = None
        self._view: dict[str, np.ndarray] | None = None
        """Delta mode: the model as the workers hold it (snapshot plus decoded deltas)."""
        self._view_version = -1
        self._last_full = -1
        self._snapshot_requested = False

        m = self.metrics = ServiceMetrics(SERVICE)
        self.m_version = m.gauge("model_version", "Current global model version")
        self.m_updates = m.counter("updates", "Gradient updates by outcome", ["status", "reason"])
        self.m_assembling = m.gauge("mesh_assembling_steps", "Model-parallel steps waiting for members' shards")
        self.m_delay = m.histogram("update_delay_versions", "Delay of accepted updates in versions", DELAY_BUCKETS)
        self.m_step = m.histogram("step_seconds", "Time to apply one batch of updates", STEP_BUCKETS)
        self.m_accuracy = m.gauge("eval_accuracy_ratio", "Held-out accuracy of the current model")
        self.m_loss = m.gauge("eval_loss", "Held-out loss of the current model")
        self.m_wal = m.counter("wal_bytes", "Bytes appended to the write-ahead log")
        self.m_checkpoints = m.counter("checkpoints", "Checkpoints written")
        self.m_pending = m.gauge("pending_updates", "Updates queued, in an open round or held by SSP")
        self.m_policy = m.gauge("sync_policy_info", "1 for the active synchronization policy", ["policy"])
        self.m_paused = m.gauge("paused", "1 while paused by an operator")
        self.m_codec_bytes = m.counter("received_gradient_bytes", "Encoded gradient bytes received", ["codec"])
        self.m_adaptive_bound = m.gauge("adaptive_bound_versions", "Adaptive policy: current delay bound D")
        self.m_adaptive_deadline = m.gauge("adaptive_deadline_seconds", "Adaptive policy: current round deadline")
        self.m_slow = m.gauge("slow_devices", "Adaptive policy: devices whose delay index is far above the median")
        self._set_policy_gauge()

    # ------------------------------------------------------------------ lifecycle
    def _load(self) -> None:
        """Build the model; resume from checkpoint + log if present (runs in a thread)."""
        spec = self.cfg.training.model_spec
        model = models.build_model(spec, seed=self.cfg.training.seed)
        self._model = model
        _, self._test_set = load_dataset(
            self.cfg.training.dataset, self.cfg.training.dataset_path or None, seed=self.cfg.training.seed
        )
        snap = store.read_checkpoint(self.state_dir)
        if snap is not None:
            if snap.model_spec != spec:
                raise ConfigError(
                    f"checkpoint in {self.state_dir} is for model {snap.model_spec!r}, config says {spec!r}; "
                    "use another ps.state_dir or remove the checkpoint"
                )
            layout = models.param_layout(model)
            bad = {k for k, v in snap.params.items() if k not in layout or tuple(v.shape) != layout[k][0]}
            if bad or set(layout) - set(snap.params):
                raise ConfigError(f"checkpoint in {self.state_dir} does not match model {spec!r}")
            self.state = ModelState(snap.params, snap.momentum)
            self.version = snap.version
            self.high_water = dict(snap.high_water)
            self.clocks = dict(snap.clocks)
            indices = snap.settings.get("delay_indices", {})
            if isinstance(indices, dict):
                self.adaptive.indices.update({str(k): float(v) for k, v in indices.items()})
            logger.info("resumed from checkpoint at version %d", self.version)
        else:
            self.state = ModelState(models.get_params(model))
        replayed = 0
        for record in store.read_wal(self.state_dir):
            if int(record["version"]) <= self.version:
                continue
            self._replay(record)
            replayed += 1
        if replayed:
            logger.info("replayed %d logged steps; now at version %d", replayed, self.version)
        self._wal = store.WriteAheadLog(self.state_dir, fsync=self.cfg.ps.fsync)
        self.m_version.set(self.version)

    def _replay(self, record: dict[str, Any]) -> None:
        assert self.state is not None
        contributions = []
        clusters = set()
        for entry in record["entries"]:
            grads = [self._decode_shard(s["param"], s["start"], s["stop"], s["codec"], s["data"])
                     for s in entry["shards"]]
            contributions.append((float(entry["weight"]), grads))
            self.high_water[entry["device"]] = (int(entry["incarnation"]), int(entry["seq"]))
            clusters.add(entry.get("cluster", ""))
        for cluster in clusters:  # one tick per cluster, however many members logged a part
            self.clocks[cluster] = self.clocks.get(cluster, 0) + 1
        self.state.step(contributions, lr=float(record["lr"]), momentum=float(record["momentum"]),
                        weight_decay=float(record.get("weight_decay", 0.0)))
        self.version = int(record["version"])

    async def run(self) -> None:
        await asyncio.to_thread(self._load)
        async with contextlib.AsyncExitStack() as stack:
            self.metrics.serve(self.cfg.metrics.address, self.cfg.metrics.port_file)
            stack.callback(self.metrics.close)
            stack.callback(self._close_wal)
            self.bus = await stack.enter_async_context(Bus(
                self.cfg.broker,
                client_id=client_id(SERVICE, self.cfg),
                metrics=self.metrics,
                subscriptions=[
                    self.topics.plan(), self.topics.all_grad(),
                    self.topics.control("ps"), self.topics.control("all"),
                ],
                on_connect=self._on_connect,
            ))
            self.ops = Operations(source=SERVICE, bus=self.bus, topics=self.topics, metrics=self.metrics,
                                  stop=self.stop)
            self.metrics.up.set(1)
            logger.info("parameter server up: model %s, version %d, policy %s, bound %d",
                        self.cfg.training.model_spec, self.version, self.policy, self.bound)
            try:
                await supervise(self.stop, consume(self.bus, self.metrics, self._dispatch), self._step_loop(),
                                self._eval_loop())
            finally:
                self.metrics.up.set(0)
                await asyncio.to_thread(self._checkpoint)

    def _close_wal(self) -> None:
        if self._wal is not None:
            self._wal.close()

    # ------------------------------------------------------------------ consuming
    async def _dispatch(self, msg: Incoming) -> None:
        parts = self.topics.relative(msg.topic)
        if parts == ["plan"]:
            plan = msg.decode(Plan)
            self.metrics.received_messages.labels(kind="plan").inc()
            if self.plan is None or plan.version >= self.plan.version:
                self.plan = plan
                await self._discard_replanned_steps(plan.version)
                self._wake.set()  # a cluster may have left: an open round may now be complete
        elif parts[0] == "grad" and len(parts) == 3:
            update = msg.decode(GradientUpdate)
            self.metrics.received_messages.labels(kind="gradient").inc()
            await self._admit(update, parts[1], parts[2])
        elif parts[0] == "control":
            await self.ops.control(msg.decode(ControlCommand), self._apply_control)
        else:
            raise WireError(f"no handler for topic {msg.topic}", "topic")

    async def _admit(self, update: GradientUpdate, topic_cluster: str, topic_device: str) -> None:
        """Check an update against topic, plan and model; queue it or discard it with an ack."""
        if update.device != topic_device or update.cluster != topic_cluster:
            raise WireError("update's device/cluster disagree with its topic", "topic")
        if self.plan is not None:
            member = self.plan.device(update.device)
            if member is None:
                self.metrics.reject("unknown_device", self.topics.grad(topic_cluster, topic_device), update.device)
                await self._ack(update, "discarded", "unknown_device", resync=False)
                return
        try:
            grads = await asyncio.to_thread(self._decode_update, update)
        except WireError as exc:
            self.metrics.reject(exc.reason, self.topics.grad(topic_cluster, topic_device), exc)
            await self._ack(update, "discarded", exc.reason, resync=False)
            return
        for shard in update.shards:
            self.m_codec_bytes.labels(codec=shard.codec).inc(len(shard.data))
        if update.need_snapshot and self.cfg.ps.broadcast == "delta" and self._last_full != self.version:
            self._request_snapshot()  # the sender missed a delta
        received = Pending(update, grads, time.monotonic())
        item = await self._assemble(received) if update.mesh_step else received
        if item is not None:
            self._queue.append(item)
            self._wake.set()

    async def _assemble(self, item: Pending) -> Pending | None:
        """Hold a model-parallel member's shards until its cluster's shards of that step cover the
        whole model; then the cluster's update, which the policies treat like any other."""
        u = item.update
        mark = self.high_water.get(u.device)
        if mark is not None and (u.incarnation, u.seq) <= mark:
            await self._ack(u, "duplicate", "", resync=False)
            return None
        key = (u.cluster, u.plan_version, u.mesh_step)
        closed = self._closed_steps.get(key)
        if closed is not None:  # a resend of a part of a step joined or discarded
            if closed:
                await self._ack(u, "discarded", closed, resync=True)
            return None  # joined and not judged yet: acked with the cluster's update
        if self.plan is not None and u.plan_version < self.plan.version:
            # its members abandon a step when the plan changes: the rest of it will not come
            self._close_step(key, "replanned")
            await self._ack(u, "discarded", "replanned", resync=True)
            return None
        assembly = self._assembling.get(key)
        if assembly is None:
            assembly = self._assembling[key] = Assembly(time.monotonic())
            self._wake.set()  # the step loop times it out
        assembly.parts[u.device] = item
        self.m_assembling.set(len(self._assembling))
        coverage = self._coverage([g for part in assembly.parts.values() for g in part.grads])
        if coverage == "partial":
            return None
        del self._assembling[key]
        self.m_assembling.set(len(self._assembling))
        self._close_step(key, "shape" if coverage == "overlap" else "")
        parts = sorted(assembly.parts.values(), key=lambda part: part.update.device)
        if coverage == "overlap":
            for part in parts:
                self.metrics.reject("shape", self.topics.grad(u.cluster, part.update.device),
                                    f"step {u.mesh_step}: members' shards overlap")
                await self._ack(part.update, "discarded", "shape", resync=True)
            return None
        first = parts[0].update
        merged = replace(first, base_version=min(part.update.base_version for part in parts),
                         need_snapshot=any(part.update.need_snapshot for part in parts),
                         shards=tuple(sh for part in parts for sh in part.update.shards))
        return Pending(merged, [g for part in parts for g in part.grads], max(part.received for part in parts),
                       parts=tuple(part.update for part in parts))

    def _coverage(self, grads: list[ShardGrad]) -> str:
        """``full`` if the shards tile every parameter exactly, ``overlap`` if two cover one row, else ``partial``."""
        assert self.state is not None
        rows: dict[str, list[tuple[int, int]]] = {}
        for g in grads:
            rows.setdefault(g.param, []).append((g.start, g.stop))
        full = len(rows) == len(self.state.params)
        for param, ranges in rows.items():
            ranges.sort()
            end = 0
            for start, stop in ranges:
                if start < end:
                    return "overlap"
                full = full and start == end
                end = stop
            full = full and end == self.state.params[param].shape[0]
        return "full" if full else "partial"

    async def _expire_assemblies(self) -> None:
        """Discard model-parallel steps whose members did not all report in time (one left or lags)."""
        now = time.monotonic()
        timeout = self.cfg.ps.mesh_assembly_timeout_s
        expired = self._take_steps([k for k, a in self._assembling.items() if now - a.opened >= timeout],
                                   "incomplete")
        for key, assembly in expired:
            for part in assembly.parts.values():
                self.metrics.reject("incomplete", self.topics.grad(key[0], part.update.device),
                                    f"step {key[2]} of {key[0]} incomplete after {timeout:g}s")
                await self._ack(part.update, "discarded", "incomplete", resync=True)

    def _assembly_timeout(self) -> float | None:
        """Seconds until the oldest model-parallel step waiting for shards times out (None: none waits)."""
        if not self._assembling:
            return None
        oldest = min(a.opened for a in self._assembling.values())
        return max(0.0, oldest + self.cfg.ps.mesh_assembly_timeout_s - time.monotonic())

    async def _discard_replanned_steps(self, plan_version: int) -> None:
        """A new plan: model-parallel steps of older plans still waiting for shards are discarded at
        once. Members abandon a step when the plan changes, so the rest of it will not come, and the
        members that did send would otherwise wait ``ps.mesh_assembly_timeout_s`` for their acks."""
        stale = self._take_steps([k for k in self._assembling if k[1] < plan_version], "replanned")
        for key, assembly in stale:
            logger.info("step %d of %s discarded: plan version %d replaced %d", key[2], key[0], plan_version, key[1])
            for part in assembly.parts.values():
                await self._ack(part.update, "discarded", "replanned", resync=True)

    def _take_steps(self, keys: list[StepKey], reason: str) -> list[tuple[StepKey, Assembly]]:
        """Remove waiting steps, closed as discarded for ``reason``: done before any await, so the
        gauge is right when their acks go out and a resend meanwhile opens no new step."""
        taken = [(k, self._assembling.pop(k)) for k in keys]
        self.m_assembling.set(len(self._assembling))
        for key, _ in taken:
            self._close_step(key, reason)
        return taken

    def _close_step(self, key: StepKey, reason: str) -> None:
        self._closed_steps[key] = reason
        while len(self._closed_steps) > CLOSED_STEPS:
            self._closed_steps.popitem(last=False)

    def _decode_update(self, update: GradientUpdate) -> list[ShardGrad]:
        seen: set[tuple[str, int, int]] = set()
        grads = []
        for s in update.shards:
            key = (s.param, s.start, s.stop)
            if key in seen:
                raise WireError(f"shard {key} appears twice", "shape")
            seen.add(key)
            grads.append(self._decode_shard(s.param, s.start, s.stop, s.codec, s.data))
        return grads

    def _decode_shard(self, param: str, start: int, stop: int, codec: str, data: bytes) -> ShardGrad:
        assert self.state is not None
        shape = self.state.slice_shape(param, start, stop)
        values = get_codec(codec).decode(data, int(np.prod(shape)))
        return ShardGrad(param, start, stop, values.reshape(shape))

    # ------------------------------------------------------------------ stepping
    def _live_clusters(self) -> list[str]:
        if self.plan is not None and self.plan.clusters:
            return list(self.plan.cluster_names)
        return sorted({p.update.cluster for p in self._round.values()} | set(self.clocks))

    def _left_the_plan(self, u: GradientUpdate, live: list[str]) -> bool:
        """Sync: ``u`` comes from a cluster the plan no longer has, computed under an older plan. No
        round waits for that cluster, and its devices, now in others, must not wait for its ack (a
        sender ahead of the PS, under a plan the PS has not received yet, is not one)."""
        return bool(self.plan is not None and self.plan.clusters and u.cluster not in live
                    and 0 < u.plan_version < self.plan.version)

    def _adaptive_refresh(self) -> None:
        """Tell the adaptive rule who is live and what the max bound is; update its gauges."""
        a = self.adaptive
        a.max_bound = self.bound
        a.live_devices = frozenset(d.device for d in self.plan.devices) if self.plan is not None else None
        self.m_adaptive_bound.set(a.bound())
        self.m_adaptive_deadline.set(a.deadline(self._live_clusters()))
        self.m_slow.set(len(a.slow_devices()))

    def _round_timeout(self) -> float | None:
        """Adaptive: seconds until the open round's deadline (None when no round holds an update)."""
        if self.policy != "adaptive" or self._round_opened is None or self.paused or not self._round:
            return None
        deadline = self._round_opened + self.adaptive.deadline(self._live_clusters())
        return max(0.0, deadline - time.monotonic())

    async def _step_loop(self) -> None:
        while True:
            timeouts = [t for t in (self._round_timeout(), self._assembly_timeout()) if t is not None]
            if not timeouts:
                await self._wake.wait()
            else:  # an adaptive round's deadline, or a model-parallel step's
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), min(timeouts))
            self._wake.clear()
            await self._expire_assemblies()
            if self._snapshot_requested:
                self._snapshot_requested = False
                await self._publish_snapshot()
            if self._sync_published is None:
                await self._publish_sync_state()
            if self.paused:
                continue
            batch: list[Pending] = []
            while self._queue and len(batch) < self.cfg.ps.max_batch:
                batch.append(self._queue.popleft())
            progressed = await self._process(batch)
            # more queued, or a step moved the clocks so an update SSP held may now go
            if self._queue or (progressed and self._deferred):
                self._wake.set()

    async def _process(self, batch: list[Pending]) -> bool:
        """Judge, apply, log, ack, publish; True if the model moved. Acks go out only after the log is durable."""
        started = time.perf_counter()
        acks: list[tuple[GradientUpdate, str, str, int, bool]] = []
        steps: list[tuple[list[Pending], int]] = []  # (contributions, version after)
        version = self.version
        live = self._live_clusters()
        adaptive = self.policy == "adaptive"
        if adaptive:
            self._adaptive_refresh()
        bound = self.adaptive.bound() if adaptive else self.bound

        candidates = self._deferred + batch
        self._deferred = []
        if self.policy == "sync":
            for cluster in [c for c, item in self._round.items() if self._left_the_plan(item.update, live)]:
                acks += [(part, "discarded", "replanned", 0, True) for part in self._round.pop(cluster).updates]
        for item in candidates:
            u = item.update
            mark = self.high_water.get(u.device)
            if mark is not None and (u.incarnation, u.seq) <= mark:
                acks += [(part, "duplicate", "", 0, False) for part in item.updates]
                continue
            if adaptive:
                verdict = self.adaptive.judge(version, u.base_version, bound)
            else:
                verdict = rules.judge(self.policy, version, u.base_version, self.bound)
            if not verdict.accept:
                for part in item.updates:
                    if adaptive and verdict.reason == "stale":
                        # "later than the bound" is what a discard says; a device back from a long
                        # outage would otherwise carry a huge index for many rounds
                        self.adaptive.observe_delay(part.device, min(verdict.delay, bound + 1))
                    acks.append((part, "discarded", verdict.reason, verdict.delay, True))
                continue
            if adaptive:
                if u.cluster in self._round:
                    self._deferred.append(item)  # the cluster's next update: it goes into the next round
                    continue
                now = time.monotonic()
                if self._round_opened is None:
                    self._round_opened = now
                if verdict.delay == 0:  # how long a cluster takes from the model it trained on to its update
                    self.adaptive.observe_arrival(u.cluster, now - self._round_opened)
                self._round[u.cluster] = item
                if rules.round_complete(self._round, live):
                    version += 1
                    steps.append((list(self._round.values()), version))
                    self._round = {}
                    self._round_opened = None
                continue
            if self.policy == "sync":
                if self._left_the_plan(u, live):
                    acks += [(part, "discarded", "replanned", verdict.delay, True) for part in item.updates]
                    continue
                if u.cluster in self._round:
                    # the cluster already contributed to this round: a second member or a repeat
                    acks += [(part, "discarded", "round_full", verdict.delay, True) for part in item.updates]
                    continue
                self._round[u.cluster] = item
                if rules.round_complete(self._round, live):
                    version += 1
                    steps.append((list(self._round.values()), version))
                    self._round = {}
                continue
            if rules.must_wait(self.policy, u.cluster, self.clocks, live, self.bound):
                self._deferred.append(item)
                continue
            version += 1
            steps.append(([item], version))
            self.clocks[u.cluster] = self.clocks.get(u.cluster, 0) + 1
            for part in item.updates:
                self.high_water[part.device] = (part.incarnation, part.seq)
        # a sync round can also complete because a cluster left the plan
        if self.policy == "sync" and self._round and rules.round_complete(self._round, live):
            version += 1
            steps.append((list(self._round.values()), version))
            self._round = {}
        # an adaptive round closes when its deadline has passed, whoever is missing
        if adaptive and self._round and (rules.round_complete(self._round, live) or (
                self._round_opened is not None
                and time.monotonic() - self._round_opened >= self.adaptive.deadline(live))):
            version += 1
            steps.append((list(self._round.values()), version))
            self._round = {}
            self._round_opened = None
        if self.policy in ("sync", "adaptive"):
            for items, _ in steps:
                for item in items:
                    u = item.update
                    self.clocks[u.cluster] = self.clocks.get(u.cluster, 0) + 1
                    for part in item.updates:
                        self.high_water[part.device] = (part.incarnation, part.seq)

        model_message = await asyncio.to_thread(self._step, steps) if steps else None
        if steps:
            for items, v in steps:
                for item in items:
                    delay = v - 1 - item.update.base_version
                    self.m_delay.observe(delay)
                    for part in item.updates:
                        if adaptive:
                            self.adaptive.observe_delay(part.device, delay)
                        acks.append((part, "accepted", "", delay, self.policy in ("sync", "adaptive")))
        if adaptive:
            self._adaptive_refresh()
            await self._publish_sync_state()
        self.m_pending.set(len(self._queue) + len(self._round) + len(self._deferred))
        if model_message is not None:
            # the model goes out before the acks, so a worker acked for version v usually has v
            await self._publish_model(model_message)
            if adaptive:
                self._round_opened = time.monotonic()  # the next round's deadline runs from its model
        # acks go to different devices: out at once, not one PUBACK after another
        await asyncio.gather(*(self._ack(u, status, reason, delay=delay, resync=resync)
                               for u, status, reason, delay, resync in acks))
        if steps:
            self.m_step.observe(time.perf_counter() - started)
            self._maybe_evaluate()
            self._since_checkpoint += len(steps)
            if self._since_checkpoint >= self.cfg.ps.checkpoint_every:
                await asyncio.to_thread(self._checkpoint)
        return bool(steps)

    def _apply_and_log(self, steps: list[tuple[list[Pending], int]]) -> None:
        assert self.state is not None and self._wal is not None
        t = self.cfg.training
        records = []
        planned = 0  # samples the plan expects per round: one batch per cluster (its members share it)
        if self.plan is not None:
            planned = sum({d.cluster: d.batch_size for d in self.plan.devices}.values())
        for items, v in steps:
            total = sum(i.update.samples for i in items)
            weights = [i.update.samples / total for i in items]
            if self.policy == "adaptive":
                weights = round_weights([i.update.samples for i in items],
                                        [v - 1 - i.update.base_version for i in items], planned)
            elif self.policy != "sync" and self.cfg.ps.staleness_weighting:
                weights = [w * rules.staleness_weight(v - 1 - i.update.base_version)
                           for w, i in zip(weights, items, strict=True)]
            contributions = list(zip(weights, (i.grads for i in items), strict=True))
            self.state.step(contributions, lr=self.lr, momentum=t.momentum, weight_decay=t.weight_decay)
            records.append({
                "version": v,
                "lr": self.lr,
                "momentum": t.momentum,
                "weight_decay": t.weight_decay,
                # a model-parallel cluster's update is logged per member, each with the cluster's weight:
                # members' shards are disjoint, so replaying them applies the same step
                "entries": [{
                    "device": part.device,
                    "cluster": part.cluster,
                    "incarnation": part.incarnation,
                    "seq": part.seq,
                    "weight": w,
                    "shards": [{"param": s.param, "start": s.start, "stop": s.stop, "codec": s.codec,
                                "data": s.data} for s in part.shards],
                } for w, i in zip(weights, items, strict=True) for part in i.updates],
            })
        self.m_wal.inc(self._wal.append(records))
        self.version = steps[-1][1]
        self.m_version.set(self.version)

    def _checkpoint(self) -> None:
        """Write a checkpoint and start a fresh log (in a thread, never during a step)."""
        with self._state_lock:
            self._write_checkpoint()

    def _write_checkpoint(self) -> None:
        if self.state is None or self._wal is None:
            return
        store.write_checkpoint(self.state_dir, store.Snapshot(
            model_spec=self.cfg.training.model_spec,
            version=self.version,
            params=self.state.params,
            momentum=self.state.momentum,
            high_water=self.high_water,
            clocks=self.clocks,
            settings={"policy": self.policy, "bound": self.bound, "lr": self.lr,
                      "delay_indices": dict(self.adaptive.indices)},
        ))
        self._wal.reset()
        self._since_checkpoint = 0
        self.m_checkpoints.inc()
        logger.debug("checkpoint at version %d", self.version)

    # ------------------------------------------------------------------ publishing
    async def _ack(self, u: GradientUpdate, status: str, reason: str, *, delay: int = 0, resync: bool) -> None:
        assert self.bus is not None
        self.m_updates.labels(status=status, reason=reason).inc()
        key = (u.cluster, u.plan_version, u.mesh_step)
        if status == "discarded" and u.mesh_step and key in self._closed_steps:
            self._closed_steps[key] = reason  # a joined step the policies discarded: a resend hears why
        ack = UpdateAck(device=u.device, incarnation=u.incarnation, seq=u.seq, status=status,  # type: ignore[arg-type]
                        reason=reason, version=self.version, delay=delay, resync=resync)
        await self.bus.publish(self.topics.ack(u.device), ack)

    def _snapshot(self) -> bytes:
        """The model as a snapshot; in delta mode it is exact (float32) and resets the workers' view."""
        assert self.state is not None
        delta_mode = self.cfg.ps.broadcast == "delta"
        dtype = "float32" if delta_mode else self.cfg.ps.snapshot_dtype
        snap = ModelSnapshot(
            version=self.version,
            model_spec=self.cfg.training.model_spec,
            tensors={k: wire.Tensor.from_numpy(v.astype(dtype, copy=False)) for k, v in self.state.params.items()},
            created=time.time(),
            sync_policy=self.policy,
        )
        if delta_mode:
            self._view = {k: v.copy() for k, v in self.state.params.items()}
            self._view_version = self._last_full = self.version
        return wire.encode(snap)

    def _member_rows(self) -> dict[str, dict[str, tuple[int, int]]]:
        """``device -> param -> (start, stop)``: the rows every model-parallel member of the plan trains."""
        out: dict[str, dict[str, tuple[int, int]]] = {}
        for c in self.plan.clusters if self.plan is not None else ():
            if len(c.members) < 2:
                continue
            for i, device in enumerate(c.members):
                rows = out[device] = {}
                for layer, counts in c.counts.items():
                    start, stop = costs.slices(counts)[i]
                    if stop > start:
                        rows[f"{layer}.weight"] = rows[f"{layer}.bias"] = (start, stop)
        return out

    def _delta(self) -> tuple[bytes, dict[str, bytes]]:
        """The encoded change from the workers' view to the model, and every model-parallel member's
        part of it; the view takes what was sent.

        Each parameter's change is cut into row blocks at the members' slice boundaries and every
        block encoded alone: the broadcast carries all blocks, a member's own message
        (``model/delta/{device}``) the blocks of its rows only, the very bytes of the broadcast, so
        every view follows one model and a member's downlink carries its share."""
        assert self.state is not None and self._view is not None
        policy = CodecPolicy(device="ps", codec=self.cfg.ps.delta_codec, density=self.cfg.ps.delta_density)
        members = self._member_rows()
        cuts: dict[str, set[int]] = {}
        for rows in members.values():
            for name, (start, stop) in rows.items():
                cuts.setdefault(name, set()).update((start, stop))
        shards = []
        for name, param in self.state.params.items():
            n = int(param.shape[0])
            points = delta_cuts(n, cuts.get(name, ()), MAX_DELTA_BLOCKS)
            for start, stop in zip(points, points[1:], strict=False):
                change = (param[start:stop] - self._view[name][start:stop]).reshape(-1)
                codec = codec_for(self.cfg.ps.delta_codec, change.size)
                data = codec.encode(change, policy)
                self._view[name][start:stop] += codec.decode(data, change.size).reshape(param[start:stop].shape)
                shards.append(ShardUpdate(param=name, start=start, stop=stop,
                                          codec=codec.name, data=data))  # type: ignore[arg-type]
        delta = ModelDelta(version=self.version, base_version=self._view_version,
                           model_spec=self.cfg.training.model_spec, shards=tuple(shards), created=time.time())
        self._view_version = self.version
        own = {}
        for device, rows in members.items():
            mine = tuple(s for s in shards if s.param in rows and s.start < rows[s.param][1]
                         and rows[s.param][0] < s.stop)
            if mine:
                own[device] = wire.encode(replace(delta, shards=mine))
        return wire.encode(delta), own

    async def _on_connect(self) -> None:
        self._request_snapshot()  # the first, or a restarted broker has lost the retained model
        self._sync_published = None  # and the retained sync state

    def sync_state(self) -> SyncState:
        """What the parameter server tells the planner about synchronization now."""
        adaptive = self.policy == "adaptive"
        a = self.adaptive
        live = a.live_devices
        return SyncState(
            policy=self.policy, version=self.version, time=time.time(),
            bound=a.bound() if adaptive else self.bound,
            deadline_s=a.deadline(self._live_clusters()) if adaptive else 0.0,
            delay_indices={d: round(i, 3) for d, i in a.indices.items() if live is None or d in live} if adaptive
            else {},
            slow=tuple(a.slow_devices()) if adaptive else ())

    async def _publish_sync_state(self) -> None:
        """Publish the retained sync state when the policy, bound or slow devices changed, or, when
        only delay indices moved, at most every ``ps.sync_state_interval_s``."""
        assert self.bus is not None
        state = self.sync_state()
        key = (state.policy, state.bound, state.slow)
        now = time.monotonic()
        if self._sync_published is not None:
            if self._sync_published[:3] == key and (
                    self._sync_published[3] == state.delay_indices
                    or now - self._sync_published_at < self.cfg.ps.sync_state_interval_s):
                return
        self._sync_published, self._sync_published_at = (*key, state.delay_indices), now
        await self.bus.publish(self.topics.sync(), state, retain=True)
    def _request_snapshot(self) -> None:
        """Have the step loop publish a snapshot: model publishing is serialized with stepping."""
        self._snapshot_requested = True
        self._wake.set()

    async def _publish_snapshot(self) -> None:
        assert self.bus is not None
        payload = await asyncio.to_thread(self._snapshot)
        await self.bus.publish(self.topics.model(), payload, retain=True, kind="model")

    def _model_message(self) -> ModelMessage:
        """After a step: the encoded snapshot or, in delta mode, delta (a snapshot when one is due);
        True for a snapshot; the model-parallel members' parts of a delta."""
        if self.cfg.ps.broadcast == "snapshot" or self._view is None or \
                self.version - self._last_full >= self.cfg.ps.snapshot_every:
            return self._snapshot(), True, {}
        broadcast, parts = self._delta()
        return broadcast, False, parts

    def _step(self, steps: list[tuple[list[Pending], int]]) -> ModelMessage:
        """Apply and log ``steps``, then encode the model to broadcast (one thread hop for both)."""
        with self._state_lock:
            self._apply_and_log(steps)
        return self._model_message()

    async def _publish_model(self, message: ModelMessage) -> None:
        assert self.bus is not None
        payload, snapshot, parts = message
        if snapshot:
            await self.bus.publish(self.topics.model(), payload, retain=True, kind="model")
            return
        await asyncio.gather(self.bus.publish(self.topics.model_delta(), payload, kind="model_delta"),
                             *(self.bus.publish(self.topics.model_delta_for(device), part, kind="model_delta")
                               for device, part in parts.items()))

    def _maybe_evaluate(self) -> None:
        """Hand the model to the evaluation loop every ``ps.eval_every`` versions, and every
        ``ps.eval_interval_s`` seconds the model moved."""
        every, interval = self.cfg.ps.eval_every, self.cfg.ps.eval_interval_s
        by_count = bool(every) and self.version - self._last_eval_version >= every
        by_time = bool(interval) and self.version != self._last_eval_version and \
            time.monotonic() - self._last_eval_time >= interval
        if not (by_count or by_time):
            return
        assert self.state is not None
        self._last_eval_version = self.version
        self._last_eval_time = time.monotonic()
        # a copy: the step loop goes on changing the weights while the evaluation runs
        self._to_evaluate = (self.version, {k: v.copy() for k, v in self.state.params.items()})
        self._eval_wake.set()

    async def _eval_loop(self) -> None:
        """Evaluate the latest model handed over, off the step loop (stepping does not wait for it)."""
        while True:
            await self._eval_wake.wait()
            self._eval_wake.clear()
            if self._to_evaluate is None:
                continue
            version, params = self._to_evaluate
            self._to_evaluate = None
            loss, accuracy = await asyncio.to_thread(self._evaluate, params)
            self.last_accuracy = accuracy
            self.m_accuracy.set(accuracy)
            self.m_loss.set(loss)
            await self.ops.event("evaluation", f"version {version}: accuracy {accuracy:.4f}, loss {loss:.4f}",
                                 version=version, accuracy=accuracy, loss=loss)

    def _evaluate(self, params: dict[str, np.ndarray]) -> tuple[float, float]:
        models.set_params(self._model, params)
        return models.evaluate(self._model, self._test_set)

    # ------------------------------------------------------------------ control
    async def _apply_control(self, cmd: ControlCommand) -> ControlResult:
        self._wake.set()  # a resume, or a new policy or bound, may release queued updates
        value = cmd.value
        match cmd.command:
            case "status":
                pass
            case "pause":
                self.paused = True
            case "resume":
                self.paused = False
            case "set-sync-policy":
                if value not in rules.POLICIES:
                    return False, f"policy must be one of {', '.join(rules.POLICIES)}", {}
                self.policy = value  # type: ignore[assignment]
                # an open round's updates are judged again under the new policy, not dropped
                self._deferred = list(self._round.values()) + self._deferred
                self._round = {}
                self._round_opened = None
                self._set_policy_gauge()
            case "set-bound":
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    return False, "bound must be an integer >= 0", {}
                self.bound = value
            case "set-lr":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 10:
                    return False, "lr must be a number in (0, 10)", {}
                self.lr = float(value)
            case "snapshot":  # a device whose view lacks rows (a new filter division), or an operator
                if self._last_full != self.version:
                    self._request_snapshot()
            case "stop":
                pass  # Operations.control stops the service once the reply is out
            case _:
                return False, f"unknown command {cmd.command!r} (status, pause, resume, set-sync-policy, " \
                              "set-bound, set-lr, snapshot, stop)", {}
        self.m_paused.set(1 if self.paused else 0)
        self._adaptive_refresh()
        if cmd.command in ("set-sync-policy", "set-bound"):
            self._sync_published = None  # the step loop publishes the new state (woken above)
        return True, "ok", {"version": self.version, "policy": self.policy, "bound": self.bound, "lr": self.lr,
                            "paused": self.paused, "accuracy": self.last_accuracy,
                            "adaptive_bound": self.adaptive.bound(),
                            "adaptive_deadline_s": self.adaptive.deadline(self._live_clusters()),
                            "slow_devices": ",".join(self.adaptive.slow_devices())}

    def _set_policy_gauge(self) -> None:
        for p in rules.POLICIES:
            self.m_policy.labels(policy=p).set(1 if p == self.policy else 0)


async def run(config: Config, *, stop: asyncio.Event | None = None) -> None:
    """Run the parameter server until ``stop`` is set, SIGINT or SIGTERM."""
    stop = stop or asyncio.Event()
    install_stop_signals(stop)
    await ParameterServer(config, stop=stop).run()


def delta_cuts(rows: int, cuts: Iterable[int], most: int) -> list[int]:
    """The block boundaries of a parameter of ``rows`` rows: 0, ``rows`` and the ``cuts`` inside,
    thinned to at most ``most`` blocks by keeping evenly spaced ones of them (in order), so that
    blocks stay small where members' slices are."""
    inner = sorted({p for p in cuts if 0 < p < rows})
    if len(inner) + 1 > most:
        keep = max(0, most - 1)
        inner = [inner[(i + 1) * len(inner) // (keep + 1)] for i in range(keep)]
    return [0, *inner, rows]
