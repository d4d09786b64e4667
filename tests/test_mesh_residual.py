"""Residual blocks under model parallelism: three uneven members compute what one process computes (loss, logits,
every gradient, the running statistics' change) for the ResNet-8 and MobileNetV2 examples and for small blocks of
every kind a layer list or a user's module makes (identity and projection skips, a body of one layer, a block after
a flatten, dropout inside a body and after a block); the parameter server joins a projection's shards like any
layer's; the filter division divides a projection with its block's last layer; what does not divide is refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import (
    GIGABIT,
    MASK_STEP,
    assert_buffers_match,
    assert_matches_one_process,
    check_division,
    dev,
    make_config,
    member_part,
    one_process,
    train_together,
)
from torch import nn

from edgemesh.common import costs, models
from edgemesh.common.bus import Bus
from edgemesh.common.costs import LayerCost
from edgemesh.common.errors import ModelError
from edgemesh.common.jobs import check_model, parse_job, read_job_file
from edgemesh.common.messages import MeshSlice
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.models.lean import GlobalAvgPool, Residual
from edgemesh.common.topics import TopicMatch, Topics
from edgemesh.local.broker import BrokerProcess
from edgemesh.services.parameter_server.assembly import Assembly
from edgemesh.services.parameter_server.scheduler import Clock
from edgemesh.services.planner.mesh.division import divide_filters
from edgemesh.services.worker.mesh.exchange import BusExchange
from edgemesh.services.worker.mesh.member import MeshMember, MeshStep, in_thread

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LATE_S = 0.5
"""How late a slow member's backward of one layer is (the others must still wait for its partials)."""
SHARES = ((0.5, 0.125), (0.0, 0.75), (0.25, 0.0), (0.6, 0.3))
"""The first two members' shares of layer ``l`` are ``SHARES[l % 4]``, the third takes the rest: uneven, and members
0 and 1 hold no unit of some layers (a block's first and last layers among them)."""


def uneven(layers: Sequence[LayerCost]) -> dict[str, tuple[int, ...]]:
    """Three uneven members' counts of every layer, in whole groups."""
    out = {}
    for li, la in enumerate(layers):
        groups = la.units // la.group
        first, second = (int(groups * share) for share in SHARES[li % len(SHARES)])
        out[la.name] = (first * la.group, second * la.group, (groups - first - second) * la.group)
    return out


def mesh_job(name: str, layers: str) -> str:
    """A mesh job file of a model of ``layers`` (a TOML array) on 3x8x8 images of three classes."""
    return f"""
[job]
name = "{name}"
[model]
input_shape = [3, 8, 8]
classes = {json.dumps(["a", "b", "c"])}
layers = {layers}
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


IDENTITY = mesh_job("res-identity", """[
    {conv2d = 8, kernel = 3, padding = 1}, "batchnorm", "relu",
    {residual = [{conv2d = 8, kernel = 3, padding = 1, bias = false}, "batchnorm", "relu", {dropout = 0.2},
                 {conv2d = 8, kernel = 3, padding = 1, bias = false}, "batchnorm"], activation = "relu"},
    {dropout = 0.3},
    {residual = ["relu", {conv2d = 8, kernel = 3, padding = 1}]},
    "globalavgpool", {linear = 3}]""")
"""Identity skips: a block with dropout in its body and after it (shared masks), then a pre-activation block of one
layer (its first stage is its last), without activation."""
PROJECTION = mesh_job("res-projection", """[
    {residual = [{conv2d = 6, kernel = 3, padding = 1, stride = 2, bias = false}, "batchnorm", "relu",
                 {conv2d = 6, kernel = 3, padding = 1, bias = false}, "batchnorm"], activation = "relu"},
    {conv2d = 10, kernel = 3, padding = 1, stride = 2},
    "flatten", "relu",
    {residual = [{linear = 12}, "batchnorm", "relu", {linear = 7}, "batchnorm"], activation = "tanh"},
    {linear = 3}]""")
"""Projection skips: a block on the standardized input (the first stage, and the block's input comes after the
standardization), and a block of linear layers after a flatten and a ReLU (its input, their output, comes after
its first stage's leading modules) with a linear projection and batch norm."""


async def assert_members_compute_what_one_process_does(spec: str, seed: int, batch: int) -> list[MeshStep]:
    layers = costs.layers(spec)
    division = uneven(layers)
    params, x, y, update, logits = one_process(spec, seed, batch)
    results = await train_together(spec, division, seed, params, x, y)
    assert_matches_one_process(results, update.loss, logits, update.grads)
    moved = {name: change for name, change in update.buffers.items() if not name.startswith("input.")}
    assert moved and all(change.any() for name, change in moved.items() if "running" in name)
    assert_buffers_match(results, moved)
    members = [MeshMember(spec, division, i, seed=seed) for i in range(3)]
    assert sum(m.param_count for m in members) == costs.cost(spec).params
    assert sum(la.units * la.macs_per_unit for la in layers) == costs.cost(spec).macs_per_sample
    return results


def _registered(example: str) -> str:
    job = read_job_file(EXAMPLES / example)
    assert check_model(job)[2] == ""  # nothing refused
    return job.model_key


@pytest.mark.parametrize("example", ["resnet8-32.toml", "mobilenetv2-32.toml"])
async def test_three_uneven_members_compute_what_one_process_does_for_the_residual_examples(example: str) -> None:
    spec = _registered(example)
    blocks = [s for s in models.mesh_stages(models.build_model(spec)) if s.closes]
    assert len(blocks) == (3 if example.startswith("resnet") else 2)
    await assert_members_compute_what_one_process_does(spec, seed=3, batch=12)


@pytest.mark.parametrize("job", [IDENTITY, PROJECTION], ids=["identity", "projection"])
async def test_three_uneven_members_compute_what_one_process_does_for_small_residual_blocks(job: str) -> None:
    spec = parse_job(job)
    check_model(spec)
    await assert_members_compute_what_one_process_does(spec.model_key, seed=5, batch=10)


def test_stages_of_residual_blocks_say_where_a_block_starts_and_where_its_sum_is_made() -> None:
    identity, projection = parse_job(IDENTITY), parse_job(PROJECTION)
    check_model(identity)
    check_model(projection)
    stages = models.mesh_stages(models.build_model(identity.model_key))
    assert stages[1:4] == (
        models.Stage("res1.body.conv1", (), ("res1.body.bn1", "res1.body.relu1", "res1.body.drop1"), opens="res1"),
        models.Stage("res1.body.conv2", (), ("res1.body.bn2",), closes="res1", post=("res1.act", "drop1")),
        models.Stage("res2.body.conv1", ("res2.body.relu1",), (), opens="res2", closes="res2", post=("gap1",)))
    stages = models.mesh_stages(models.build_model(projection.model_key))
    assert stages[0].opens == "res1" and stages[0].pre == ("input",) and stages[0].entry == 1
    assert stages[1].skip == ("res1.skip.conv1", "res1.skip.bn1")
    assert stages[3] == models.Stage("res2.body.fc1", ("flatten1", "relu1"), ("res2.body.bn1", "res2.body.relu1"),
                                     opens="res2", entry=2)
    assert stages[4].skip == ("res2.skip.fc1", "res2.skip.bn1") and stages[4].post == ("res2.act",)


def _users_model() -> nn.Module:
    body = nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1))
    return nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(2, 4, 3, padding=1), relu1=nn.ReLU(),
        res1=Residual(body, skip=nn.Conv2d(4, 8, 1, stride=2), act=nn.ReLU()),
        gap1=GlobalAvgPool(), fc1=nn.Linear(8, 3)))


async def test_a_users_block_whose_projection_is_a_bare_convolution_with_bias_divides() -> None:
    name = "mesh-users-residual"
    models.register_spec(models.ModelSpec(name=name, input_shape=(2, 6, 6), num_classes=3, builder=_users_model,
                                          description="a projection without batch norm, with bias"))
    layers = {la.name: la for la in costs.layers(name)}
    assert list(layers) == ["conv1", "res1.body.0", "res1.body.3", "fc1"]
    assert layers["res1.body.3"].divided == ("res1.skip.weight", "res1.skip.bias")
    # the projection's unit: 9 positions of 4 inputs, its 4 weights and bias
    assert layers["res1.body.3"].macs_per_unit == 9 * 8 * 9 + 9 * 4
    assert layers["res1.body.3"].params_per_unit == (8 * 9 + 1) + (4 + 1)
    await assert_members_compute_what_one_process_does(name, seed=2, batch=8)


@contextlib.asynccontextmanager
async def member_buses(broker: BrokerProcess, members: list[MeshMember], x: np.ndarray) -> AsyncIterator[
        list[BusExchange]]:
    """One MQTT connection and :class:`BusExchange` per member, as a worker's session makes them, routing to it the
    other members' forward slices and the backward slices addressed to it."""
    cfg, topics, devices = make_config(broker, job="meshres"), Topics("meshres"), [f"m{i}" for i in range(3)]
    async with contextlib.AsyncExitStack() as stack:
        exchanges = []
        for device, member in zip(devices, members, strict=True):
            bus = Bus(cfg.broker, client_id=f"{device}-{uuid.uuid4().hex[:8]}", metrics=ServiceMetrics("worker"))
            ex = BusExchange(bus, topics, cluster="m-m0", device=device, members=devices, counts=member.counts,
                             order=member.order, plan_version=1, timeout_s=10.0, input_shape=x.shape[1:],
                             skips=member.skips)
            ex.begin(MASK_STEP, len(x))

            async def deliver(msg: MeshSlice, where: TopicMatch, ex: BusExchange = ex) -> None:
                ex.deliver(msg, where.device)

            for other in devices:
                if other != device:
                    bus.route(topics.mesh_filter("m-m0", "+", "fwd", other), MeshSlice, deliver)
            bus.route(topics.backward_filter("m-m0", device), MeshSlice, deliver)
            await stack.enter_async_context(bus)
            exchanges.append(ex)
        yield exchanges


async def test_members_over_mqtt_wait_for_the_skips_partials_of_a_member_without_the_blocks_first_layer(
        mosquitto_broker: BrokerProcess) -> None:
    spec = parse_job(IDENTITY)
    check_model(spec)
    # member 0 holds none of res1's first layer and 3 channels of its last: its partial of res1's input is the
    # skip's, on those channels, 2 of which member 1 holds in the layer before (conv1)
    division = uneven(costs.layers(spec.model_key)) | {
        "conv1": (1, 4, 3), "res1.body.conv1": (0, 6, 2), "res1.body.conv2": (3, 0, 5)}
    params, x, y, update, logits = one_process(spec.model_key, 5, 10)
    members = [MeshMember(spec.model_key, division, i, seed=5) for i in range(3)]
    assert members[0].skips == {"res1.body.conv1": "res1.body.conv2", "res2.body.conv1": "res2.body.conv1"}
    for m in members:
        m.load(params, version=0)
    async def late(fn: Callable[..., Any], *args: Any, flops: float = 0.0) -> Any:
        """Member 0's runner: slow at the backward of res1's first layer, so its partials come last."""
        if fn == members[0]._backward and args[0] == "res1.body.conv1":
            await asyncio.sleep(LATE_S)
        return await in_thread(fn, *args, flops=flops)

    async with member_buses(mosquitto_broker, members, x) as exchanges:
        results = await asyncio.wait_for(asyncio.gather(*(m.step(MASK_STEP, x, y, ex, run=late if i == 0 else None)
                                                          for i, (m, ex) in enumerate(zip(members, exchanges,
                                                                                          strict=True)))), 30.0)
    assert_matches_one_process(list(results), update.loss, logits, update.grads)  # the others waited for them


async def test_the_parameter_server_joins_a_projections_shards_into_one_processs_update() -> None:
    spec = _registered("resnet8-32.toml")
    params, x, y, update, _ = one_process(spec, seed=3, batch=6)
    results = await train_together(spec, uneven(costs.layers(spec)), 3, params, x, y)
    assert {n for r in results for n in r.grads} >= {"res2.skip.conv1.weight", "res2.skip.bn1.weight"}
    model = models.build_model(spec, seed=3)
    assembly, clock = Assembly({n: s[0][0] for n, s in models.gradient_layout(model).items()}, timeout_s=5.0), Clock()
    outs = [assembly.add(member_part(f"m{i}", r, len(y), MASK_STEP), clock, 1, 0.0) for i, r in enumerate(results)]
    assert not outs[0].joined and not outs[1].joined
    [joined] = outs[-1].joined
    for kind, want in (("grads", update.grads), ("buffers", update.buffers)):
        got: dict[str, np.ndarray] = {}
        for g in getattr(joined, kind):
            got.setdefault(g.param, np.zeros_like(want[g.param]))[g.start:g.stop] += g.values.reshape(
                (g.stop - g.start, *want[g.param].shape[1:]))
        assert set(got) == {n for n in want if not n.startswith("input.")}  # the standardization's constants stay
        for name, values in got.items():
            np.testing.assert_allclose(values, want[name], rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("example", ["resnet8-32.toml", "mobilenetv2-32.toml"])
def test_the_filter_division_divides_a_projection_with_its_blocks_last_layer(example: str) -> None:
    spec = _registered(example)
    layers = costs.layers(spec)
    assert not any(".skip" in la.name for la in layers)  # no division entry of its own
    members = [dev("slow", "pi4", flops=0.5e9, link=GIGABIT), dev("mid", "pi5", flops=1e9, link=GIGABIT),
               dev("fast", "pi5", flops=4e9, link=GIGABIT)]
    for batch in (8, 64):
        division = divide_filters(spec, members, batch)
        check_division(division, spec, members, batch)
        for index in range(3):
            rows = MeshMember(spec, division.counts, index).rows()
            for la in layers:
                for tensor in la.divided:
                    assert rows[tensor] == rows[f"{la.name}.weight"], tensor
            if example.startswith("resnet"):
                assert rows["res3.skip.conv1.weight"] == rows["res3.body.conv2.weight"]
                assert rows["res3.skip.bn1.running_mean"] == rows["res3.body.bn2.running_mean"]


def test_a_projections_cost_counts_with_its_blocks_last_layer() -> None:
    spec = _registered("resnet8-32.toml")
    figures = {la.name: la for la in costs.layers(spec)}
    last = figures["res2.body.conv2"]  # 16x16 positions, 32 units of 3x3x32, its projection 1x1x16 of stride 2
    assert last.macs_per_unit == 16 * 16 * (3 * 3 * 32) + 16 * 16 * 16
    assert last.params_per_unit == 3 * 3 * 32 + 2 + 16 + 2
    assert last.out_per_unit == 2 * 16 * 16  # the conv's and the projection's outputs before their batch norms
    assert last.counters == ("res2.body.bn2.num_batches_tracked", "res2.skip.bn1.num_batches_tracked")
    assert figures["res2.body.conv1"].in_values == 16 * 32 * 32  # the block's input, kept whole


@pytest.mark.parametrize(("model", "match"), [
    (nn.Sequential(nn.Conv2d(1, 4, 3), Residual(nn.Sequential(nn.Conv2d(4, 4, 1), Residual(nn.Sequential(
        nn.Conv2d(4, 4, 1)))))), r"'1.body.1' \(Residual inside a residual block: nested blocks do not divide\)"),
    (nn.Sequential(nn.Conv2d(1, 4, 3), Residual(nn.Conv2d(4, 4, 1))), r"'1' \(Residual whose body is not sequential"),
    (nn.Sequential(nn.Conv2d(1, 4, 3), Residual(nn.Sequential(nn.ReLU()))), r"'1' \(Residual whose body does not end"),
    (nn.Sequential(nn.Linear(4, 4), Residual(nn.Sequential(nn.Linear(4, 4), nn.Flatten()))),
     r"'1' \(Residual whose body does not end with a conv or linear layer"),
    (nn.Sequential(nn.Conv2d(1, 4, 3), Residual(nn.Sequential(nn.Conv2d(4, 8, 1)), skip=nn.Sequential(nn.ReLU()))),
     r"'1.skip' \(a skip connection divides as the identity or as a conv or linear layer followed by batch norms\)"),
    (nn.Sequential(nn.Conv2d(1, 4, 3), Residual(nn.Sequential(nn.Conv2d(4, 8, 1)), skip=nn.Conv2d(4, 8, 1, groups=2))),
     r"'1.skip' \(a projection divides with the body's last layer '1.body.0' of 8 units"),
    (nn.Sequential(nn.Conv2d(1, 4, 3), Residual(nn.Sequential(nn.Conv2d(4, 8, 1)),
                                                skip=nn.Sequential(nn.Conv2d(4, 8, 1), nn.BatchNorm2d(6)))),
     r"'1.skip.1' \(BatchNorm2d of 6 features after '1.skip.0' of 8 units\)"),
    (nn.Sequential(nn.Conv2d(1, 4, 3), Residual(nn.Sequential(nn.Conv2d(4, 4, 1)), act=nn.AlphaDropout(0.1))),
     r"'1.act' \(AlphaDropout\)"),
], ids=["nested", "body-not-sequential", "no-layer", "ends-replicated", "other-skip", "grouped-projection",
        "projection-norm", "activation"])
def test_what_a_residual_block_cannot_divide_is_refused_naming_the_module(model: nn.Module, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        models.mesh_stages(model)
