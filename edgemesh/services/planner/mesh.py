"""Edge Mesh planning (DESIGN.md §4): the filter division inside a cluster and the hybrid training grid.

Pure functions, no I/O and no torch: the planner service wires them to the bus, tests and
``bench/`` call them directly. ``divide_filters`` splits every divisible layer of a model among
the members of one cluster; ``training_grid`` chooses the clusters of a whole fleet.

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
``in_values``. The member's step time is the sum of four parts (no overlap assumed):

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
``n_l`` alone, ``a_il + w_il x n_l`` (``_layer_coefficients``). A member with no unit of a layer
still spends ``a_il`` there, receiving the others' slices.

**Memory** of a member, bytes:
``RUNTIME_BYTES + PARAM_COPIES_MESH x 4 x held + 4 x b x (sum_l n_l x (2 x out_l + gathered_l) + sum_l in_l)``:
the layer outputs it computes before their channel-wise tail and their gradients, its gathered
slices, and the whole gathered input of every layer (kept for the weight gradient).
``PARAM_COPIES_MESH`` is ``costs.PARAM_COPIES`` (weights, gradients, error-feedback residual,
model view: a shard needs all four). Everything in the time and memory is linear in the counts:
``time_i = c_i + sum_l w_il x n_l`` and ``memory = m0 + sum_l q_l x n_l``, which the algorithms use.

Filter division (``divide_filters``)
------------------------------------
The division minimises the iteration: every layer's slowest member and the slowest
parameter-server exchange.

1. Memory caps: with ``cap_i = min(1, (memory_i - m0) / sum_l q_l x U_l)``, member *i* takes at
   most ``cap_i x U_l`` units of every layer, which keeps it within its memory.
2. Every layer alone: its units go to the members at a water level ``T_l`` (the parameter-server
   traffic of the layer's parameters counted with it), ``sum_i clamp((T_l - a_il) / W_il, 0, cap_i) = 1``
   with ``W_il`` the member's seconds for the whole layer: found exactly by a scan of the breakpoints
   of that piecewise-linear function. Then integer counts: floors, and the units left one at a time to
   the member whose time on the layer grows least and whose memory still holds them.
3. Local search: while moving one unit of a layer off the member that sets the layer's time or the
   slowest parameter-server exchange shortens the iteration by at least ``MIN_MOVE_GAIN`` of it
   (memory permitting), make the best such move: this weighs the parameter traffic exactly, which
   step 2 only spreads over the layers.
4. The splits by speed and the even split replace the result should they predict a shorter iteration.
If the members' memory cannot hold the model even together, the memory caps are dropped, the
division minimises time alone and ``fits`` is False.

Training grid (``training_grid``)
---------------------------------
An iteration trains ``batch`` samples in all (the global batch: the same SGD step whatever the
fleet), split among the clusters, which run synchronous rounds: the iteration lasts as long as
the slowest cluster. The grid chooses the number of clusters ``K``, their members, each cluster's
share ``b_c`` of the batch and the division inside each for the shortest predicted iteration:

* A device whose memory cannot hold ``1 / max_cluster_size`` of the model is excluded. When
  there are more devices than ``batch / min_batch x max_cluster_size``, only the fastest take
  part (the others are ``idle``).
* For each candidate ``K`` (every count from ``ceil(n / max_cluster_size)`` to
  ``min(n, batch / min_batch)`` for small fleets; a geometric ladder of ``GRID_CANDIDATES`` and
  ``GRID_REFINE`` more around the best for large ones), devices go to ``K`` clusters of about
  equal total FLOPS (fastest first, each to the cluster with the least so far). The batch is split
  so that the clusters finish together: a cluster's time is about ``a_c + s_c x b`` (compute and
  exchange traffic grow with its batch, the parameter traffic does not), fitted from two quick
  estimates (every member the same share of every layer, at the water level of the members' whole
  steps: the layers' meetings left out), and ``clamp((T - a_c) / s_c, min_batch, max_batch) = b_c``
  with ``sum b_c = batch`` gives ``T`` and the ``b_c`` (``planner.min_batch`` and
  ``planner.max_batch``; whole samples by largest remainder). Counts too few to train ``batch``
  at ``max_batch`` each compete only when no count can: then the most samples win. A small fleet
  (at most ``GRID_CANDIDATES`` counts) also weighs, for every ``K`` and ``0 < s < K``, the ``s``
  fastest devices alone and the others in ``K - s`` clusters of equal FLOPS: equal FLOPS pairs a
  fast board with a slow one that may not be worth its exchanges.
* Every layout of a small fleet, or for a fleet with more choices the
  ``GRID_FINALISTS`` counts with the shortest ``T`` (another ``K`` must be ``GRID_TIE`` shorter
  to rank above a smaller one) and one cluster per device, is divided exactly (``divide_filters``):
  the quick estimate can flatter a layout of many meshes by half or more;
  the shortest exact iteration wins, or with a ``slack`` (``planner.grid_slack``) the fewest
  clusters within that share of it: every replica of the model costs each of its members its
  rows four times over and the PS one gradient per round (smaller counts whose estimate is
  within the slack are divided exactly too). Members the division gives no unit at all (a link
  too slow to be worth its exchange traffic) are dropped from their cluster as ``idle``.

One cluster per device is among the candidates (``K = n``), with batches balanced to speed, so
the grid is never predicted slower than balanced data parallelism.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edgemesh.common import costs
from edgemesh.common.costs import LayerCost
from edgemesh.services.planner.layout import MAX_NAME, NAME_HASH_CHARS, DeviceInfo, cluster_name

PARAM_COPIES_MESH = costs.PARAM_COPIES
"""float32 copies of its parameter shard a member holds (the same four as a data-parallel worker)."""
DEFAULT_LINK_BPS = 12.5e6
"""Link rate assumed when a device has not measured its uplink: 100 Mbit/s, in bytes/s."""
MESH_PREFIX = "m-"
"""A cluster of several devices is named ``m-<first member>``."""
DEFAULT_MAX_CLUSTER_SIZE = 8
"""Most members of one cluster: beyond, every member spends its step receiving the others' slices."""
GRID_TIE = 0.01
"""A layout with more clusters must predict an iteration this share shorter to be chosen."""
GRID_CANDIDATES = 12
"""Cluster counts tried on a geometric ladder for a large fleet (all of them for a fleet with fewer choices)."""
GRID_FINALISTS = 2
"""Layouts with the best estimates that are divided exactly before one is chosen when more than
``GRID_CANDIDATES`` counts were weighed (one for a fleet of more than ``LARGE_FLEET``, besides one
cluster per device); with fewer, all are."""
LARGE_FLEET = 200
GRID_REFINE = 6
"""Cluster counts tried again, evenly, between the ladder neighbours of the best count."""
MIN_MOVE_GAIN = 1e-3
"""Share of the iteration a single-unit move of the local search must save: below it, members would
trade units between layers for microseconds (and equal members end up unequal)."""
REPLAN_THRESHOLD = 0.25
"""Default relative slowdown of the current layout, against the best new one, that warrants a new plan."""
_MIN_WEIGHT = 1e-15
"""Floor of a member's seconds per whole model share, so that a share always costs time."""
_TOLERANCE = 1e-12


# --------------------------------------------------------------------------- results


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Division:
    """How one cluster divides the model: output units of every layer per member, in member order."""

    members: tuple[str, ...]
    counts: dict[str, tuple[int, ...]]
    """Layer name -> units of each member (every layer's counts add up to its units)."""
    member_seconds: tuple[float, ...]
    """Predicted step time of each member."""
    predicted_s: float
    """Predicted iteration time of the cluster: every layer as long as its slowest member there, plus the
    slowest parameter-server exchange (at least the slowest member's step)."""
    member_memory_bytes: tuple[int, ...]
    fits: bool
    """Whether every member's memory holds its share (False: even the best division overflows one)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GridCluster:
    """One cluster of the training grid."""

    name: str
    members: tuple[str, ...]
    """Devices in member order (by name): the order of ``division.counts``."""
    division: Division
    batch: int
    """Samples of the iteration's batch this cluster trains."""
    predicted_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Grid:
    """The chosen clusters of a fleet and what they are predicted to achieve."""

    clusters: tuple[GridCluster, ...]
    excluded: tuple[str, ...]
    """Devices whose memory holds too little of the model to be useful anywhere."""
    idle: tuple[str, ...]
    """Devices the best layout gives no work: on their links or at their speed they would only slow
    their cluster down."""
    predicted_iteration_s: float
    """The slowest cluster's iteration: the length of a synchronous round."""
    throughput_samples_s: float
    """Samples trained per second: the batch over the round time."""

    @property
    def members(self) -> frozenset[str]:
        return frozenset(m for c in self.clusters for m in c.members)


# --------------------------------------------------------------------------- cost model


def _rates(device: DeviceInfo) -> tuple[float, float, float]:
    up = device.link_rate_bps if device.link_rate_bps > 0 else DEFAULT_LINK_BPS
    down = device.downlink_rate_bps if device.downlink_rate_bps > 0 else up
    return up, down, max(0.0, device.latency_s)


def _check_batch(batch: int) -> None:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")


def _check_devices(devices: Sequence[DeviceInfo]) -> None:
    names = {d.device for d in devices}
    if len(names) != len(devices):
        raise ValueError(f"a device appears twice in {sorted(d.device for d in devices)}")
    for d in devices:
        if not (0 < d.flops < math.inf):
            raise ValueError(f"{d.device}: flops must be a positive number, got {d.flops}")
        if not (d.memory_bytes >= 0 and 0 <= d.link_rate_bps < math.inf and 0 <= d.downlink_rate_bps < math.inf
                and 0 <= d.latency_s < math.inf):
            raise ValueError(f"{d.device}: memory, link rates and latency must be finite numbers >= 0")


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
    return _step(_checked(spec, device, held, batch, cluster_size), device, held, batch, cluster_size, wire)


def _checked(spec: str, device: DeviceInfo, held: Sequence[int], batch: int,
             cluster_size: int) -> tuple[LayerCost, ...]:
    """``spec``'s layers, once the arguments of a public cost-model call are checked (ValueError)."""
    layers = costs.layers(spec)
    _check_batch(batch)
    _check_devices([device])
    _held(layers, held)
    if cluster_size < 1:
        raise ValueError("cluster_size must be >= 1")
    return layers


def _layer_seconds(layers: Sequence[LayerCost], device: DeviceInfo, held: Sequence[int], batch: int, k: int,
                   wire: Wire) -> list[float]:
    """The member's seconds on every layer: its compute there, forward and backward, the layer's forward
    all-gather and the backward reduce-scatter of its output gradient (the parameter-server traffic
    left out)."""
    const, weights, _ = _layer_coefficients(layers, device, batch, k, wire)
    return [c + w * n for c, w, n in zip(const, weights, held, strict=True)]


def _layer_coefficients(layers: Sequence[LayerCost], device: DeviceInfo, batch: int, k: int,
                        wire: Wire) -> tuple[list[float], list[float], list[float]]:
    """``(a, w, p)``: on layer ``l`` the member spends ``a[l] + w[l] x n_l`` seconds (``_layer_seconds``)
    and its parameter-server traffic takes ``2 x lat + sum_l p[l] x n_l``. A member holding no unit of a
    layer still spends ``a[l]`` there: it receives the others' slices."""
    up, down, lat = _rates(device)
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


def _cluster_seconds(layers: Sequence[LayerCost], members: Sequence[DeviceInfo], held: Sequence[Sequence[int]],
                     batch: int, wire: Wire) -> float:
    """A cluster's iteration: its members meet at every layer's exchange, so each layer lasts as long
    as its slowest member there; then each pushes its gradient and pulls the model."""
    k = len(members)
    per_layer = [_layer_seconds(layers, d, held[i], batch, k, wire) for i, d in enumerate(members)]
    ps = [_step(layers, d, held[i], batch, k, wire).ps_s for i, d in enumerate(members)]
    return sum(max(times[li] for times in per_layer) for li in range(len(layers))) + max(ps)


def _step(layers: Sequence[LayerCost], device: DeviceInfo, held: Sequence[int], batch: int, k: int,
          wire: Wire) -> StepTime:
    up, down, lat = _rates(device)
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
    _check_batch(batch)
    _held(layers, held)
    return _memory(layers, held, batch)


def _memory(layers: Sequence[LayerCost], held: Sequence[int], batch: int) -> int:
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
    return _cluster_seconds(layers, members, [[counts[la.name][i] for la in layers] for i in range(len(members))],
                            batch, wire)


def _coefficients(layers: Sequence[LayerCost], device: DeviceInfo, batch: int, k: int,
                  wire: Wire) -> tuple[float, list[float]]:
    """``(c, w)`` with ``member_time = c + sum_l w[l] x n_l`` for a member of a cluster of ``k``."""
    const, weights, ps = _layer_coefficients(layers, device, batch, k, wire)
    return 2 * _rates(device)[2] + sum(const), [w + p for w, p in zip(weights, ps, strict=True)]


def _memory_coefficients(layers: Sequence[LayerCost], batch: int) -> tuple[int, list[int]]:
    """``(m0, q)`` with ``member_memory = m0 + sum_l q[l] x n_l``."""
    m0 = costs.RUNTIME_BYTES + costs.FLOAT32_BYTES * batch * sum(la.in_values for la in layers)
    q = [costs.FLOAT32_BYTES * (PARAM_COPIES_MESH * la.params_per_unit
                                + batch * (2 * la.out_per_unit + la.gathered_per_unit)) for la in layers]
    return m0, q


def _water_level(const: Sequence[float], weight: Sequence[float], cap: Sequence[float]) -> float:
    """The smallest ``T`` with ``sum_i clamp((T - const_i) / weight_i, 0, cap_i) >= 1`` (inf if the caps
    add up to less than 1): exact, from the breakpoints of the piecewise-linear sum."""
    events: list[tuple[float, float]] = []
    for c, w, x in zip(const, weight, cap, strict=True):
        if x > 0:
            events.append((c, 1.0 / w))
            events.append((c + x * w, -1.0 / w))
    events.sort()
    covered = slope = 0.0
    prev = events[0][0] if events else math.inf
    for at, change in events:
        reached = covered + slope * (at - prev)
        if reached >= 1.0 - _TOLERANCE:
            return prev + max(0.0, 1.0 - covered) / slope
        covered, prev = reached, at
        slope += change
    return math.inf


# --------------------------------------------------------------------------- filter division


def divide_filters(spec: str, members: Sequence[DeviceInfo], batch: int, wire: Wire = FLOAT32_WIRE) -> Division:
    """Divide every divisible layer of ``spec`` among ``members`` (in the given order) so that the
    slowest member's step is as short as possible within every member's memory (module docstring).

    Raises ValueError for no members, a batch below 1, a duplicate member or a non-positive flops;
    ModelError for an unknown spec.
    """
    layers = costs.layers(spec)
    _check_batch(batch)
    if not members:
        raise ValueError("a cluster needs members")
    _check_devices(members)
    return _divide(layers, members, batch, wire)


def _divide(layers: Sequence[LayerCost], members: Sequence[DeviceInfo], batch: int, wire: Wire) -> Division:
    k = len(members)
    units = [la.units for la in layers]
    m0, q = _memory_coefficients(layers, batch)
    full_memory = sum(qi * u for qi, u in zip(q, units, strict=True))
    caps = [min(1.0, max(0.0, (d.memory_bytes - m0) / full_memory)) for d in members]
    memory_bound = sum(caps) >= 1.0 - _TOLERANCE
    if k == 1:
        counts = [[u] for u in units]  # counts[l][i]
    else:
        if not memory_bound:
            caps = [1.0] * k  # nothing fits: divide for time alone (fits will say so)
        room = [d.memory_bytes - m0 if memory_bound else math.inf for d in members]
        forms = [_layer_coefficients(layers, d, batch, k, wire) for d in members]
        fixed = [2 * _rates(d)[2] for d in members]  # the push and the update message's latencies
        counts = _improve(_layer_counts(units, forms, caps, q, room), forms, fixed, q, room)
        # the splits by speed and the even split, should they do better still
        best_s = _cluster_seconds(layers, members, _by_member(counts, k), batch, wire)
        for other in (_proportional(units, [d.flops for d in members]), _proportional(units, [1.0] * k)):
            fits = all(sum(q[li] * other[li][i] for li in range(len(units))) <= room[i] for i in range(k))
            other_s = _cluster_seconds(layers, members, _by_member(other, k), batch, wire) if fits else math.inf
            if other_s < best_s:
                counts, best_s = other, other_s
    division = {la.name: tuple(counts[li]) for li, la in enumerate(layers)}
    held = _by_member(counts, k)
    seconds = tuple(_step(layers, d, held[i], batch, k, wire).total_s for i, d in enumerate(members))
    predicted = _cluster_seconds(layers, members, held, batch, wire)
    memory = tuple(_memory(layers, held[i], batch) for i in range(k))
    return Division(members=tuple(d.device for d in members), counts=division, member_seconds=seconds,
                    predicted_s=predicted, member_memory_bytes=memory,
                    fits=all(m <= d.memory_bytes for m, d in zip(memory, members, strict=True)))


Forms = Sequence[tuple[Sequence[float], Sequence[float], Sequence[float]]]
"""Every member's ``_layer_coefficients``: ``forms[i] = (a, w, p)``."""


def _layer_counts(units: Sequence[int], forms: Forms, caps: Sequence[float], q: Sequence[int],
                  room: Sequence[float]) -> list[list[int]]:
    """Whole units per layer and member, ``[l][i]`` (steps 1 and 2 of the module docstring): every
    layer's water level, its parameter traffic counted with it, then floors and the units left one
    at a time to the member whose time there grows least and whose memory still holds them."""
    k = len(forms)
    counts: list[list[int]] = []
    times = []
    for li, u in enumerate(units):
        const = [f[0][li] for f in forms]
        weight = [max(_MIN_WEIGHT, f[1][li] + f[2][li]) for f in forms]
        level = _water_level(const, [w * u for w in weight], caps)
        if math.isinf(level):  # the caps add up to 1 only within rounding
            shares = list(caps)
        else:
            shares = [min(x, max(0.0, (level - c) / (w * u))) for c, w, x in zip(const, weight, caps, strict=True)]
        counts.append([min(u, math.floor(x * u + 1e-9)) for x in shares])
        times.append([c + w * n for c, w, n in zip(const, weight, counts[-1], strict=True)])
    used = [sum(q[li] * row[i] for li, row in enumerate(counts)) for i in range(k)]  # the floors fit the caps
    total = [sum(row[i] for row in times) for i in range(k)]
    for li, u in enumerate(units):
        row = counts[li]
        for _ in range(u - sum(row)):
            fitting = [i for i in range(k) if used[i] + q[li] <= room[i]] or list(range(k))
            # ties (equal members) to the member with the least work so far
            i = min(fitting, key=lambda j: (times[li][j] + forms[j][1][li] + forms[j][2][li], total[j], j))
            step = forms[i][1][li] + forms[i][2][li]
            row[i] += 1
            times[li][i] += step
            total[i] += step
            used[i] += q[li]
    return counts


def _improve(counts: list[list[int]], forms: Forms, fixed: Sequence[float], q: Sequence[int],
             room: Sequence[float]) -> list[list[int]]:
    """Step 3 of the module docstring: single-unit moves, within a layer, off a member that sets the
    layer's time or the parameter-server exchange, while one lowers the cluster's iteration (the sum
    of every layer's slowest member and the slowest exchange) by ``MIN_MOVE_GAIN`` of it, memory
    permitting."""
    k, n_layers = len(forms), len(counts)
    t = [[forms[i][0][li] + forms[i][1][li] * counts[li][i] for i in range(k)] for li in range(n_layers)]
    ps = [fixed[i] + sum(forms[i][2][li] * counts[li][i] for li in range(n_layers)) for i in range(k)]
    used = [sum(q[li] * counts[li][i] for li in range(n_layers)) for i in range(k)]
    tops = [max(row) for row in t]
    for _ in range(k * sum(map(sum, counts))):
        iteration = sum(tops) + max(ps)  # every move shortens the iteration
        ps_top = max(ps)
        slowest_ps = ps.index(ps_top)
        best: tuple[float, int, int, int] | None = None
        for li in range(n_layers):
            row, top = t[li], tops[li]
            for i in {row.index(top), slowest_ps}:
                if counts[li][i] == 0:
                    continue
                wi, pi = forms[i][1][li], forms[i][2][li]
                for j in range(k):
                    if j == i or used[j] + q[li] > room[j]:
                        continue
                    wj, pj = forms[j][1][li], forms[j][2][li]
                    ti, tj = row[i] - wi, row[j] + wj
                    layer = max(ti, tj, *(row[m] for m in range(k) if m != i and m != j)) if k > 2 else max(ti, tj)
                    exchange = max(ps[i] - pi, ps[j] + pj, *(ps[m] for m in range(k) if m != i and m != j)) \
                        if k > 2 else max(ps[i] - pi, ps[j] + pj)
                    gain = top + ps_top - layer - exchange
                    if gain > MIN_MOVE_GAIN * iteration and (best is None or gain > best[0]):
                        best = (gain, li, i, j)
        if best is None:
            break
        _, li, i, j = best
        counts[li][i] -= 1
        counts[li][j] += 1
        t[li][i] -= forms[i][1][li]
        t[li][j] += forms[j][1][li]
        ps[i] -= forms[i][2][li]
        ps[j] += forms[j][2][li]
        used[i] -= q[li]
        used[j] += q[li]
        tops[li] = max(t[li])
    return counts


def _by_member(counts: Sequence[Sequence[int]], k: int) -> list[list[int]]:
    """``counts[l][i]`` (layer by member) as ``held[i][l]`` (member by layer)."""
    return [[row[i] for row in counts] for i in range(k)]


def _proportional(units: Sequence[int], weights: Sequence[float]) -> list[list[int]]:
    """Every layer's units in proportion to ``weights`` (largest remainder), ``[l][i]``."""
    out = []
    for u in units:
        exact = [u * w / sum(weights) for w in weights]
        row = [math.floor(x) for x in exact]
        for i in sorted(range(len(weights)), key=lambda j: (row[j] - exact[j], j))[:u - sum(row)]:
            row[i] += 1
        out.append(row)
    return out


# --------------------------------------------------------------------------- training grid


def _estimate(layers: Sequence[LayerCost], members: Sequence[DeviceInfo], batch: int, wire: Wire,
              lines: dict[tuple[str, int], tuple[float, float, float, float]] | None = None) -> float:
    """A cluster's quick iteration estimate (every member the same share of every layer, the layers'
    meetings left out: module docstring): inf if the members' memory cannot hold the model at
    ``batch``. ``lines`` caches every member's cost coefficients, which are affine in the batch."""
    k = len(members)
    m0, full_memory = _model_memory(tuple(layers), batch)
    caps = [min(1.0, max(0.0, (d.memory_bytes - m0) / full_memory)) for d in members]
    if sum(caps) < 1.0 - _TOLERANCE:
        return math.inf
    const, per_share = [], []
    for d in members:
        key = (d.device, k)
        line = lines.get(key) if lines is not None else None
        if line is None:
            line = _line(layers, d, k, wire)
            if lines is not None:
                lines[key] = line
        c0, c1, p0, p1 = line
        const.append(c0 + c1 * batch)
        per_share.append(max(_MIN_WEIGHT, p0 + p1 * batch))
    return _water_level(const, per_share, caps)


@functools.lru_cache(maxsize=1024)
def _model_memory(layers: tuple[LayerCost, ...], batch: int) -> tuple[int, int]:
    """``(m0, bytes of the whole model's share)`` of the memory form at ``batch``."""
    m0, q = _memory_coefficients(layers, batch)
    return m0, sum(qi * la.units for qi, la in zip(q, layers, strict=True))


def _line(layers: Sequence[LayerCost], device: DeviceInfo, k: int, wire: Wire) -> tuple[float, float, float, float]:
    """``(c0, c1, p0, p1)``: a member's fixed seconds are ``c0 + c1 x b`` and its seconds per whole
    model ``p0 + p1 x b`` at batch ``b`` (``_coefficients`` summed over the whole model: affine in the
    batch). The grid asks this for every device and cluster size, so it is folded from per-spec sums."""
    up, down, lat = _rates(device)
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


def _split(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` samples in proportion to ``weights``, at least one each (largest remainder)."""
    n = len(weights)
    spare = total - n
    whole = sum(weights)
    exact = [spare * w / whole for w in weights]
    out = [1 + math.floor(e) for e in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in order[:total - sum(out)]:
        out[i] += 1
    return out


def _groups(devices: Sequence[DeviceInfo], k: int, max_size: int) -> list[list[DeviceInfo]]:
    """``devices`` in ``k`` clusters of at most ``max_size`` with about equal total FLOPS: fastest first,
    each to the cluster with the least so far (longest processing time first)."""
    heap = [(0.0, i) for i in range(k)]
    groups: list[list[DeviceInfo]] = [[] for _ in range(k)]
    for d in sorted(devices, key=lambda d: (-d.flops, d.device)):
        full: list[tuple[float, int]] = []
        while True:
            total, i = heapq.heappop(heap)
            if len(groups[i]) < max_size:
                break
            full.append((total, i))
        groups[i].append(d)
        heapq.heappush(heap, (total + d.flops, i))
        for entry in full:
            heapq.heappush(heap, entry)
    return [sorted(g, key=lambda d: d.device) for g in groups if g]


def _balance(layers: Sequence[LayerCost], groups: Sequence[Sequence[DeviceInfo]], total: int, wire: Wire,
             lines: dict[tuple[str, int], tuple[float, float, float, float]],
             bounds: tuple[int, int] = (1, 0)) -> tuple[list[int], list[float]]:
    """Split ``total`` samples among ``groups`` so that they finish together; (batches, times).

    A cluster's time is about ``a + s x b`` in its batch ``b`` (compute and exchange traffic grow
    with ``b``, the parameter traffic does not): fitted from two estimates, then the batches
    solve ``clamp((T - a_c) / s_c, low, high) = b_c`` with ``sum b_c = total`` (``bounds`` are
    ``(low, high)``, 0 for no ``high``)."""
    flops = [sum(d.flops for d in g) for g in groups]
    batches = _split(total, flops)
    fits = []
    for g, b in zip(groups, batches, strict=True):
        other = 2 * b
        t1, t2 = _estimate(layers, g, b, wire, lines), _estimate(layers, g, other, wire, lines)
        if math.isinf(t2) and b > 1:  # twice the samples overflow the members' memory: half of them
            other = b // 2
            t2 = _estimate(layers, g, other, wire, lines)
        if math.isinf(t1) or math.isinf(t2):
            return batches, [math.inf] * len(groups)
        slope = max((t2 - t1) / (other - b), _MIN_WEIGHT)
        fits.append((t1 - slope * b, slope))
    batches = _level_split(total, fits, *bounds)
    return batches, [_estimate(layers, g, b, wire, lines) for g, b in zip(groups, batches, strict=True)]


def _level_split(total: int, fits: Sequence[tuple[float, float]], low: int, high: int) -> list[int]:
    """Whole batches ``b_c = clamp((T - a_c) / s_c, low, high)`` for ``fits`` ``(a_c, s_c)`` with
    ``sum b_c = total`` (``high`` 0: none): ``T`` by bisection, then floors and the samples left to
    the largest remainders. Short of ``total`` only when every cluster is at ``high``."""
    n = len(fits)
    high = high or total
    a = np.array([f[0] for f in fits])
    s = np.array([f[1] for f in fits])
    if n * high <= total:
        return [high] * n
    if n * low >= total:  # the grid's counts keep n x low <= total: this only evens out a remainder
        return _split(total, [1.0] * n)

    def at(level: float) -> np.ndarray:
        return np.clip((level - a) / s, low, high)

    lo_t, hi_t = float(np.min(a + s * low)), float(np.max(a + s * high))
    for _ in range(100):
        mid = (lo_t + hi_t) / 2
        if at(mid).sum() < total:
            lo_t = mid
        else:
            hi_t = mid
    exact = at(hi_t)
    out = [min(high, max(low, math.floor(e))) for e in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - out[i]), i))
    left = total - sum(out)
    for i in order:  # floors only lose samples; the loop back is for rounding's sake
        if left > 0 and out[i] < high:
            out[i], left = out[i] + 1, left - 1
    for i in reversed(order):
        if left < 0 and out[i] > low:
            out[i], left = out[i] - 1, left + 1
    return out


def _sizes(n: int, total: int, max_size: int, min_batch: int = 1) -> list[int]:
    """Cluster counts worth trying for ``n`` devices: every one for small fleets, a geometric ladder
    of about ``GRID_CANDIDATES`` for large ones; at least ``n / max_size``, at most ``total / min_batch``."""
    low, high = max(1, math.ceil(n / max_size)), min(n, max(1, total // min_batch))
    if n == 0 or low > high:
        return []
    if high - low < GRID_CANDIDATES:
        return list(range(low, high + 1))
    ratio = (high / low) ** (1 / (GRID_CANDIDATES - 1))
    return sorted({min(high, round(low * ratio**s)) for s in range(GRID_CANDIDATES)} | {low, high})


def mesh_cluster_name(members: Sequence[str]) -> str:
    """The name of the cluster of ``members`` (member order): ``c-<device>`` for one device, as in
    ``layout.cluster_name``; ``m-<first member>`` for several, shortened with a hash like it."""
    if not members:
        raise ValueError("a cluster needs members")
    if len(members) == 1:
        return cluster_name(members[0])
    name = f"{MESH_PREFIX}{members[0]}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(members[0].encode()).hexdigest()[:NAME_HASH_CHARS]
    return f"{name[:MAX_NAME - NAME_HASH_CHARS - 1]}-{digest}"


def training_grid(spec: str, devices: Sequence[DeviceInfo], *, batch: int,
                  max_cluster_size: int = DEFAULT_MAX_CLUSTER_SIZE, wire: Wire = FLOAT32_WIRE,
                  slack: float = 0.0, min_batch: int = 1, max_batch: int = 0) -> Grid:
    """The hybrid training grid of ``devices`` for iterations of ``batch`` samples in all: clusters of
    at most ``max_cluster_size`` members that each hold ``spec``, their share of the batch (within
    ``[min_batch, max_batch]``, 0: no upper bound), and the filter division inside each, for the
    shortest predicted iteration (module docstring): the fewest clusters whose iteration is within
    ``slack`` (a share) of the shortest. Deterministic: ties go to fewer clusters, devices are taken
    in name order. A ``min_batch`` above ``batch`` gives one cluster; when too few devices are left
    for ``batch / max_batch`` clusters, every cluster trains ``max_batch`` and the iteration fewer
    samples than ``batch``.

    No devices gives an empty grid. Raises ValueError for a batch, ``max_cluster_size`` or
    ``min_batch`` below 1, a ``max_batch`` below ``min_batch`` (other than 0), a negative ``slack``,
    a device named twice or a device with non-positive flops; ModelError for an unknown spec.
    """
    layers = costs.layers(spec)
    _check_batch(batch)
    if max_cluster_size < 1:
        raise ValueError(f"max_cluster_size must be >= 1, got {max_cluster_size}")
    if min_batch < 1 or (max_batch and max_batch < min_batch):
        raise ValueError(f"need 1 <= min_batch <= max_batch (or max_batch 0), got {min_batch} and {max_batch}")
    min_batch = min(min_batch, batch)
    if not slack >= 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    _check_devices(devices)
    ordered = sorted(devices, key=lambda d: d.device)
    m0, q = _memory_coefficients(layers, 1)
    full_memory = sum(qi * la.units for qi, la in zip(q, layers, strict=True))
    useful = [d for d in ordered if (d.memory_bytes - m0) / full_memory >= 1.0 / max_cluster_size - _TOLERANCE]
    spare: list[str] = []
    most = batch // min_batch * max_cluster_size
    if len(useful) > most:  # more devices than the batch has work for: the fastest
        fastest = sorted(useful, key=lambda d: (-d.flops, d.device))
        spare = [d.device for d in fastest[most:]]
        useful = sorted(fastest[:most], key=lambda d: d.device)
    lines: dict[tuple[str, int], tuple[float, float, float, float]] = {}
    tried: dict[int, tuple[float, list[list[DeviceInfo]], list[int]]] = {}

    def attempt(k: int) -> None:
        if k not in tried:
            groups = _groups(useful, k, max_cluster_size)
            batches, times = _balance(layers, groups, batch, wire, lines, (min_batch, max_batch))
            tried[k] = (max(times), groups, batches)

    def estimate_order() -> list[int]:
        """Cluster counts with a finite estimate that train the most samples (all ``batch`` unless
        ``max_batch`` caps every cluster), best first (a smaller count wins a tie)."""
        finite = [k for k, (t, _, _) in tried.items() if math.isfinite(t)]
        most = max((sum(tried[k][2]) for k in finite), default=0)
        finite = [k for k in finite if sum(tried[k][2]) == most]
        best_t = min((tried[k][0] for k in finite), default=math.inf)
        return sorted(finite, key=lambda k: (tried[k][0] > best_t * (1 + GRID_TIE), tried[k][0], k))

    sizes = _sizes(len(useful), batch, max_cluster_size, min_batch)
    for k in sizes:
        attempt(k)
    order = estimate_order()
    if order and len(sizes) > 1:  # a large fleet: every count between the best's neighbours
        at = sizes.index(order[0]) if order[0] in sizes else 0
        low, high = sizes[max(0, at - 1)], sizes[min(len(sizes) - 1, at + 1)]
        step = max(1, (high - low) // GRID_REFINE)
        for k in range(low, high + 1, step):
            attempt(k)
        order = estimate_order()
    if not order:
        return Grid(clusters=(), excluded=tuple(d.device for d in ordered), idle=(), predicted_iteration_s=0.0,
                    throughput_samples_s=0.0)
    # the estimate leaves out the meetings at every layer: a small fleet has every count divided
    # exactly, a larger one the best few
    small = len(order) <= GRID_CANDIDATES
    finalists = list(order) if small else order[:GRID_FINALISTS if len(useful) <= LARGE_FLEET else 1]
    if slack > 0:  # fewer clusters within the slack: the quick estimates flatter them, so all are weighed
        finalists += [k for k in order if k < order[0] and k not in finalists
                      and tried[k][0] <= tried[order[0]][0] * (1 + slack)]
    if len(useful) in order and len(useful) not in finalists:
        finalists.append(len(useful))  # one cluster per device: exact already, the baseline to beat
    layouts = [(tried[k][1], tried[k][2]) for k in finalists]
    if small:
        layouts += _fast_alone(layers, useful, order, max_cluster_size, batch, wire, lines, (min_batch, max_batch),
                               samples=sum(tried[order[0]][2]))
    built = [_build(layers, groups, batches, wire) for groups, batches in layouts]
    shortest = min(max(c.predicted_s for c in b[0]) for b in built)
    clusters, idle = min((b for b in built if max(c.predicted_s for c in b[0]) <= shortest * (1 + slack)),
                         key=lambda b: (len(b[0]), max(c.predicted_s for c in b[0])))
    idle = [*spare, *idle]
    clusters.sort(key=lambda c: c.name)
    round_s = max(c.predicted_s for c in clusters)
    kept = {d.device for d in useful} | set(spare)
    excluded = sorted(d.device for d in ordered if d.device not in kept)
    return Grid(clusters=tuple(clusters), excluded=tuple(excluded), idle=tuple(sorted(idle)),
                predicted_iteration_s=round_s, throughput_samples_s=sum(c.batch for c in clusters) / round_s)


def _fast_alone(layers: Sequence[LayerCost], devices: Sequence[DeviceInfo], counts: Sequence[int], max_size: int,
                total: int, wire: Wire, lines: dict[tuple[str, int], tuple[float, float, float, float]],
                bounds: tuple[int, int], *, samples: int) -> list[tuple[list[list[DeviceInfo]], list[int]]]:
    """More layouts of ``counts`` clusters for a small fleet: the ``s`` fastest devices alone and the
    others in ``K - s`` clusters of about equal FLOPS, for every ``0 < s < K``, with their batches
    (those that hold the model and train ``samples``). Equal FLOPS pairs a fast board with a slow
    one whose share is not worth its exchanges; these keep the fast boards whole."""
    fastest = sorted(devices, key=lambda d: (-d.flops, d.device))
    out = []
    for k in counts:
        for alone in range(1, k):
            rest = sorted(fastest[alone:], key=lambda d: d.device)
            if not rest or len(rest) > (k - alone) * max_size:
                continue
            groups = [[d] for d in fastest[:alone]] + _groups(rest, k - alone, max_size)
            batches, times = _balance(layers, groups, total, wire, lines, bounds)
            if math.isfinite(max(times)) and sum(batches) == samples:
                out.append((groups, batches))
    return out


def _build(layers: Sequence[LayerCost], groups: Sequence[Sequence[DeviceInfo]], batches: Sequence[int],
           wire: Wire) -> tuple[list[GridCluster], list[str]]:
    """The clusters of ``groups`` with their exact divisions, and the members left idle."""
    clusters, idle = [], []
    for group, b in zip(groups, batches, strict=True):
        members = list(group)
        division = _divide(layers, members, b, wire)
        while True:  # members the division gives nothing would only wait: drop them, divide again
            busy = [d for i, d in enumerate(members) if any(n[i] for n in division.counts.values())]
            if len(busy) == len(members):
                break
            working = {d.device for d in busy}
            idle += [d.device for d in members if d.device not in working]
            members = busy
            division = _divide(layers, members, b, wire)
        clusters.append(GridCluster(name=mesh_cluster_name(division.members), members=division.members,
                                    division=division, batch=b, predicted_s=division.predicted_s))
    return clusters, idle


def grid_iteration_s(spec: str, grid: Grid, devices: Sequence[DeviceInfo], wire: Wire = FLOAT32_WIRE) -> float:
    """The predicted iteration of ``grid``'s layout (its clusters, batches and divisions) for the
    figures in ``devices``."""
    by_name = {d.device: d for d in devices}
    return max(cluster_iteration_s(spec, [by_name[m] for m in c.members], c.division.counts, batch=c.batch,
                                   wire=wire) for c in grid.clusters) if grid.clusters else 0.0


def needs_replan(old: Grid, devices: Sequence[DeviceInfo], spec: str, batch: int,
                 threshold: float = REPLAN_THRESHOLD, *, max_cluster_size: int = DEFAULT_MAX_CLUSTER_SIZE,
                 wire: Wire = FLOAT32_WIRE, slack: float = 0.0, min_batch: int = 1, max_batch: int = 0) -> bool:
    """Whether ``old`` should give way to a new grid: a device joined or left, a member's memory no
    longer holds its share, or the old layout's predicted iteration under the new measurements is
    more than ``threshold`` (relative) above the best new layout's (a device slowed down)."""
    by_name = {d.device: d for d in devices}
    if len(by_name) != len(devices):
        raise ValueError("a device appears twice")
    if set(by_name) != old.members | set(old.excluded) | set(old.idle):
        return True
    layers = costs.layers(spec)
    for cluster in old.clusters:
        counts = cluster.division.counts
        for i, m in enumerate(cluster.members):
            need = member_memory(spec, [counts[la.name][i] for la in layers], batch=cluster.batch)
            if need > by_name[m].memory_bytes:
                return True
    new = training_grid(spec, devices, batch=batch, max_cluster_size=max_cluster_size, wire=wire, slack=slack,
                        min_batch=min_batch, max_batch=max_batch)
    if not old.clusters or not new.clusters:
        return bool(old.clusters) != bool(new.clusters)
    return grid_iteration_s(spec, old, devices, wire) > (1 + threshold) * new.predicted_iteration_s


# --------------------------------------------------------------------------- benchmark hooks


FLEET_CLASSES: tuple[tuple[str, float, float, float, float], ...] = (
    # name, weight, matmul FLOP/s, memory bytes, uplink bytes/s
    ("pi3", 0.25, 9.2e9, 566 * 2**20, 6.25e6),
    ("pi4", 0.25, 23.8e9, 3.3 * 2**30, 4.8e6),
    ("pi5", 0.2, 60.5e9, 7 * 2**30, 14e6),
    ("laptop", 0.1, 115e9, 8 * 2**30, 25e6),
    ("zero", 0.15, 4e9, 270 * 2**20, 4e6),
    ("tiny", 0.05, 2e9, 262 * 2**20, 2e6),
)
"""Device classes of ``sample_fleet``: Raspberry Pi 3/4/5, a laptop, and two boards too small to
hold ``cifar-cnn`` alone (``tiny`` cannot even hold a useful share of it)."""


def sample_fleet(n: int, seed: int = 0) -> list[DeviceInfo]:
    """``n`` random devices of ``FLEET_CLASSES``, with ±20 % flops, ×0.5-1.5 links and 1-10 ms latency."""
    rng = np.random.default_rng(seed)
    weights = np.array([c[1] for c in FLEET_CLASSES])
    kinds = rng.choice(len(FLEET_CLASSES), size=n, p=weights / weights.sum())
    flops_jitter = rng.uniform(0.8, 1.2, size=n)
    link_jitter = rng.uniform(0.5, 1.5, size=(n, 2))
    latency = rng.uniform(0.001, 0.010, size=n)
    fleet = []
    for i in range(n):
        name, _, flops, memory, up = FLEET_CLASSES[int(kinds[i])]
        fleet.append(DeviceInfo(device=f"{name}-{i:05d}", flops=flops * flops_jitter[i], memory_bytes=int(memory),
                                link_rate_bps=up * link_jitter[i, 0], downlink_rate_bps=up * 2 * link_jitter[i, 1],
                                latency_s=float(latency[i])))
    return fleet


def time_layout(n: int = 1000, seed: int = 0, *, spec: str = "cifar-cnn", batch: int = 0) -> float:
    """Seconds ``training_grid`` takes to lay out ``sample_fleet(n, seed)`` for iterations of ``batch``
    samples (0: four per device) (for ``bench/``)."""
    fleet = sample_fleet(n, seed)
    batch = batch or 4 * n
    start = time.perf_counter()
    training_grid(spec, fleet, batch=batch)
    return time.perf_counter() - start
