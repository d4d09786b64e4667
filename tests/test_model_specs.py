"""Models a job brings: layer lists and Python entry points, checked when the spec is made; their
costs derived from the modules; the torch-free cost registry and its plain form."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_matches_one_process, reference
from torch import nn

from edgemesh.common import costs, models
from edgemesh.common.costs import LayerCost, ModelCost
from edgemesh.common.errors import ModelError
from edgemesh.common.jobs import check_model, read_job_file
from edgemesh.common.models import (
    DIGITS_MEAN_STD,
    LeanMaxPool2d,
    LeanReLU,
    Stage,
    Standardize,
    build_model,
    compute_gradients,
    derive_costs,
    entry_point_spec,
    get_params,
    layer_list_spec,
    mesh_stages,
    param_layout,
    register_spec,
)
from edgemesh.common.models.layer_list import MAX_RESIDUAL_DEPTH
from edgemesh.common.models.lean import GlobalAvgPool, Residual
from edgemesh.operator.export import check_onnx, export_model
from edgemesh.services.worker.mesh.exchange import LocalHub
from edgemesh.services.worker.mesh.member import MeshMember

SMALL: list[Any] = [{"conv2d": 4, "kernel": 3}, "relu", {"maxpool2d": 2}, "flatten", {"linear": 5}, "relu",
                    {"linear": 3}]
"""A small CNN on (1, 6, 6) images, 3 classes: conv (4, 4, 4), pool (4, 2, 2), 16 features, 5, 3."""
DIGITS_LIST: list[Any] = [{"conv2d": 16, "kernel": 3, "padding": 1}, "relu", {"conv2d": 32, "kernel": 3, "padding": 1},
                          "relu", {"maxpool2d": 2}, "flatten", {"linear": 64}, "relu", {"linear": 10}]
"""digits-cnn, written as a layer list."""


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def build_model_of(spec: models.ModelSpec) -> nn.Module:
    """``spec``'s model, built without a name in the registry."""
    with torch.random.fork_rng(devices=[]):
        return spec.builder()


def _small(name: str = "small", **kwargs: Any) -> models.ModelSpec:
    return layer_list_spec(name, SMALL, (1, 6, 6), 3, mean=(0.5,), std=(0.25,), **kwargs)


# --------------------------------------------------------------------------- layer lists


def test_a_layer_list_builds_named_children_and_trains_a_step() -> None:
    spec = _small("list-small", description="a small CNN")
    register_spec(spec)
    assert spec.input_shape == (1, 6, 6) and spec.description == "a small CNN"
    model = build_model("list-small", seed=1)
    assert isinstance(model, nn.Sequential)
    assert [n for n, _ in model.named_children()] == ["input", "conv1", "relu1", "pool1", "flatten1", "fc1", "relu2",
                                                      "fc2"]
    assert isinstance(model.input, Standardize) and isinstance(model.relu1, LeanReLU)
    assert isinstance(model.pool1, LeanMaxPool2d)
    assert param_layout(model) == {
        "conv1.weight": ((4, 1, 3, 3), "float32"), "conv1.bias": ((4,), "float32"),
        "fc1.weight": ((5, 16), "float32"), "fc1.bias": ((5,), "float32"),
        "fc2.weight": ((3, 5), "float32"), "fc2.bias": ((3,), "float32"),
        "input.mean": ((1, 1, 1, 1), "float32"), "input.std": ((1, 1, 1, 1), "float32"),  # buffers travel too
    }
    rng = np.random.default_rng(0)
    x, y = rng.random((8, 1, 6, 6), dtype=np.float32), rng.integers(0, 3, 8)
    loss, grads = compute_gradients(model, x, y)
    assert np.isfinite(loss) and set(grads) == {n for n, _ in model.named_parameters()}
    params = {n: p - 0.5 * grads[n] if n in grads else p for n, p in get_params(model).items()}
    models.set_params(model, params)
    assert compute_gradients(model, x, y)[0] < loss
    # a fresh module every build, the same one for the same seed
    again = build_model("list-small", seed=1)
    assert again is not model and all(np.array_equal(a, b) for a, b in zip(
        get_params(again).values(), get_params(build_model("list-small", seed=1)).values(), strict=True))


def test_digits_cnn_as_a_layer_list_is_digits_cnn() -> None:
    register_spec(layer_list_spec("list-digits", DIGITS_LIST, [1, 8, 8], 10, mean=DIGITS_MEAN_STD[0],
                                  std=DIGITS_MEAN_STD[1]))
    ours, builtin = build_model("list-digits", seed=4), build_model("digits-cnn", seed=4)
    assert param_layout(ours) == param_layout(builtin)
    assert all(np.array_equal(a, b) for a, b in zip(get_params(ours).values(), get_params(builtin).values(),
                                                   strict=True))
    assert derive_costs(ours, (1, 8, 8)) == derive_costs(builtin, (1, 8, 8))
    x = torch.rand((2, 1, 8, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours(x), builtin(x))


def test_layer_list_costs_by_hand() -> None:
    cost, layers = derive_costs(build_model_of(_small()), (1, 6, 6))
    conv, fc1, fc2 = 4 * 4 * 4 * 9, 16 * 5, 5 * 3
    assert cost == ModelCost(
        params=(4 * 9 + 4) + (16 * 5 + 5) + (5 * 3 + 3),
        macs_per_sample=conv + fc1 + fc2,
        # input, standardized, conv, relu, pool, flatten, fc1, relu, fc2
        activations_per_sample=36 + 36 + 64 + 64 + 16 + 16 + 5 + 5 + 3,
    )
    assert layers == (
        LayerCost("conv1", units=4, macs_per_unit=16 * 9, params_per_unit=10, out_per_unit=16, gathered_per_unit=4,
                  in_values=36),
        LayerCost("fc1", units=5, macs_per_unit=16, params_per_unit=17, out_per_unit=1, gathered_per_unit=1,
                  in_values=16),
        LayerCost("fc2", units=3, macs_per_unit=5, params_per_unit=6, out_per_unit=1, gathered_per_unit=1,
                  in_values=5),
    )


def test_feature_vectors_standardize_per_feature_and_train() -> None:
    spec = layer_list_spec("list-features", [{"linear": 8}, "tanh", "batchnorm", {"dropout": 0.25}, {"linear": 3},
                                             "sigmoid"], (6,), 3, mean=[0.5] * 6, std=[2.0] * 6)
    model = build_model_of(spec)
    assert isinstance(model.bn1, nn.BatchNorm1d) and isinstance(model.drop1, nn.Dropout)
    first = model.get_submodule("input")
    assert isinstance(first, Standardize) and first.mean.shape == (1, 6) and first.std.shape == (1, 6)
    rng = np.random.default_rng(0)
    loss, grads = compute_gradients(model, rng.random((8, 6), dtype=np.float32), rng.integers(0, 3, 8))
    assert np.isfinite(loss) and grads["fc1.weight"].shape == (8, 6) and grads["bn1.weight"].shape == (8,)


def test_standardize_broadcasts_over_dim_1_for_any_rank() -> None:
    assert Standardize((0.5,), (2.0,)).mean.shape == (1, 1, 1, 1)  # images, the default
    three = Standardize((1.0, 2.0, 3.0), (1.0, 1.0, 2.0), sample_rank=2)
    assert three.std.shape == (1, 3, 1)
    x = torch.ones((2, 3, 5))
    assert torch.equal(three(x)[:, :, 0], torch.tensor([[0.0, -1.0, -1.0]] * 2))
    assert [n for n, _ in three.named_parameters()] == []
    with pytest.raises(ModelError, match="> 0"):
        Standardize((0.0,), (0.0,))


def test_batchnorm_follows_the_incoming_rank() -> None:
    model = build_model_of(layer_list_spec("list-bn", [{"conv2d": 2, "kernel": 1}, "batchnorm", "flatten",
                                                       {"linear": 2}], (1, 2, 2), 2))
    assert isinstance(model.bn1, nn.BatchNorm2d) and model.bn1.num_features == 2


BAD_LAYERS: list[tuple[list[Any], str]] = [
    (["relu", "relux"], r"layer 2 \('relux'\): unknown layer; known: conv2d, linear, relu, maxpool2d"),
    ([{"conv": 4, "kernel": 3}], r"layer 1 \(\{'conv': 4, 'kernel': 3\}\): unknown layer"),
    ([{"conv2d": 4, "linear": 3}], r"layer 1 .*names 2 layers \(conv2d, linear\)"),
    (["conv2d"], r"layer 1 \('conv2d'\): conv2d needs its output channels"),
    ([{"relu": True}], r"layer 1 \(\{'relu': True\}\): relu takes no value"),
    ([7], r"layer 1 \(7\): a layer is a name or a table, not int"),
    ([{"conv2d": 4, "kernal": 3}], r"layer 1 \(\{'conv2d': 4, 'kernal': 3\}\): unknown option 'kernal' for "
                                   r"conv2d; options: kernel, padding, stride, groups, bias"),
    ([{"conv2d": 4}], r"layer 1 \(\{'conv2d': 4\}\): conv2d needs option kernel"),
    ([{"conv2d": 4, "kernel": 2.5}], r"layer 1 .*conv2d option kernel must be an integer >= 1, got 2.5"),
    ([{"conv2d": 4, "kernel": 3, "padding": -1}], r"layer 1 .*option padding must be an integer >= 0, got -1"),
    ([{"conv2d": 4, "kernel": True}], r"layer 1 .*option kernel must be an integer >= 1, got True"),
    (["flatten", {"linear": -3}], r"layer 2 \(\{'linear': -3\}\): linear output features must be a positive"),
    (["flatten", {"dropout": 1.0}, {"linear": 3}], r"layer 2 \(\{'dropout': 1.0\}\): dropout probability must be "
                                                   r"a number in \[0, 1\)"),
    (["flatten", {"linear": 3, "stride": 1}], r"layer 2 .*unknown option 'stride' for linear; options: bias"),
    (["flatten", {"conv2d": 4, "kernel": 3}], r"layer 2 \(\{'conv2d': 4, 'kernel': 3\}\): expects a \(channels, "
                                              r"height, width\) input but gets shape \(36,\)"),
    ([{"conv2d": 4, "kernel": 3}, {"linear": 3}], r"layer 2 \(\{'linear': 3\}\): expects a flat \(features,\) input "
                                                  r"but gets shape \(4, 4, 4\); put 'flatten' before it"),
    ([{"maxpool2d": 8}, "flatten", {"linear": 3}], r"layer 1 \(\{'maxpool2d': 8\}\): does not fit its input of shape "
                                                   r"\(1, 6, 6\)"),
    ([{"conv2d": 4, "kernel": 7}, "flatten", {"linear": 3}], r"layer 1 .*does not fit its input of shape"),
    ([{"avgpool2d": 2, "stride": 0}], r"layer 1 .*option stride must be an integer >= 1, got 0"),
    (["flatten", {"linear": 4}], r"layer 2 \(\{'linear': 4\}\): the model's output per sample is \(4,\), but it "
                                 r"must be \(3,\) for 3 classes"),
    (["flatten", {"linear": 3}, "batchnorm", {"conv2d": 1, "kernel": 1}], r"layer 4 .*expects a \(channels"),
    ([], r"model 'bad': the layer list is empty"),
]


@pytest.mark.parametrize(("layers", "match"), BAD_LAYERS)
def test_a_bad_layer_list_is_refused_when_the_spec_is_made_naming_the_layer(layers: list[Any], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        layer_list_spec("bad", layers, (1, 6, 6), 3)


@pytest.mark.parametrize(("shape", "classes", "kwargs", "match"), [
    ((1, 0, 6), 3, {}, r"input_shape must be one or more positive integers, got \(1, 0, 6\)"),
    ((), 3, {}, "input_shape"),
    ((1, 6.0, 6), 3, {}, "input_shape"),
    ((1, 6, 6), 0, {}, "num_classes must be a positive integer"),
    ((1, 6, 6), 3, {"mean": (0.5, 0.5), "std": (1.0, 1.0)}, r"one value per channel \(input_shape\[0\] = 1\)"),
    ((1, 6, 6), 3, {"mean": (0.5,)}, "one value per channel"),
    ((1, 6, 6), 3, {"mean": (0.5,), "std": (0.0,)}, "std must be > 0"),
])
def test_bad_inputs_are_refused(shape: tuple[int, ...], classes: int, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        layer_list_spec("bad", ["flatten", {"linear": 3}], shape, classes, **kwargs)


def test_a_layer_list_cnn_is_divided_by_mesh_and_a_grouped_convolution_by_whole_groups() -> None:
    assert mesh_stages(build_model_of(_small())) == (
        Stage("conv1", ("input",), ("relu1", "pool1")), Stage("fc1", ("flatten1",), ("relu2",)), Stage("fc2", (), ()))
    dropped = layer_list_spec("list-dropout", [*SMALL[:5], {"dropout": 0.5}, {"linear": 3}], (1, 6, 6), 3)
    assert mesh_stages(build_model_of(dropped))[1] == Stage("fc1", ("flatten1",), ("drop1",))  # a shared mask
    grouped = layer_list_spec("list-grouped", [{"conv2d": 4, "kernel": 3, "groups": 2, "bias": False}, *SMALL[1:]],
                              (2, 6, 6), 3)
    assert mesh_stages(build_model_of(grouped))[0] == Stage("conv1", (), ("relu1", "pool1"))  # no mean or std
    register_spec(grouped)
    conv1 = costs.layers("list-grouped")[0]
    # two groups of two filters, each filter on one input channel: 9 MACs per output value, 9 weights, no bias
    assert (conv1.units, conv1.group, conv1.bias) == (4, 2, False)
    assert (conv1.macs_per_unit, conv1.params_per_unit) == (16 * 9, 9)
    assert costs.member_rows([conv1], {"conv1": (2, 2)}, 1) == {"conv1.weight": (2, 4)}


async def test_members_of_a_layer_list_model_compute_what_one_process_does() -> None:
    layers = [{"conv2d": 6, "kernel": 3, "padding": 1}, "tanh", {"avgpool2d": 2}, {"conv2d": 8, "kernel": 3},
              "relu", "flatten", {"linear": 12}, "sigmoid", {"linear": 10}]
    register_spec(layer_list_spec("list-mesh", layers, (2, 8, 8), 10, mean=(0.5, 0.4), std=(0.3, 0.2)))
    counts = {"conv1": (4, 2), "conv2": (3, 5), "fc1": (6, 6), "fc2": (0, 10)}
    params, x, y, loss, logits, grads = reference("list-mesh", seed=2, batch=8)
    hub = LocalHub(2)
    members = [MeshMember("list-mesh", counts, i, seed=2) for i in range(2)]
    for m in members:
        m.load(params, version=0)
    results = await asyncio.gather(*(m.step(1, x, y, hub.member(i)) for i, m in enumerate(members)))
    assert_matches_one_process(list(results), loss, logits, grads)


# --------------------------------------------------------------------------- edge CNN layers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EDGE_EXAMPLES = ("mobilenetv2-32.toml", "resnet8-32.toml")
EDGE_MAX_PARAMS = 100_000
"""Parameters an example edge CNN may have (it trains on a Pi)."""
ONNX_TOLERANCE = 1e-4
"""Largest difference between onnxruntime's and torch's logits of an exported model."""


def _first_layer(item: Any, shape: tuple[int, ...]) -> nn.Module:
    """The module ``item`` builds as the first layer of a list on samples of ``shape``."""
    model = build_model_of(layer_list_spec("one", [item, "flatten", {"linear": 2}], shape, 2))
    return model[0]


@pytest.mark.parametrize(("item", "shape", "kind", "out"), [
    ("relu6", (2, 3, 3), nn.ReLU6, (2, 3, 3)),
    ("hardswish", (2, 3, 3), nn.Hardswish, (2, 3, 3)),
    ("silu", (5,), nn.SiLU, (5,)),
    ("globalavgpool", (4, 3, 5), GlobalAvgPool, (4,)),
    ({"conv2d": 6, "kernel": 3, "groups": 2, "bias": False}, (4, 5, 5), nn.Conv2d, (6, 3, 3)),
    ({"linear": 3, "bias": False}, (5,), nn.Linear, (3,)),
    ({"linear": 3, "bias": True}, (5,), nn.Linear, (3,)),
    ({"groupnorm": 2}, (4, 3, 3), nn.GroupNorm, (4, 3, 3)),
    ({"groupnorm": 3}, (6,), nn.GroupNorm, (6,)),
])
def test_each_edge_layer_builds_its_module_and_output_shape(item: Any, shape: tuple[int, ...], kind: type,
                                                            out: tuple[int, ...]) -> None:
    layer = _first_layer(item, shape)
    assert type(layer) is kind
    assert layer(torch.rand((2, *shape))).shape == (2, *out)


def test_edge_activations_compute_their_functions() -> None:
    x = torch.linspace(-8, 8, 33)
    assert torch.equal(_first_layer("relu6", (33,))(x), x.clamp(0, 6))
    torch.testing.assert_close(_first_layer("hardswish", (33,))(x), x * (x + 3).clamp(0, 6) / 6)
    torch.testing.assert_close(_first_layer("silu", (33,))(x), x * torch.sigmoid(x))


def test_group_norm_normalizes_each_sample_alone_and_keeps_no_statistics() -> None:
    """Group norm (``{groupnorm = G}``) normalizes each sample over its groups of channels: a sample comes out the same
    alone as in any batch, in training as in evaluation, so a device's batch (one camera's images) does not shape
    what the model learns, and no running statistic is kept or travels."""
    model = build_model_of(layer_list_spec("gn", [{"conv2d": 4, "kernel": 3, "bias": False}, {"groupnorm": 2}, "relu",
                                                  "flatten", {"linear": 3}], (3, 6, 6), 3))
    norm = model.gn1
    assert isinstance(norm, nn.GroupNorm) and (norm.num_groups, norm.num_channels) == (2, 4)
    assert models.buffer_kinds(model) == {} and {n for n, _ in model.named_parameters()} >= {"gn1.weight", "gn1.bias"}
    generator = torch.Generator().manual_seed(0)
    batch = torch.rand((8, 3, 6, 6), generator=generator) * torch.tensor([1.0, 3.0] * 4).view(8, 1, 1, 1)
    model.train()
    together = model(batch)
    alone = torch.cat([model(batch[i:i + 1]) for i in range(8)])
    model.eval()
    torch.testing.assert_close(together, alone)
    torch.testing.assert_close(model(batch), together)


def test_a_group_norm_model_exports_to_onnx_as_torch_computes(tmp_path: Path) -> None:
    block = {"residual": [{"conv2d": 8, "kernel": 3, "padding": 1}, {"groupnorm": 2}], "activation": "relu"}
    spec = layer_list_spec("gn-onnx", [{"conv2d": 8, "kernel": 3, "padding": 1, "bias": False}, {"groupnorm": 4},
                                       "relu", block, "globalavgpool", {"linear": 3}], (3, 8, 8), 3)
    model = build_model_of(spec)
    _randomize(model, seed=3)  # group norm's weight and bias away from 1 and 0
    path = export_model(model, (3, 8, 8), "onnx", tmp_path / "gn.onnx")
    assert check_onnx(model, (3, 8, 8), path) <= ONNX_TOLERANCE


def test_global_average_pooling_is_each_channels_mean() -> None:
    x = torch.rand((3, 4, 5, 6), generator=torch.Generator().manual_seed(0))
    pooled = _first_layer("globalavgpool", (4, 5, 6))(x)
    torch.testing.assert_close(pooled, nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())(x))
    assert [n for n, _ in GlobalAvgPool().named_parameters()] == []


def test_bias_false_leaves_the_bias_out_and_bias_true_keeps_it() -> None:
    model = build_model_of(layer_list_spec("bias", [{"conv2d": 2, "kernel": 3, "bias": False}, "flatten",
                                                    {"linear": 4, "bias": False}, {"linear": 3, "bias": True}],
                                           (1, 4, 4), 3))
    assert model.conv1.bias is None and model.fc1.bias is None and model.fc2.bias is not None
    assert [n for n, _ in model.named_parameters()] == ["conv1.weight", "fc1.weight", "fc2.weight", "fc2.bias"]


def test_a_depthwise_convolution_filters_each_channel_alone() -> None:
    conv = _first_layer({"conv2d": 4, "kernel": 3, "padding": 1, "groups": 4}, (4, 5, 5))
    assert isinstance(conv, nn.Conv2d) and conv.groups == conv.in_channels == conv.out_channels == 4
    assert conv.weight.shape == (4, 1, 3, 3)
    x = torch.rand((1, 4, 5, 5), generator=torch.Generator().manual_seed(1))
    changed = x.clone()
    changed[:, 2] += 1.0
    with torch.no_grad():
        moved = (conv(changed) - conv(x)).abs().amax(dim=(0, 2, 3))
    assert moved[2] > 0 and torch.all(moved[[0, 1, 3]] == 0)


def _nested(depth: int) -> Any:
    """``depth`` residual blocks, one inside the other, around a ReLU."""
    item: Any = "relu"
    for _ in range(depth):
        item = {"residual": [item]}
    return item


EDGE_BAD_LAYERS: list[tuple[list[Any], str]] = [
    ([{"conv2d": 4, "kernel": 3}, {"conv2d": 6, "kernel": 1, "groups": 4}],
     r"layer 2 \(\{'conv2d': 6, 'kernel': 1, 'groups': 4\}\): groups = 4 must divide the input channels \(4\) and "
     r"the output channels \(6\)"),
    ([{"conv2d": 4, "kernel": 3, "groups": 2}], r"layer 1 .*groups = 2 must divide the input channels \(1\)"),
    ([{"conv2d": 4, "kernel": 3, "groups": 0}], r"layer 1 .*conv2d option groups must be an integer >= 1, got 0"),
    ([{"conv2d": 4, "kernel": 3, "bias": 1}], r"layer 1 .*conv2d option bias must be true or false, got 1"),
    ([{"conv2d": 4, "kernel": 3, "bias": "false"}], r"layer 1 .*conv2d option bias must be true or false, "
                                                     r"got 'false'"),
    (["flatten", {"linear": 3, "bias": 0}], r"layer 2 \(\{'linear': 3, 'bias': 0\}\): linear option bias must be "
                                            r"true or false, got 0"),
    ([{"relu6": 1}], r"layer 1 \(\{'relu6': 1\}\): relu6 takes no value or options"),
    (["flatten", "globalavgpool"], r"layer 2 \('globalavgpool'\): expects a \(channels, height, width\) input but "
                                   r"gets shape \(36,\)"),
    ([{"residual": []}], r"layer 1 \(residual\): residual takes a non-empty list of layers, got \[\]"),
    ([{"residual": "relu"}], r"layer 1 \(residual\): residual takes a non-empty list of layers, got 'relu'"),
    (["residual"], r"layer 1 \('residual'\): residual needs its layer list: write \{residual = \.\.\.\}"),
    ([{"residual": ["relu"], "activaton": "relu"}], r"layer 1 \(residual\): unknown option 'activaton' for "
                                                    r"residual; options: activation"),
    ([{"residual": ["relu"], "activation": "gelu"}], r"layer 1 \(residual\): residual option activation must be "
                                                     r"one of relu, relu6, hardswish, silu, tanh, sigmoid, "
                                                     r"got 'gelu'"),
    ([{"residual": ["relu"], "activation": True}], r"activation must be one of .*got True"),
    ([_nested(MAX_RESIDUAL_DEPTH + 1)], r"model 'bad': " + r"layer 1 \(residual\), " * MAX_RESIDUAL_DEPTH
     + r"layer 1 \(residual\): residual blocks nest at most 3 deep"),
    (["relu", {"residual": ["relu", {"linear": 3}]}], r"model 'bad': layer 2 \(residual\), layer 2 \(\{'linear': "
                                                      r"3\}\): expects a flat \(features,\) input but gets shape "
                                                      r"\(1, 6, 6\)"),
    ([{"residual": [{"residual": [{"conv2d": 2, "kernel": 1, "groups": 2}]}]}],
     r"layer 1 \(residual\), layer 1 \(residual\), layer 1 \(\{'conv2d': 2, 'kernel': 1, 'groups': 2\}\): groups"),
    ([{"residual": ["flatten"]}], r"layer 1 \(residual\): its layers turn shape \(1, 6, 6\) into \(36,\); a skip "
                                  r"connection projects only"),
    ([{"residual": [{"conv2d": 2, "kernel": 1, "padding": 1}]}], r"layer 1 \(residual\): its layers turn shape "
                                                                 r"\(1, 6, 6\) into \(2, 8, 8\); a 1x1 convolution"),
    (["flatten", {"residual": [{"linear": 3}]}, {"linear": 4}], r"layer 3 \(\{'linear': 4\}\): the model's output "
                                                                r"per sample is \(4,\)"),
    (["flatten", {"linear": 3}, {"residual": [{"linear": 4}]}], r"layer 3 \(residual\): the model's output per "
                                                                r"sample is \(4,\)"),
    ([{"conv2d": 4, "kernel": 1}, {"groupnorm": 3}], r"layer 2 \(\{'groupnorm': 3\}\): 3 groups must divide its "
                                                     r"input's 4 channels"),
    (["groupnorm"], r"layer 1 \('groupnorm'\): groupnorm needs its groups: write \{groupnorm = \.\.\.\}"),
    ([{"groupnorm": 0}], r"groupnorm groups must be a positive integer, got 0"),
]


@pytest.mark.parametrize(("layers", "match"), EDGE_BAD_LAYERS)
def test_a_bad_edge_layer_is_refused_naming_its_path(layers: list[Any], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        layer_list_spec("bad", layers, (1, 6, 6), 3)


def test_residual_blocks_nest_up_to_the_limit() -> None:
    model = build_model_of(layer_list_spec("deep", [_nested(MAX_RESIDUAL_DEPTH), "flatten", {"linear": 3}],
                                           (1, 6, 6), 3))
    inner = ".".join(["res1.body"] * MAX_RESIDUAL_DEPTH)
    assert isinstance(model.get_submodule(f"{inner}.relu1"), LeanReLU)


RESIDUAL_LIST: list[Any] = [
    {"conv2d": 4, "kernel": 3, "padding": 1, "bias": False}, "batchnorm", "relu",
    {"residual": [{"conv2d": 4, "kernel": 3, "padding": 1}, "relu6"]},
    {"residual": [{"conv2d": 8, "kernel": 3, "padding": 1, "stride": 2, "bias": False}, "batchnorm", "relu",
                  {"residual": [{"conv2d": 8, "kernel": 1}, "silu"]}], "activation": "relu"},
    "globalavgpool", "flatten",
    {"residual": [{"linear": 6}, "hardswish"]},
    {"linear": 3},
]
"""A block keeping its shape, one projecting with batch norm (holding a block), a flat one projecting without."""
RESIDUAL_NAMES = [
    "conv1.weight", "bn1.weight", "bn1.bias",
    "res1.body.conv1.weight", "res1.body.conv1.bias",
    "res2.body.conv1.weight", "res2.body.bn1.weight", "res2.body.bn1.bias",
    "res2.body.res1.body.conv1.weight", "res2.body.res1.body.conv1.bias",
    "res2.skip.conv1.weight", "res2.skip.bn1.weight", "res2.skip.bn1.bias",
    "res3.body.fc1.weight", "res3.body.fc1.bias", "res3.skip.fc1.weight",
    "fc1.weight", "fc1.bias",
]


def test_residual_blocks_name_their_children_by_the_list_alone() -> None:
    a = build_model_of(layer_list_spec("res-a", RESIDUAL_LIST, (2, 8, 8), 3))
    b = build_model_of(layer_list_spec("res-b", [dict(i) if isinstance(i, dict) else i for i in RESIDUAL_LIST],
                                       (2, 8, 8), 3))
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()] == RESIDUAL_NAMES
    assert list(a.state_dict()) == list(b.state_dict())
    assert [n for n, _ in a.named_children()] == ["conv1", "bn1", "relu1", "res1", "res2", "gap1", "flatten1",
                                                  "res3", "fc1"]
    assert isinstance(a.res1, Residual) and a.res1.skip is None and a.res1.act is None  # the identity
    assert isinstance(a.res2.act, LeanReLU) and isinstance(a.res3.skip.fc1, nn.Linear)
    assert a.res3.skip.fc1.bias is None and not hasattr(a.res3.skip, "bn1")  # no batch norm in its body
    projection = a.res2.skip.conv1
    assert (projection.kernel_size, projection.stride, projection.bias) == ((1, 1), (2, 2), None)
    register_spec(layer_list_spec("res-seeded", RESIDUAL_LIST, (2, 8, 8), 3))
    first, again = build_model("res-seeded", seed=7), build_model("res-seeded", seed=7)
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), again.parameters(), strict=True))


def _randomize(module: nn.Module, seed: int) -> None:
    """Random values in every parameter and batch-norm statistic, so no default (a zero bias, a unit scale) hides
    a module left out."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if tensor.is_floating_point():
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + (0.5 if "running_var" in name else -0.5))


def _copy(source: nn.Module, target: nn.Module) -> None:
    """``source``'s parameters and buffers into ``target``'s, in order (their names differ)."""
    with torch.no_grad():
        for theirs, ours in zip((*source.parameters(), *source.buffers()), (*target.parameters(), *target.buffers()),
                                strict=True):
            ours.copy_(theirs)


@pytest.mark.parametrize("training", [True, False])
def test_a_residual_block_with_projection_adds_body_and_projection_then_activates(training: bool) -> None:
    layers = [{"residual": [{"conv2d": 4, "kernel": 3, "padding": 1, "stride": 2}, "batchnorm", "relu",
                            {"conv2d": 4, "kernel": 3, "padding": 1}, "batchnorm"], "activation": "relu"},
              "globalavgpool", {"linear": 3}]
    block = build_model_of(layer_list_spec("res-proj", layers, (2, 7, 7), 3)).res1
    _randomize(block, seed=3)
    body = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, stride=2), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))
    projection = nn.Sequential(nn.Conv2d(2, 4, 1, stride=2, bias=False), nn.BatchNorm2d(4))
    _copy(block.body, body)
    _copy(block.skip, projection)
    block.train(training)
    body.train(training)
    projection.train(training)
    x = torch.rand((5, 2, 7, 7), generator=torch.Generator().manual_seed(4))
    expected = torch.relu(body(x) + projection(x))
    assert expected.shape == (5, 4, 4, 4)
    torch.testing.assert_close(block(x), expected)


def test_an_identity_block_adds_its_input_and_a_flat_block_projects_with_a_linear_layer() -> None:
    model = build_model_of(layer_list_spec("res-flat", [{"residual": ["tanh"], "activation": "sigmoid"},
                                                        {"residual": [{"linear": 4}, "relu"]}, {"linear": 3}],
                                           (6,), 3))
    _randomize(model, seed=5)
    x = torch.rand((3, 6), generator=torch.Generator().manual_seed(6))
    identity = torch.sigmoid(torch.tanh(x) + x)
    torch.testing.assert_close(model.res1(x), identity)
    fc, skip = model.res2.body.fc1, model.res2.skip.fc1
    assert skip.weight.shape == (4, 6) and skip.bias is None
    torch.testing.assert_close(model.res2(identity), torch.relu(fc(identity)) + identity @ skip.weight.T)


def test_dropout_and_batchnorm_in_nested_blocks_train_and_evaluate() -> None:
    layers = [{"conv2d": 4, "kernel": 3, "padding": 1},
              {"residual": [{"residual": ["batchnorm", {"dropout": 0.5}]}, {"conv2d": 4, "kernel": 1}]},
              "flatten", {"residual": [{"linear": 8}, "batchnorm", {"dropout": 0.5}]}, {"linear": 3}]
    model = build_model_of(layer_list_spec("res-drop", layers, (1, 6, 6), 3))
    inner_bn, inner_drop = model.res1.body.res1.body.bn1, model.res1.body.res1.body.drop1
    assert isinstance(inner_bn, nn.BatchNorm2d) and isinstance(inner_drop, nn.Dropout) and inner_drop.p == 0.5
    assert isinstance(model.res2.body.bn1, nn.BatchNorm1d) and isinstance(model.res2.skip.bn1, nn.BatchNorm1d)
    x = torch.rand((8, 1, 6, 6), generator=torch.Generator().manual_seed(2))
    model.train()
    before = inner_bn.running_mean.clone()
    a, b = model(x), model(x)
    assert not torch.equal(a, b), "dropout draws in training"
    assert not torch.equal(inner_bn.running_mean, before), "batch norm keeps statistics in training"
    model.eval()
    assert torch.equal(model(x), model(x)), "no dropout in evaluation"
    rng = np.random.default_rng(0)
    loss, grads = compute_gradients(model, rng.random((8, 1, 6, 6), dtype=np.float32), rng.integers(0, 3, 8))
    assert np.isfinite(loss) and set(grads) == {n for n, _ in model.named_parameters()}
    assert np.abs(grads["res1.body.res1.body.bn1.weight"]).sum() > 0


@pytest.mark.parametrize("activation", [{}, {"activation": "relu"}])
def test_residual_costs_by_hand(activation: dict[str, str]) -> None:
    layers = [{"residual": [{"conv2d": 2, "kernel": 3, "padding": 1, "stride": 2}], **activation},
              "globalavgpool", {"linear": 3}]
    cost, layers_figures = derive_costs(build_model_of(layer_list_spec("res-cost", layers, (1, 4, 4), 3)), (1, 4, 4))
    body, projection, fc = 2 * 2 * 2 * 9, 2 * 2 * 2, 2 * 3
    assert cost == ModelCost(
        params=(2 * 9 + 2) + 2 + (2 * 3 + 3),
        macs_per_sample=body + projection + fc,
        # input, body conv, projection, the sum (or the activation of it), pooled, fc
        activations_per_sample=16 + 8 + 8 + 8 + 2 + 3,
    )
    # model parallelism divides the block: its projection's figures count with the body's last (here only) conv
    assert layers_figures is not None and layers_figures[0].name == "res1.body.conv1"
    # per unit: 4 outputs of a 3x3 conv and of the 1x1 projection; the projection has no bias
    assert (layers_figures[0].macs_per_unit, layers_figures[0].params_per_unit) == (4 * 9 + 4, (9 + 1) + 1)


def test_model_parallelism_refuses_what_it_cannot_divide_naming_the_module() -> None:
    nested = layer_list_spec("res-bn", [{"residual": [{"residual": [{"conv2d": 1, "kernel": 3, "padding": 1}]},
                                                      "batchnorm"]}, "flatten", {"linear": 3}], (1, 6, 6), 3)
    with pytest.raises(ModelError, match=r"'res1.body.res1' \(Residual inside a residual block"):
        mesh_stages(build_model_of(nested))
    grouped = layer_list_spec("gn-mesh", [{"conv2d": 4, "kernel": 3}, {"groupnorm": 2}, "flatten", {"linear": 3}],
                              (1, 6, 6), 3)
    with pytest.raises(ModelError, match=r"cannot divide module 'gn1' \(GroupNorm\)"):  # its groups span the members
        mesh_stages(build_model_of(grouped))
    reflected = nn.Sequential(OrderedDict(conv1=nn.Conv2d(1, 4, 3, padding=1, padding_mode="circular")))
    with pytest.raises(ModelError, match=r"cannot divide module 'conv1' \(Conv2d with padding_mode = 'circular'\)"):
        mesh_stages(reflected)
    register_spec(nested)
    assert costs.cost("res-bn").params == (9 + 1) + 2 + (36 * 3 + 3)  # whole-model figures still derive
    with pytest.raises(ModelError, match=r"no layer figures for model 'res-bn': .*'res1.body.res1' \(Residual"):
        costs.layers("res-bn")


async def test_members_divide_a_model_with_the_new_channel_wise_layers_as_one_process_computes() -> None:
    layers = [{"conv2d": 6, "kernel": 3, "padding": 1}, "relu6", {"conv2d": 8, "kernel": 3}, "hardswish",
              "globalavgpool", {"linear": 12}, "silu", {"linear": 10}]
    register_spec(layer_list_spec("list-mesh-edge", layers, (2, 8, 8), 10, mean=(0.5, 0.4), std=(0.3, 0.2)))
    assert mesh_stages(build_model("list-mesh-edge")) == (
        Stage("conv1", ("input",), ("relu6_1",)), Stage("conv2", (), ("hswish1", "gap1")), Stage("fc1", (), ("silu1",)),
        Stage("fc2", (), ()))
    counts = {"conv1": (4, 2), "conv2": (3, 5), "fc1": (6, 6), "fc2": (0, 10)}
    params, x, y, loss, logits, grads = reference("list-mesh-edge", seed=2, batch=8)
    hub = LocalHub(2)
    members = [MeshMember("list-mesh-edge", counts, i, seed=2) for i in range(2)]
    for m in members:
        m.load(params, version=0)
    results = await asyncio.gather(*(m.step(1, x, y, hub.member(i)) for i, m in enumerate(members)))
    assert_matches_one_process(list(results), loss, logits, grads)


@pytest.mark.parametrize("example", EDGE_EXAMPLES)
def test_the_edge_cnn_examples_build_and_train_a_step(example: str) -> None:
    job = read_job_file(EXAMPLES / example)
    cost, layers, refusal = check_model(job)
    assert cost.params < EDGE_MAX_PARAMS and layers is not None and refusal == ""  # model parallelism divides it
    model = build_model(job.model_key, seed=1)
    assert cost.params == sum(p.numel() for p in model.parameters())
    assert model(torch.zeros((2, *job.model.input_shape))).shape == (2, job.num_classes)
    rng = np.random.default_rng(0)
    x, y = rng.random((4, *job.model.input_shape), dtype=np.float32), rng.integers(0, job.num_classes, 4)
    loss, grads = compute_gradients(model, x, y)
    assert np.isfinite(loss) and set(grads) == {n for n, _ in model.named_parameters()}
    assert all(np.isfinite(g).all() for g in grads.values())
    assert np.abs(grads["conv1.weight"]).sum() > 0, "the gradient reaches the first layer"


def _registered(path: Path) -> str:
    """The name of the model of the job file at ``path``, registered."""
    job = read_job_file(path)
    check_model(job)
    return job.model_key


def test_the_mobilenet_example_has_depthwise_convolutions_and_residuals_where_shapes_allow() -> None:
    model = build_model(_registered(EXAMPLES / "mobilenetv2-32.toml"))
    depthwise = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert len(depthwise) == 3 and all(m.groups == m.in_channels == m.out_channels for m in depthwise)
    blocks = [m for m in model.modules() if isinstance(m, Residual)]
    assert len(blocks) == 2 and all(b.skip is None for b in blocks)
    assert isinstance(model.gap1, GlobalAvgPool)


def test_the_resnet8_example_projects_the_skip_of_its_downsampling_stages() -> None:
    model = build_model(_registered(EXAMPLES / "resnet8-32.toml"))
    assert [n for n, m in model.named_children() if isinstance(m, Residual)] == ["res1", "res2", "res3"]
    assert model.res1.skip is None
    for name, channels in (("res2", 32), ("res3", 64)):
        conv = model.get_submodule(f"{name}.skip.conv1")
        assert (conv.out_channels, conv.stride, conv.bias) == (channels, (2, 2), None)
        assert isinstance(model.get_submodule(f"{name}.skip.bn1"), nn.BatchNorm2d)
        assert isinstance(model.get_submodule(f"{name}.act"), LeanReLU)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) + 1 == 8, "ResNet-8: seven 3x3 convolutions and the linear layer"


@pytest.mark.parametrize("example", EDGE_EXAMPLES)
def test_the_edge_cnn_examples_export_to_onnx_as_torch_computes(example: str, tmp_path: Path) -> None:
    job = read_job_file(EXAMPLES / example)
    check_model(job)
    model = build_model(job.model_key, seed=2)
    _randomize(model, seed=2)  # batch-norm statistics away from their defaults
    path = export_model(model, job.model.input_shape, "onnx", tmp_path / "model.onnx")
    assert check_onnx(model, job.model.input_shape, path) <= ONNX_TOLERANCE


# --------------------------------------------------------------------------- entry points

USER_MODELS = '''
from torch import nn

calls = 0


def build(num_classes):
    global calls
    calls += 1
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 16), nn.ReLU(), nn.Linear(16, num_classes))


def shaped(*, input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0] * input_shape[1] * input_shape[2], num_classes))


def bare():
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 3))


def four():
    return nn.Sequential(nn.Flatten(), nn.Linear(36, 4))


def text():
    return "a model"


def fails():
    raise RuntimeError("out of ideas")


def rejects():
    return nn.Sequential(nn.Linear(7, 3))


class Factory:
    @staticmethod
    def make():
        return bare()


SIZE = 3
'''


USER_MODULES = ("em_user_models", "em_broken_models", "em_missing_models")
"""The test's entry-point modules, allowed as a host's ``models.allowed`` allows them (nothing else imports)."""


@pytest.fixture
def user_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory holding ``em_user_models.py`` (and ``em_broken_models.py``, which does not import)."""
    (tmp_path / "em_user_models.py").write_text(textwrap.dedent(USER_MODELS))
    (tmp_path / "em_broken_models.py").write_text("import torch\nraise ValueError('no GPU here')\n")
    yield tmp_path
    for name in ("em_user_models", "em_broken_models"):
        sys.modules.pop(name, None)


def test_an_entry_point_builds_a_fresh_module_every_time(user_dir: Path) -> None:
    path_before = list(sys.path)
    spec = entry_point_spec("ep-user", "em_user_models:build", (1, 6, 6), 3, allowed=USER_MODULES,
                            search_path=[user_dir])
    assert sys.path == path_before  # the job's directory is on the path only while importing and building
    user = sys.modules["em_user_models"]
    assert user.calls == 1  # built once to check it
    register_spec(spec)
    a, b = build_model("ep-user", seed=5), build_model("ep-user", seed=5)
    assert user.calls == 3 and a is not b
    assert [n for n, _ in a.named_parameters()] == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert all(np.array_equal(p, q) for p, q in zip(get_params(a).values(), get_params(b).values(), strict=True))
    rng = np.random.default_rng(0)
    loss, _ = compute_gradients(a, rng.random((4, 1, 6, 6), dtype=np.float32), rng.integers(0, 3, 4))
    assert np.isfinite(loss)
    cost, layers = derive_costs(a, (1, 6, 6))
    assert cost == ModelCost(params=36 * 16 + 16 + 16 * 3 + 3, macs_per_sample=36 * 16 + 16 * 3,
                             activations_per_sample=36 + 36 + 16 + 16 + 3)
    assert layers is not None and [la.name for la in layers] == ["1", "3"]


def test_an_entry_point_gets_its_shape_and_classes_by_keyword_and_standardizes(user_dir: Path) -> None:
    spec = entry_point_spec("ep-shaped", "em_user_models:shaped", (1, 6, 6), 5, mean=(0.5,), std=(0.2,),
                            allowed=USER_MODULES, search_path=[str(user_dir)])
    model = spec.builder()
    # a user's Sequential is spliced after the normalization: its parameters keep their names
    assert [n for n, _ in model.named_children()] == ["input", "0", "1"]
    assert list(param_layout(model)) == ["1.weight", "1.bias", "input.mean", "input.std"]
    assert model(torch.zeros((2, 1, 6, 6))).shape == (2, 5)
    assert entry_point_spec("ep-static", "em_user_models:Factory.make", (1, 6, 6), 3, allowed=USER_MODULES,
                            search_path=[user_dir]).builder()(torch.zeros((1, 1, 6, 6))).shape == (1, 3)


@pytest.mark.parametrize(("entry_point", "match"), [
    ("em_user_models.build", r"entry point 'em_user_models.build': expected 'package.module:function'"),
    ("em_user_models:", "expected 'package.module:function'"),
    ("em-user:build", "expected 'package.module:function'"),
    ("em_missing_models:build", r"entry point 'em_missing_models:build': module 'em_missing_models' does not "
                                r"import: No module named 'em_missing_models'"),
    ("em_broken_models:build", r"entry point 'em_broken_models:build': module 'em_broken_models' does not import: "
                               r"no GPU here"),
    ("em_user_models:missing", r"entry point 'em_user_models:missing': module 'em_user_models' has no attribute "
                               r"'missing'"),
    ("em_user_models:SIZE", r"entry point 'em_user_models:SIZE': 'SIZE' is a int, not callable"),
    ("em_user_models:text", r"entry point 'em_user_models:text': returns a str, not a torch.nn.Module"),
    ("em_user_models:fails", r"entry point 'em_user_models:fails': calling it fails: RuntimeError: out of ideas"),
    ("em_user_models:four", r"entry point 'em_user_models:four': the model's output per sample is \(4,\), but it "
                            r"must be \(3,\)"),
    ("em_user_models:rejects", r"entry point 'em_user_models:rejects': the model rejects a zero sample of shape "
                               r"\(1, 1, 6, 6\)"),
])
def test_a_bad_entry_point_is_refused_naming_it(user_dir: Path, entry_point: str, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        entry_point_spec("ep-bad", entry_point, (1, 6, 6), 3, allowed=USER_MODULES, search_path=[user_dir])


def test_a_module_outside_the_search_path_does_not_import(user_dir: Path) -> None:
    with pytest.raises(ModelError, match="does not import: No module named 'em_user_models'"):
        entry_point_spec("ep-nowhere", "em_user_models:bare", (1, 6, 6), 3, allowed=USER_MODULES)


# --------------------------------------------------------------------------- the cost registry


def test_the_registry_derives_a_spec_on_first_use_and_forgets_a_replaced_one() -> None:
    register_spec(_small("list-registry"))
    assert not costs.known("list-registry")
    assert costs.cost("list-registry").params == 143 and costs.known("list-registry")
    assert [la.name for la in costs.layers("list-registry")] == ["conv1", "fc1", "fc2"]
    assert costs.max_batch_for_memory("list-registry", costs.training_memory_bytes("list-registry", 7)) == 7
    register_spec(layer_list_spec("list-registry", ["flatten", {"linear": 3}], (1, 6, 6), 3))  # a new model
    assert not costs.known("list-registry")
    assert costs.cost("list-registry").params == 36 * 3 + 3
    with pytest.raises(ModelError, match="unknown model 'resnet-9000'; known: .*digits-cnn"):
        costs.layers("resnet-9000")
    assert not costs.known("resnet-9000")


def test_figures_carried_for_a_new_spec_are_kept_when_the_spec_is_registered() -> None:
    carried = ModelCost(params=143, macs_per_sample=671, activations_per_sample=245)
    costs.register("list-carried", carried, None)  # from the job's message, before the model is built
    register_spec(_small("list-carried"))
    assert costs.known("list-carried") and costs.cost("list-carried") is carried


def test_registered_figures_are_used_as_given() -> None:
    figures = ModelCost(params=10, macs_per_sample=20, activations_per_sample=30)
    costs.register("given-elsewhere", figures, None)  # no such spec here: the planner's case
    assert costs.known("given-elsewhere") and costs.cost("given-elsewhere") == figures
    with pytest.raises(ModelError, match="no layer figures for model 'given-elsewhere'"):
        costs.layers("given-elsewhere")
    costs.forget("given-elsewhere")
    assert not costs.known("given-elsewhere")


@pytest.mark.parametrize("name", ["digits-cnn", "cifar-cnn"])
def test_the_plain_form_round_trips(name: str) -> None:
    cost, layers = costs.cost(name), costs.layers(name)
    plain = costs.cost_to_plain(cost, layers)
    assert plain["version"] == costs.PLAIN_VERSION and plain["params"] == cost.params
    assert costs.cost_from_plain(plain) == (cost, layers)
    undivided = costs.cost_to_plain(cost, None)
    assert undivided["layers"] is None and costs.cost_from_plain(undivided) == (cost, None)


def test_a_layer_without_bias_or_in_groups_round_trips_and_older_figures_still_decode() -> None:
    cost = ModelCost(params=143, macs_per_sample=671, activations_per_sample=245)
    layers = (LayerCost("conv1", 4, 144, 10, 16, 4, 36, bias=False, group=2), LayerCost("conv2", 5, 16, 17, 1, 1, 16))
    plain = costs.cost_to_plain(cost, layers)
    assert plain["layers"][0]["bias"] is False and plain["layers"][0]["group"] == 2
    assert "bias" not in plain["layers"][1] and "group" not in plain["layers"][1]  # defaults are not written
    assert costs.cost_from_plain(plain) == (cost, layers)
    assert costs.cost_from_plain(_plain())[1] == (LayerCost("conv1", 4, 144, 10, 16, 4, 36),  # as older figures were
                                                  LayerCost("conv2", 5, 16, 17, 1, 1, 16))


def test_a_submission_whose_groups_do_not_divide_a_layer_is_refused() -> None:
    from edgemesh.common.messages import JobSubmission

    def submission(group: int) -> JobSubmission:
        return JobSubmission(name="grouped", source=b"x", sha256="0" * 64, submitted_at=1.0,
                             layers=(LayerCost("conv1", 4, 144, 10, 16, 4, 36, bias=False, group=group),))

    submission(2).validate()
    for bad in (3, 0):
        with pytest.raises(ValueError, match="conv1"):
            submission(bad).validate()


def _plain(**changes: Any) -> dict[str, Any]:
    plain = costs.cost_to_plain(ModelCost(params=143, macs_per_sample=671, activations_per_sample=245), (
        LayerCost("conv1", 4, 144, 10, 16, 4, 36), LayerCost("conv2", 5, 16, 17, 1, 1, 16)))
    plain.update(changes)
    return plain


def _layer(**changes: Any) -> dict[str, Any]:
    plain = _plain()
    plain["layers"][1].update(changes)
    return plain


@pytest.mark.parametrize(("plain", "match"), [
    ([], "expected a table, got list"),
    (_plain(version=2), "version 2 is not 1"),
    (_plain(params=-1), "params must be an integer >= 0, got -1"),
    (_plain(macs_per_sample=1.5), "macs_per_sample must be an integer"),
    (_plain(activations_per_sample=True), "activations_per_sample must be an integer"),
    ({k: v for k, v in _plain().items() if k != "params"}, r"missing \['params'\]"),
    (_plain(flops=3), r"unexpected \['flops'\]"),
    (_plain(layers="conv1"), "layers must be a non-empty list or null"),
    (_plain(layers=[]), "layers must be a non-empty list or null"),
    (_layer(units=0), r"layer 1 \(conv2\): units must be >= 1"),
    (_layer(name=""), "layer 1: name must be a non-empty string"),
    (_layer(name="conv1"), "layer names repeat"),
    (_layer(in_values="many"), "layer 1: in_values must be an integer"),
    (_layer(extra=1), r"layer 1: missing \[\], unexpected \['extra'\]"),
    (_layer(bias=0), r"layer 1 \(conv2\): bias must be true or false, got 0"),
    (_layer(group=2), r"layer 1 \(conv2\): group must be an integer >= 1 that divides the units, got 2"),
    (_layer(group=0), "group must be an integer >= 1"),
])
def test_a_bad_plain_form_is_refused(plain: Any, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        costs.cost_from_plain(plain)


def test_the_cost_registry_does_not_import_torch() -> None:
    code = "import edgemesh.common.costs, sys; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0
