"""A parameter server split across processes: which rows of the model each shard owns, and the model
assembled from every shard's broadcast (docs/scale.md#a-sharded-parameter-server).

With ``ps.shards`` = n, the model's rows, taken in the order of its parameters, are cut into n runs of
about equal size at row boundaries (``divide``); process i (``edgemesh ps --shard i/n``) owns run i as
rows ``(param, start, stop)`` along dim 0, the model's own unit of a gradient shard. Every process
derives the same division from the model alone, so nothing else needs to be agreed on.

* The parameter server keeps its rows as tensors of their own (``param[start:stop]`` under the name
  ``param``), so its step, log, checkpoint and broadcast are those of an unsharded one;
  :meth:`Division.localize` moves a gradient's rows into them and refuses rows it does not own.
* A worker sends each shard the gradient of its rows, on that shard's topics, and holds one
  :class:`ModelView` per shard; :class:`ShardedView` puts them together into whole tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from edgemesh.common.broadcast import ModelView
from edgemesh.common.errors import ConfigError, WireError
from edgemesh.common.messages import ShardUpdate
from edgemesh.common.topics import Topics

Piece = tuple[str, int, int, np.ndarray]
"""``(param, start, stop, rows)``: rows of a gradient."""


@dataclass(frozen=True, slots=True)
class Span:
    """Rows ``[start, stop)`` along dim 0 of ``param``."""

    param: str
    start: int
    stop: int


def divide(shapes: Mapping[str, tuple[int, ...]], shards: int) -> list[list[Span]]:
    """The rows of a model with parameters ``shapes`` (in their order), cut into ``shards`` runs of about
    equal numbers of values at row boundaries; run i is shard i's. ConfigError if a shard would be empty."""
    if shards < 1:
        raise ConfigError(f"ps.shards must be >= 1, got {shards}")
    scalars = [name for name, shape in shapes.items() if not shape]
    if shards > 1 and scalars:
        raise ConfigError(f"a sharded parameter server divides tensors by rows; {scalars[0]!r} is a scalar")
    total = sum(math.prod(shape) for shape in shapes.values())
    target = total / shards
    runs: list[list[Span]] = [[] for _ in range(shards)]
    shard, done = 0, 0
    for name, shape in shapes.items():
        row = math.prod(shape[1:])
        start = 0
        while start < shape[0]:
            if shard < shards - 1:
                room = round(((shard + 1) * target - done) / row) if row else shape[0]
                if room <= 0:
                    shard += 1
                    continue
                stop = min(shape[0], start + room)
            else:
                stop = shape[0]
            runs[shard].append(Span(name, start, stop))
            done += (stop - start) * row
            start = stop
    empty = [i for i, run in enumerate(runs) if not run]
    if empty:
        raise ConfigError(f"the model has too few rows for {shards} parameter server shards (shard {empty[0]} "
                          "would own none)")
    return runs


def local_rows(run: Iterable[Span], rows: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The part of a model-parallel member's ``rows`` (``param -> (start, stop)`` of whole parameters) within a
    shard's ``run``, counted from the shard's first row of each parameter; every parameter of the run is named,
    with an empty range where the member has none of its rows."""
    out = {}
    for span in run:
        start, stop = rows.get(span.param, (0, 0))
        a, b = max(start, span.start), min(stop, span.stop)
        out[span.param] = (a - span.start, b - span.start) if a < b else (0, 0)
    return out


def cut(grads: Mapping[str, tuple[int, int, np.ndarray]], spans: Iterable[Span]) -> list[Piece]:
    """A model-parallel member's gradient (``param -> (start, stop, rows)``) cut at the shards' ``spans``: the
    pieces, each within one shard's rows (none where it has no rows)."""
    out: list[Piece] = []
    for span in spans:
        if span.param in grads:
            start, stop, rows = grads[span.param]
            a, b = max(start, span.start), min(stop, span.stop)
            if a < b:
                out.append((span.param, a, b, rows[a - start:b - start]))
    return out


@dataclass(frozen=True, slots=True)
class Division:
    """One shard's rows of the model: what its parameter server keeps."""

    shard: int
    shards: int
    spans: tuple[Span, ...]

    @classmethod
    def of(cls, shapes: Mapping[str, tuple[int, ...]], shard: int, shards: int) -> Division:
        return cls(shard, shards, tuple(divide(shapes, shards)[shard]))

    def take(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This shard's rows of the whole ``params``, each a tensor of its own under its parameter's name."""
        return {s.param: np.array(params[s.param][s.start:s.stop], dtype=np.float32) for s in self.spans}

    def local_rows(self, rows: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """``local_rows(self.spans, rows)``: a model-parallel member's rows, as this shard's."""
        return local_rows(self.spans, rows)

    def localize(self, shards: Iterable[ShardUpdate]) -> tuple[ShardUpdate, ...]:
        """A gradient's shards in this shard's own rows (``start`` counted from its first row of the
        parameter); WireError (``shape``) for rows it does not own."""
        own = {s.param: s for s in self.spans}
        out = []
        for s in shards:
            span = own.get(s.param)
            if span is None or not span.start <= s.start < s.stop <= span.stop:
                raise WireError(f"rows {s.param}[{s.start}:{s.stop}] are not parameter server shard {self.shard}'s",
                                "shape")
            out.append(replace(s, start=s.start - span.start, stop=s.stop - span.start))
        return tuple(out)


class ShardedView:
    """The model as n parameter server shards broadcast it: one :class:`ModelView` per shard, put together
    into whole tensors once the model's shapes are known (``know``)."""

    def __init__(self, shards: int) -> None:
        self.views = [ModelView() for _ in range(shards)]
        self.runs: list[list[Span]] | None = None
        self.rows: dict[str, tuple[int, int]] | None = None
        """A model-parallel member's rows of whole parameters (None: whole parameters): each shard's view keeps
        their part within its rows (``local_rows``), and ``params`` are the member's rows, put together."""
        self._assembled: dict[str, np.ndarray] | None = None
        self._from: list[dict[str, np.ndarray] | None] = []
        """Every shard's params the assembled tensors were made of (held, not their ``id``s: a freed
        dict's id is soon another's)."""

    def know(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        if self.runs is None:
            self.runs = divide(shapes, len(self.views))
            self.restrict(self.rows)

    def restrict(self, rows: Mapping[str, tuple[int, int]] | None) -> bool:
        """Keep only a model-parallel member's ``rows`` from now on (None: whole parameters), as
        ``ModelView.restrict`` does: True if every shard's view still holds what it must, False if one was
        emptied for the next snapshot of that shard."""
        self.rows = dict(rows) if rows is not None else None
        if self.runs is None:
            return True  # applied when the model's shapes are known
        kept = [view.restrict(None if rows is None else local_rows(run, rows))
                for view, run in zip(self.views, self.runs, strict=True)]
        return all(kept)

    def shapes(self, shard: int) -> dict[str, tuple[int, ...]] | None:
        """The shapes of shard ``shard``'s tensors (None until the model is known)."""
        if self.runs is None:
            return None
        return {s.param: (s.stop - s.start,) for s in self.runs[shard]}

    @property
    def ready(self) -> bool:
        return self.runs is not None and all(v.ready for v in self.views)

    @property
    def versions(self) -> tuple[int, ...]:
        return tuple(v.version for v in self.views)

    @property
    def version(self) -> int:
        """The oldest shard's version."""
        return min(self.versions)

    @property
    def stamp(self) -> int:
        """What moves whenever the model moves: the sum of the shards' versions (it moves shard by shard)."""
        return sum(self.versions)

    def shard_topics(self, topics: Topics) -> list[Topics]:
        """The topics of the parameter server shards whose model this view follows, in shard order."""
        return [topics.for_shard(i) for i in range(len(self.views))]

    def pieces(self, grads: Mapping[str, tuple[int, int, np.ndarray]]) -> list[Piece]:
        """A model-parallel member's gradient (``param -> (start, stop, rows)``) cut at the shards' rows (``cut``)."""
        return cut(grads, self.spans)

    @property
    def gap(self) -> bool:
        return any(v.gap for v in self.views)

    @property
    def params(self) -> dict[str, np.ndarray] | None:
        """Whole tensors from every shard's rows (made again only when a shard's view moved)."""
        if not self.ready:
            return None
        now = [v.params for v in self.views]
        if self._assembled is None or any(a is not b for a, b in zip(now, self._from, strict=True)):
            self._assembled, self._from = self.assemble(p for p in now if p is not None), now
        return self._assembled

    def assemble(self, parts: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Whole tensors from each shard's rows, in shard order."""
        assert self.runs is not None
        pieces: dict[str, list[np.ndarray]] = {}
        for run, part in zip(self.runs, parts, strict=True):
            for span in run:
                pieces.setdefault(span.param, []).append(part[span.param])
        return {name: p[0] if len(p) == 1 else np.concatenate(p) for name, p in pieces.items()}

    def split(self, shards: Sequence[ShardUpdate]) -> list[list[ShardUpdate]]:
        """Gradient shards grouped by the parameter server shard whose rows they are (each must lie within one
        shard's rows: ``spans`` says how to cut them, ``cut`` a model-parallel member's rows)."""
        assert self.runs is not None
        owners: dict[str, list[tuple[Span, int]]] = {}
        for i, run in enumerate(self.runs):
            for span in run:
                owners.setdefault(span.param, []).append((span, i))
        out: list[list[ShardUpdate]] = [[] for _ in self.views]
        for s in shards:
            owner = [i for span, i in owners.get(s.param, ()) if span.start <= s.start and s.stop <= span.stop]
            if not owner:
                raise ValueError(f"rows {s.param}[{s.start}:{s.stop}] are not within one parameter server shard's")
            out[owner[0]].append(s)
        return out

    @property
    def spans(self) -> list[Span]:
        """Every shard's rows, in order: how a gradient is cut."""
        assert self.runs is not None
        return [span for run in self.runs for span in run]
