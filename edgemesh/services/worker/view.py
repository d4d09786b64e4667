"""The global model as a worker holds it: the last snapshot plus the deltas applied since."""

from __future__ import annotations

import math

import numpy as np

from edgemesh.common.codecs import get_codec
from edgemesh.common.errors import WireError
from edgemesh.common.messages import ModelDelta, ModelSnapshot


class ModelView:
    """Follows ``model`` snapshots and ``model/delta`` deltas.

    ``params`` is replaced, never changed in place, so a training step running in a thread
    keeps a consistent copy. A delta that does not start where the view is marks a ``gap``:
    the worker then asks for a snapshot (``GradientUpdate.need_snapshot``).
    """

    def __init__(self) -> None:
        self.params: dict[str, np.ndarray] | None = None
        self.version = -1
        self.gap = False

    @property
    def ready(self) -> bool:
        return self.params is not None

    def load(self, snap: ModelSnapshot) -> bool:
        """Take a snapshot unless it is older than the view; True if taken."""
        if self.params is not None and snap.version < self.version and not self.gap:
            return False
        self.params = {k: np.array(t.to_numpy(), dtype=np.float32) for k, t in snap.tensors.items()}
        self.version = snap.version
        self.gap = False
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
        params = dict(self.params)
        for shard in delta.shards:
            base = params.get(shard.param)
            if base is None or not 0 <= shard.start < shard.stop <= base.shape[0]:
                raise WireError(f"delta shard {shard.param}[{shard.start}:{shard.stop}] does not fit", "shape")
            rows = base[shard.start:shard.stop]
            change = get_codec(shard.codec).decode(shard.data, math.prod(rows.shape)).reshape(rows.shape)
            updated = base.copy()
            updated[shard.start:shard.stop] += change
            params[shard.param] = updated
        self.params = params
        self.version = delta.version
        return True
