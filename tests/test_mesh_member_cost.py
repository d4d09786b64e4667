"""Edge Mesh planning, the cost model (planner/mesh/member_cost.py): step times, exchanges, memory."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import GIB, dev, full

from edgemesh.common import costs
from edgemesh.common.jobs import check_model, read_job_file
from edgemesh.services.planner.mesh import member_cost
from edgemesh.services.planner.mesh.devices import DeviceInfo
from edgemesh.services.planner.mesh.member_cost import (
    DEFAULT_LINK_BPS,
    FLOAT32_WIRE,
    layer_seconds,
    member_memory,
    member_step,
    member_time,
)


def test_a_single_device_pays_compute_and_the_parameter_server_only() -> None:
    pi = dev("pi", "pi4", latency=0.002)
    step = member_step("cifar-cnn", pi, full("cifar-cnn"), batch=32, cluster_size=1)
    assert step.compute_s == pytest.approx(costs.step_seconds_estimate("cifar-cnn", 32, pi.flops))
    assert step.gather_s == step.scatter_s == 0.0
    model_bytes = costs.cost("cifar-cnn").params * costs.FLOAT32_BYTES
    assert step.ps_s == pytest.approx(2 * model_bytes / pi.link_rate_bps + 2 * 0.002)  # unknown downlink = uplink
    assert step.total_s == member_time("cifar-cnn", pi, full("cifar-cnn"), batch=32, cluster_size=1)
    # an unmeasured link is the default rate
    blind = DeviceInfo(device="blind", flops=1e10, memory_bytes=GIB)
    assert member_step("digits-cnn", blind, full("digits-cnn"), batch=8, cluster_size=1).ps_s == pytest.approx(
        2 * costs.cost("digits-cnn").params * costs.FLOAT32_BYTES / DEFAULT_LINK_BPS)


def test_a_residual_models_projections_cost_with_their_blocks_last_layers() -> None:
    job = read_job_file(Path(__file__).resolve().parent.parent / "examples" / "resnet8-32.toml")
    check_model(job)
    spec, pi = job.model_key, dev("pi", "pi4", latency=0.002)
    # one member holding every unit pays the whole model's work and traffic, the projections' included
    step = member_step(spec, pi, full(spec), batch=16, cluster_size=1)
    assert step.compute_s == pytest.approx(costs.step_seconds_estimate(spec, 16, pi.flops))
    model_bytes = costs.cost(spec).params * costs.FLOAT32_BYTES
    assert step.ps_s == pytest.approx(2 * model_bytes / pi.link_rate_bps + 2 * 0.002)


def test_exchange_traffic_follows_the_documented_formulas() -> None:
    layers = costs.layers("digits-cnn")
    d = DeviceInfo(device="d", flops=1e10, memory_bytes=GIB, link_rate_bps=1e6, downlink_rate_bps=4e6, latency_s=0.01)
    b = 16
    # holding everything in a cluster of 3: it uploads all its slices and downloads every gradient channel twice
    step = member_step("digits-cnn", d, full("digits-cnn"), batch=b, cluster_size=3)
    gathered = sum(la.units * la.gathered_per_unit for la in layers) * b * FLOAT32_WIRE.activation
    inputs = sum(la.in_values for la in layers[1:]) * b * FLOAT32_WIRE.activation
    assert step.gather_s == pytest.approx(gathered / 1e6 + len(layers) * 0.01)
    assert step.scatter_s == pytest.approx(2 * inputs / 4e6 + (len(layers) - 1) * 0.01)
    # holding nothing: it downloads every slice and uploads every channel of its partial gradients
    step = member_step("digits-cnn", d, [0] * len(layers), batch=b, cluster_size=3)
    assert step.compute_s == 0.0 and step.ps_s == pytest.approx(2 * 0.01)
    assert step.gather_s == pytest.approx(gathered / 4e6 + len(layers) * 0.01)
    assert step.scatter_s == pytest.approx(inputs / 1e6 + (len(layers) - 1) * 0.01)
    # memory grows with the share and the batch, from the runtime up
    assert costs.RUNTIME_BYTES < member_memory("cifar-cnn", [0] * 5, batch=32) < member_memory(
        "cifar-cnn", [16, 32, 64, 128, 5], batch=32) < member_memory("cifar-cnn", full("cifar-cnn"), batch=32)
    with pytest.raises(ValueError):
        member_time("digits-cnn", d, [17, 0, 0, 0], batch=b, cluster_size=2)  # conv1 has 16 filters


def test_the_linear_forms_the_planner_optimises_are_the_cost_model() -> None:
    rng = random.Random(0)
    for spec in ("cifar-cnn", "digits-cnn"):
        layers = costs.layers(spec)
        for _ in range(100):
            d = DeviceInfo(device="d", flops=rng.uniform(1e9, 1e11), memory_bytes=GIB,
                           link_rate_bps=rng.choice([0.0, rng.uniform(1e6, 1e8)]),
                           downlink_rate_bps=rng.choice([0.0, rng.uniform(1e6, 1e8)]), latency_s=rng.uniform(0, 0.01))
            k, batch = rng.randint(1, 8), rng.randint(1, 64)
            counts = [rng.randint(0, la.units) for la in layers]
            const, weights = member_cost._coefficients(layers, d, batch, k, FLOAT32_WIRE)
            assert const + sum(w * n for w, n in zip(weights, counts, strict=True)) == pytest.approx(
                member_time(spec, d, counts, batch=batch, cluster_size=k), rel=1e-12)
            # the layers' seconds (what members meet at) and the parameter-server exchange make up the step
            step = member_step(spec, d, counts, batch=batch, cluster_size=k)
            assert sum(layer_seconds(spec, d, counts, batch=batch, cluster_size=k)) + step.ps_s == pytest.approx(
                step.total_s, rel=1e-12)
            # the grid's affine form in the batch: fixed seconds and seconds per whole model
            c0, c1, p0, p1 = member_cost.batch_line(layers, d, k, FLOAT32_WIRE)
            assert c0 + c1 * batch + p0 + p1 * batch == pytest.approx(
                member_time(spec, d, full(spec), batch=batch, cluster_size=k), rel=1e-9)
