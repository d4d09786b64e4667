"""The parameter server: global model, version clock, synchronization policy, durability.

Backbone, top to bottom:
1. load the checkpoint and replay the write-ahead log (``store``);
2. connect; publish the retained model snapshot;
3. consume: plan, gradients, control; each gradient is decoded and checked against the model
   (unknown device, wrong shard, codec errors, NaN -> counted rejection and a ``discarded`` ack);
4. step loop: take the queued updates, judge each under the policy (``policy``), apply the
   accepted ones (``optimizer``), log them durably, ack, publish a snapshot, evaluate, checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgemesh.common import models, wire
from edgemesh.common.bus import Bus, Incoming
from edgemesh.common.codecs import get_codec
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
    UpdateAck,
)
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.topics import Topics
from edgemesh.services.operations import ControlResult, Operations, consume
from edgemesh.services.parameter_server import policy as rules
from edgemesh.services.parameter_server import store
from edgemesh.services.parameter_server.adaptive import AdaptiveDelay, AdaptiveSettings
from edgemesh.services.parameter_server.optimizer import ModelState, ShardGrad
from edgemesh.services.runtime import client_id, install_stop_signals, supervise

logger = logging.getLogger(__name__)

SERVICE = "ps"
DELAY_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)


@dataclass(slots=True)
class Pending:
    """A decoded, shape-checked update waiting for the step loop."""

    update: GradientUpdate
    grads: list[ShardGrad]
    received: float


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
        """Adaptive: monotonic time the open round got its first update (its deadline runs from here)."""
        self._deferred: list[Pending] = []
        p = config.ps
        self.adaptive = AdaptiveDelay(AdaptiveSettings(
            alpha=p.adaptive_alpha, quantile=p.adaptive_quantile, slack=p.adaptive_slack,
            min_deadline_s=p.adaptive_min_deadline_s, max_deadline_s=p.adaptive_max_deadline_s,
            min_bound=p.adaptive_min_bound, slow_factor=p.adaptive_slow_factor))
        self._since_checkpoint = 0
        self._last_eval_version = -1
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
        for entry in record["entries"]:
            grads = [self._decode_shard(s["param"], s["start"], s["stop"], s["codec"], s["data"])
                     for s in entry["shards"]]
            contributions.append((float(entry["weight"]), grads))
            self.high_water[entry["device"]] = (int(entry["incarnation"]), int(entry["seq"]))
            cluster = entry.get("cluster", "")
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
                await supervise(self.stop, consume(self.bus, self.metrics, self._dispatch), self._step_loop())
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
        self._queue.append(Pending(update, grads, time.monotonic()))
        self._wake.set()

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

    def _adaptive_refresh(self) -> None:
        """Tell the adaptive rule who is live and what the max bound is; update its gauges."""
        a = self.adaptive
        a.max_bound = self.bound
        a.live_devices = frozenset(d.device for d in self.plan.devices) if self.plan is not None else None
        self.m_adaptive_bound.set(a.bound())
        self.m_adaptive_deadline.set(a.deadline(self._live_clusters()))
        self.m_slow.set(len(a.slow_devices()))

    def _round_timeout(self) -> float | None:
        """Adaptive: seconds until the open round's deadline (None when no round is open)."""
        if self.policy != "adaptive" or self._round_opened is None or self.paused:
            return None
        deadline = self._round_opened + self.adaptive.deadline(self._live_clusters())
        return max(0.0, deadline - time.monotonic())

    async def _step_loop(self) -> None:
        while True:
            timeout = self._round_timeout()
            if timeout is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)  # an adaptive round's deadline
            self._wake.clear()
            if self._snapshot_requested:
                self._snapshot_requested = False
                await self._publish_snapshot()
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
        for item in candidates:
            u = item.update
            mark = self.high_water.get(u.device)
            if mark is not None and (u.incarnation, u.seq) <= mark:
                acks.append((u, "duplicate", "", 0, False))
                continue
            if adaptive:
                verdict = self.adaptive.judge(version, u.base_version, bound)
            else:
                verdict = rules.judge(self.policy, version, u.base_version, self.bound)
            if not verdict.accept:
                if adaptive and verdict.reason == "stale":
                    self.adaptive.observe_delay(u.device, verdict.delay)
                acks.append((u, "discarded", verdict.reason, verdict.delay, True))
                continue
            if adaptive:
                if u.cluster in self._round:
                    self._deferred.append(item)  # the cluster's next update: it goes into the next round
                    continue
                now = time.monotonic()
                if self._round_opened is None:
                    self._round_opened = now
                self.adaptive.observe_arrival(u.cluster, now - self._round_opened)
                self._round[u.cluster] = item
                if rules.round_complete(self._round, live):
                    version += 1
                    steps.append((list(self._round.values()), version))
                    self._round = {}
                    self._round_opened = None
                continue
            if self.policy == "sync":
                if u.cluster in self._round:
                    # the cluster already contributed to this round: a second member or a repeat
                    acks.append((u, "discarded", "round_full", verdict.delay, True))
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
            self.high_water[u.device] = (u.incarnation, u.seq)
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
                    self.high_water[u.device] = (u.incarnation, u.seq)

        if steps:
            await asyncio.to_thread(self._apply_and_log, steps)
            for items, v in steps:
                for item in items:
                    delay = v - 1 - item.update.base_version
                    self.m_delay.observe(delay)
                    if adaptive:
                        self.adaptive.observe_delay(item.update.device, delay)
                    acks.append((item.update, "accepted", "", delay, self.policy in ("sync", "adaptive")))
        if adaptive:
            self._adaptive_refresh()
        self.m_pending.set(len(self._queue) + len(self._round) + len(self._deferred))
        if steps:
            # the model goes out before the acks, so a worker acked for version v usually has v
            await self._publish_model()
        for u, status, reason, delay, resync in acks:
            await self._ack(u, status, reason, delay=delay, resync=resync)
        if steps:
            self.m_step.observe(time.perf_counter() - started)
            await self._maybe_evaluate()
            self._since_checkpoint += len(steps)
            if self._since_checkpoint >= self.cfg.ps.checkpoint_every:
                await asyncio.to_thread(self._checkpoint)
        return bool(steps)

    def _apply_and_log(self, steps: list[tuple[list[Pending], int]]) -> None:
        assert self.state is not None and self._wal is not None
        t = self.cfg.training
        records = []
        for items, v in steps:
            total = sum(i.update.samples for i in items)
            weights = [i.update.samples / total for i in items]
            if self.policy == "adaptive":
                weights = [w * self.adaptive.weight(v - 1 - i.update.base_version)
                           for w, i in zip(weights, items, strict=True)]
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
                "entries": [{
                    "device": i.update.device,
                    "cluster": i.update.cluster,
                    "incarnation": i.update.incarnation,
                    "seq": i.update.seq,
                    "weight": w,
                    "shards": [{"param": s.param, "start": s.start, "stop": s.stop, "codec": s.codec,
                                "data": s.data} for s in i.update.shards],
                } for w, i in zip(weights, items, strict=True)],
            })
        self.m_wal.inc(self._wal.append(records))
        self.version = steps[-1][1]
        self.m_version.set(self.version)

    def _checkpoint(self) -> None:
        if self.state is None or self._wal is None:
            return
        store.write_checkpoint(self.state_dir, store.Snapshot(
            model_spec=self.cfg.training.model_spec,
            version=self.version,
            params=self.state.params,
            momentum=self.state.momentum,
            high_water=self.high_water,
            clocks=self.clocks,
            settings={"policy": self.policy, "bound": self.bound, "lr": self.lr},
        ))
        self._wal.reset()
        self._since_checkpoint = 0
        self.m_checkpoints.inc()
        logger.debug("checkpoint at version %d", self.version)

    # ------------------------------------------------------------------ publishing
    async def _ack(self, u: GradientUpdate, status: str, reason: str, *, delay: int = 0, resync: bool) -> None:
        assert self.bus is not None
        self.m_updates.labels(status=status, reason=reason).inc()
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

    def _delta(self) -> bytes:
        """The encoded change from the workers' view to the model; the view takes what was sent."""
        assert self.state is not None and self._view is not None
        codec = get_codec(self.cfg.ps.delta_codec)
        policy = CodecPolicy(device="ps", codec=self.cfg.ps.delta_codec, density=self.cfg.ps.delta_density)
        shards = []
        for name, param in self.state.params.items():
            change = (param - self._view[name]).reshape(-1)
            data = codec.encode(change, policy)
            self._view[name] += codec.decode(data, change.size).reshape(param.shape)
            shards.append(ShardUpdate(param=name, start=0, stop=int(param.shape[0]),
                                      codec=self.cfg.ps.delta_codec, data=data))
        delta = ModelDelta(version=self.version, base_version=self._view_version,
                           model_spec=self.cfg.training.model_spec, shards=tuple(shards), created=time.time())
        self._view_version = self.version
        return wire.encode(delta)

    async def _on_connect(self) -> None:
        self._request_snapshot()  # the first, or a restarted broker has lost the retained model

    def _request_snapshot(self) -> None:
        """Have the step loop publish a snapshot: model publishing is serialized with stepping."""
        self._snapshot_requested = True
        self._wake.set()

    async def _publish_snapshot(self) -> None:
        assert self.bus is not None
        payload = await asyncio.to_thread(self._snapshot)
        await self.bus.publish(self.topics.model(), payload, retain=True, kind="model")

    async def _publish_model(self) -> None:
        """After a step: a snapshot, or in delta mode a delta (a snapshot when one is due)."""
        assert self.bus is not None
        if self.cfg.ps.broadcast == "snapshot" or self._view is None or \
                self.version - self._last_full >= self.cfg.ps.snapshot_every:
            await self._publish_snapshot()
            return
        payload = await asyncio.to_thread(self._delta)
        await self.bus.publish(self.topics.model_delta(), payload, kind="model_delta")

    async def _maybe_evaluate(self) -> None:
        every = self.cfg.ps.eval_every
        if not every or self.version - self._last_eval_version < every:
            return
        self._last_eval_version = self.version
        version = self.version
        loss, accuracy = await asyncio.to_thread(self._evaluate)
        self.last_accuracy = accuracy
        self.m_accuracy.set(accuracy)
        self.m_loss.set(loss)
        await self.ops.event("evaluation", f"version {version}: accuracy {accuracy:.4f}, loss {loss:.4f}",
                          version=version, accuracy=accuracy, loss=loss)

    def _evaluate(self) -> tuple[float, float]:
        assert self.state is not None
        models.set_params(self._model, self.state.params)
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
            case "stop":
                pass  # Operations.control stops the service once the reply is out
            case _:
                return False, f"unknown command {cmd.command!r} (status, pause, resume, set-sync-policy, " \
                              "set-bound, set-lr, stop)", {}
        self.m_paused.set(1 if self.paused else 0)
        self._adaptive_refresh()
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
