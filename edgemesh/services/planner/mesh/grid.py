"""Edge Mesh planning, the training grid: the clusters of a whole fleet and their shares of the batch.

Predicted times are the cost model's (``cost_model``), and every cluster divides the model by
``divide_filters`` (``division``).

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

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from edgemesh.common import costs
from edgemesh.common.costs import LayerCost
from edgemesh.services.planner.mesh.cost_model import (
    FLOAT32_WIRE,
    MIN_WEIGHT,
    Wire,
    batch_line,
    check_batch,
    cluster_iteration_s,
    member_memory,
    memory_coefficients,
    model_memory,
)
from edgemesh.services.planner.mesh.devices import DeviceInfo, check_devices, cluster_name, sample_fleet
from edgemesh.services.planner.mesh.division import TOLERANCE, Division, divide, water_level

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
"""Useful devices above which a single finalist is divided exactly (``GRID_FINALISTS``)."""
GRID_REFINE = 6
"""Cluster counts tried again, evenly, between the ladder neighbours of the best count."""
REPLAN_THRESHOLD = 0.25
"""Default relative slowdown of the current layout, against the best new one, that warrants a new plan."""


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


def _estimate(layers: Sequence[LayerCost], members: Sequence[DeviceInfo], batch: int, wire: Wire,
              lines: dict[tuple[str, int], tuple[float, float, float, float]] | None = None) -> float:
    """A cluster's quick iteration estimate (every member the same share of every layer, the layers'
    meetings left out: module docstring): inf if the members' memory cannot hold the model at
    ``batch``. ``lines`` caches every member's cost coefficients, which are affine in the batch."""
    k = len(members)
    m0, full_memory = model_memory(tuple(layers), batch)
    caps = [min(1.0, max(0.0, (d.memory_bytes - m0) / full_memory)) for d in members]
    if sum(caps) < 1.0 - TOLERANCE:
        return math.inf
    const, per_share = [], []
    for d in members:
        key = (d.device, k)
        line = lines.get(key) if lines is not None else None
        if line is None:
            line = batch_line(layers, d, k, wire)
            if lines is not None:
                lines[key] = line
        c0, c1, p0, p1 = line
        const.append(c0 + c1 * batch)
        per_share.append(max(MIN_WEIGHT, p0 + p1 * batch))
    return water_level(const, per_share, caps)


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
        slope = max((t2 - t1) / (other - b), MIN_WEIGHT)
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
    check_batch(batch)
    if max_cluster_size < 1:
        raise ValueError(f"max_cluster_size must be >= 1, got {max_cluster_size}")
    if min_batch < 1 or (max_batch and max_batch < min_batch):
        raise ValueError(f"need 1 <= min_batch <= max_batch (or max_batch 0), got {min_batch} and {max_batch}")
    min_batch = min(min_batch, batch)
    if not slack >= 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    check_devices(devices)
    ordered = sorted(devices, key=lambda d: d.device)
    m0, q = memory_coefficients(layers, 1)
    full_memory = sum(qi * la.units for qi, la in zip(q, layers, strict=True))
    useful = [d for d in ordered if (d.memory_bytes - m0) / full_memory >= 1.0 / max_cluster_size - TOLERANCE]
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
        division = divide(layers, members, b, wire)
        while True:  # members the division gives nothing would only wait: drop them, divide again
            busy = [d for i, d in enumerate(members) if any(n[i] for n in division.counts.values())]
            if len(busy) == len(members):
                break
            working = {d.device for d in busy}
            idle += [d.device for d in members if d.device not in working]
            members = busy
            division = divide(layers, members, b, wire)
        clusters.append(GridCluster(name=cluster_name(division.members), members=division.members,
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


def links_moved(old: Grid, planned: Sequence[DeviceInfo], devices: Sequence[DeviceInfo], spec: str,
                threshold: float = REPLAN_THRESHOLD, *, wire: Wire = FLOAT32_WIRE) -> bool:
    """Whether the link figures in ``devices`` (uplink, downlink, latency) move ``old``'s predicted iteration,
    from the one it had for the figures it was laid out with (``planned``), by more than ``threshold`` (relative,
    either way). Speeds stay the planned ones here: a slowdown is ``needs_replan``'s to judge.

    ``needs_replan`` asks whether another layout would win by the threshold; a link's cost falls on every layout
    (a member moves the others' slices whatever its share), so a slow link measured for the first time, where
    the hello gave none and the cost model assumed 100 Mbit/s, changes the best division while no layout wins
    by much. Weighing a link by what it does to the iteration keeps noise in a fast link (a loopback measured at
    50 or 500 MB/s) from re-planning. Devices ``old`` was not laid out with are ``needs_replan``'s too."""
    now = {d.device: d for d in devices}
    if not old.clusters or not planned or not old.members <= now.keys():
        return False
    relinked = [replace(d, link_rate_bps=now[d.device].link_rate_bps, downlink_rate_bps=now[d.device].downlink_rate_bps,
                        latency_s=now[d.device].latency_s) if d.device in now else d for d in planned]
    before = grid_iteration_s(spec, old, planned, wire)
    after = grid_iteration_s(spec, old, relinked, wire)
    return abs(after - before) > threshold * before


# --------------------------------------------------------------------------- benchmark hooks


def time_layout(n: int = 1000, seed: int = 0, *, spec: str = "cifar-cnn", batch: int = 0) -> float:
    """Seconds ``training_grid`` takes to lay out ``sample_fleet(n, seed)`` for iterations of ``batch``
    samples (0: four per device) (for ``bench/``)."""
    fleet = sample_fleet(n, seed)
    batch = batch or 4 * n
    start = time.perf_counter()
    training_grid(spec, fleet, batch=batch)
    return time.perf_counter() - start
