"""A model-parallel cluster on its members' own data (docs/mesh.md, "Whose data"): each step's batch is one member's,
the members taking turns, and it reaches the others with the first layer's exchange; what arrives is checked."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from helpers import UNEVEN, assert_matches_one_process

from edgemesh.common import models
from edgemesh.common.data import batch_at
from edgemesh.common.data.dataset import Dataset
from edgemesh.common.errors import WireError
from edgemesh.common.messages import MeshSlice
from edgemesh.common.topics import Topics
from edgemesh.common.wire.tensors import Tensor
from edgemesh.services.worker.mesh.exchange import BusExchange, LocalHub
from edgemesh.services.worker.mesh.member import MeshMember, owner_of

SPEC = "digits-cnn"
STEPS = 6


def test_members_take_turns_and_one_without_data_never_owns_a_step() -> None:
    assert [owner_of(s, [True, True, True]) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [owner_of(s, [True, False, True]) for s in range(6)] == [0, 2, 2, 0, 2, 2]
    assert owner_of(7, [False, False, False]) is None


def local_data(seed: int, classes: list[int]) -> Dataset:
    """A member's own samples: random inputs of ``SPEC``'s shape, labels of ``classes`` alone."""
    rng = np.random.default_rng(seed)
    shape = models.get_spec(SPEC).input_shape
    return Dataset(f"member-{seed}", rng.random((40, *shape), dtype=np.float32),
                   rng.choice(classes, 40).astype(np.int64), 10)


async def test_each_step_three_members_compute_what_one_process_does_on_the_owners_batch() -> None:
    data = [local_data(0, [0, 1, 2]), local_data(1, [3, 4, 5, 6]), local_data(2, [7, 8, 9])]
    hub = LocalHub(3)
    members = [MeshMember(SPEC, UNEVEN[SPEC], i, seed=4) for i in range(3)]
    model = models.build_model(SPEC, seed=4)
    owners = []
    for step in range(1, STEPS + 1):
        params = models.get_params(model)
        for m in members:
            m.load(params, version=step)
        owner = owner_of(step, [len(d) > 0 for d in data])
        assert owner is not None
        owners.append(owner)
        mine = batch_at(data[owner], 8, seed=9, step=step)

        async def one(i: int, m: MeshMember, step: int = step, owner: int = owner, mine: tuple = mine) -> object:
            x, y = await hub.member(i).inputs(step, owner, mine if i == owner else None)
            return await m.step(step, x, y, hub.member(i))

        results = await asyncio.gather(*(one(i, m) for i, m in enumerate(members)))
        x, y = mine
        loss, grads = models.compute_gradients(model, x, y)
        with torch.no_grad():
            logits = model(torch.tensor(x)).numpy()
        assert_matches_one_process(list(results), loss, logits, grads)
        assert set(y.tolist()) <= set(data[owner].y.tolist())  # the owner's classes alone
        models.set_params(model, {k: v - 0.05 * grads[k] if k in grads else v for k, v in params.items()})
    assert owners == [1, 2, 0, 1, 2, 0]


class Quiet:
    """A bus that only counts what is published."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, MeshSlice]] = []

    async def publish(self, topic: str, msg: MeshSlice, **_: object) -> int:
        self.sent.append((topic, msg))
        return 1


def exchange(device: str, bus: Quiet | None = None) -> BusExchange:
    spec = models.get_spec(SPEC)
    ex = BusExchange(bus or Quiet(), Topics("j"), cluster="c", device=device, members=["a", "b", "c"],  # type: ignore[arg-type]
                     counts=UNEVEN[SPEC], order=list(UNEVEN[SPEC]), plan_version=1, timeout_s=5,
                     input_shape=spec.input_shape, classes=spec.num_classes)
    return ex


def input_slice(x: np.ndarray, y: np.ndarray, *, sender: int = 1, layer: str = "conv1") -> MeshSlice:
    return MeshSlice(cluster="c", plan_version=1, step=5, layer=layer, phase="input",
                     sender=sender, tensor=Tensor.from_numpy(x), labels=Tensor.from_numpy(y))


async def test_the_owner_sends_its_batch_on_the_first_layers_input_topic_and_the_others_take_it() -> None:
    bus = Quiet()
    owner, other = exchange("b", bus), exchange("c")
    x = np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)
    y = np.array([1, 2, 3, 4])
    for ex in (owner, other):
        ex.begin(5, 4 if ex is owner else 0, owner=1)
    got = await owner.inputs(5, 1, (x, y))
    (topic, sent), = bus.sent
    assert topic == Topics("j").mesh("c", "conv1", "input", "b") and sent.phase == "input"
    assert other.deliver(sent, "b")
    x2, y2 = await other.inputs(5, 1, None)
    np.testing.assert_array_equal(x2, got[0])
    np.testing.assert_array_equal(y2, y)
    assert other.batch == 4


@pytest.mark.parametrize("x, y, sender, layer, reason", [
    (np.zeros((4, 1, 8, 7), np.float32), np.arange(4), 1, "conv1", "shape"),  # not the model's input shape
    (np.zeros((4, 1, 8, 8), np.float32), np.arange(3), 1, "conv1", "shape"),  # a label missing
    (np.zeros((4, 1, 8, 8), np.float32), np.array([0, 1, 2, 10]), 1, "conv1", "label"),  # no class 10
    (np.full((4, 1, 8, 8), np.nan, np.float32), np.arange(4), 1, "conv1", "nan"),
    (np.zeros((4, 1, 8, 8), np.float32), np.arange(4), 0, "conv1", "owner"),  # not the step's owner
    (np.zeros((4, 1, 8, 8), np.float32), np.arange(4), 1, "conv2", "shape"),  # not the first layer
])
def test_an_input_slice_that_does_not_fit_is_refused(x: np.ndarray, y: np.ndarray, sender: int, layer: str,
                                                      reason: str) -> None:
    ex = exchange("c")
    ex.begin(5, 0, owner=1)
    with pytest.raises(WireError) as caught:
        ex.deliver(input_slice(x, y, sender=sender, layer=layer), "ab"[sender])
    assert caught.value.reason == reason


def test_labels_travel_with_input_slices_only() -> None:
    with pytest.raises(ValueError, match="labels"):
        MeshSlice(cluster="c", plan_version=1, step=5, layer="conv1", phase="fwd", sender=1,
                  tensor=Tensor.from_numpy(np.zeros((2, 3), np.float32)),
                  labels=Tensor.from_numpy(np.arange(2))).validate()
