"""The model broadcast, both halves: the parameter server's encoder and the worker's view (docs/topics.md).

The PS publishes the model retained on ``model`` as a snapshot and, with ``ps.broadcast = "delta"``,
each new version as a delta on ``model/delta``: the change from the model as the workers hold it
(their *view*: the last snapshot plus the deltas since, as they decode them) to the model, encoded
with ``ps.delta_codec``; what a lossy codec leaves out stays in the difference and goes with the next
delta. Every ``ps.snapshot_every`` versions, and on request, a float32 snapshot resets the views.

A model-parallel member trains only its rows. Each parameter's change is cut into row blocks at the
members' slice boundaries and every block is encoded alone: the broadcast carries all blocks, a
member's own message (``model/delta/{device}``) only the blocks of its rows, the very same bytes, so
every view follows one model while a member's downlink carries its share.

* :class:`Broadcaster` (PS): the next message after a step, a snapshot or a delta.
* :class:`ModelView` (worker): follows snapshots and deltas; ``decode`` (in a thread) then ``commit``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from edgemesh.common import costs, wire
from edgemesh.common.codecs import codec_for, get_codec, quick_to_decode
from edgemesh.common.config import ParameterServerConfig
from edgemesh.common.errors import WireError
from edgemesh.common.messages import CodecPolicy, ModelDelta, ModelSnapshot, Plan, ShardUpdate
from edgemesh.common.vocabulary import ROUND_POLICIES, CodecName, SyncPolicy
from edgemesh.common.wire.half import from_half, to_half
from edgemesh.common.wire.tensors import Tensor

if TYPE_CHECKING:
    from edgemesh.common.topics import Topics

Rows = Mapping[str, tuple[int, int]]
"""``param -> (start, stop)`` along dim 0."""
MAX_DELTA_BLOCKS = 64
"""Most row blocks one parameter's delta is cut into for the model-parallel members' rows (each block
costs the broadcast a shard header); a plan that would cut finer keeps evenly spaced ones of its
cut points (``delta_cuts``), and a member's part then holds rows beyond its own in at most the two
blocks its slice ends fall in."""


# --------------------------------------------------------------------------- the parameter server's half


@dataclass(frozen=True, slots=True)
class ModelMessage:
    """An encoded model message: a snapshot, or a delta with every model-parallel member's part of it."""

    payload: bytes
    snapshot: bool
    parts: Mapping[str, bytes]
    """device -> its part of a delta."""


class Broadcaster:
    """What the PS publishes after a step, and its view of what the workers hold."""

    def __init__(self, config: ParameterServerConfig, model_spec: str) -> None:
        self.cfg = config
        self.model_spec = model_spec
        self._view: dict[str, np.ndarray] | None = None
        """Delta mode: the model as the workers hold it (snapshot plus decoded deltas)."""
        self._view_version = -1
        self.last_full = -1
        """Version of the last snapshot published."""
        self.skipped = False
        """A version went unpublished (no one listened) since the last snapshot."""
        self.own: Callable[[Rows], Rows] | None = None
        """A parameter server shard's: a member's rows of the model as its own rows (``Division.local_rows``). Each
        member then hears of every version, with an empty part where the shard holds none of its rows."""

    @property
    def view(self) -> Mapping[str, np.ndarray] | None:
        return self._view

    def snapshot(self, params: Mapping[str, np.ndarray], version: int, policy: SyncPolicy) -> bytes:
        """The model as a snapshot; in delta mode it is exact (float32) and resets the workers' view."""
        delta_mode = self.cfg.broadcast == "delta"
        dtype = "float32" if delta_mode else self.cfg.snapshot_dtype
        tensors = {k: Tensor.from_numpy(to_half(v) if dtype == "float16" else v.astype(dtype, copy=False))
                   for k, v in params.items()}
        snap = ModelSnapshot(version=version, model_spec=self.model_spec, created=time.time(), sync_policy=policy,
                             tensors=tensors)
        if delta_mode:
            self._view = {k: v.copy() for k, v in params.items()}
            self._view_version = self.last_full = version
        self.skipped = False
        return wire.encode(snap)

    def skip(self) -> None:
        """A version no one listens to goes out as nothing; the next message is then a snapshot."""
        self._view, self.skipped = None, True

    def to_plan(self, params: Mapping[str, np.ndarray], version: int, policy: SyncPolicy,
                plan: Plan | None) -> ModelMessage | None:
        """``after_step``, if ``plan`` names a device; otherwise nothing, as no one listens (``skip``)."""
        if plan is None or not plan.devices:
            self.skip()
            return None
        return self.after_step(params, version, policy, plan)

    def after_step(self, params: Mapping[str, np.ndarray], version: int, policy: SyncPolicy,
                   plan: Plan | None) -> ModelMessage:
        """The message for ``version``: a delta, or a snapshot when one is due (or in snapshot mode)."""
        if self.cfg.broadcast == "snapshot" or self._view is None or \
                version - self.last_full >= self.cfg.snapshot_every:
            return ModelMessage(self.snapshot(params, version, policy), True, {})
        members: Mapping[str, Rows] = member_rows(plan)
        if self.own is not None:
            members = {device: self.own(rows) for device, rows in members.items()}
        return self._delta(params, version, members, delta_codec(self.cfg, policy))

    def _delta(self, params: Mapping[str, np.ndarray], version: int, members: Mapping[str, Rows],
               codec_name: CodecName) -> ModelMessage:
        """The encoded change from the workers' view to the model, and every member's part of it; the
        view takes what was sent."""
        assert self._view is not None
        policy = CodecPolicy(device="ps", codec=codec_name, density=self.cfg.delta_density)
        cuts: dict[str, set[int]] = {}
        for rows in members.values():
            for name, (start, stop) in rows.items():
                cuts.setdefault(name, set()).update((start, stop))
        shards = []
        for name, param in params.items():
            points = delta_cuts(int(param.shape[0]), cuts.get(name, ()), MAX_DELTA_BLOCKS)
            for start, stop in zip(points, points[1:], strict=False):
                view = self._view[name][start:stop]
                change = np.subtract(param[start:stop], view)
                codec = codec_for(codec_name, change.size)
                if codec.name == "none":  # float32 as is: a view of the change, packed into the message at once
                    data: bytes = memoryview(change).cast("B")  # type: ignore[assignment]  # bytes-like, not copied
                else:
                    data = codec.encode(change.reshape(-1), policy)
                # the view takes what a worker decodes: the change itself where the codec loses nothing
                view += change if codec.lossless else codec.decode(data, change.size).reshape(view.shape)
                shards.append(ShardUpdate(param=name, start=start, stop=stop, codec=codec.name, data=data))
        delta = ModelDelta(version=version, base_version=self._view_version, model_spec=self.model_spec,
                           shards=tuple(shards), created=time.time())
        self._view_version = version
        parts = {}
        for device, rows in members.items():
            mine = tuple(s for s in shards
                         if s.param in rows and s.start < rows[s.param][1] and rows[s.param][0] < s.stop)
            if mine or self.own is not None:
                parts[device] = wire.encode(replace(delta, shards=mine))
        return ModelMessage(wire.encode(delta), False, parts)


def delta_codec(config: ParameterServerConfig, policy: SyncPolicy) -> CodecName:
    """``ps.delta_codec``, ``auto`` resolved: ``fp16`` under the round policies, ``grid`` under ``async`` and ``ssp``.

    A round's version moves the model by every device's batch at once and reaches each device once, so a lossy
    delta leaves the devices computing a round behind by much of a step (under ``sync`` it cost the digits CNN 3
    points, docs/benchmarks.md); under ``async`` a device hears of every other device's update, each a small step,
    and ``grid`` at a sixth of ``fp16``'s bytes cost nothing measurable."""
    if config.delta_codec != "auto":
        return config.delta_codec
    return "fp16" if policy in ROUND_POLICIES else "grid"


def _float32(values: np.ndarray) -> np.ndarray:
    """A writable float32 copy of a snapshot's tensor (float16 ones through ``half``: fast whatever the values)."""
    return from_half(values) if values.dtype.itemsize == 2 else np.array(values, dtype=np.float32)


def member_rows(plan: Plan | None) -> dict[str, dict[str, tuple[int, int]]]:
    """``device -> tensor -> (start, stop)``: the rows every model-parallel member of ``plan`` trains, by the rule its
    own model view keeps (``costs.member_rows``: its slice of each layer and of the tensors divided with it, such as
    batch norm's, and every counter whole), the layers it has no unit of left out."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    if plan is None:
        return out
    for c in plan.clusters:
        if len(c.members) < 2:
            continue
        layers = costs.layers(plan.model_spec)
        for i, device in enumerate(c.members):
            out[device] = {name: (start, stop) for name, (start, stop) in costs.member_rows(layers, c.counts, i).items()
                           if stop > start}
    return out


def delta_cuts(rows: int, cuts: Iterable[int], most: int) -> list[int]:
    """The block boundaries of a parameter of ``rows`` rows: 0, ``rows`` and the ``cuts`` inside,
    thinned to at most ``most`` blocks by keeping evenly spaced ones of them (in order), so that
    blocks stay small where members' slices are."""
    inner = sorted({p for p in cuts if 0 < p < rows})
    if len(inner) + 1 > most:
        keep = max(0, most - 1)
        inner = [inner[(i + 1) * len(inner) // (keep + 1)] for i in range(keep)]
    return [0, *inner, rows]


# --------------------------------------------------------------------------- the worker's half


@dataclass(frozen=True, slots=True)
class Decoded:
    """A delta decoded against a view: the parameters it leads to, and what they were decoded from."""

    params: dict[str, np.ndarray]
    version: int
    base_version: int
    rows: Rows | None


class ModelView:
    """The global model as a worker holds it: the last ``model`` snapshot plus the ``model/delta``
    deltas applied since.

    ``params`` is replaced, never changed in place, so a training step running in a thread
    keeps a consistent copy. A delta that does not start where the view is, or lacks rows the view
    holds, marks a ``gap``: the worker then asks for a snapshot (``GradientUpdate.need_snapshot``).
    So does a snapshot older than a delta that came while the view held no model (emptied by a new
    division, waiting for the snapshot it asked for).

    A model-parallel member keeps only its rows (``restrict``): ``params`` then holds
    ``param[start:stop]`` of every parameter, and snapshots and deltas update just those rows; it
    takes its part of each delta (``model/delta/{device}``), and a delta that lacks some of its rows
    is a gap.
    """

    def __init__(self) -> None:
        self.params: dict[str, np.ndarray] | None = None
        self.version = -1
        self.gap = False
        self.rows: dict[str, tuple[int, int]] | None = None
        """Rows ``[start, stop)`` along dim 0 kept of each parameter; None = whole parameters."""
        self.lengths: dict[str, int] = {}
        """Length along dim 0 of every whole parameter, from the last snapshot."""
        self._heard = -1
        """The newest version this view heard of while it held no model (a delta it could not take, or the
        version it held when a new division emptied it): a snapshot older than that leaves a gap."""

    @property
    def ready(self) -> bool:
        return self.params is not None

    @property
    def stamp(self) -> int:
        """What moves whenever the model this view holds moves: its version."""
        return self.version

    def shard_topics(self, topics: Topics) -> list[Topics]:
        """The topics of the parameter servers whose model this view follows: one."""
        return [topics]

    def pieces(self, grads: Mapping[str, tuple[int, int, np.ndarray]]) -> list[tuple[str, int, int, np.ndarray]]:
        """A model-parallel member's gradient (``param -> (start, stop, rows)``) as the pieces its parameter server
        takes: as it is."""
        return [(name, start, stop, rows) for name, (start, stop, rows) in grads.items()]

    def restrict(self, rows: Rows | None) -> bool:
        """Keep only ``rows`` of every parameter from now on (None: whole parameters).

        True if the view still holds everything it must; False if it lacked rows, in which case it
        is emptied and waits for the next snapshot."""
        new = dict(rows) if rows is not None else None
        if new == self.rows:
            return True
        old, self.rows = self.rows, new
        if self.params is None:
            return True
        if new is not None and set(new) == set(self.params):
            base = old or {k: (0, v.shape[0]) for k, v in self.params.items()}
            if all(base[k][0] <= a <= b <= base[k][1] for k, (a, b) in new.items()):
                self.params = {k: self.params[k][a - base[k][0]:b - base[k][0]].copy() for k, (a, b) in new.items()}
                return True
        self._heard = max(self._heard, self.version)
        self.params, self.version, self.gap = None, -1, False
        return False

    def load(self, snap: ModelSnapshot) -> bool:
        """Take a snapshot unless it is older than the view (a gap too waits for one at least as new: an older
        one is a replay, or the retained one again after a reconnect); True if taken."""
        if self.params is not None and snap.version < self.version:
            return False
        rows = self.rows
        if rows is not None and not set(rows) <= set(snap.tensors):
            raise WireError("snapshot lacks parameters whose rows this view keeps", "shape")
        self.lengths = {k: t.shape[0] if t.shape else 0 for k, t in snap.tensors.items()}
        # a restricted view keeps its rows alone (a model-parallel member: not the model's buffers either)
        whole = {k: slice(None) for k in snap.tensors} if rows is None else {k: slice(*r) for k, r in rows.items()}
        self.params = {k: _float32(snap.tensors[k].to_numpy()[part]) for k, part in whole.items()}
        self.version = snap.version
        self.gap, self._heard = snap.version < self._heard, -1
        return True

    def apply(self, delta: ModelDelta) -> bool:
        """``commit(decode(delta))``: add a delta that starts at this view's version; True if applied."""
        return self.commit(self.decode(delta), delta)

    async def receive(self, delta: ModelDelta) -> bool:
        """``apply`` with the decoding off the event loop (in a thread, unless it is ``quick_to_decode``); True if
        applied."""
        if quick_to_decode(delta.shards):
            return self.apply(delta)
        return self.commit(await asyncio.to_thread(self.decode, delta), delta)

    def decode(self, delta: ModelDelta) -> Decoded | None:
        """The parameters ``delta`` leads to from this view, or None when it does not apply (older, a
        gap, rows it lacks). Reads the view without changing it: safe in a thread.

        Raises WireError for a delta that does not fit the model.
        """
        params, version, rows = self.params, self.version, self.rows
        if not delta.shards and rows is None:  # only a member's part from a shard may be
            raise WireError("a delta of no rows on a whole model", "field")
        if params is None or delta.version <= version or delta.base_version != version:
            return None
        for shard in delta.shards:
            if not 0 <= shard.start < shard.stop <= self.lengths.get(shard.param, 0):
                raise WireError(f"delta shard {shard.param}[{shard.start}:{shard.stop}] does not fit", "shape")
        out = dict(params)
        for shard in delta.shards:
            if shard.param not in out:
                continue  # a tensor a restricted view does not keep (a model-parallel member: the model's buffers)
            base = out[shard.param]
            first, last = rows[shard.param] if rows is not None and shard.param in rows else (0, base.shape[0])
            shape = (shard.stop - shard.start, *base.shape[1:])
            change = get_codec(shard.codec).decode(shard.data, math.prod(shape)).reshape(shape)
            a, b = max(shard.start, first), min(shard.stop, last)
            if a >= b:
                continue  # none of this view's rows
            if (a, b) == (first, last) == (shard.start, shard.stop):  # the whole tensor: one pass, into a new one
                out[shard.param] = np.add(base, change)
                continue
            updated = base.copy()
            updated[a - first:b - first] += change[a - shard.start:b - shard.start]
            out[shard.param] = updated
        if not _covers(delta, rows if rows is not None else {k: (0, n) for k, n in self.lengths.items()}):
            return None  # a member's part cut for other rows (the PS had another plan), or one for a whole view
        return Decoded(out, delta.version, version, rows)

    def commit(self, decoded: Decoded | None, delta: ModelDelta) -> bool:
        """Take what ``decode`` gave for ``delta`` if the view is still where it was decoded from;
        otherwise mark a gap when ``delta`` is newer than the view. True if taken."""
        if decoded is not None and decoded.base_version == self.version and decoded.rows == self.rows \
                and self.params is not None:
            self.params, self.version = decoded.params, decoded.version
            return True
        if self.params is None:
            self._heard = max(self._heard, delta.version)
        elif delta.version > self.version:
            self.gap = True
        return False


def _covers(delta: ModelDelta, rows: Rows) -> bool:
    """Whether ``delta``'s shards hold every row a restricted view keeps."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for shard in delta.shards:
        spans.setdefault(shard.param, []).append((shard.start, shard.stop))
    for name, (start, stop) in rows.items():
        reached = start
        for a, b in sorted(spans.get(name, ())):
            if a > reached:
                break
            reached = max(reached, b)
        if reached < stop:
            return False
    return True
