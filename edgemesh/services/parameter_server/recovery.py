"""The parameter server's durability on top of ``store``: resume from checkpoint and log, log every step.

* ``resume``: the checkpoint (weights, momentum, clock, settings) if there is one and it is for this
  model, then every logged step newer than it replayed through the same SGD step, so the PS comes
  back exactly where its last acked step left it.
* ``log_beside``: before any update of a step is acked, the step goes to the write-ahead log (fsynced):
  its version, the optimizer settings, the aggregation it used (``robust``: the rule, clip's threshold)
  and, per member update, device, cluster, incarnation, seq, the step's item it belongs to, weight and
  the encoded shards; or, when it is smaller than all of those shards (a ``sync`` round of many dense
  updates), the step's weighted sum in float32 (``sum``) and the norms of its contributions, which a replay
  steps on alone, with the same result.
* ``checkpoint``: write, fsync, rename; the log then starts afresh.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import Scalar, StepPart, StepRecord
from edgemesh.common.vocabulary import AGGREGATION_RULES, SYNC_POLICIES, AggregationRule, SyncPolicy
from edgemesh.services.parameter_server import store
from edgemesh.services.parameter_server.optimizer import ModelState, ShardGrad
from edgemesh.services.parameter_server.robust import Aggregation, Combined, combine
from edgemesh.services.parameter_server.scheduler import Clock, Step, buffer_mean

T = TypeVar("T")

logger = logging.getLogger(__name__)

LR_LIMIT = 10.0
"""Learning rates ``set-lr`` (and a checkpoint) may set lie in (0, LR_LIMIT)."""
SETTING_COMMANDS: dict[str, tuple[str, str]] = {
    "set-sync-policy": ("policy", f"policy must be one of {', '.join(SYNC_POLICIES)}"),
    "set-bound": ("bound", "bound must be an integer >= 0"),
    "set-lr": ("lr", f"lr must be a number in (0, {LR_LIMIT:g})"),
    "set-aggregation": ("aggregation", f"aggregation must be one of {', '.join(AGGREGATION_RULES)}"),
}
"""Operator commands that set one setting: command -> (the setting, the reply to a value it refuses)."""


@dataclass(frozen=True, slots=True)
class Optimizer:
    """The SGD settings of one step (logged with it: a replay applies the step as it was)."""

    lr: float
    momentum: float
    weight_decay: float = 0.0


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    """What an operator set that a checkpoint keeps, read back and checked (None: not kept, or not valid)."""

    policy: SyncPolicy | None = None
    bound: int | None = None
    lr: float | None = None
    paused: bool | None = None
    aggregation: AggregationRule | None = None
    delay_indices: dict[str, float] = field(default_factory=dict)
    cycles: dict[str, list[float]] = field(default_factory=dict)
    """``adaptive``: each cluster's last cycles (what the round deadline is learned from)."""
    norms: list[float] = field(default_factory=list)
    """Norms of the last contributions applied (what ``clip`` compares with)."""

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> OperatorSettings:
        bound, lr, paused, indices, norms = (settings.get(k) for k in ("bound", "lr", "paused", "delay_indices",
                                                                        "norms"))
        return cls(
            policy=next((p for p in SYNC_POLICIES if p == settings.get("policy")), None),
            bound=bound if isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0 else None,
            lr=float(lr) if isinstance(lr, float | int) and not isinstance(lr, bool) and 0 < lr < LR_LIMIT else None,
            paused=paused if isinstance(paused, bool) else None,
            aggregation=next((r for r in AGGREGATION_RULES if r == settings.get("aggregation")), None),
            delay_indices={str(k): float(v) for k, v in indices.items()} if isinstance(indices, dict) else {},
            cycles=_cycles(settings.get("cycles")),
            norms=[float(v) for v in norms if isinstance(v, float | int)] if isinstance(norms, list) else [])

    @classmethod
    def command(cls, command: str, value: Scalar) -> OperatorSettings | str:
        """The setting ``pause``, ``resume`` or a ``set-...`` command (``SETTING_COMMANDS``) asks for, checked as
        a checkpoint's is; or the reply to a value it refuses."""
        if command in ("pause", "resume"):
            return cls(paused=command == "pause")
        key, refusal = SETTING_COMMANDS[command]
        wanted = cls.of({key: value})
        return wanted if getattr(wanted, key) is not None else refusal


@dataclass(slots=True)
class Resumed:
    """What ``resume`` found: the model state and the operator's settings (empty when new)."""

    state: ModelState
    settings: dict[str, Any] = field(default_factory=dict)
    replayed: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    """The replayed steps: the version each made, and its updates with their weights."""


class Recovery:
    """The checkpoint and write-ahead log in ``state_dir``."""

    def __init__(self, state_dir: Path, *, fsync: bool) -> None:
        self.state_dir = state_dir
        self._fsync = fsync
        self._wal: store.WriteAheadLog | None = None
        self._writer: ThreadPoolExecutor | None = None
        """The log's own thread, for ``log_beside``."""

    def resume(self, model_spec: str, initial: Mapping[str, np.ndarray], clock: Clock, *,
               buffers: Mapping[str, bool] | None = None) -> Resumed:
        """The state to start from: ``initial`` weights (and ``buffers``: which of them are the module's buffers,
        ``ModelState``), or the checkpoint and the log after it; ``clock`` takes their version, high-water marks
        and cluster clocks."""
        buffers = dict(buffers or {})
        snap = store.read_checkpoint(self.state_dir)
        if snap is None:
            resumed = Resumed(ModelState(initial, buffers=buffers))
        else:
            if snap.model_spec != model_spec:
                raise ConfigError(f"checkpoint in {self.state_dir} is for model {snap.model_spec!r}, config says "
                                  f"{model_spec!r}; use another ps.state_dir or remove the checkpoint")
            params = dict(snap.params)
            lacking = [k for k in initial if k not in params and k in buffers]
            if lacking:  # a checkpoint from before buffers were kept: they start from their initial values
                logger.warning("checkpoint in %s keeps no buffers (%s); they start from their initial values",
                               self.state_dir, ", ".join(lacking))
                params.update({k: initial[k] for k in lacking})
            bad = {k for k, v in params.items() if k not in initial or v.shape != initial[k].shape}
            if bad or set(initial) - set(params):
                raise ConfigError(f"checkpoint in {self.state_dir} does not match model {model_spec!r}")
            resumed = Resumed(ModelState(params, snap.momentum, buffers=buffers), dict(snap.settings))
            clock.version, clock.high_water, clock.clocks = snap.version, dict(snap.high_water), dict(snap.clocks)
            logger.info("resumed from checkpoint at version %d", snap.version)
        for record in store.read_wal(self.state_dir):
            if int(record["version"]) > clock.version:
                # the norms clip compares with go on from the checkpoint's through the replayed steps
                resumed.settings["norms"] = [*resumed.settings.get("norms", []),
                                             *self._replay(resumed.state, clock, record)]
                resumed.replayed += 1
                resumed.steps.append(_step_record(record))
        if resumed.replayed:
            logger.info("replayed %d logged steps; now at version %d", resumed.replayed, clock.version)
        self._wal = store.WriteAheadLog(self.state_dir, fsync=self._fsync)
        return resumed

    @staticmethod
    def _replay(state: ModelState, clock: Clock, record: dict[str, Any]) -> list[float]:
        """Apply a logged step as it was applied; the norms of its contributions as applied."""
        items: dict[int, tuple[float, list[ShardGrad]]] = {}
        moved: dict[int, tuple[int, list[ShardGrad]]] = {}
        clusters = set()
        for n, entry in enumerate(record["entries"]):
            grads = [state.decode_shard(s["param"], s["start"], s["stop"], s["codec"], s["data"])
                     for s in entry.get("shards", ())]
            buffers = [state.decode_shard(s["param"], s["start"], s["stop"], "none", s["data"])
                       for s in entry.get("buffers", ())]
            # a model-parallel cluster's members were one contribution (a log from before items: one each)
            item = int(entry.get("item", -1 - n))
            items.setdefault(item, (float(entry["weight"]), []))[1].extend(grads)
            moved.setdefault(item, (int(entry.get("samples", 1)), []))[1].extend(buffers)
            clock.high_water[entry["device"]] = (int(entry["incarnation"]), int(entry["seq"]))
            clusters.add(entry.get("cluster", ""))
        for cluster in clusters:  # one tick per cluster, however many members logged a part
            clock.clocks[cluster] = clock.clocks.get(cluster, 0) + 1
        optimizer = Optimizer(float(record["lr"]), float(record["momentum"]), float(record.get("weight_decay", 0.0)))
        if "sum" in record:  # the step's weighted sum, logged instead of its contributions
            summed = [state.decode_shard(s["param"], s["start"], s["stop"], "none", s["data"]) for s in record["sum"]]
            state.step([(1.0, summed)], lr=optimizer.lr, momentum=optimizer.momentum,
                       weight_decay=optimizer.weight_decay)
            norms = [float(v) for v in record.get("norms", [])]
        else:
            combined = combine(list(items.values()), Aggregation.of_record(record.get("aggregation")))
            state.step(combined.contributions, lr=optimizer.lr, momentum=optimizer.momentum,
                       weight_decay=optimizer.weight_decay, buffers=buffer_mean(list(moved.values())))
            norms = combined.norms
        clock.version = int(record["version"])
        return norms

    def log_beside(self, steps: Sequence[Step], optimizer: Optimizer, combined: Sequence[Combined],
                   sums: Sequence[list[ShardGrad]], beside: Callable[[], T]) -> tuple[int, T]:
        """Append ``steps`` durably (each with its items' weights and the aggregation it used, or the weighted sum
        it stepped on, ``ModelState.sum``'s, whichever is smaller, so that a replay is exact), in the log's own
        thread while ``beside()`` runs in this one (the step is applied and the model's broadcast encoded while
        the step is made durable: ``fdatasync`` and the write release the GIL); returns once both are done: the
        bytes written and what ``beside`` returned (either's exception, the log's first)."""
        assert self._wal is not None, "resume() first"
        wal, records = self._wal, self._records(steps, optimizer, combined, sums)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wal")
        writing = self._writer.submit(wal.append, records)
        try:
            out = beside()
        finally:
            written = writing.result()  # the log's error, if any, over beside's
        return written, out

    @staticmethod
    def _records(steps: Sequence[Step], optimizer: Optimizer, combined: Sequence[Combined],
                 sums: Sequence[list[ShardGrad]]) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = [{
            "version": step.version,
            "lr": optimizer.lr,
            "momentum": optimizer.momentum,
            "weight_decay": optimizer.weight_decay,
            "aggregation": c.how.record(),
            # a model-parallel cluster's update is logged per member, each with the cluster's weight and
            # item: members' shards are disjoint, so replaying them as one contribution applies the same step
            "entries": [{
                "device": part.device,
                "cluster": part.cluster,
                "incarnation": part.incarnation,
                "seq": part.seq,
                "item": i,
                "weight": w,
                "samples": part.samples,  # what the step's buffer changes are weighted by
                **({"scale": c.scales[i]} if c.scales else {}),  # clip's, for a sharded server's other shards
                "shards": [{"param": s.param, "start": s.start, "stop": s.stop, "codec": s.codec, "data": s.data}
                           for s in part.shards],
                "buffers": [{"param": s.param, "start": s.start, "stop": s.stop, "data": s.data}
                            for s in part.buffers],
            } for i, (w, item) in enumerate(zip(step.weights, step.items, strict=True)) for part in item.updates],
        } for step, c in zip(steps, combined, strict=True)]
        for record, c, summed in zip(records, combined, sums, strict=True):
            sent = sum(len(s["data"]) for entry in record["entries"] for s in (*entry["shards"], *entry["buffers"]))
            if sum(g.values.nbytes for g in summed) < sent:  # e.g. a sync round of dense updates: one sum, not N
                record["sum"] = [{"param": g.param, "start": g.start, "stop": g.stop,
                                  "data": np.ascontiguousarray(g.values, dtype=np.float32).data} for g in summed]
                record["norms"] = list(c.norms)
                for entry in record["entries"]:
                    del entry["shards"], entry["buffers"]
        return records

    def checkpoint(self, model_spec: str, state: ModelState, clock: Clock, settings: dict[str, Any]) -> None:
        """Write a checkpoint and start a fresh log."""
        if self._wal is None:
            return
        store.write_checkpoint(self.state_dir, store.Snapshot(
            model_spec=model_spec, version=clock.version, params=state.params, momentum=state.momentum,
            high_water=clock.high_water, clocks=clock.clocks, settings=settings))
        self._wal.reset()
        logger.debug("checkpoint at version %d", clock.version)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown()
        if self._wal is not None:
            self._wal.close()


def _step_record(record: Mapping[str, Any]) -> StepRecord:
    """A logged step as shard 0 of a sharded server publishes it (``shard_steps``): its weights with ``clip``'s
    scales, and the updates ``krum`` left out."""
    how = Aggregation.of_record(record.get("aggregation"))
    chosen = None if how.chosen is None else set(how.chosen)
    return StepRecord(version=int(record["version"]), rule=how.rule, parts=tuple(
        StepPart(device=e["device"], incarnation=int(e["incarnation"]), seq=int(e["seq"]),
                 weight=float(e["weight"]) * float(e.get("scale", 1.0)),
                 excluded=chosen is not None and int(e.get("item", -1)) not in chosen)
        for e in record["entries"]))


def _cycles(kept: Any) -> dict[str, list[float]]:
    """A checkpoint's cycles per cluster, each a finite, non-negative number of seconds (others are dropped)."""
    if not isinstance(kept, dict):
        return {}
    return {str(c): [float(v) for v in seconds
                     if isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v) and v >= 0]
            for c, seconds in kept.items() if isinstance(seconds, list)}
