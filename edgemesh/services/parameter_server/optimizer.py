"""The global model as named float32 tensors and its SGD-with-momentum step.

Gradients arrive by shard ``(param, start, stop)`` along dim 0, so whole tensors (data
parallel) and slices (model parallel) go through the same step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from edgemesh.common.errors import WireError


@dataclass(frozen=True, slots=True)
class ShardGrad:
    """A decoded gradient for ``param[start:stop]``, shaped like that slice."""

    param: str
    start: int
    stop: int
    values: np.ndarray


class ModelState:
    """Parameters, momentum buffers and the update rule."""

    def __init__(self, params: Mapping[str, np.ndarray], momentum: Mapping[str, np.ndarray] | None = None) -> None:
        self.params = {k: np.array(v, dtype=np.float32, copy=True) for k, v in params.items()}
        self.momentum = {k: np.zeros_like(v) for k, v in self.params.items()}
        for k, v in (momentum or {}).items():
            if k in self.momentum and v.shape == self.momentum[k].shape:
                self.momentum[k] = np.array(v, dtype=np.float32, copy=True)

    def slice_shape(self, param: str, start: int, stop: int) -> tuple[int, ...]:
        """Shape of ``param[start:stop]``; raises WireError (reason ``shape``) if it does not exist."""
        p = self.params.get(param)
        if p is None:
            raise WireError(f"unknown parameter {param!r}", "shape")
        if not 0 <= start < stop <= p.shape[0]:
            raise WireError(f"shard {param}[{start}:{stop}] outside dim 0 of size {p.shape[0]}", "shape")
        return (stop - start, *p.shape[1:])

    def numel(self, param: str, start: int, stop: int) -> int:
        return math.prod(self.slice_shape(param, start, stop))

    def step(
        self,
        contributions: Iterable[tuple[float, Iterable[ShardGrad]]],
        *,
        lr: float,
        momentum: float,
        weight_decay: float = 0.0,
    ) -> None:
        """One SGD step on the weighted sum of the contributions' gradients.

        Each contribution is ``(weight, shards)``; weights of one step should sum to 1.
        Only the slices some contribution covers are touched.
        """
        acc: dict[tuple[str, int, int], np.ndarray] = {}
        for weight, shards in contributions:
            for g in shards:
                key = (g.param, g.start, g.stop)
                scaled = g.values * np.float32(weight)
                if key in acc:
                    acc[key] += scaled
                else:
                    acc[key] = scaled
        lr32, mom32, wd32 = np.float32(lr), np.float32(momentum), np.float32(weight_decay)
        for (param, start, stop), grad in acc.items():
            p = self.params[param][start:stop]
            buf = self.momentum[param][start:stop]
            if weight_decay:
                grad = grad + wd32 * p
            buf *= mom32
            buf += grad
            p -= lr32 * buf
