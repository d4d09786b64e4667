"""Edge Mesh planning, the training grid: the clusters of a whole fleet and their shares of the batch.

Predicted times are the cost model's (``member_cost``), and every cluster divides the model by
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
from dataclasses import dataclass

import numpy as np

from edgemesh.common import costs
from edgemesh.common.costs import LayerCost
from edgemesh.services.planner.mesh.devices import DeviceInfo, check_devices, cluster_name, sample_fleet
from edgemesh.services.planner.mesh.division import TOLERANCE, Division, divide, water_level
from edgemesh.services.planner.mesh.member_cost import (
    FLOAT32_WIRE,
    MIN_WEIGHT,
    Wire,
    batch_line,
    check_batch,
    cluster_iteration_s,
    memory_coefficients,
    model_memory,
)

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


Lines = dict[tuple[str, int], tuple[float, float, float, float]]
"""Every member's cost coefficients by (device, cluster size), affine in the batch: the quick estimate's cache."""


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
              lines: Lines | None = None) -> float:
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
             lines: Lines,
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
    _check_settings(batch, max_cluster_size, min_batch, max_batch, slack)
    min_batch = min(min_batch, batch)
    check_devices(devices)
    ordered = sorted(devices, key=lambda d: d.device)
    useful, spare = _taking_part(layers, ordered, max_cluster_size, most=batch // min_batch * max_cluster_size)
    search = _Search(layers, useful, batch, max_cluster_size, wire, (min_batch, max_batch))
    order = search.ranked(_sizes(len(useful), batch, max_cluster_size, min_batch))
    if not order:
        return Grid(clusters=(), excluded=tuple(d.device for d in ordered), idle=(), predicted_iteration_s=0.0,
                    throughput_samples_s=0.0)
    # the estimate leaves out the meetings at every layer: the finalists are divided exactly
    built = [_build(layers, groups, batches, wire) for groups, batches in search.finalists(order, slack)]
    clusters, idle = _fewest_within(built, slack)
    clusters.sort(key=lambda c: c.name)
    round_s = max(c.predicted_s for c in clusters)
    kept = {d.device for d in useful} | set(spare)
    excluded = sorted(d.device for d in ordered if d.device not in kept)
    return Grid(clusters=tuple(clusters), excluded=tuple(excluded), idle=tuple(sorted([*spare, *idle])),
                predicted_iteration_s=round_s, throughput_samples_s=sum(c.batch for c in clusters) / round_s)


def _check_settings(batch: int, max_cluster_size: int, min_batch: int, max_batch: int, slack: float) -> None:
    """ValueError for a setting of ``training_grid`` out of its range."""
    check_batch(batch)
    if max_cluster_size < 1:
        raise ValueError(f"max_cluster_size must be >= 1, got {max_cluster_size}")
    if min_batch < 1 or (max_batch and max_batch < min_batch):
        raise ValueError(f"need 1 <= min_batch <= max_batch (or max_batch 0), got {min_batch} and {max_batch}")
    if not slack >= 0:
        raise ValueError(f"slack must be >= 0, got {slack}")


def _taking_part(layers: Sequence[LayerCost], ordered: Sequence[DeviceInfo], max_size: int,
                 most: int) -> tuple[list[DeviceInfo], list[str]]:
    """The devices whose memory holds ``1 / max_size`` of the model, in name order, and the names of those left
    idle when there are more than ``most`` of them (the batch has work for the fastest ``most``)."""
    m0, q = memory_coefficients(layers, 1)
    full_memory = sum(qi * la.units for qi, la in zip(q, layers, strict=True))
    useful = [d for d in ordered if (d.memory_bytes - m0) / full_memory >= 1.0 / max_size - TOLERANCE]
    if len(useful) <= most:
        return useful, []
    fastest = sorted(useful, key=lambda d: (-d.flops, d.device))
    return sorted(fastest[:most], key=lambda d: d.device), [d.device for d in fastest[most:]]


@dataclass(frozen=True, slots=True)
class _Layout:
    """Clusters of devices, their shares of the batch, and the quick estimate of the iteration."""

    groups: list[list[DeviceInfo]]
    batches: list[int]
    estimate_s: float


class _Search:
    """The layouts of the ``useful`` devices weighed by their quick estimates, one per cluster count tried (module
    docstring), and the finalists among them that are divided exactly."""

    def __init__(self, layers: Sequence[LayerCost], useful: list[DeviceInfo], batch: int, max_size: int, wire: Wire,
                 bounds: tuple[int, int]) -> None:
        self.layers, self.useful, self.batch, self.max_size, self.wire = layers, useful, batch, max_size, wire
        self.bounds = bounds
        """``(min_batch, max_batch)`` of a cluster."""
        self.lines: Lines = {}
        self.tried: dict[int, _Layout] = {}

    def ranked(self, sizes: list[int]) -> list[int]:
        """Try the cluster counts ``sizes``, then for a large fleet every count between the best's neighbours; the
        counts tried, best first (``ranking``)."""
        for k in sizes:
            self._attempt(k)
        order = self.ranking()
        if order and len(sizes) > 1:
            at = sizes.index(order[0]) if order[0] in sizes else 0
            low, high = sizes[max(0, at - 1)], sizes[min(len(sizes) - 1, at + 1)]
            step = max(1, (high - low) // GRID_REFINE)
            for k in range(low, high + 1, step):
                self._attempt(k)
            order = self.ranking()
        return order

    def _attempt(self, k: int) -> None:
        if k not in self.tried:
            groups = _groups(self.useful, k, self.max_size)
            batches, times = _balance(self.layers, groups, self.batch, self.wire, self.lines, self.bounds)
            self.tried[k] = _Layout(groups, batches, max(times))

    def ranking(self) -> list[int]:
        """Cluster counts with a finite estimate that train the most samples (all ``batch`` unless
        ``max_batch`` caps every cluster), best first (a smaller count wins a tie)."""
        tried = self.tried
        finite = [k for k, layout in tried.items() if math.isfinite(layout.estimate_s)]
        most = max((sum(tried[k].batches) for k in finite), default=0)
        finite = [k for k in finite if sum(tried[k].batches) == most]
        best_t = min((tried[k].estimate_s for k in finite), default=math.inf)
        return sorted(finite, key=lambda k: (tried[k].estimate_s > best_t * (1 + GRID_TIE), tried[k].estimate_s, k))

    def finalists(self, order: list[int], slack: float) -> list[tuple[list[list[DeviceInfo]], list[int]]]:
        """The layouts to divide exactly: of a small fleet every count (and the fast boards alone), of a larger
        one the best few; with a ``slack``, fewer clusters within it; and one cluster per device."""
        tried, n = self.tried, len(self.useful)
        small = len(order) <= GRID_CANDIDATES
        chosen = list(order) if small else order[:GRID_FINALISTS if n <= LARGE_FLEET else 1]
        if slack > 0:  # fewer clusters within the slack: the quick estimates flatter them, so all are weighed
            within = tried[order[0]].estimate_s * (1 + slack)
            chosen += [k for k in order if k < order[0] and k not in chosen and tried[k].estimate_s <= within]
        if n in order and n not in chosen:
            chosen.append(n)  # one cluster per device: exact already, the baseline to beat
        layouts = [(tried[k].groups, tried[k].batches) for k in chosen]
        if small:
            layouts += _fast_alone(self.layers, self.useful, order, self.max_size, self.batch, self.wire, self.lines,
                                   self.bounds, samples=sum(tried[order[0]].batches))
        return layouts


def _fewest_within(built: list[tuple[list[GridCluster], list[str]]],
                   slack: float) -> tuple[list[GridCluster], list[str]]:
    """Of layouts divided exactly (clusters, idle members), the one of fewest clusters whose iteration is within
    ``slack`` of the shortest (the shortest among those)."""
    shortest = min(max(c.predicted_s for c in b[0]) for b in built)
    return min((b for b in built if max(c.predicted_s for c in b[0]) <= shortest * (1 + slack)),
               key=lambda b: (len(b[0]), max(c.predicted_s for c in b[0])))


def _fast_alone(layers: Sequence[LayerCost], devices: Sequence[DeviceInfo], counts: Sequence[int], max_size: int,
                total: int, wire: Wire, lines: Lines,
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


# --------------------------------------------------------------------------- benchmark hooks


def time_layout(n: int = 1000, seed: int = 0, *, spec: str = "cifar-cnn", batch: int = 0) -> float:
    """Seconds ``training_grid`` takes to lay out ``sample_fleet(n, seed)`` for iterations of ``batch``
    samples (0: four per device) (for ``bench/``)."""
    fleet = sample_fleet(n, seed)
    batch = batch or 4 * n
    start = time.perf_counter()
    training_grid(spec, fleet, batch=batch)
    return time.perf_counter() - start
