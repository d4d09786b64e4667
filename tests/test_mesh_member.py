"""A model-parallel member's compute (pure): members of one cluster, trading slices in one process,
compute what one process does; the models and divisions a member refuses; the batch members share."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import numpy as np
import pytest
from helpers import UNEVEN, assert_matches_one_process, reference
from torch import nn

from edgemesh.common import costs, models
from edgemesh.common.costs import slices
from edgemesh.common.data import batch_at, synthetic_cifar
from edgemesh.common.errors import ModelError
from edgemesh.common.jobs import check_model, parse_job
from edgemesh.common.models.lean import Residual
from edgemesh.services.worker.mesh.exchange import LocalHub
from edgemesh.services.worker.mesh.member import MeshMember


@pytest.mark.parametrize("spec", sorted(UNEVEN))
async def test_three_uneven_members_compute_what_one_process_does(spec: str) -> None:
    params, x, y, loss, logits, grads = reference(spec, seed=3, batch=16)
    hub = LocalHub(3)
    members = [MeshMember(spec, UNEVEN[spec], i, seed=3) for i in range(3)]
    for m in members:
        m.load(params, version=0)
    results = await asyncio.gather(*(m.step(1, x, y, hub.member(i)) for i, m in enumerate(members)))
    assert_matches_one_process(list(results), loss, logits, grads)
    # a member holds its slices only
    assert sum(m.param_count for m in members) == costs.cost(spec).params


USER_JOB = """
[job]
name = "user-mesh"
[model]
input_shape = [3, 12, 12]
classes = ["a", "b", "c"]
layers = [{conv2d = 12, kernel = 3, padding = 1}, "relu", {maxpool2d = 2}, {conv2d = 10, kernel = 3}, "tanh",
          {avgpool2d = 2}, "flatten", {linear = 24}, "relu", {linear = 3}]
[data]
format = "image-folder"
path = "x"
mean = [0.4, 0.5, 0.6]
std = [0.2, 0.25, 0.3]
[evaluation]
local_share = 0.2
[planner]
parallelism = "mesh"
"""


async def test_three_uneven_members_compute_what_one_process_does_for_a_users_layer_list() -> None:
    spec = parse_job(USER_JOB)
    check_model(spec)  # registers the model and its figures, as a job's hosts do
    division = {"conv1": (5, 0, 7), "conv2": (1, 6, 3), "fc1": (10, 13, 1), "fc2": (1, 1, 1)}
    assert [la.name for la in costs.layers(spec.model_key)] == list(division)
    params, x, y, loss, logits, grads = reference(spec.model_key, seed=5, batch=12)
    hub = LocalHub(3)
    members = [MeshMember(spec.model_key, division, i, seed=5) for i in range(3)]
    for m in members:
        m.load(params, version=0)
    results = await asyncio.gather(*(m.step(1, x, y, hub.member(i)) for i, m in enumerate(members)))
    assert_matches_one_process(list(results), loss, logits, grads)


def test_layer_figures_match_the_modules() -> None:
    for spec in models.MODEL_SPECS:
        assert models.measure_layers(spec) == costs.layers(spec)


def test_models_that_cannot_be_divided_are_refused() -> None:
    with pytest.raises(ModelError, match="'bn1' .BatchNorm2d that follows no conv"):
        models.mesh_stages(nn.Sequential(OrderedDict(bn1=nn.BatchNorm2d(1), conv1=nn.Conv2d(1, 4, 3))))
    with pytest.raises(ModelError, match="'bn1' .BatchNorm1d that follows no conv"):  # a flatten ended the stage
        models.mesh_stages(nn.Sequential(OrderedDict(conv1=nn.Conv2d(1, 4, 3), flat=nn.Flatten(),
                                                     bn1=nn.BatchNorm1d(16), fc1=nn.Linear(16, 2))))
    with pytest.raises(ModelError, match="'bn1' .BatchNorm2d of 8 features after 'conv1' of 4 units"):
        models.mesh_stages(nn.Sequential(OrderedDict(conv1=nn.Conv2d(1, 4, 3), bn1=nn.BatchNorm2d(8))))
    with pytest.raises(ModelError, match="'2' .AlphaDropout"):
        models.mesh_stages(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.AlphaDropout(0.5), nn.Linear(4, 2)))
    with pytest.raises(ModelError, match="'0' .Conv2d with padding_mode = 'reflect'"):
        models.mesh_stages(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")))
    nested = Residual(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), Residual(nn.Sequential(nn.Conv2d(4, 4, 1)))))
    with pytest.raises(ModelError, match=r"'1.body.1' \(Residual inside a residual block"):
        models.mesh_stages(nn.Sequential(nn.Conv2d(1, 4, 3), nested))
    with pytest.raises(ModelError, match='sequential model .* got a Linear: .* planner.parallelism = "data"'):
        models.mesh_stages(nn.Linear(4, 2))


@pytest.mark.parametrize("counts, match", [
    ({"conv1": (8, 8), "conv2": (16, 16), "fc1": (32, 32)}, "division names layers"),
    ({"conv1": (8, 7), "conv2": (16, 16), "fc1": (32, 32), "fc2": (5, 5)}, "add up to 16"),
    ({"conv1": (17, -1), "conv2": (16, 16), "fc1": (32, 32), "fc2": (5, 5)}, "must be >= 0"),
    ({"conv1": (8, 8), "conv2": (16, 16), "fc1": (32, 32), "fc2": (10,)}, "one count per member"),
])
def test_bad_divisions_are_refused(counts: dict, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        MeshMember("digits-cnn", counts, 0)


def test_slices_are_contiguous_in_member_order() -> None:
    assert slices([3, 0, 2]) == [(0, 3), (3, 3), (3, 5)]


def test_members_draw_the_same_batch_for_a_step_and_other_batches_for_other_steps() -> None:
    train, test = synthetic_cifar(seed=1, train=256, test=64)
    assert train.x.shape == (256, 3, 32, 32) and test.x.shape == (64, 3, 32, 32)
    assert 0.0 <= train.x.min() and train.x.max() <= 1.0 and len(set(train.y.tolist())) > 5
    a, b = batch_at(train, 16, seed=3, step=7), batch_at(train, 16, seed=3, step=7)
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[0], batch_at(train, 16, seed=3, step=8)[0])
    assert batch_at(train, 1000, seed=3, step=1)[0].shape[0] == 256  # at most the whole set
