"""The global model as a worker holds it: the last snapshot plus the deltas applied since."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from edgemesh.common.codecs import get_codec
from edgemesh.common.errors import WireError
from edgemesh.common.messages import ModelDelta, ModelSnapshot


class ModelView:
    """Follows ``model`` snapshots and ``model/delta`` deltas.

    ``params`` is replaced, never changed in place, so a training step running in a thread
    keeps a consistent copy. A delta that does not start where the view is marks a ``gap``:
    the worker then asks for a snapshot (``GradientUpdate.need_snapshot``).

    A model-parallel member keeps only its rows (``restrict``): ``params`` then holds
    ``param[start:stop]`` of every parameter, and snapshots and deltas update just those rows; it
    takes its part of each delta (``model/delta/{device}``: the blocks of its rows), and a delta that
    lacks some of its rows is a gap.
    """

    def __init__(self) -> None:
        self.params: dict[str, np.ndarray] | None = None
        self.version = -1
        self.gap = False
        self.rows: dict[str, tuple[int, int]] | None = None
        """Rows ``[start, stop)`` along dim 0 kept of each parameter; None = whole parameters."""
        self.lengths: dict[str, int] = {}
        """Length along dim 0 of every whole parameter, from the last snapshot."""

    def restrict(self, rows: Mapping[str, tuple[int, int]] | None) -> bool:
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
        self.params, self.version, self.gap = None, -1, False
        return False

    @property
    def ready(self) -> bool:
        return self.params is not None

    def load(self, snap: ModelSnapshot) -> bool:
        """Take a snapshot unless it is older than the view; True if taken."""
        if self.params is not None and snap.version < self.version and not self.gap:
            return False
        self.lengths = {k: t.shape[0] if t.shape else 0 for k, t in snap.tensors.items()}
        rows = self.rows
        if rows is None:
            self.params = {k: np.array(t.to_numpy(), dtype=np.float32) for k, t in snap.tensors.items()}
        else:
            if set(rows) != set(snap.tensors):
                raise WireError("snapshot names other parameters than the rows this view keeps", "shape")
            self.params = {k: np.array(t.to_numpy()[rows[k][0]:rows[k][1]], dtype=np.float32)
                           for k, t in snap.tensors.items()}
        self.version = snap.version
        self.gap = False
        return True

    def _covers(self, delta: ModelDelta) -> bool:
        """Whether ``delta``'s shards hold every row this restricted view keeps."""
        assert self.rows is not None
        spans: dict[str, list[tuple[int, int]]] = {}
        for shard in delta.shards:
            spans.setdefault(shard.param, []).append((shard.start, shard.stop))
        for name, (start, stop) in self.rows.items():
            reached = start
            for a, b in sorted(spans.get(name, ())):
                if a > reached:
                    break
                reached = max(reached, b)
            if reached < stop:
                return False
        return True

    def apply(self, delta: ModelDelta) -> bool:
        """Add a delta that starts at this view's version; True if applied.

        Raises WireError (counted by the caller) for a delta that does not fit the model.
        """
        if self.params is None or delta.version <= self.version:
            return False
        if delta.base_version != self.version:
            self.gap = True
            return False
        for shard in delta.shards:
            if shard.param not in self.params or not 0 <= shard.start < shard.stop <= self.lengths.get(shard.param, 0):
                raise WireError(f"delta shard {shard.param}[{shard.start}:{shard.stop}] does not fit", "shape")
        if self.rows is not None and not self._covers(delta):
            self.gap = True  # a member's part cut for other rows (the PS had another plan): wait for a snapshot
            return False
        params = dict(self.params)
        for shard in delta.shards:
            base = params[shard.param]
            first, last = self.rows[shard.param] if self.rows is not None and shard.param in self.rows else (
                0, base.shape[0])
            shape = (shard.stop - shard.start, *base.shape[1:])
            change = get_codec(shard.codec).decode(shard.data, math.prod(shape)).reshape(shape)
            a, b = max(shard.start, first), min(shard.stop, last)
            if a >= b:
                continue  # none of this view's rows
            updated = base.copy()
            updated[a - first:b - first] += change[a - shard.start:b - shard.start]
            params[shard.param] = updated
        self.params = params
        self.version = delta.version
        return True
