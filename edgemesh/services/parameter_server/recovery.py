"""The parameter server's durability on top of ``store``: resume from checkpoint and log, log every step.

* ``resume``: the checkpoint (weights, momentum, clock, settings) if there is one and it is for this
  model, then every logged step newer than it replayed through the same SGD step, so the PS comes
  back exactly where its last acked step left it.
* ``log``: before any update of a step is acked, the step goes to the write-ahead log (fsynced), in the log's own
  thread while the caller goes on (``Logging``): its version, the optimizer settings, the aggregation it used
  (``robust``: the rule, clip's threshold) and, per member update, device, cluster, incarnation, seq, the step's
  item it belongs to, weight and the encoded shards; or, when it is smaller than all of those shards (a ``sync``
  round of many dense updates), the step's weighted sum in float32 (``sum``) and the norms of its contributions,
  which a replay steps on alone, with the same result.
* ``checkpoint``: write, fsync, rename; the log then starts afresh. Beside the model it keeps the settings it is
  given (``settings``: what an operator set, and what a sharded server's shard 0 keeps).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import StepPart, StepRecord
from edgemesh.services.parameter_server import store
from edgemesh.services.parameter_server.optimizer import ModelState, ShardGrad
from edgemesh.services.parameter_server.robust import Aggregation, Combined, combine
from edgemesh.services.parameter_server.scheduler import Clock, Step, buffer_mean

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Optimizer:
    """The SGD settings of one step (logged with it: a replay applies the step as it was)."""

    lr: float
    momentum: float
    weight_decay: float = 0.0


@dataclass(slots=True)
class Resumed:
    """What ``resume`` found: the model state and the operator's settings (empty when new)."""

    state: ModelState
    settings: dict[str, Any] = field(default_factory=dict)
    replayed: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    """The replayed steps: the version each made, and its updates with their weights."""


class Logging:
    """Steps on their way into the write-ahead log (``Recovery.log``). As a ``with`` block: the block runs beside
    the write, and its end waits until the steps are durable (the log's error, if any, over the block's)."""

    def __init__(self, writing: Future[int]) -> None:
        self._writing = writing
        self.written = 0
        """Bytes the steps took in the log, once durable."""

    def durable(self) -> int:
        """Wait until the steps are durable; the bytes written."""
        self.written = self._writing.result()
        return self.written

    def __enter__(self) -> Logging:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.durable()


class Recovery:
    """The checkpoint and write-ahead log in ``state_dir``."""

    def __init__(self, state_dir: Path, *, fsync: bool) -> None:
        self.state_dir = state_dir
        self._fsync = fsync
        self._wal: store.WriteAheadLog | None = None
        self._writer: ThreadPoolExecutor | None = None
        """The log's own thread, for ``log``."""

    def resume(self, model_spec: str, initial: Mapping[str, np.ndarray], clock: Clock, *,
               buffers: Mapping[str, bool] | None = None, momenta: Mapping[str, float] | None = None) -> Resumed:
        """The state to start from: ``initial`` weights (and ``buffers``: which of them are the module's buffers,
        ``momenta``: which are running averages, ``ModelState``), or the checkpoint and the log after it; ``clock``
        takes their version, high-water marks and cluster clocks."""
        buffers = dict(buffers or {})
        snap = store.read_checkpoint(self.state_dir)
        if snap is None:
            resumed = Resumed(ModelState(initial, buffers=buffers, momenta=momenta))
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
            resumed = Resumed(ModelState(params, snap.momentum, buffers=buffers, momenta=momenta), dict(snap.settings))
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

    def log(self, steps: Sequence[Step], optimizer: Optimizer, combined: Sequence[Combined],
            sums: Sequence[list[ShardGrad]]) -> Logging:
        """Append ``steps`` durably (each with its items' weights and the aggregation it used, or the weighted sum
        it stepped on, ``ModelState.sum``'s, whichever is smaller, so that a replay is exact) in the log's own
        thread, and return at once: the caller goes on (encodes the broadcast) while the write and its
        ``fdatasync`` release the GIL. The steps are durable once ``Logging.durable`` returns (or its ``with``
        block ends)."""
        assert self._wal is not None, "resume() first"
        wal, records = self._wal, self._records(steps, optimizer, combined, sums)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wal")
        return Logging(self._writer.submit(wal.append, records))

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

