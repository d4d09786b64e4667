"""The layers of users' CNNs under model parallelism: batch norm divided with its layer's channels, dropout with
a mask the cluster shares, global average pooling, layers without bias, grouped and depthwise convolutions (divided
by whole groups). Three uneven members compute what one process computes (loss, logits, every gradient, the running
statistics' change); the parameter server joins their gradient and buffer rows."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    GIGABIT,
    MASK_STEP,
    assert_buffers_match,
    assert_matches_one_process,
    dev,
    member_part,
    one_process,
    train_together,
)
from torch import nn

from edgemesh.common import costs, models
from edgemesh.common.errors import ModelError
from edgemesh.common.jobs import check_model, parse_job
from edgemesh.common.models.masks import dropout_mask
from edgemesh.services.parameter_server.assembly import Assembly
from edgemesh.services.parameter_server.scheduler import Candidate, Clock
from edgemesh.services.planner.mesh.division import divide_filters
from edgemesh.services.worker.mesh.exchange import LocalHub
from edgemesh.services.worker.mesh.member import MeshMember


def mesh_job(name: str, classes: list[str], layers: str) -> str:
    """A mesh job file of a model of ``layers`` (a TOML array) on 3x8x8 images of ``classes``, as a user writes it."""
    return f"""
[job]
name = "{name}"
[model]
input_shape = [3, 8, 8]
classes = {json.dumps(classes)}
layers = {layers}
[data]
format = "image-folder"
path = "x"
[evaluation]
local_share = 0.2
[planner]
parallelism = "mesh"
"""


CONV_BN = mesh_job("user-bn", ["a", "b", "c"], """[
    {conv2d = 8, kernel = 3, padding = 1}, "batchnorm", "relu", {dropout = 0.3},
    {conv2d = 8, kernel = 3, padding = 1}, "batchnorm", "relu", "globalavgpool", {linear = 3}]""")
"""conv-BN-ReLU-dropout-conv-BN-ReLU-global average pooling-linear, as a user writes it."""
CONV_BN_DIVISION = {"conv1": (5, 2, 1), "conv2": (1, 2, 5), "fc1": (1, 1, 1)}
FLAT_BN = mesh_job("user-bn-flat", ["a", "b", "c", "d"], """[
    {conv2d = 8, kernel = 3, padding = 1, stride = 2}, "batchnorm", "relu", "flatten", {dropout = 0.25},
    {linear = 12}, "batchnorm", "tanh", {dropout = 0.5}, {linear = 4}]""")
"""Batch norm after a linear layer, a dropout before a layer (every member applies the whole mask) and one after."""
FLAT_BN_DIVISION = {"conv1": (5, 0, 3), "fc1": (2, 9, 1), "fc2": (0, 3, 1)}
NO_BIAS = mesh_job("user-no-bias", ["a", "b", "c"], """[
    {conv2d = 8, kernel = 3, padding = 1, bias = false}, "batchnorm", "relu",
    {conv2d = 8, kernel = 3, padding = 1, bias = false}, "batchnorm", "relu", "globalavgpool", {linear = 3}]""")
"""conv(bias=False)-BN-ReLU twice, global average pooling, linear: the usual convolution before batch norm."""
NO_BIAS_DIVISION = {"conv1": (5, 2, 1), "conv2": (1, 2, 5), "fc1": (1, 1, 1)}
MOBILE = mesh_job("user-mobile", ["a", "b", "c", "d"], """[
    {conv2d = 8, kernel = 3, padding = 1, stride = 2, bias = false}, "batchnorm", "relu6",
    {conv2d = 8, kernel = 3, padding = 1, groups = 8, bias = false}, "batchnorm", "relu6",
    {conv2d = 12, kernel = 1, bias = false}, "batchnorm", "relu6",
    {conv2d = 24, kernel = 3, padding = 1, groups = 12, bias = false}, "batchnorm", "relu6",
    {conv2d = 16, kernel = 1, groups = 4, bias = false}, "batchnorm", "relu6", "globalavgpool", {linear = 4}]""")
"""A MobileNet-style depthwise-separable model without residuals: conv-BN-ReLU6, depthwise conv (groups = channels),
pointwise 1x1 conv, then a depthwise conv of two filters a channel (groups of 2) and a grouped 1x1 conv (4 groups
of 4), every conv without bias."""
MOBILE_DIVISION = {"conv1": (5, 2, 1), "conv2": (1, 2, 5), "conv3": (4, 7, 1), "conv4": (14, 2, 8),
                   "conv5": (8, 0, 8), "fc1": (1, 2, 1)}
"""Uneven counts in whole groups: of 1 (conv2), 2 (conv4) and 4 (conv5) filters."""


@pytest.mark.parametrize(("job", "division"), [(CONV_BN, CONV_BN_DIVISION), (FLAT_BN, FLAT_BN_DIVISION),
                                               (NO_BIAS, NO_BIAS_DIVISION), (MOBILE, MOBILE_DIVISION)],
                         ids=["conv-bn", "flat-bn", "no-bias", "mobile"])
async def test_three_uneven_members_compute_what_one_process_does_with_batch_norm_and_dropout(
        job: str, division: dict[str, tuple[int, ...]]) -> None:
    spec = parse_job(job)
    check_model(spec)  # registers the model and its figures, as a job's hosts do
    layers = costs.layers(spec.model_key)
    assert [la.name for la in layers] == list(division)
    params, x, y, update, logits = one_process(spec.model_key, seed=5, batch=12)
    results = await train_together(spec.model_key, division, 5, params, x, y)
    assert_matches_one_process(results, update.loss, logits, update.grads)
    moved = {name: change for name, change in update.buffers.items() if name.split(".")[0].startswith("bn")}
    assert moved and all(change.any() for change in moved.values())
    assert_buffers_match(results, moved)
    # the figures count batch norm's parameters in the members' shares
    assert sum(la.units * la.params_per_unit for la in layers) == costs.cost(spec.model_key).params
    members = [MeshMember(spec.model_key, division, i, seed=5) for i in range(3)]
    assert sum(m.param_count for m in members) == costs.cost(spec.model_key).params


async def test_the_mask_depends_on_the_step_and_a_different_mask_changes_the_result() -> None:
    spec = parse_job(CONV_BN)
    check_model(spec)
    shape = (4, 8, 3, 3)
    a, b = dropout_mask(shape, 0.3, 5, MASK_STEP, "drop1"), dropout_mask(shape, 0.3, 5, MASK_STEP, "drop1")
    assert torch.equal(a, b) and 0 < float(a.mean()) < 1
    assert not torch.equal(a, dropout_mask((4, 8, 3, 3), 0.3, 5, MASK_STEP + 1, "drop1"))
    assert not torch.equal(a, dropout_mask((4, 8, 3, 3), 0.3, 5, MASK_STEP, "drop2"))
    params, x, y, update, _ = one_process(spec.model_key, seed=5, batch=12)
    hub = LocalHub(3)
    members = [MeshMember(spec.model_key, CONV_BN_DIVISION, i, seed=5) for i in range(3)]
    for m in members:
        m.load(params, version=0)
    other = await asyncio.gather(*(m.step(MASK_STEP + 1, x, y, hub.member(i)) for i, m in enumerate(members)))
    assert other[0].loss != pytest.approx(update.loss, abs=1e-5)


async def test_momentum_none_batch_norm_moves_as_a_cumulative_average() -> None:
    def build() -> nn.Module:
        return nn.Sequential(OrderedDict(
            conv1=nn.Conv2d(2, 6, 3), bn1=nn.BatchNorm2d(6, momentum=None), relu1=nn.ReLU(),
            pool1=nn.AdaptiveAvgPool2d(1), flat1=nn.Flatten(), fc1=nn.Linear(6, 5),
            bn2=nn.BatchNorm1d(5, affine=False), fc2=nn.Linear(5, 3)))

    name = "mesh-bn-momentum-none"
    models.register_spec(models.ModelSpec(name=name, input_shape=(2, 5, 5), num_classes=3, builder=build,
                                          description="batch norm as a cumulative average"))
    division = {"conv1": (3, 0, 3), "fc1": (1, 2, 2), "fc2": (1, 1, 1)}
    model = models.build_model(name, seed=2)
    state = model.state_dict()
    state["bn1.num_batches_tracked"].fill_(3)  # the fourth batch weighs a quarter
    params = models.get_params(model)
    rng = np.random.default_rng(2)
    x, y = rng.random((10, 2, 5, 5), dtype=np.float32), rng.integers(0, 3, 10)
    update = models.compute_update(model, x, y)
    with torch.no_grad():
        logits = model(torch.tensor(x)).numpy()
    results = await train_together(name, division, 2, params, x, y)
    assert_matches_one_process(results, update.loss, logits, update.grads)
    assert_buffers_match(results, update.buffers)
    assert results[0].buffers["bn1.num_batches_tracked"][2].tolist() == [1.0]


async def test_the_parameter_server_joins_the_members_buffer_rows_into_one_processs_change() -> None:
    spec = parse_job(CONV_BN)
    check_model(spec)
    params, x, y, update, _ = one_process(spec.model_key, seed=5, batch=12)
    results = await train_together(spec.model_key, CONV_BN_DIVISION, 5, params, x, y)
    model = models.build_model(spec.model_key, seed=5)
    assembly, clock = Assembly({n: s[0][0] for n, s in models.gradient_layout(model).items()}, timeout_s=5.0), Clock()
    outs = [assembly.add(member_part(f"m{i}", r, len(y), MASK_STEP), clock, 1, 0.0) for i, r in enumerate(results)]
    [joined] = outs[-1].joined
    got: dict[str, np.ndarray] = {}
    for g in joined.buffers:
        got.setdefault(g.param, np.zeros_like(update.buffers[g.param]))[g.start:g.stop] += g.values.reshape(
            (g.stop - g.start, *update.buffers[g.param].shape[1:]))
    for name, change in update.buffers.items():
        if name.startswith("bn"):
            np.testing.assert_allclose(got[name], change, rtol=1e-4, atol=1e-6)
    # a counter sent by two members would count the step twice: the step is refused as a shape error
    twice: dict[str, Any] = dict(results[1].buffers)
    twice["bn1.num_batches_tracked"] = (0, 1, np.ones(1, np.float32))
    results[1].buffers = twice
    bad = [assembly.add(replace_step(member_part(f"m{i}", r, len(y), MASK_STEP)), clock, 1, 0.0)
           for i, r in enumerate(results)]
    assert not any(out.joined for out in bad)
    assert sorted((a.update.device, a.reason) for out in bad for a in out.rejected) == [
        ("m0", "shape"), ("m1", "shape"), ("m2", "shape")]


def replace_step(candidate: Candidate) -> Candidate:
    """``candidate`` for the next cluster step."""
    return replace(candidate, update=replace(candidate.update, mesh_step=MASK_STEP + 1, seq=2))


async def test_a_member_of_a_bias_less_or_grouped_layer_holds_and_sends_weight_rows_only() -> None:
    spec = parse_job(MOBILE)
    check_model(spec)
    layers = {la.name: la for la in costs.layers(spec.model_key)}
    assert [(la.bias, la.group) for la in layers.values()] == [
        (False, 1), (False, 1), (False, 1), (False, 2), (False, 4), (True, 1)]
    # a depthwise conv's per-unit work is its kernel area, not the input channels' times it
    assert (layers["conv2"].macs_per_unit, layers["conv2"].params_per_unit) == (4 * 4 * 9, 9 + 2)
    assert (layers["conv5"].macs_per_unit, layers["conv5"].params_per_unit) == (4 * 4 * 6, 6 + 2)
    member = MeshMember(spec.model_key, MOBILE_DIVISION, 1, seed=5)
    rows = member.rows()
    assert not any(name.startswith("conv") and name.endswith(".bias") for name in rows)
    assert rows["conv4.weight"] == (14, 16) and rows["bn4.bias"] == (14, 16) and rows["fc1.bias"] == (1, 3)
    params, x, y, _, _ = one_process(spec.model_key, seed=5, batch=6)
    results = await train_together(spec.model_key, MOBILE_DIVISION, 5, params, x, y)
    assert not any(name.startswith("conv") and name.endswith(".bias") for r in results for name in r.grads)
    with pytest.raises(ModelError, match=r"division of conv5 is \[6, 2, 8\]: .* whole groups of 4 channels"):
        MeshMember(spec.model_key, {**MOBILE_DIVISION, "conv5": (6, 2, 8)}, 0, seed=5)


def test_the_filter_division_gives_a_grouped_or_depthwise_layer_whole_groups() -> None:
    spec = parse_job(MOBILE)
    check_model(spec)
    layers = costs.layers(spec.model_key)
    # slow boards, so that compute sets the division of so small a model
    members = [dev("slow", "pi5", flops=0.05e9, link=GIGABIT), dev("mid", "pi5", flops=0.1e9, link=GIGABIT),
               dev("fast", "pi5", flops=0.4e9, link=GIGABIT)]
    for batch in (8, 64, 512):
        division = divide_filters(spec.model_key, members, batch)
        for la in layers:
            counts = division.counts[la.name]
            assert sum(counts) == la.units and all(n % la.group == 0 for n in counts), (la.name, counts)
        # by speed, in whole groups: of 2 filters (conv4, a depthwise conv of two filters a channel) and of 4
        assert division.counts["conv4"][0] < division.counts["conv4"][1] < division.counts["conv4"][2]
        assert division.counts["conv5"][1] < division.counts["conv5"][2]
    # members then compute them
    MeshMember(spec.model_key, division.counts, 0, seed=5)


async def test_the_parameter_server_joins_the_shards_of_a_bias_less_layer_into_a_full_update() -> None:
    spec = parse_job(NO_BIAS)
    check_model(spec)
    params, x, y, update, _ = one_process(spec.model_key, seed=5, batch=12)
    assert "conv1.bias" not in params and "conv1.bias" not in update.grads
    results = await train_together(spec.model_key, NO_BIAS_DIVISION, 5, params, x, y)
    model = models.build_model(spec.model_key, seed=5)
    rows = {n: s[0][0] for n, s in models.gradient_layout(model).items()}
    assembly, clock = Assembly(rows, timeout_s=5.0), Clock()
    outs = [assembly.add(member_part(f"m{i}", r, len(y), MASK_STEP), clock, 1, 0.0) for i, r in enumerate(results)]
    assert not outs[0].joined and not outs[1].joined
    [joined] = outs[-1].joined
    got = {name: np.zeros_like(g) for name, g in update.grads.items()}
    for g in joined.grads:
        got[g.param][g.start:g.stop] += g.values.reshape((g.stop - g.start, *update.grads[g.param].shape[1:]))
    assert set(got) == set(rows)
    for name, grad in update.grads.items():
        np.testing.assert_allclose(got[name], grad, rtol=1e-4, atol=1e-5)
