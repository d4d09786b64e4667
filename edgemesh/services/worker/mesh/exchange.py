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
from edgemesh.common.half import from_half, to_half
from edgemesh.common.messages import MeshSlice
from edgemesh.common.tensor import Tensor
from edgemesh.common.topics import Topics
from edgemesh.services.worker.mesh.member import Exchange

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
        if msg.phase == "bwd" and msg.layer not in self.previous:
            raise WireError(f"backward slice for the first layer {msg.layer}", "shape")
        units = self.counts[msg.layer][msg.sender] if msg.phase == "fwd" else \
            self.counts[self.previous[msg.layer]][self.index]
        shape = msg.tensor.shape
        if len(shape) < 2 or shape[1] != units or (msg.step == self.step and shape[0] != self.batch):
            raise WireError(f"{msg.phase} slice of {msg.layer} from member {msg.sender} has shape {shape}; "
                            f"expected ({self.batch}, {units}, ...)", "shape")
        raw = msg.tensor.to_numpy()
        values = from_half(raw) if raw.dtype.itemsize == 2 else raw.astype(np.float32)
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
        wire = to_half(array) if self.dtype.itemsize == 2 else np.ascontiguousarray(array, dtype=self.dtype)
        self._count(layer, phase, 0, wire.nbytes)
        tensor = Tensor.from_numpy(wire)
        msg = MeshSlice(cluster=self.cluster, plan_version=self.plan_version, step=self.step, layer=layer,
                        phase=phase, sender=self.index, tensor=tensor)  # type: ignore[arg-type]
        topic = self.topics.mesh(self.cluster, layer, phase, self.device) if phase == "fwd" else \
            self.topics.mesh_backward(self.cluster, layer, to, self.device)
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

    async def scatter(self, step: int, layer: str, pieces: Sequence[np.ndarray]) -> list[np.ndarray]:
        previous = self.counts[self.previous[layer]]
        sends = [self._publish(layer, "bwd", self.members[j], p) for j, p in enumerate(pieces)
                 if j != self.index and p.size and previous[j]]
        await asyncio.gather(*sends)
        got = await self._collect(step, layer, "bwd")
        empty = np.empty((0,), np.float32)
        return [got.get(j, empty) for j in range(len(self.members))]
