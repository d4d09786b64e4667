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

The result is, up to float rounding, the loss, logits and gradients one process computes on the
same batch (tested). A member holds only its parameter slices and, for the backward pass, the
whole input of every stage and its own slice of every output. Gradients leave as shards
``(param, start, stop)`` along dim 0, which is how the parameter server takes them.

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


@dataclass(slots=True)
class MeshStep:
    """One member's result of one step."""

    loss: float
    logits: np.ndarray
    """The whole logits of the batch (every member has them)."""
    grads: dict[str, tuple[int, int, np.ndarray]]
    """``param -> (start, stop, gradient of rows [start, stop))``: this member's shards."""
    compute_s: float = 0.0
    """Seconds spent computing (not waiting for other members)."""
    layer_s: dict[str, float] = field(default_factory=dict)
    """Compute seconds per layer, forward and backward (the loss counts to the last layer)."""


@dataclass(slots=True)
class _Layer:
    kind: str  # "conv" | "linear"
    options: dict[str, Any]
    pre: list[nn.Module]
    tail: list[nn.Module]
    start: int
    stop: int
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    saved: tuple[torch.Tensor, torch.Tensor] | None = None
    """(input leaf, output slice) of the step in progress, for the backward pass."""


class MeshMember:
    """Member ``index`` of a cluster dividing ``model_spec`` by ``counts`` (layer -> units per member).

    Raises ModelError if the division does not match the model (a layer missing, counts that do
    not add up to the layer's units, a negative count) or the model cannot be divided.
    """

    def __init__(self, model_spec: str, counts: Mapping[str, Sequence[int]], index: int, *, seed: int = 0) -> None:
        model = models.build_model(model_spec, seed=seed)
        stages = models.mesh_stages(model)
        modules = dict(model.named_children())
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
        self.counts = {name: tuple(int(n) for n in counts[name]) for name in names}
        self.layers: dict[str, _Layer] = {}
        for stage in stages:
            module = modules[stage.layer]
            units = module.out_channels if isinstance(module, nn.Conv2d) else module.out_features
            c = self.counts[stage.layer]
            if any(n < 0 for n in c) or sum(c) != units:
                raise ModelError(f"division of {stage.layer} is {list(c)}: must be >= 0 and add up to {units}")
            start, stop = slices(c)[index]
            if isinstance(module, nn.Conv2d):
                if module.groups != 1:
                    raise ModelError(f"{stage.layer}: grouped convolutions cannot be divided")
                kind, options = "conv", {"stride": module.stride, "padding": module.padding,
                                         "dilation": module.dilation}
            else:
                kind, options = "linear", {}
            self.layers[stage.layer] = _Layer(kind, options, [modules[n] for n in stage.pre],
                                              [modules[n] for n in stage.tail], start, stop)
        self.order = names
        self.version = -1
        self._macs = {c.name: c.macs_per_unit for c in models.measure_layers(model_spec)}
        self._row_params = {name: sum(int(p[0].numel()) for p in modules[name].parameters()) for name in names}
        """Forward multiply-accumulates per output unit and sample, by layer."""

    # ------------------------------------------------------------------ parameters
    def shards(self) -> list[tuple[str, int, int]]:
        """``(param, start, stop)`` of every parameter slice this member holds (non-empty ones)."""
        out = []
        for name in self.order:
            layer = self.layers[name]
            if layer.stop > layer.start:
                out += [(f"{name}.weight", layer.start, layer.stop), (f"{name}.bias", layer.start, layer.stop)]
        return out

    def rows(self) -> dict[str, tuple[int, int]]:
        """``param -> (start, stop)``: the rows of every parameter this member trains (empty ranges
        for layers it has no unit of), what its model view keeps."""
        return {f"{name}.{part}": (layer.start, layer.stop) for name, layer in self.layers.items()
                for part in ("weight", "bias")}

    def load(self, params: Mapping[str, np.ndarray], version: int) -> None:
        """Take this member's rows of model ``version``: from whole parameters, or from arrays of
        exactly its rows (a view restricted to ``rows()``)."""
        for name in self.order:
            layer = self.layers[name]
            for part in ("weight", "bias"):
                array = np.asarray(params[f"{name}.{part}"], dtype=np.float32)
                units, own = sum(self.counts[name]), layer.stop - layer.start
                if array.shape[:1] == (units,):
                    rows = array[layer.start:layer.stop]
                elif array.shape[:1] == (own,):
                    rows = array
                else:
                    raise ModelError(f"{name}.{part} has shape {array.shape}; the division has {units} units, "
                                     f"this member {own}")
                setattr(layer, part, torch.tensor(rows, dtype=torch.float32).requires_grad_(True))
        self.version = version

    def _flops(self, name: str, batch: int) -> float:
        """Training FLOPs of this member's units of ``name`` for ``batch`` samples (forward a third)."""
        layer = self.layers[name]
        return float(costs.FLOPS_PER_MAC * (layer.stop - layer.start) * self._macs[name] * batch)

    def flops_per_sample(self) -> float:
        """Training FLOPs of this member's units for one sample (``costs.FLOPS_PER_MAC`` per MAC)."""
        return sum(self._flops(name, 1) for name in self.order)

    @property
    def param_count(self) -> int:
        """Parameters this member holds (its rows of every weight and bias)."""
        return sum((layer.stop - layer.start) * self._row_params[name] for name, layer in self.layers.items())

    # ------------------------------------------------------------------ one step
    async def step(self, step: int, x: np.ndarray, y: np.ndarray, exchange: Exchange,
                   run: Runner | None = None) -> MeshStep:
        """Forward, loss and backward of one batch with the other members; this member's gradient shards."""
        if self.version < 0:
            raise ModelError("no parameters loaded")
        run = run or in_thread
        busy = dict.fromkeys(self.order, 0.0)
        batch = len(x)
        act = np.asarray(x, dtype=np.float32)
        for s, name in enumerate(self.order):
            piece, took = await run(self._forward, name, act, s > 0, flops=self._flops(name, batch) / 3)
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
        return MeshStep(loss=loss, logits=logits, grads=grads, compute_s=sum(busy.values()), layer_s=busy)

    def _forward(self, name: str, act: np.ndarray, needs_grad: bool) -> tuple[np.ndarray, float]:
        started = time.perf_counter()
        layer = self.layers[name]
        x = torch.from_numpy(np.ascontiguousarray(act)).requires_grad_(needs_grad)
        if layer.stop == layer.start:
            layer.saved = None
            return np.empty((x.shape[0], 0), np.float32), time.perf_counter() - started
        h = x
        for module in layer.pre:
            h = module(h)
        assert layer.weight is not None and layer.bias is not None
        if layer.kind == "conv":
            out = F.conv2d(h, layer.weight, layer.bias, **layer.options)
        else:
            out = F.linear(h, layer.weight, layer.bias)
        for module in layer.tail:
            out = module(out)
        layer.saved = (x, out)
        return out.detach().numpy(), time.perf_counter() - started

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
        started = time.perf_counter()
        layer = self.layers[name]
        if layer.saved is None:
            return None, {}, time.perf_counter() - started
        x, out = layer.saved
        layer.saved = None
        assert layer.weight is not None and layer.bias is not None
        layer.weight.grad = layer.bias.grad = None
        torch.autograd.backward([out], [torch.from_numpy(np.ascontiguousarray(grad, dtype=np.float32))])
        assert layer.weight.grad is not None and layer.bias.grad is not None
        shards = {f"{name}.weight": (layer.start, layer.stop, layer.weight.grad.numpy().copy()),
                  f"{name}.bias": (layer.start, layer.stop, layer.bias.grad.numpy().copy())}
        partial = x.grad.numpy() if x.grad is not None else None
        return partial, shards, time.perf_counter() - started


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
