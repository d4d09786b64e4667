"""Edge Mesh planning, the cost model: a member's predicted step time and memory in a cluster.

Cost model
----------
One member of a cluster of ``k`` members trains one step on a batch of ``b`` samples and holds
``n_l`` of the ``U_l`` output units of every divisible layer ``l`` (``costs.layers(spec)``, in
forward order ``l = 0 .. L-1``; the other members hold the rest). ``F`` is its matrix-multiply
rate (``DeviceInfo.flops``), ``up`` / ``down`` its uplink / downlink rates in bytes/s and ``lat``
its one-way latency to the broker. An unknown uplink (0) is ``DEFAULT_LINK_BPS``, an unknown
downlink is the uplink, an unknown latency is 0. ``V``, ``G`` and ``M`` are the bytes one value
takes on the wire (``Wire``): an activation or activation gradient (4 as float32, 2 as float16),
a gradient pushed to the parameter server and a model update pulled from it (what their codecs
make of a float32: 2 for fp16, 0.3 for grid-coded deltas at density 0.3). Per layer, ``macs``,
``params``, ``out``, ``gathered`` are the ``LayerCost`` figures per unit and ``in`` its
``in_values`` (a residual block's projection counts in its block's last layer's figures: it has that
layer's output units and a member computes its rows of it, with no exchange of its own). The member's
step time is the sum of four parts (no overlap assumed):

* **compute**: ``sum_l n_l x macs_l x FLOPS_PER_MAC x b / (F x TRAIN_EFFICIENCY)``.
* **forward all-gather** (``k > 1``; MQTT through a broker: a member publishes its slice once,
  the broker fans it out), every layer:
  ``n_l x gathered_l x b x V / up + (U_l - n_l) x gathered_l x b x V / down + lat``.
* **backward reduce-scatter** (``k > 1``), every layer but the first (its input is the data):
  the member publishes the other members' channels of its partial input gradient and receives
  its own channels from each of them. With ``share = n_{l-1} x gathered_{l-1}`` (its part of the
  layer's input; ``in_l = U_{l-1} x gathered_{l-1}`` for every spec):
  ``(in_l - share) x b x V / up + (k - 1) x share x b x V / down + lat``.
* **parameter server**: push the gradient of the parameters it holds and receive their update,
  ``held x G / up + held x M / down + 2 x lat`` with ``held = sum_l n_l x params_l`` (the whole
  model in a single-device cluster: plain data parallelism; a member receives the blocks of its
  rows of every model delta, ``model/delta/{device}``). One push and one update message per step,
  hence the two latencies.

A single-member cluster has no intra-cluster traffic. Members meet at every layer's exchanges, so
the cluster's iteration (``cluster_iteration_s``) is the sum over layers of the slowest member's
time on that layer, plus the slowest member's parameter-server traffic: at least its slowest
member's step. A member's time on layer ``l`` is its compute there, the layer's forward all-gather
and the backward reduce-scatter of the layer's output gradient (the one above, which carries the
next layer's input gradient and is sized by the member's share ``n_l`` of this layer): affine in
``n_l`` alone, ``a_il + w_il x n_l`` (``layer_coefficients``). A member with no unit of a layer
still spends ``a_il`` there, receiving the others' slices.

**Memory** of a member, bytes:
``RUNTIME_BYTES + PARAM_COPIES_MESH x 4 x held + 4 x b x (sum_l n_l x (2 x out_l + gathered_l) + sum_l in_l)``:
the layer outputs it computes before their channel-wise tail and their gradients, its gathered
slices, and the whole gathered input of every layer (kept for the weight gradient).
``PARAM_COPIES_MESH`` is ``costs.PARAM_COPIES`` (weights, gradients, error-feedback residual,
model view: a shard needs all four). Everything in the time and memory is linear in the counts:
``time_i = c_i + sum_l w_il x n_l`` and ``memory = m0 + sum_l q_l x n_l``, which the algorithms use.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from edgemesh.common import costs
from edgemesh.common.broadcast import delta_codec
from edgemesh.common.codecs import bytes_per_value
from edgemesh.common.config import Config
from edgemesh.common.costs import LayerCost
from edgemesh.services.planner.mesh.devices import DeviceInfo, check_devices

PARAM_COPIES_MESH = costs.PARAM_COPIES
"""float32 copies of its parameter shard a member holds (the same four as a data-parallel worker)."""
DEFAULT_LINK_BPS = 12.5e6
"""Link rate assumed when a device has not measured its uplink: 100 Mbit/s, in bytes/s."""
MIN_WEIGHT = 1e-15
"""Floor of a member's seconds per whole model share, so that a share always costs time."""


@dataclass(frozen=True, slots=True)
class Wire:
    """Bytes one value takes on the wire: an activation or activation gradient between members, a
    gradient pushed to the parameter server, a model update pulled from it (what the codecs make of
    a float32)."""

    activation: float = costs.FLOAT32_BYTES
    gradient: float = costs.FLOAT32_BYTES
    model: float = costs.FLOAT32_BYTES


FLOAT32_WIRE = Wire()
"""Every value as float32: the default."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTime:
    """The parts of one member's predicted step time, seconds."""

    compute_s: float
    gather_s: float
    """Forward all-gather of every layer's output slices, latency included."""
    scatter_s: float
    """Backward reduce-scatter of the partial input gradients, latency included."""
    ps_s: float
    """Gradient push and parameter pull of the member's shard."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.gather_s + self.scatter_s + self.ps_s


def link_rates(device: DeviceInfo) -> tuple[float, float, float]:
    """``(up, down, lat)`` of ``device``: its uplink and downlink rates, bytes/s, and its one-way
    latency, seconds, with the defaults of the module docstring for what it has not measured."""
    up = device.link_rate_bps if device.link_rate_bps > 0 else DEFAULT_LINK_BPS
    down = device.downlink_rate_bps if device.downlink_rate_bps > 0 else up
    return up, down, max(0.0, device.latency_s)


def check_batch(batch: int) -> None:
    """Raise ValueError for a batch below 1."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")


def _held(layers: Sequence[LayerCost], held: Sequence[int]) -> None:
    if len(held) != len(layers):
        raise ValueError(f"{len(held)} counts for {len(layers)} layers")
    for layer, n in zip(layers, held, strict=True):
        if not 0 <= n <= layer.units:
            raise ValueError(f"{layer.name}: {n} units held of {layer.units}")


def member_step(spec: str, device: DeviceInfo, held: Sequence[int], *, batch: int, cluster_size: int,
                wire: Wire = FLOAT32_WIRE) -> StepTime:
    """The predicted step time of ``device`` holding ``held[l]`` units of every layer of ``spec``
    (forward order) in a cluster of ``cluster_size`` members (module docstring, "Cost model")."""
    return step_time(_checked(spec, device, held, batch, cluster_size), device, held, batch, cluster_size, wire)


def _checked(spec: str, device: DeviceInfo, held: Sequence[int], batch: int,
             cluster_size: int) -> tuple[LayerCost, ...]:
    """``spec``'s layers, once the arguments of a public cost-model call are checked (ValueError)."""
    layers = costs.layers(spec)
    check_batch(batch)
    check_devices([device])
    _held(layers, held)
    if cluster_size < 1:
        raise ValueError("cluster_size must be >= 1")
    return layers


def _layer_seconds(layers: Sequence[LayerCost], device: DeviceInfo, held: Sequence[int], batch: int, k: int,
                   wire: Wire) -> list[float]:
    """The member's seconds on every layer: its compute there, forward and backward, the layer's forward
    all-gather and the backward reduce-scatter of its output gradient (the parameter-server traffic
    left out)."""
    const, weights, _ = layer_coefficients(layers, device, batch, k, wire)
    return [c + w * n for c, w, n in zip(const, weights, held, strict=True)]


def layer_coefficients(layers: Sequence[LayerCost], device: DeviceInfo, batch: int, k: int,
                       wire: Wire) -> tuple[list[float], list[float], list[float]]:
    """``(a, w, p)``: on layer ``l`` the member spends ``a[l] + w[l] x n_l`` seconds (``_layer_seconds``)
    and its parameter-server traffic takes ``2 x lat + sum_l p[l] x n_l``. A member holding no unit of a
    layer still spends ``a[l]`` there: it receives the others' slices."""
    up, down, lat = link_rates(device)
    value_bytes = wire.activation * batch
    rate = device.flops * costs.TRAIN_EFFICIENCY
    last = len(layers) - 1
    const, weights, ps = [], [], []
    for i, layer in enumerate(layers):
        a, w = 0.0, layer.macs_per_unit * costs.FLOPS_PER_MAC * batch / rate
        if k > 1:
            g = layer.gathered_per_unit * value_bytes
            a += layer.units * g / down + lat  # the forward all-gather: every slice but its own comes in
            w += g * (1 / up - 1 / down)
            if i < last:  # the reduce-scatter of this layer's output gradient, the next layer's input
                a += layers[i + 1].in_values * value_bytes / up + lat
                w += g * ((k - 1) / down - 1 / up)
        const.append(a)
        weights.append(w)
        ps.append(layer.params_per_unit * (wire.gradient / up + wire.model / down))
    return const, weights, ps


def cluster_seconds(layers: Sequence[LayerCost], members: Sequence[DeviceInfo], held: Sequence[Sequence[int]],
                    batch: int, wire: Wire) -> float:
    """A cluster's iteration: its members meet at every layer's exchange, so each layer lasts as long
    as its slowest member there; then each pushes its gradient and pulls the model."""
    k = len(members)
    per_layer = [_layer_seconds(layers, d, held[i], batch, k, wire) for i, d in enumerate(members)]
    ps = [step_time(layers, d, held[i], batch, k, wire).ps_s for i, d in enumerate(members)]
    return sum(max(times[li] for times in per_layer) for li in range(len(layers))) + max(ps)


def step_time(layers: Sequence[LayerCost], device: DeviceInfo, held: Sequence[int], batch: int, k: int,
              wire: Wire) -> StepTime:
    """``member_step`` on the layers of a spec, unchecked."""
    up, down, lat = link_rates(device)
    value_bytes = wire.activation * batch
    compute = sum(n * la.macs_per_unit for la, n in zip(layers, held, strict=True)) * costs.FLOPS_PER_MAC * batch
    gather = scatter = 0.0
    if k > 1:
        for i, (layer, n) in enumerate(zip(layers, held, strict=True)):
            gather += (n * layer.gathered_per_unit * value_bytes / up
                       + (layer.units - n) * layer.gathered_per_unit * value_bytes / down + lat)
            if i > 0:
                share = held[i - 1] * layers[i - 1].gathered_per_unit
                scatter += ((layer.in_values - share) * value_bytes / up
                            + (k - 1) * share * value_bytes / down + lat)
    params = sum(n * la.params_per_unit for la, n in zip(layers, held, strict=True))
    return StepTime(compute_s=compute / (device.flops * costs.TRAIN_EFFICIENCY), gather_s=gather,
                    scatter_s=scatter, ps_s=params * (wire.gradient / up + wire.model / down) + 2 * lat)


def layer_seconds(spec: str, device: DeviceInfo, held: Sequence[int], *, batch: int, cluster_size: int,
                  wire: Wire = FLOAT32_WIRE) -> list[float]:
    """The predicted seconds of ``device`` on every layer of ``spec`` (forward order) holding ``held[l]``
    units in a cluster of ``cluster_size``: compute, the layer's all-gather and the reduce-scatter of its
    output gradient (what members meet at; the parameter-server traffic left out)."""
    layers = _checked(spec, device, held, batch, cluster_size)
    return _layer_seconds(layers, device, held, batch, cluster_size, wire)


def member_time(spec: str, device: DeviceInfo, held: Sequence[int], *, batch: int, cluster_size: int,
                wire: Wire = FLOAT32_WIRE) -> float:
    """``member_step(...).total_s``: the member's predicted step time, seconds."""
    return member_step(spec, device, held, batch=batch, cluster_size=cluster_size, wire=wire).total_s


def member_memory(spec: str, held: Sequence[int], *, batch: int) -> int:
    """Predicted peak memory, bytes, of a member holding ``held[l]`` units of every layer of ``spec``."""
    layers = costs.layers(spec)
    check_batch(batch)
    _held(layers, held)
    return costs.member_memory_bytes(layers, held, batch)


def cluster_iteration_s(spec: str, members: Sequence[DeviceInfo], counts: Mapping[str, Sequence[int]], *,
                        batch: int, wire: Wire = FLOAT32_WIRE) -> float:
    """Predicted iteration time of a cluster with ``counts`` as in ``Division``: every layer as long as its
    slowest member there (they meet at its exchange), plus the slowest gradient push and model pull."""
    layers = costs.layers(spec)
    if not members:
        raise ValueError("a cluster needs members")
    if set(counts) != {la.name for la in layers}:
        raise ValueError(f"counts name layers {sorted(counts)}, the model has {[la.name for la in layers]}")
    for layer in layers:
        if len(counts[layer.name]) != len(members) or sum(counts[layer.name]) != layer.units:
            raise ValueError(f"{layer.name}: counts {tuple(counts[layer.name])} do not divide {layer.units} units "
                             f"among {len(members)} members")
    return cluster_seconds(layers, members, [[counts[la.name][i] for la in layers] for i in range(len(members))],
                           batch, wire)


def _coefficients(layers: Sequence[LayerCost], device: DeviceInfo, batch: int, k: int,
                  wire: Wire) -> tuple[float, list[float]]:
    """``(c, w)`` with ``member_time = c + sum_l w[l] x n_l`` for a member of a cluster of ``k``."""
    const, weights, ps = layer_coefficients(layers, device, batch, k, wire)
    return 2 * link_rates(device)[2] + sum(const), [w + p for w, p in zip(weights, ps, strict=True)]


def memory_coefficients(layers: Sequence[LayerCost], batch: int) -> tuple[int, list[int]]:
    """``(m0, q)`` with ``member_memory = m0 + sum_l q[l] x n_l``."""
    m0 = costs.RUNTIME_BYTES + costs.FLOAT32_BYTES * batch * sum(la.in_values for la in layers)
    q = [costs.FLOAT32_BYTES * (PARAM_COPIES_MESH * la.params_per_unit
                                + batch * (2 * la.out_per_unit + la.gathered_per_unit)) for la in layers]
    return m0, q


@functools.lru_cache(maxsize=1024)
def model_memory(layers: tuple[LayerCost, ...], batch: int) -> tuple[int, int]:
    """``(m0, bytes of the whole model's share)`` of the memory form at ``batch``."""
    m0, q = memory_coefficients(layers, batch)
    return m0, sum(qi * la.units for qi, la in zip(q, layers, strict=True))


def batch_line(layers: Sequence[LayerCost], device: DeviceInfo, k: int,
               wire: Wire) -> tuple[float, float, float, float]:
    """``(c0, c1, p0, p1)``: a member's fixed seconds are ``c0 + c1 x b`` and its seconds per whole
    model ``p0 + p1 x b`` at batch ``b`` (``_coefficients`` summed over the whole model: affine in the
    batch). The grid asks this for every device and cluster size, so it is folded from per-spec sums."""
    up, down, lat = link_rates(device)
    macs, params, gathered, gathered_inner, inputs = _sums(tuple(layers))
    rate = device.flops * costs.TRAIN_EFFICIENCY
    c0, c1 = 2 * lat, 0.0
    p0, p1 = params * (wire.gradient / up + wire.model / down), macs * costs.FLOPS_PER_MAC / rate
    if k > 1:
        value = wire.activation
        c0 += (2 * len(layers) - 1) * lat
        c1 += value * (gathered / down + inputs / up)
        p1 += value * (gathered * (1 / up - 1 / down) + gathered_inner * ((k - 1) / down - 1 / up))
    return c0, c1, p0, p1


@functools.lru_cache(maxsize=64)
def _sums(layers: tuple[LayerCost, ...]) -> tuple[int, int, int, int, int]:
    """Whole-model sums of a spec's layer figures: MACs, parameters and gathered values (of every
    layer and of all but the last) per sample, and the inputs of every layer but the first."""
    return (sum(la.units * la.macs_per_unit for la in layers), sum(la.units * la.params_per_unit for la in layers),
            sum(la.units * la.gathered_per_unit for la in layers),
            sum(la.units * la.gathered_per_unit for la in layers[:-1]), sum(la.in_values for la in layers[1:]))


def wire_for(config: Config) -> Wire:
    """Bytes per value the cost model charges, from the configured codecs: activations as
    ``worker.mesh_dtype``, gradients as the compressor's default codec (the adaptive compressor may
    compress harder on slow links), model updates as the parameter server's delta codec (under the job's policy)."""
    c = config
    density = c.compressor.static_density if c.compressor.default_codec in ("topk", "threshold") else 1.0
    model = costs.FLOAT32_BYTES if c.ps.broadcast != "delta" else \
        bytes_per_value(delta_codec(c.ps, c.training.sync_policy), c.ps.delta_density)
    return Wire(activation=2.0 if c.worker.mesh_dtype == "float16" else float(costs.FLOAT32_BYTES),
                gradient=bytes_per_value(c.compressor.default_codec, density), model=model)
