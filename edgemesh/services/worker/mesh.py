"""Model parallelism inside a cluster (DESIGN.md §4): one member's slice of every conv and linear layer.

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
blocks; communication goes through an :class:`Exchange`: :class:`LocalHub` in one process,
the worker's MQTT exchange on ``mesh/...`` topics between devices.
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
from edgemesh.common.bus import Bus
from edgemesh.common.costs import slices
from edgemesh.common.errors import ModelError, WireError
from edgemesh.common.messages import MeshSlice
from edgemesh.common.topics import Topics
from edgemesh.common.wire import Tensor

Runner = Callable[..., Awaitable[Any]]
"""``run(fn, *args, flops=...)``: call ``fn(*args)`` off the event loop; ``flops`` is the training
work of the call, for an emulated device to hold it to its board's speed."""
MAILBOX_STEPS = 3
"""Steps a member keeps slices for (its own and the ones right after): a bound on memory."""


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


@dataclass
class LocalHub:
    """An :class:`Exchange` for ``members`` members of one process (tests, benchmarks)."""

    members: int
    _slots: dict[tuple[int, str, str], dict[int, Any]] = field(default_factory=dict)
    _events: dict[tuple[int, str, str], asyncio.Event] = field(default_factory=dict)

    def member(self, index: int) -> Exchange:
        return _LocalMember(self, index)

    async def _trade(self, key: tuple[int, str, str], index: int, value: Any) -> dict[int, Any]:
        slot = self._slots.setdefault(key, {})
        event = self._events.setdefault(key, asyncio.Event())
        slot[index] = value
        if len(slot) == self.members:
            event.set()
        await event.wait()
        return slot


@dataclass
class _LocalMember:
    hub: LocalHub
    index: int

    async def gather(self, step: int, layer: str, piece: np.ndarray) -> list[np.ndarray]:
        slot = await self.hub._trade((step, layer, "fwd"), self.index, piece)
        return [slot[j] for j in range(self.hub.members)]

    async def scatter(self, step: int, layer: str, pieces: Sequence[np.ndarray]) -> list[np.ndarray]:
        slot = await self.hub._trade((step, layer, "bwd"), self.index, list(pieces))
        return [slot[j][self.index] for j in range(self.hub.members)]


class MeshTimeout(ModelError):
    """A member's slice did not arrive in time: the step is abandoned (a member left or lags)."""


class BusExchange:
    """An :class:`Exchange` over MQTT ``mesh/{cluster}/{layer}/{phase}/{device}`` topics.

    The worker feeds every received :class:`MeshSlice` to :meth:`deliver`. Members with no units
    in a layer send nothing for it and are not waited for: the division says who has what.
    """

    def __init__(self, bus: Bus, topics: Topics, *, cluster: str, device: str, members: Sequence[str],
                 counts: Mapping[str, Sequence[int]], order: Sequence[str], plan_version: int,
                 timeout_s: float, dtype: str = "float32") -> None:
        self.bus, self.topics = bus, topics
        self.cluster, self.device = cluster, device
        self.members = tuple(members)
        self.index = self.members.index(device)
        self.counts = {k: tuple(v) for k, v in counts.items()}
        self.previous = {order[i]: order[i - 1] for i in range(1, len(order))}
        self.plan_version = plan_version
        self.timeout_s = timeout_s
        self.dtype = np.dtype(dtype)
        self.step = 0
        self.batch = 0
        self.aborted = ""
        self._box: dict[tuple[int, str, str], dict[int, np.ndarray]] = {}
        self._events: dict[tuple[int, str, str], asyncio.Event] = {}
        self.bytes_sent = 0
        self.layer_bytes: dict[str, list[int]] = {}
        """``layer -> [sent, received]`` tensor bytes of the current step's exchanges of each layer: its
        forward all-gather and the backward reduce-scatter of its output gradient (the next layer's
        input gradient), both sized by the member's units of it, as the cost model charges them. Over
        one link, messages of different layers overlap in time; their bytes say which layer used it."""

    def begin(self, step: int, batch: int) -> None:
        """Start ``step`` on ``batch`` samples: slices of earlier steps are dropped, later ones kept."""
        self.step, self.batch = step, batch
        self.layer_bytes = {}
        for key in [k for k in self._box if k[0] < step]:
            self._box.pop(key, None)
            self._events.pop(key, None)

    def abort(self, reason: str) -> None:
        """End the step in progress and every later wait at once (a new plan replaced this one)."""
        self.aborted = reason
        for event in self._events.values():
            event.set()

    def deliver(self, msg: MeshSlice) -> bool:
        """Take a slice from the bus; False (and dropped) if it is not for this cluster, plan or step."""
        if msg.cluster != self.cluster or msg.plan_version != self.plan_version or msg.step < self.step:
            return False
        if msg.sender == self.index or msg.sender >= len(self.members) or msg.layer not in self.counts:
            raise WireError(f"mesh slice from member {msg.sender} of {len(self.members)} for {msg.layer}", "shape")
        key = (msg.step, msg.layer, msg.phase)
        if len({k[0] for k in self._box} | {msg.step}) > MAILBOX_STEPS:
            return False  # far ahead of this member: it will be resent, or the step abandoned
        if msg.phase == "bwd" and msg.layer not in self.previous:
            raise WireError(f"backward slice for the first layer {msg.layer}", "shape")
        units = self.counts[msg.layer][msg.sender] if msg.phase == "fwd" else \
            self.counts[self.previous[msg.layer]][self.index]
        shape = msg.tensor.shape
        if len(shape) < 2 or shape[1] != units or (msg.step == self.step and shape[0] != self.batch):
            raise WireError(f"{msg.phase} slice of {msg.layer} from member {msg.sender} has shape {shape}; "
                            f"expected ({self.batch}, {units}, ...)", "shape")
        values = msg.tensor.to_numpy().astype(np.float32)
        if not np.isfinite(values).all():
            raise WireError(f"{msg.phase} slice of {msg.layer} from member {msg.sender} is not finite", "nan")
        self._box.setdefault(key, {})[msg.sender] = values
        self._events.setdefault(key, asyncio.Event()).set()
        return True

    def _senders(self, layer: str, phase: str) -> list[int]:
        """Members who send this member something for ``layer`` in ``phase``."""
        if phase == "fwd":
            return [j for j, n in enumerate(self.counts[layer]) if n and j != self.index]
        if self.counts[self.previous[layer]][self.index] == 0:
            return []  # this member holds none of the previous layer: nothing to receive
        return [j for j, n in enumerate(self.counts[layer]) if n and j != self.index]

    def _count(self, layer: str, phase: str, direction: int, nbytes: int) -> None:
        owner = layer if phase == "fwd" else self.previous[layer]
        self.layer_bytes.setdefault(owner, [0, 0])[direction] += nbytes

    async def _publish(self, layer: str, phase: str, to: str, array: np.ndarray) -> None:
        wire = np.ascontiguousarray(array, dtype=self.dtype)
        self._count(layer, phase, 0, wire.nbytes)
        tensor = Tensor.from_numpy(wire)
        msg = MeshSlice(cluster=self.cluster, plan_version=self.plan_version, step=self.step, layer=layer,
                        phase=phase, sender=self.index, tensor=tensor)  # type: ignore[arg-type]
        self.bytes_sent += await self.bus.publish(self.topics.mesh(self.cluster, layer, phase, to), msg)

    async def _collect(self, step: int, layer: str, phase: str) -> dict[int, np.ndarray]:
        key = (step, layer, phase)
        want = set(self._senders(layer, phase))
        try:
            async with asyncio.timeout(self.timeout_s):
                while not want <= set(self._box.get(key, {})):
                    if self.aborted:
                        raise MeshTimeout(f"step {step}: {self.aborted}")
                    event = self._events.setdefault(key, asyncio.Event())
                    event.clear()
                    if want <= set(self._box.get(key, {})):
                        break
                    await event.wait()
        except TimeoutError:
            missing = sorted(want - set(self._box.get(key, {})))
            raise MeshTimeout(f"step {step}: no {phase} slice of {layer} from "
                              f"{', '.join(self.members[j] for j in missing)} within {self.timeout_s:g}s") from None
        got = self._box.pop(key, {})
        self._events.pop(key, None)
        self._count(layer, phase, 1, sum(a.size for a in got.values()) * self.dtype.itemsize)
        return got

    async def gather(self, step: int, layer: str, piece: np.ndarray) -> list[np.ndarray]:
        if piece.size:
            await self._publish(layer, "fwd", self.device, piece)
        got = await self._collect(step, layer, "fwd")
        got[self.index] = piece
        empty = np.empty((0,), np.float32)
        return [got.get(j, empty) for j in range(len(self.members))]

    async def scatter(self, step: int, layer: str, pieces: Sequence[np.ndarray]) -> list[np.ndarray]:
        previous = self.counts[self.previous[layer]]
        sends = [self._publish(layer, "bwd", self.members[j], p) for j, p in enumerate(pieces)
                 if j != self.index and p.size and previous[j]]
        await asyncio.gather(*sends)
        got = await self._collect(step, layer, "bwd")
        empty = np.empty((0,), np.float32)
        return [got.get(j, empty) for j in range(len(self.members))]
