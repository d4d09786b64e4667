"""The global model as named float32 tensors and its SGD-with-momentum step.

Gradients arrive by shard ``(param, start, stop)`` along dim 0, so whole tensors (data
parallel) and slices (model parallel) go through the same step.

The model state holds the module's persistent buffers beside its parameters (batch norm's running
statistics and counter). A buffer is not a parameter: an update carries its change over the worker's
step (:class:`edgemesh.common.models.Update`), a step combines those changes with the updates'
sample shares (``buffer_contributions``) and adds the result, with no learning rate, momentum or weight decay; a
running statistic's mean change is compounded over the step's updates (``compounded``: as that many batches in turn
would move it), an integer buffer (a counter) is rounded after each step (docs/synchronization.md).

Every step is judged before it stands (:meth:`ModelState.apply`): a step whose arithmetic overflows or leaves a
value that is not finite, or that grows a tensor's L2 norm past ``MAX_GROWTH`` times what it was (or past
``MAX_GROWTH`` times its floor, ``PARAM_FLOOR`` for a parameter, ``BUFFER_FLOOR`` for a buffer, when it was
smaller), is refused: the tensors and their momentum are put back as they were before it
(docs/synchronization.md#what-the-parameter-server-refuses). The bounds are constants, not settings: a replay of the
write-ahead log judges every step again and must refuse the same ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from edgemesh.common.codecs import get_codec
from edgemesh.common.errors import WireError
from edgemesh.common.messages import ShardUpdate

MAX_RUNS = 64
"""Most runs of rows a parameter's step takes as slices, in place; more (rows scattered by a sparse codec) are
gathered, stepped and scattered back at once."""
MAX_GROWTH = 10.0
"""Most a step may multiply a tensor's L2 norm by (above its floor). An honest step moves a tensor by a learning
rate times its gradient and momentum, a small fraction of its norm; one device's exploding or forged update (a value
of 1e30) multiplies it by orders of magnitude."""
PARAM_FLOOR = 1.0
"""A parameter's norm below this counts as this: a bias that starts at zero may take its first steps."""
BUFFER_FLOOR = 1e6
"""A buffer's norm below this counts as this: running statistics move to the data's scale in a few steps (a running
variance of raw pixel values is in the thousands), and a counter counts up from zero."""
SURE_MARGIN = 2.0
"""A step is applied without a copy to undo it when its bound by norms, times this, is within ``MAX_GROWTH``: float32
sums of squares are not exact."""
StepRefusal = Literal["nonfinite", "growth"]
"""Why a step was refused: a value it made is not finite (or its arithmetic overflowed), or it grew a tensor's norm
past the bound."""


@dataclass(frozen=True, slots=True)
class Refused:
    """A step :meth:`ModelState.apply` refused, and why."""

    reason: StepRefusal
    detail: str


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
                 buffers: Mapping[str, bool] | None = None, momenta: Mapping[str, float] | None = None) -> None:
        self.params = {k: np.array(v, dtype=np.float32, copy=True) for k, v in params.items()}
        self.buffers = {k: bool(v) for k, v in (buffers or {}).items() if k in self.params}
        """Which tensors of ``params`` are buffers, and whether each holds integers (a counter): stepped by adding
        their combined change, not by SGD."""
        self.momenta = {k: float(v) for k, v in (momenta or {}).items() if k in self.buffers}
        """Buffers that are exponential averages (batch norm's running statistics), with their momentum: a step of
        several updates moves them as that many batches in turn would (``compounded``)."""
        self.momentum = {k: np.zeros_like(v) for k, v in self.params.items()}
        self._scratch: dict[str, np.ndarray] = {}
        """Per parameter, room for ``lr * buf``: a step allocates no model-sized temporaries."""
        self._before: dict[str, np.ndarray] = {}
        self._before_momentum: dict[str, np.ndarray] = {}
        """The tensors a step touches, and their momentum, as they were before it (``apply`` puts them back when it
        refuses the step)."""
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
        of the contributions). ``sum`` then ``apply``, which may refuse the step (the state then stays as it was: a
        replay of the log refuses what the step refused)."""
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
        update) is stepped on as it was decoded, not copied first. A sum that overflows holds infinities, no
        warning: ``apply`` refuses a step on it, and counts why.
        """
        with np.errstate(over="ignore", invalid="ignore"):
            return self._sum(contributions, buffers)

    def _sum(self, contributions: Iterable[tuple[float, Iterable[ShardGrad]]],
             buffers: Iterable[tuple[float, Iterable[ShardGrad]]]) -> Summed:
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
            changes = self._sum_buffers(moved)
            acc.update(changes.acc)
            rows.update(changes.rows)
        return Summed(acc, rows)

    def _sum_buffers(self, moved: list[tuple[float, Iterable[ShardGrad]]]) -> Summed:
        """The weighted sum of the buffers' changes, a running average's compounded over the ``moved`` updates."""
        changes = self.sum(moved)
        if len(moved) > 1:  # a lone change (weight 1) stands as it came
            for name, change in changes.acc.items():
                if name in self.momenta:
                    change *= np.float32(compounded(self.momenta[name], len(moved)))
        return changes

    def restore(self, params: Mapping[str, np.ndarray]) -> None:
        """``params`` in place of the model's tensors (weights and buffers), momentum cleared: the divergence guard's
        rollback to its best evaluated state."""
        for name, value in params.items():
            self.params[name][...] = value
        for buf in self.momentum.values():
            buf.fill(0.0)

    def apply(self, summed: Summed, *, lr: float, momentum: float, weight_decay: float = 0.0) -> Refused | None:
        """SGD with momentum on ``summed`` (which it does not change), in place; the rows it lacks stay as they
        are. A step that overflows, leaves a value that is not finite or grows a tensor's norm past the bound (module
        docstring) is refused: every tensor it touched, and their momentum, go back to what they were, and the
        refusal is returned (None: the step stands). A step whose norms show it stays well within the bound
        (``_surely_within``, nearly every step) is applied as it is, with no copy to undo it."""
        if self._surely_within(summed, lr=lr, momentum=momentum, weight_decay=weight_decay):
            self._apply(summed, lr=lr, momentum=momentum, weight_decay=weight_decay)
            return None
        touched = self._keep(summed.acc)
        try:
            with np.errstate(over="raise", invalid="raise", divide="raise"):
                self._apply(summed, lr=lr, momentum=momentum, weight_decay=weight_decay)
        except FloatingPointError as exc:
            refused: Refused | None = Refused("nonfinite", f"the step's arithmetic failed: {exc}")
        else:
            refused = self._judge(touched)
        if refused is not None:
            self._restore(touched)
        return refused

    def _surely_within(self, summed: Summed, *, lr: float, momentum: float, weight_decay: float) -> bool:
        """Whether the step certainly leaves every tensor it touches finite and within the bound, by the triangle
        inequality over norms: a parameter's is at most ``|p| + lr (momentum |buf| + |grad| + weight_decay |p|)``, a
        buffer's ``|b| + |change|`` (and half a count per value, rounded). The norms are finite float32 sums of
        squares, so every value is below 2e19 and no operation of the step can overflow; ``SURE_MARGIN`` covers their
        rounding. False sends the step to the exact judgement."""
        lr, momentum, weight_decay = abs(lr), abs(momentum), abs(weight_decay)
        for name, grad in summed.acc.items():
            touched = summed.rows[name]
            size, moved = _norm(self.params[name]), _norm(grad if touched.all() else grad[touched])
            if name in self.buffers:
                bound = size + moved + (0.5 * math.sqrt(touched.sum() * math.prod(grad.shape[1:]))
                                        if self.buffers[name] else 0.0)
                floor = BUFFER_FLOOR
            else:
                bound = size + lr * (momentum * _norm(self.momentum[name]) + moved + weight_decay * size)
                floor = PARAM_FLOOR
            if not SURE_MARGIN * bound <= MAX_GROWTH * max(size, floor):  # NaN or infinity: not sure either
                return False
        return True

    def _keep(self, params: Iterable[str]) -> list[str]:
        """Copy the tensors ``params`` names, and their momentum, aside (into buffers kept for it: no allocation
        after the first step); the names."""
        names = list(params)
        for name in names:
            for source, kept in ((self.params, self._before), (self.momentum, self._before_momentum)):
                if source is self.momentum and name in self.buffers:
                    continue  # a buffer has no momentum
                into = kept.get(name)
                if into is None:
                    into = kept[name] = np.empty_like(source[name])
                np.copyto(into, source[name])
        return names

    def _restore(self, names: Iterable[str]) -> None:
        for name in names:
            np.copyto(self.params[name], self._before[name])
            if name not in self.buffers:
                np.copyto(self.momentum[name], self._before_momentum[name])

    def _judge(self, names: Iterable[str]) -> Refused | None:
        """The refusal the step that just moved ``names`` calls for (None: it stands)."""
        for name in names:
            after, before = _norm(self.params[name]), _norm(self._before[name])
            if not math.isfinite(after) and not np.isfinite(self.params[name]).all():
                return Refused("nonfinite", f"{name} holds values that are not finite")
            floor = BUFFER_FLOOR if name in self.buffers else PARAM_FLOOR
            if not after <= MAX_GROWTH * max(before, floor):  # an infinite norm of finite values: grown too
                return Refused("growth", f"the L2 norm of {name} would grow from {before:.4g} to {after:.4g}, "
                               f"more than {MAX_GROWTH:g} x {max(before, floor):.4g}")
        return None

    def _apply(self, summed: Summed, *, lr: float, momentum: float, weight_decay: float) -> None:
        """``apply``'s arithmetic, unjudged."""
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


def compounded(momentum: float, batches: int) -> float:
    """What a step of ``batches`` updates multiplies their mean change of an exponential average by, so that it moves
    as those batches would, one after another, in one process: ``(1 - (1 - momentum)^batches) / momentum``.

    Each update's change is ``momentum * (s_i - r)`` from the same average ``r``; ``batches`` averages in turn leave
    ``r + (1 - (1 - momentum)^batches) * (mean s - r)``. Without it a synchronous round of ten devices would move
    batch norm's running statistics as one batch does, and they would trail the weights by ten times the samples
    they trail them by in one process (the more so as the learning rate grows with the round, ``round_scaling``)."""
    return (1.0 - (1.0 - momentum) ** batches) / momentum if momentum > 0 else 1.0


def _norm(values: np.ndarray) -> float:
    """L2 norm of a tensor (float32 dot products: one too large to square is infinite, which the bound refuses)."""
    flat = values.reshape(-1)
    with np.errstate(all="ignore"):
        return math.sqrt(float(np.dot(flat, flat)))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """``(start, stop)`` of every run of True in a boolean vector."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
