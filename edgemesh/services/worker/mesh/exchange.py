"""How the members of a model-parallel cluster trade slices within a step: in one process
(:class:`LocalHub`, tests and benchmarks) or over MQTT (:class:`BusExchange`, between devices)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgemesh.common.bus import Bus
from edgemesh.common.errors import ModelError, WireError
from edgemesh.common.messages import MeshSlice
from edgemesh.common.topics import Topics
from edgemesh.common.wire.half import from_half, to_half
from edgemesh.common.wire.tensors import Tensor
from edgemesh.services.worker.mesh.member import Batch, Exchange

MAILBOX_STEPS = 3
"""Steps a member keeps slices for (its own and the ones right after): a bound on memory."""


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

    async def inputs(self, step: int, owner: int, batch: Batch | None) -> Batch:
        key = (step, "", "input")
        event = self.hub._events.setdefault(key, asyncio.Event())
        if self.index == owner:
            assert batch is not None, "the owner of a step brings its batch"
            self.hub._slots.setdefault(key, {})[owner] = batch
            event.set()
            return batch
        await event.wait()
        got: Batch = self.hub._slots[key][owner]
        return got


class MeshTimeout(ModelError):
    """A member's slice did not arrive in time: the step is abandoned (a member left or lags)."""


class BusExchange:
    """An :class:`Exchange` over MQTT ``mesh/{cluster}/{layer}/{phase}/{device}`` topics.

    The worker feeds every received :class:`MeshSlice` to :meth:`deliver`. Members with no units
    in a layer send nothing for it and are not waited for: the division says who has what. The backward
    partials of a residual block's first layer also come from the holders of its last layer (``skips``:
    first layer -> last layer), who send the skip connection's part of them. A step's
    batch comes from its owner as the first layer's ``input`` slice, checked against the model's
    ``input_shape`` and ``classes`` (0: not checked).
    """

    def __init__(self, bus: Bus, topics: Topics, *, cluster: str, device: str, members: Sequence[str],
                 counts: Mapping[str, Sequence[int]], order: Sequence[str], plan_version: int,
                 timeout_s: float, dtype: str = "float32", input_shape: Sequence[int] = (),
                 classes: int = 0, skips: Mapping[str, str] | None = None) -> None:
        self.bus, self.topics = bus, topics
        self.cluster, self.device = cluster, device
        self.members = tuple(members)
        self.index = self.members.index(device)
        self.counts = {k: tuple(v) for k, v in counts.items()}
        self.previous = {order[i]: order[i - 1] for i in range(1, len(order))}
        self.first = order[0]
        self.skips = dict(skips or {})
        self.input_shape = tuple(int(d) for d in input_shape)
        self.classes = classes
        self.owner = -1
        """The member whose data give the current step's batch (-1: none, every member draws it)."""
        self.plan_version = plan_version
        self.timeout_s = timeout_s
        self.dtype = np.dtype(dtype)
        self.step = 0
        self.batch = 0
        self.aborted = ""
        self._box: dict[tuple[int, str, str], dict[int, np.ndarray]] = {}
        self._events: dict[tuple[int, str, str], asyncio.Event] = {}
        self._labels: dict[tuple[int, int], np.ndarray] = {}
        """(step, sender) -> the labels of an input slice (beside its inputs in the mailbox)."""
        self.bytes_sent = 0
        self.layer_bytes: dict[str, list[int]] = {}
        """``layer -> [sent, received]`` tensor bytes of the current step's exchanges of each layer: its
        forward all-gather and the backward reduce-scatter of its output gradient (the next layer's
        input gradient), both sized by the member's units of it, as the cost model charges them. Over
        one link, messages of different layers overlap in time; their bytes say which layer used it."""

    def begin(self, step: int, batch: int, owner: int = -1) -> None:
        """Start ``step`` on ``batch`` samples (0: not known until member ``owner``'s input slice arrives): slices
        of earlier steps are dropped, later ones kept."""
        self.step, self.batch, self.owner = step, batch, owner
        self.layer_bytes = {}
        for key in [k for k in self._box if k[0] < step]:
            self._box.pop(key, None)
            self._events.pop(key, None)
        for old in [k for k in self._labels if k[0] < step]:
            del self._labels[old]

    def abort(self, reason: str) -> None:
        """End the step in progress and every later wait at once (a new plan replaced this one)."""
        self.aborted = reason
        for event in self._events.values():
            event.set()

    def deliver(self, msg: MeshSlice, sent_by: str) -> bool:
        """Take a slice that device ``sent_by`` (its topic's last level) published; False (and dropped) if it is
        not for this cluster, plan or step. A slice must come from the member it names."""
        if msg.cluster != self.cluster or msg.plan_version != self.plan_version or msg.step < self.step:
            return False
        if msg.sender == self.index or msg.sender >= len(self.members) or msg.layer not in self.counts:
            raise WireError(f"mesh slice from member {msg.sender} of {len(self.members)} for {msg.layer}", "shape")
        if self.members[msg.sender] != sent_by:
            raise WireError(f"{sent_by} sent a slice as member {msg.sender} ({self.members[msg.sender]})", "topic")
        key = (msg.step, msg.layer, msg.phase)
        if len({k[0] for k in self._box} | {msg.step}) > MAILBOX_STEPS:
            return False  # far ahead of this member: it will be resent, or the step abandoned
        if msg.phase == "input":
            return self._take_input(msg)
        if msg.phase == "bwd" and msg.layer not in self.previous:
            raise WireError(f"backward slice for the first layer {msg.layer}", "shape")
        units = self.counts[msg.layer][msg.sender] if msg.phase == "fwd" else \
            self.counts[self.previous[msg.layer]][self.index]
        shape = msg.tensor.shape
        if len(shape) < 2 or shape[1] != units or (msg.step == self.step and self.batch and shape[0] != self.batch):
            raise WireError(f"{msg.phase} slice of {msg.layer} from member {msg.sender} has shape {shape}; "
                            f"expected ({self.batch}, {units}, ...)", "shape")
        raw = msg.tensor.to_numpy()
        values = from_half(raw) if raw.dtype.itemsize == 2 else raw.astype(np.float32)
        if not np.isfinite(values).all():
            raise WireError(f"{msg.phase} slice of {msg.layer} from member {msg.sender} is not finite", "nan")
        self._box.setdefault(key, {})[msg.sender] = values
        self._events.setdefault(key, asyncio.Event()).set()
        return True

    def _take_input(self, msg: MeshSlice) -> bool:
        """Keep a step's batch: the first layer's inputs, of the model's input shape, and labels of its classes,
        one per sample, from the step's owner."""
        if msg.layer != self.first:
            raise WireError(f"input slice for {msg.layer}, not the first layer {self.first}", "shape")
        if msg.step == self.step and msg.sender != self.owner:
            raise WireError(f"input slice of step {msg.step} from member {msg.sender}, not its owner {self.owner}",
                            "owner")
        shape, labels = msg.tensor.shape, msg.labels
        if labels is None or not shape or shape[0] < 1 or tuple(labels.shape) != (shape[0],) or (
                self.input_shape and tuple(shape[1:]) != self.input_shape):
            raise WireError(f"input slice of shape {shape} with labels {labels and labels.shape}; expected "
                            f"(batch, {', '.join(map(str, self.input_shape))}) and (batch,)", "shape")
        y = labels.to_numpy().astype(np.int64)
        if self.classes and (int(y.min()) < 0 or int(y.max()) >= self.classes):
            raise WireError(f"input slice's labels lie outside [0, {self.classes})", "label")
        raw = msg.tensor.to_numpy()
        values = from_half(raw) if raw.dtype.itemsize == 2 else raw.astype(np.float32)
        if not np.isfinite(values).all():
            raise WireError(f"input slice of step {msg.step} from member {msg.sender} is not finite", "nan")
        self._box.setdefault((msg.step, msg.layer, msg.phase), {})[msg.sender] = values
        self._labels[(msg.step, msg.sender)] = y
        self._events.setdefault((msg.step, msg.layer, msg.phase), asyncio.Event()).set()
        return True

    def _senders(self, layer: str, phase: str) -> list[int]:
        """Members who send this member something for ``layer`` in ``phase``."""
        if phase == "input":
            return [self.owner] if self.owner != self.index else []
        if phase == "fwd":
            return [j for j, n in enumerate(self.counts[layer]) if n and j != self.index]
        if self.counts[self.previous[layer]][self.index] == 0:
            return []  # this member holds none of the previous layer: nothing to receive
        senders = [self.counts[layer], *([self.counts[self.skips[layer]]] if layer in self.skips else [])]
        return [j for j in range(len(self.members)) if j != self.index and any(c[j] for c in senders)]

    def _count(self, layer: str, phase: str, direction: int, nbytes: int) -> None:
        owner = self.previous[layer] if phase == "bwd" else layer
        self.layer_bytes.setdefault(owner, [0, 0])[direction] += nbytes

    def _wire(self, array: np.ndarray) -> np.ndarray:
        return to_half(array) if self.dtype.itemsize == 2 else np.ascontiguousarray(array, dtype=self.dtype)

    async def _publish(self, layer: str, phase: str, to: str, array: np.ndarray,
                       labels: np.ndarray | None = None) -> None:
        wire = self._wire(array)
        self._count(layer, phase, 0, wire.nbytes)
        tensor = Tensor.from_numpy(wire)
        msg = MeshSlice(cluster=self.cluster, plan_version=self.plan_version, step=self.step, layer=layer,
                        phase=phase, sender=self.index, tensor=tensor,  # type: ignore[arg-type]
                        labels=None if labels is None else Tensor.from_numpy(labels.astype(np.int64)))
        topic = self.topics.mesh_backward(self.cluster, layer, to, self.device) if phase == "bwd" else \
            self.topics.mesh(self.cluster, layer, phase, self.device)
        self.bytes_sent += await self.bus.publish(topic, msg)

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

    async def inputs(self, step: int, owner: int, batch: Batch | None) -> Batch:
        """The step's batch: the owner sends its own (and computes on it as the others receive it, rounded to
        ``dtype``); the others wait for it. Slices that came before it with another batch size are dropped."""
        if owner == self.index:
            assert batch is not None, "the owner of a step brings its batch"
            x, y = batch
            await self._publish(self.first, "input", self.device, x, np.asarray(y))
            sent = self._wire(x)
            x = from_half(sent) if sent.dtype.itemsize == 2 else sent.astype(np.float32)
        else:
            x = (await self._collect(step, self.first, "input"))[owner]
            y = self._labels.pop((step, owner))
        self.batch = len(y)
        for key, box in self._box.items():
            if key[0] == step:
                for sender in [j for j, a in box.items() if a.shape[0] != self.batch]:
                    del box[sender]
        return x, y

    async def scatter(self, step: int, layer: str, pieces: Sequence[np.ndarray]) -> list[np.ndarray]:
        previous = self.counts[self.previous[layer]]
        sends = [self._publish(layer, "bwd", self.members[j], p) for j, p in enumerate(pieces)
                 if j != self.index and p.size and previous[j]]
        await asyncio.gather(*sends)
        got = await self._collect(step, layer, "bwd")
        empty = np.empty((0,), np.float32)
        return [got.get(j, empty) for j in range(len(self.members))]
