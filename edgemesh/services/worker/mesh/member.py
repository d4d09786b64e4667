"""Model parallelism inside a cluster (docs/mesh.md): one member's slice of every conv and linear layer.

A cluster of ``k`` members trains one batch together. The filter division gives member *i*
``counts[layer][i]`` of each layer's output units (filters or features), contiguous and in member
order. One step, for every stage (a layer with its replicated ``pre`` and channel-wise ``tail``
modules, :func:`models.mesh_stages`):

* **forward**: apply ``pre`` to the whole input, the member's slice of the layer, ``tail`` to the
  slice; all-gather the slices along dim 1, which gives every member the whole input of the next
  stage. After the last stage every member holds the whole logits and computes the same loss.
* **backward**, last stage first: the member's slice of the output gradient gives its weight and
  bias gradients and a *partial* gradient of the stage's whole input; the partials are summed
  across members by a reduce-scatter (member *j* receives, from every other member, the channels
  of their partial that belong to *j*'s slice of the previous stage), which gives each member
  the output gradient of its slice of the previous stage.

A batch norm in a stage's tail normalizes the member's own channels over the whole batch (every
member holds it) with its rows of the weight, bias and running statistics; a dropout applies the
member's slice of a mask of the whole tensor drawn from a seed the cluster shares (``models.masks``:
the plan's seed, the step and the module's name), and a dropout before a layer the whole mask.

A residual block ``act(body(x) + skip(x))`` divides through its body's stages. Its first stage keeps the block's
input (whole: every member gathered it); its last adds to its slice, after the tail, the member's channels of the
skip: the kept input's, or its rows of the projection and of the projection's batch norm (the projection has the
layer's output units, so the layer's counts divide it), then runs the block's activation before the all-gather.
Backward, the last stage also gives the skip's partial gradient of the block input (and the projection's gradients,
shards of the same rows); the first stage adds it to its own partial before the reduce-scatter, whose sum over the
members makes the block input's gradient whole.

The result is, up to float rounding, the loss, logits, gradients and running statistics one
process computes on the same batch with the same dropout masks (tested). A member holds only its
rows of the model state and, for the backward pass, the whole input of every stage and its own
slice of every output. Gradients leave as shards ``(param, start, stop)`` along dim 0, which is how
the parameter server takes them; the running statistics' changes leave as shards of the member's
rows, and the batch counters' change from the cluster's first member alone.

Computation runs through ``run`` (``asyncio.to_thread`` by default) so the event loop never
blocks; communication goes through an :class:`Exchange` (``exchange``): ``LocalHub`` in one
process, ``BusExchange`` on ``mesh/...`` topics between devices.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from edgemesh.common import costs, models
from edgemesh.common.costs import slices
from edgemesh.common.errors import ModelError
from edgemesh.common.models.masks import apply_mask, dropout_mask

Batch = tuple[np.ndarray, np.ndarray]
"""A step's inputs and labels."""
Runner = Callable[..., Awaitable[Any]]
"""``run(fn, *args, flops=...)``: call ``fn(*args)`` off the event loop; ``flops`` is the training
work of the call, for an emulated device to hold it to its board's speed."""


class Exchange(Protocol):
    """How the members of one cluster trade slices within a step."""

    async def gather(self, step: int, layer: str, piece: np.ndarray) -> list[np.ndarray]:
        """Send this member's output slice of ``layer``; return every member's, in member order."""
        ...

    async def scatter(self, step: int, layer: str, pieces: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Send ``pieces[j]`` to member *j*; return what every member sent this one, in member order."""
        ...

    async def inputs(self, step: int, owner: int, batch: Batch | None) -> Batch:
        """The step's batch, from member ``owner``'s data: the owner passes it (``batch``) and sends it to the
        others, who pass None and receive it; every member returns the batch to compute on."""
        ...


def owner_of(step: int, holding: Sequence[bool]) -> int | None:
    """The member whose local data give ``step``'s batch: member ``step % k`` of ``k``, or the next one in
    member order (wrapping round) that holds data; None if no member holds any."""
    k = len(holding)
    return next(((step + i) % k for i in range(k) if holding[(step + i) % k]), None)


@dataclass(slots=True)
class MeshStep:
    """One member's result of one step."""

    loss: float
    logits: np.ndarray
    """The whole logits of the batch (every member has them)."""
    grads: dict[str, tuple[int, int, np.ndarray]]
    """``param -> (start, stop, gradient of rows [start, stop))``: this member's shards."""
    buffers: dict[str, tuple[int, int, np.ndarray]] = field(default_factory=dict)
    """``buffer -> (start, stop, change of rows [start, stop))``: how the step moved this member's rows of the
    running statistics, and (the first member alone) the batch counters."""
    compute_s: float = 0.0
    """Seconds spent computing (not waiting for other members)."""
    layer_s: dict[str, float] = field(default_factory=dict)
    """Compute seconds per layer, forward and backward (the loss counts to the last layer)."""


@dataclass(slots=True)
class _Norm:
    """A batch norm of a stage's tail on this member's channels: its rows of the weight, bias and running
    statistics (as loaded: a step moves copies of them), and the batch counter whole."""

    name: str
    momentum: float | None
    eps: float
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    running_mean: torch.Tensor | None = None
    running_var: torch.Tensor | None = None
    count: int = 0
    moved: tuple[torch.Tensor, torch.Tensor] | None = None
    """The running statistics of the step in progress (None: not tracked)."""

    def begin(self) -> None:
        """A step starts from the loaded running statistics."""
        if self.running_mean is None or self.running_var is None:
            self.moved = None
        else:
            self.moved = (self.running_mean.clone(), self.running_var.clone())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``nn.BatchNorm``'s training forward on these channels: batch statistics over the whole batch, the running
        ones moved by the momentum (or, with none, by ``1 / batches``)."""
        factor = 0.0
        if self.moved is not None:
            factor = self.momentum if self.momentum is not None else 1.0 / (self.count + 1)
        mean, var = self.moved if self.moved is not None else (None, None)
        return F.batch_norm(x, mean, var, self.weight, self.bias, training=True, momentum=factor, eps=self.eps)


@dataclass(frozen=True, slots=True)
class _Dropout:
    """A dropout of the model, applied with the cluster's shared mask (``models.masks``)."""

    name: str
    p: float


Op = nn.Module | _Norm | _Dropout
"""One module of a stage's ``pre`` or ``tail`` as a member runs it."""


@dataclass(slots=True)
class _Layer:
    name: str
    kind: str  # "conv" | "linear"
    options: dict[str, Any]
    pre: list[Op]
    tail: list[Op]
    start: int
    stop: int
    units: int
    parts: tuple[str, ...] = ("weight", "bias")
    """The layer's own parameters: ``weight``, and ``bias`` unless it has none."""
    groups: int = 1
    """A grouped convolution's groups: this member computes its whole groups from their input channels alone."""
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    saved: tuple[torch.Tensor, torch.Tensor | None] | None = None
    """(input leaf, output slice or None for a member with no unit of it) of the step in progress, for the backward
    pass."""
    opens: str = ""
    """The residual block whose input this stage keeps (``models.Stage.opens``), after the first ``entry`` modules of
    ``pre``."""
    entry: int = 0
    closes: str = ""
    """The residual block whose skip this stage adds to its slice after ``tail``, before ``post``."""
    skip: _Layer | None = None
    """The closed block's projection: this member's rows of it (the layer's), its batch norms as its tail."""
    post: list[Op] = field(default_factory=list)

    def norms(self) -> list[_Norm]:
        """The batch norms of this member's rows: the tail's, the projection's and those after the block's sum."""
        ops = [*self.tail, *(self.skip.tail if self.skip is not None else ()), *self.post]
        return [op for op in ops if isinstance(op, _Norm)]

    def own(self) -> list[_Layer]:
        """The layer and its projection, whose weight (and bias) rows this member holds."""
        return [self, self.skip] if self.skip is not None else [self]


@dataclass(slots=True)
class _Kept:
    """A residual block's input, kept by its first stage for its last: ``whole`` in the first stage's graph, and
    ``leaf``, a copy the last stage reads, whose gradient is the skip's partial gradient of the block input."""

    whole: torch.Tensor
    leaf: torch.Tensor


def _op(name: str, module: nn.Module) -> Op:
    """How a member runs child ``name`` of the model: a batch norm on its rows, a dropout with the shared mask, any
    other module as it is."""
    if isinstance(module, models.NORMS):
        momentum = None if module.momentum is None else float(module.momentum)
        return _Norm(name, momentum, float(module.eps))
    if isinstance(module, models.DROPOUTS):
        return _Dropout(name, float(module.p))
    return module


class MeshMember:
    """Member ``index`` of a cluster dividing ``model_spec`` by ``counts`` (layer -> units per member).

    ``seed`` is the plan's: the model is built from it, and the dropout masks are drawn from it.
    Raises ModelError if the division does not match the model (a layer missing, counts that do
    not add up to the layer's units, a negative count) or the model cannot be divided.
    """

    def __init__(self, model_spec: str, counts: Mapping[str, Sequence[int]], index: int, *, seed: int = 0) -> None:
        model = models.build_model(model_spec, seed=seed)
        stages = models.mesh_stages(model)
        modules = dict(model.named_modules())
        names = [s.layer for s in stages]
        if set(counts) != set(names):
            raise ModelError(f"division names layers {sorted(counts)}, model {model_spec} has {names}")
        sizes = {len(c) for c in counts.values()}
        if len(sizes) != 1:
            raise ModelError("every layer's division must have one count per member")
        self.members = sizes.pop()
        if not 0 <= index < self.members:
            raise ModelError(f"member index {index} outside a cluster of {self.members}")
        self.index = index
        self.model_spec = model_spec
        self.seed = seed
        self.counts = {name: tuple(int(n) for n in counts[name]) for name in names}
        self.layers: dict[str, _Layer] = {}
        for stage in stages:
            self.layers[stage.layer] = self._layer(stage, modules)
        self._kept: dict[str, _Kept] = {}
        """Residual blocks' inputs of the step in progress, by block."""
        self.skips = {s.layer: c.layer for s in stages if s.opens for c in stages if c.closes == s.opens}
        """``first layer -> last layer`` of every residual block: the last layer's holders send partial gradients of
        the first layer's input too (the skip's part), also a member holding none of the first layer."""
        self.order = names
        self.version = -1
        self._figures = models.measure_layers(model_spec)
        self._macs = {c.name: c.macs_per_unit for c in self._figures}
        """Forward multiply-accumulates per output unit and sample, by layer."""
        self._lengths = {name: int(t.shape[0]) if t.dim() else 1 for name, t in model.state_dict().items()}
        self._params = {name for name, _ in model.named_parameters()}

    def _layer(self, stage: models.Stage, modules: Mapping[str, nn.Module]) -> _Layer:
        c = self.counts[stage.layer]
        layer = self._rows(stage.layer, modules, c, [_op(n, modules[n]) for n in stage.pre],
                           [_op(n, modules[n]) for n in stage.tail])
        if layer.groups > 1 and any(n % (layer.units // layer.groups) for n in c):
            raise ModelError(f"division of {stage.layer} is {list(c)}: a grouped convolution's counts must be whole "
                             f"groups of {layer.units // layer.groups} channels")
        layer.opens, layer.entry, layer.closes = stage.opens, stage.entry, stage.closes
        layer.post = [_op(n, modules[n]) for n in stage.post]
        if stage.skip:  # the projection has the layer's output units: the same counts divide it
            layer.skip = self._rows(stage.skip[0], modules, c, [], [_op(n, modules[n]) for n in stage.skip[1:]])
        return layer

    def _rows(self, name: str, modules: Mapping[str, nn.Module], c: Sequence[int], pre: list[Op],
              tail: list[Op]) -> _Layer:
        """This member's rows of conv or linear layer ``name`` divided by counts ``c``."""
        module = modules[name]
        assert isinstance(module, nn.Conv2d | nn.Linear)
        units = module.out_channels if isinstance(module, nn.Conv2d) else module.out_features
        if any(n < 0 for n in c) or sum(c) != units:
            raise ModelError(f"division of {name} is {list(c)}: must be >= 0 and add up to {units}")
        start, stop = slices(c)[self.index]
        groups = module.groups if isinstance(module, nn.Conv2d) else 1
        if isinstance(module, nn.Conv2d):
            kind, options = "conv", {"stride": module.stride, "padding": module.padding, "dilation": module.dilation}
        else:
            kind, options = "linear", {}
        parts = ("weight", "bias") if module.bias is not None else ("weight",)
        return _Layer(name, kind, options, pre, tail, start, stop, units, parts, groups)

    # ------------------------------------------------------------------ parameters
    def shards(self) -> list[tuple[str, int, int]]:
        """``(param, start, stop)`` of every parameter slice this member holds (non-empty ones)."""
        return [(name, a, b) for name, (a, b) in self.rows().items() if b > a and name in self._params]

    def rows(self) -> dict[str, tuple[int, int]]:
        """``tensor -> (start, stop)``: the rows of the model state this member holds (empty ranges for layers it
        has no unit of), what its model view keeps: its rows of every layer's weight and bias and of the batch norms
        divided with it (``costs.member_rows``), and the batch counters whole."""
        return costs.member_rows(self._figures, self.counts, self.index)

    def load(self, params: Mapping[str, np.ndarray], version: int) -> None:
        """Take this member's rows of model ``version``: from whole tensors, or from arrays of
        exactly its rows (a view restricted to ``rows()``)."""
        targets = self._targets()
        for tensor, (start, stop) in self.rows().items():
            array = np.asarray(params[tensor], dtype=np.float32)
            whole, own = self._lengths[tensor], stop - start
            if array.shape[:1] == (whole,):
                rows = array[start:stop]
            elif array.shape[:1] == (own,):
                rows = array
            else:
                raise ModelError(f"{tensor} has shape {array.shape}; the model has {whole} rows, this member {own}")
            holder, part = targets[tensor]
            if part == "count":
                setattr(holder, part, int(np.rint(rows[0])))
                continue
            value = torch.tensor(rows, dtype=torch.float32)
            setattr(holder, part, value.requires_grad_(True) if tensor in self._params else value)
        self.version = version

    def _targets(self) -> dict[str, tuple[_Layer | _Norm, str]]:
        """Where each tensor of ``rows()`` lives in this member: ``(layer or batch norm, attribute)``."""
        out: dict[str, tuple[_Layer | _Norm, str]] = {}
        for layer in self.layers.values():
            out |= {f"{own.name}.{part}": (own, part) for own in layer.own() for part in own.parts}
            for norm in layer.norms():
                out |= {f"{norm.name}.{part}": (norm, part)
                        for part in ("weight", "bias", "running_mean", "running_var")}
                out[f"{norm.name}.num_batches_tracked"] = (norm, "count")
        return out

    def _flops(self, name: str, batch: int) -> float:
        """Training FLOPs of this member's units of ``name`` for ``batch`` samples (forward a third)."""
        layer = self.layers[name]
        return float(costs.FLOPS_PER_MAC * (layer.stop - layer.start) * self._macs[name] * batch)

    def flops_per_sample(self) -> float:
        """Training FLOPs of this member's units for one sample (``costs.FLOPS_PER_MAC`` per MAC)."""
        return sum(self._flops(name, 1) for name in self.order)

    @property
    def param_count(self) -> int:
        """Parameters this member holds (its rows of every weight and bias, batch norms' included)."""
        return sum((self.layers[c.name].stop - self.layers[c.name].start) * c.params_per_unit for c in self._figures)

    # ------------------------------------------------------------------ one step
    async def step(self, step: int, x: np.ndarray, y: np.ndarray, exchange: Exchange,
                   run: Runner | None = None) -> MeshStep:
        """Forward, loss and backward of one batch with the other members; this member's gradient shards and the
        change of its running statistics. ``step`` is the cluster's step number (the dropout masks are drawn from
        it)."""
        if self.version < 0:
            raise ModelError("no parameters loaded")
        run = run or in_thread
        busy = dict.fromkeys(self.order, 0.0)
        batch = len(x)
        for layer in self.layers.values():
            for norm in layer.norms():
                norm.begin()
        act = np.asarray(x, dtype=np.float32)
        for s, name in enumerate(self.order):
            piece, took = await run(self._forward, name, act, s > 0, step, flops=self._flops(name, batch) / 3)
            busy[name] += took
            act = _concat(await exchange.gather(step, name, piece))
        logits = act
        loss, grad, took = await run(self._loss, logits, y, flops=0.0)
        busy[self.order[-1]] += took
        last = self.layers[self.order[-1]]
        grad = grad[:, last.start:last.stop]
        grads: dict[str, tuple[int, int, np.ndarray]] = {}
        for s in range(len(self.order) - 1, -1, -1):
            name = self.order[s]
            partial, shards, took = await run(self._backward, name, grad, flops=self._flops(name, batch) * 2 / 3)
            busy[name] += took
            grads.update(shards)
            if s == 0:
                break
            previous = self.counts[self.order[s - 1]]
            pieces = [np.empty((0,), np.float32) if partial is None or j == self.index else partial[:, a:b]
                      for j, (a, b) in enumerate(slices(previous))]
            received = await exchange.scatter(step, name, pieces)
            a, b = slices(previous)[self.index]
            own = partial[:, a:b] if partial is not None else None
            grad = _sum([own, *(r for j, r in enumerate(received) if j != self.index)])
        return MeshStep(loss=loss, logits=logits, grads=grads, buffers=self._moved(), compute_s=sum(busy.values()),
                        layer_s=busy)

    def _moved(self) -> dict[str, tuple[int, int, np.ndarray]]:
        """How the step moved this member's rows of the running statistics, and the batch counters (one step: 1)
        when it is the first member, which alone sends them so that the joined update counts the step once."""
        out: dict[str, tuple[int, int, np.ndarray]] = {}
        for layer in self.layers.values():
            for norm in layer.norms():
                if norm.moved is None:
                    continue
                if self.index == 0:
                    out[f"{norm.name}.num_batches_tracked"] = (0, 1, np.ones(1, np.float32))
                if layer.stop == layer.start:
                    continue
                mean, var = ((after.to(torch.float64) - getattr(norm, part).to(torch.float64)).numpy()
                             for part, after in zip(("running_mean", "running_var"), norm.moved, strict=True))
                if norm.momentum is not None:  # as one process's step reports it (``models.compute_update``)
                    var = models.mixture_variance_change(var, mean, norm.momentum)
                out[f"{norm.name}.running_mean"] = (layer.start, layer.stop, mean.astype(np.float32))
                out[f"{norm.name}.running_var"] = (layer.start, layer.stop, var.astype(np.float32))
        return out

    def _run(self, ops: Sequence[Op], h: torch.Tensor, step: int, span: tuple[int, int, int] | None) -> torch.Tensor:
        """``h`` through ``ops``: on the whole tensor (``span`` None), or on this member's channels ``(start, stop,
        of units)`` of it, a dropout then taking its slice of the whole tensor's mask."""
        for op in ops:
            if isinstance(op, _Dropout):
                shape = tuple(h.shape) if span is None else (h.shape[0], span[2], *h.shape[2:])
                mask = dropout_mask(shape, op.p, self.seed, step, op.name)
                h = apply_mask(h, mask if span is None else mask[:, span[0]:span[1]], op.p)
            else:
                h = op(h)
        return h

    def _forward(self, name: str, act: np.ndarray, needs_grad: bool, step: int) -> tuple[np.ndarray, float]:
        """This member's output slice of stage ``name`` from its whole input ``act``; the first stage of a residual
        block keeps the block's input (also a member with no unit of it: its skip may need it), the last adds the
        member's channels of the skip before ``post``."""
        started = time.perf_counter()
        layer = self.layers[name]
        x = torch.from_numpy(np.ascontiguousarray(act)).requires_grad_(needs_grad)
        empty = np.empty((x.shape[0], 0), np.float32)
        layer.saved = None
        if layer.stop == layer.start and not layer.opens:
            return empty, time.perf_counter() - started
        h = self._run(layer.pre[:layer.entry], x, step, None)
        if layer.opens:
            self._kept[layer.opens] = _Kept(h, h.detach().requires_grad_(h.requires_grad))
        if layer.stop == layer.start:
            layer.saved = (x, None)
            return empty, time.perf_counter() - started
        span = (layer.start, layer.stop, layer.units)
        out = self._run(layer.tail, _apply(layer, self._run(layer.pre[layer.entry:], h, step, None)), step, span)
        if layer.closes:
            out = self._run(layer.post, out + self._skip(layer, step), step, span)
        layer.saved = (x, out)
        return out.detach().numpy(), time.perf_counter() - started

    def _skip(self, layer: _Layer, step: int) -> torch.Tensor:
        """This member's channels of the skip connection of the block ``layer`` closes: of its kept input, or its
        rows of the projection of it and the projection's batch norms."""
        kept = self._kept[layer.closes].leaf
        if layer.skip is None:
            return kept[:, layer.start:layer.stop]
        return self._run(layer.skip.tail, _apply(layer.skip, kept), step, (layer.start, layer.stop, layer.units))

    def _loss(self, logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, float]:
        started = time.perf_counter()
        z = torch.from_numpy(np.ascontiguousarray(logits)).requires_grad_(True)
        target = torch.as_tensor(np.asarray(y), dtype=torch.int64)
        if target.ndim != 1 or target.shape[0] != z.shape[0]:
            raise ModelError(f"labels {tuple(target.shape)} do not match logits {tuple(z.shape)}")
        if int(target.min()) < 0 or int(target.max()) >= z.shape[1]:
            raise ModelError(f"labels must lie in [0, {z.shape[1]})")
        loss = F.cross_entropy(z, target)
        loss.backward()
        assert z.grad is not None
        return float(loss.item()), z.grad.numpy(), time.perf_counter() - started

    def _backward(self, name: str, grad: np.ndarray) -> tuple[np.ndarray | None, dict[str, tuple[int, int, np.ndarray]],
                                                                float]:
        """This member's gradient shards of stage ``name`` from its output-slice gradient ``grad``, and its partial
        gradient of the stage's whole input; at a residual block's first stage the partial also holds the skip's
        part, which the block's last stage left in the kept input's gradient."""
        started = time.perf_counter()
        layer = self.layers[name]
        if layer.saved is None:
            return None, {}, time.perf_counter() - started
        x, out = layer.saved
        layer.saved = None
        shards = {}
        kept = self._kept.pop(layer.opens, None)
        if out is not None:
            trained = [(f"{own.name}.{part}", getattr(own, part)) for own in layer.own() for part in own.parts]
            trained += [(f"{norm.name}.{part}", getattr(norm, part)) for norm in layer.norms()
                        for part in ("weight", "bias") if getattr(norm, part) is not None]
            for _, tensor in trained:
                tensor.grad = None
            # a block's input is reached again below, through the modules of pre before it: keep their graph
            torch.autograd.backward([out], [torch.from_numpy(np.ascontiguousarray(grad, dtype=np.float32))],
                                    retain_graph=kept is not None)
            for param, tensor in trained:
                assert tensor.grad is not None
                shards[param] = (layer.start, layer.stop, tensor.grad.numpy().copy())
        if kept is not None and kept.leaf.grad is not None and kept.whole.requires_grad:
            torch.autograd.backward([kept.whole], [kept.leaf.grad])
        partial = x.grad.numpy() if x.grad is not None else None
        return partial, shards, time.perf_counter() - started


def _apply(layer: _Layer, h: torch.Tensor) -> torch.Tensor:
    """This member's output units of conv or linear ``layer`` from its whole input ``h``."""
    assert layer.weight is not None
    return _conv(h, layer) if layer.kind == "conv" else F.linear(h, layer.weight, layer.bias)


def _conv(h: torch.Tensor, layer: _Layer) -> torch.Tensor:
    """This member's output channels of a conv layer from the whole input ``h``: of a grouped convolution, its whole
    groups from their input channels alone (its weight rows are those groups' filters), so that its partial input
    gradient is zero on the other channels."""
    assert layer.weight is not None
    if layer.groups == 1:
        return F.conv2d(h, layer.weight, layer.bias, **layer.options)
    size, width = layer.units // layer.groups, h.shape[1] // layer.groups
    first, last = layer.start // size, layer.stop // size
    return F.conv2d(h[:, first * width:last * width], layer.weight, layer.bias, groups=last - first, **layer.options)


async def in_thread(fn: Callable[..., Any], *args: Any, flops: float = 0.0) -> Any:
    """The default :data:`Runner`: ``fn(*args)`` in a thread."""
    del flops
    return await asyncio.to_thread(fn, *args)


def _concat(pieces: Sequence[np.ndarray]) -> np.ndarray:
    """Member slices joined along dim 1; empty slices (members with no units) are skipped."""
    parts = [p for p in pieces if p.size]
    if not parts:
        raise ModelError("no member produced any output units")
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def _sum(parts: Sequence[np.ndarray | None]) -> np.ndarray:
    """Partial input gradients of one slice summed across members (empty = no contribution)."""
    real = [p for p in parts if p is not None and p.size]
    if not real:
        return np.empty((0,), np.float32)
    total = np.array(real[0], dtype=np.float32)
    for p in real[1:]:
        if p.shape != total.shape:
            raise ModelError(f"partial gradient of shape {p.shape}, expected {total.shape}")
        total += p
    return total
