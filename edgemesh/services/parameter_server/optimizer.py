"""The global model as named float32 tensors and its SGD-with-momentum step.

Gradients arrive by shard ``(param, start, stop)`` along dim 0, so whole tensors (data
parallel) and slices (model parallel) go through the same step.

The model state holds the module's persistent buffers beside its parameters (batch norm's running
statistics and counter). A buffer is not a parameter: an update carries its change over the worker's
step (:class:`edgemesh.common.models.Update`), a step combines those changes with the updates'
sample shares (``buffer_contributions``) and adds the result as it is, with no learning rate, momentum
or weight decay; an integer buffer (a counter) is rounded after each step (docs/synchronization.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from edgemesh.common.codecs import get_codec
from edgemesh.common.errors import WireError
from edgemesh.common.messages import ShardUpdate

MAX_RUNS = 64
"""Most runs of rows a parameter's step takes as slices, in place; more (rows scattered by a sparse codec) are
gathered, stepped and scattered back at once."""


@dataclass(frozen=True, slots=True)
class ShardGrad:
    """A decoded gradient for ``param[start:stop]``, shaped like that slice."""

    param: str
    start: int
    stop: int
    values: np.ndarray


@dataclass(frozen=True, slots=True)
class Summed:
    """A step's weighted gradient sum (``ModelState.sum``): by parameter, and the rows of each it covers."""

    acc: dict[str, np.ndarray]
    rows: dict[str, np.ndarray]

    @property
    def grads(self) -> list[ShardGrad]:
        """The sum as the runs of rows it covers."""
        return [ShardGrad(param, start, stop, self.acc[param][start:stop])
                for param, touched in self.rows.items() for start, stop in _runs(touched)]


class ModelState:
    """The model state (parameters and the module's buffers), momentum, and the update rule."""

    def __init__(self, params: Mapping[str, np.ndarray], momentum: Mapping[str, np.ndarray] | None = None, *,
                 buffers: Mapping[str, bool] | None = None) -> None:
        self.params = {k: np.array(v, dtype=np.float32, copy=True) for k, v in params.items()}
        self.buffers = {k: bool(v) for k, v in (buffers or {}).items() if k in self.params}
        """Which tensors of ``params`` are buffers, and whether each holds integers (a counter): stepped by adding
        their combined change, not by SGD."""
        self.momentum = {k: np.zeros_like(v) for k, v in self.params.items()}
        self._scratch: dict[str, np.ndarray] = {}
        """Per parameter, room for ``lr * buf``: a step allocates no model-sized temporaries."""
        for k, v in (momentum or {}).items():
            if k in self.momentum and v.shape == self.momentum[k].shape:
                self.momentum[k] = np.array(v, dtype=np.float32, copy=True)

    def slice_shape(self, param: str, start: int, stop: int) -> tuple[int, ...]:
        """Shape of ``param[start:stop]``; raises WireError (reason ``shape``) if it does not exist."""
        p = self.params.get(param)
        if p is None:
            raise WireError(f"unknown parameter {param!r}", "shape")
        if p.ndim == 0:
            raise WireError(f"parameter {param!r} is a scalar and has no shards", "shape")
        if not 0 <= start < stop <= p.shape[0]:
            raise WireError(f"shard {param}[{start}:{stop}] outside dim 0 of size {p.shape[0]}", "shape")
        return (stop - start, *p.shape[1:])

    def numel(self, param: str, start: int, stop: int) -> int:
        return math.prod(self.slice_shape(param, start, stop))

    def decode_shard(self, param: str, start: int, stop: int, codec: str, data: bytes) -> ShardGrad:
        """One encoded shard as the gradient of ``param[start:stop]``; WireError (shape, codec, nan) if it
        does not fit."""
        shape = self.slice_shape(param, start, stop)
        return ShardGrad(param, start, stop, get_codec(codec).decode(data, math.prod(shape)).reshape(shape))

    def decode(self, shards: Iterable[ShardUpdate], *, buffers: bool = False) -> list[ShardGrad]:
        """An update's shards as gradients of this model's parameters' slices (``buffers``: as changes of its
        buffers' slices); a shard named twice, or of a tensor of the other kind, is a ``shape`` error."""
        seen: set[tuple[str, int, int]] = set()
        grads = []
        for s in shards:
            key = (s.param, s.start, s.stop)
            if key in seen:
                raise WireError(f"shard {key} appears twice", "shape")
            if (s.param in self.buffers) != buffers:
                raise WireError(f"{s.param!r} is {'not ' if buffers else ''}a buffer of the model: its change travels "
                                f"{'with the gradients' if buffers else 'in the update buffers'}", "shape")
            seen.add(key)
            grads.append(self.decode_shard(s.param, s.start, s.stop, s.codec, s.data))
        return grads

    def step(
        self,
        contributions: Iterable[tuple[float, Iterable[ShardGrad]]],
        *,
        lr: float,
        momentum: float,
        weight_decay: float = 0.0,
        buffers: Iterable[tuple[float, Iterable[ShardGrad]]] = (),
    ) -> list[ShardGrad]:
        """One SGD step on the weighted sum of the contributions' gradients; returns that sum, as the runs of rows
        it touched (stepping on it alone, with weight 1, is the same step: the write-ahead log may keep it instead
        of the contributions). ``sum`` then ``apply``."""
        summed = self.sum(contributions, buffers)
        self.apply(summed, lr=lr, momentum=momentum, weight_decay=weight_decay)
        return summed.grads

    def sum(self, contributions: Iterable[tuple[float, Iterable[ShardGrad]]],
            buffers: Iterable[tuple[float, Iterable[ShardGrad]]] = ()) -> Summed:
        """The weighted sum of the contributions' gradients, by parameter, and the rows it covers, with the weighted
        sum of the ``buffers``' changes (``Step.buffer_contributions``); the model is not read (so a step's sum can
        be logged while it is applied).

        Each contribution is ``(weight, shards)``; weights of one step should sum to 1.
        Only the slices some contribution covers are touched. A lone contribution of weight 1 (an ``async``
        update) is stepped on as it was decoded, not copied first.
        """
        given = [(np.float32(weight), shards) for weight, shards in contributions]
        alone = len(given) == 1 and given[0][0] == 1
        acc: dict[str, np.ndarray] = {}
        rows: dict[str, np.ndarray] = {}
        borrowed: set[str] = set()
        """Sums that are a decoded gradient itself (read-only, perhaps): copied before anything is added."""
        for w, shards in given:
            for g in shards:
                if g.param not in acc:
                    target = self.params[g.param]
                    if g.start == 0 and g.stop == target.shape[0]:  # a whole tensor first: its product is the sum
                        if alone and g.values.dtype == np.float32:  # so far (one pass, not zeros and +=)
                            acc[g.param] = g.values.reshape(target.shape)
                            borrowed.add(g.param)
                        else:
                            acc[g.param] = (g.values * w).reshape(target.shape)
                        rows[g.param] = np.ones(target.shape[0], dtype=bool)
                        continue
                    acc[g.param] = np.empty_like(target)  # rows are written before they are read
                    rows[g.param] = np.zeros(target.shape[0], dtype=bool)
                if g.param in borrowed:
                    acc[g.param] = acc[g.param].copy()
                    borrowed.discard(g.param)
                into, covered = acc[g.param][g.start:g.stop], rows[g.param][g.start:g.stop]
                if not covered.any():  # first rows here: the product is the sum so far
                    np.multiply(g.values.reshape(into.shape), w, out=into)
                else:
                    into[~covered] = 0
                    into += g.values * w
                covered[:] = True
        moved = list(buffers)
        if moved:  # buffers and parameters are different tensors: the sums lie side by side
            changes = self.sum(moved)
            acc.update(changes.acc)
            rows.update(changes.rows)
        return Summed(acc, rows)

    def apply(self, summed: Summed, *, lr: float, momentum: float, weight_decay: float = 0.0) -> None:
        """SGD with momentum on ``summed`` (which it does not change), in place; the rows it lacks stay as they
        are."""
        lr32, mom32, wd32 = np.float32(lr), np.float32(momentum), np.float32(weight_decay)
        for param, grad in summed.acc.items():
            touched = summed.rows[param]
            if param in self.buffers:
                self._move(param, grad, touched)
                continue
            scratch = self._scratch.get(param)
            if scratch is None:
                scratch = self._scratch[param] = np.empty_like(self.params[param])
            if touched.all():
                self._update(self.params[param], self.momentum[param], grad, lr32, mom32, wd32, scratch)
                continue
            runs = _runs(touched)
            if len(runs) <= MAX_RUNS:  # runs of rows are views: stepped in place, nothing gathered or scattered
                p, buf = self.params[param], self.momentum[param]
                for a, b in runs:
                    self._update(p[a:b], buf[a:b], grad[a:b], lr32, mom32, wd32, scratch[a:b])
                continue
            p, buf = self.params[param][touched], self.momentum[param][touched]
            self._update(p, buf, grad[touched], lr32, mom32, wd32, np.empty_like(p))
            self.params[param][touched], self.momentum[param][touched] = p, buf

    def _move(self, buffer: str, change: np.ndarray, touched: np.ndarray) -> None:
        """A buffer's rows ``touched`` plus their combined ``change``; a counter's rounded to whole counts."""
        p = self.params[buffer]
        p[touched] += change[touched]
        if self.buffers[buffer]:
            np.rint(p, out=p)

    @staticmethod
    def _update(p: np.ndarray, buf: np.ndarray, grad: np.ndarray, lr: np.float32, mom: np.float32,
                wd: np.float32, scratch: np.ndarray) -> None:
        """In place: ``buf = mom * buf + grad (+ wd * p)``; ``p -= lr * buf`` (``lr * buf`` into ``scratch``)."""
        if wd:
            grad = grad + wd * p
        buf *= mom
        buf += grad
        np.multiply(buf, lr, out=scratch)
        p -= scratch


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``(start, stop)`` of every run of True in a boolean vector."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
