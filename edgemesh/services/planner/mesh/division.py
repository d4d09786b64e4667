"""Edge Mesh planning, the filter division: how the members of one cluster divide the model.

The symbols are the cost model's (``member_cost``): member *i* spends ``a_il + w_il x n_l`` seconds
on ``n_l`` of the ``U_l`` units of layer ``l`` and needs ``m0 + sum_l q_l x n_l`` bytes of memory.

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
A grouped convolution (``LayerCost.group`` > 1 units a group) is divided in whole groups: steps 1 to 4 run on
its groups as units (each with a group's figures), and a member's count is its groups times the group's size.
If the members' memory cannot hold the model even together, the memory caps are dropped, the
division minimises time alone and ``fits`` is False.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from edgemesh.common import costs
from edgemesh.common.costs import LayerCost
from edgemesh.services.planner.mesh.devices import DeviceInfo, check_devices
from edgemesh.services.planner.mesh.member_cost import (
    FLOAT32_WIRE,
    MIN_WEIGHT,
    Wire,
    check_batch,
    cluster_seconds,
    layer_coefficients,
    link_rates,
    memory_coefficients,
    step_time,
)

MIN_MOVE_GAIN = 1e-3
"""Share of the iteration a single-unit move of the local search must save: below it, members would
trade units between layers for microseconds (and equal members end up unequal)."""
TOLERANCE = 1e-12
"""Rounding slack of the comparisons of model shares, which add up to 1."""


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


def divide_filters(spec: str, members: Sequence[DeviceInfo], batch: int, wire: Wire = FLOAT32_WIRE) -> Division:
    """Divide every divisible layer of ``spec`` among ``members`` (in the given order) so that the
    slowest member's step is as short as possible within every member's memory (module docstring).

    Raises ValueError for no members, a batch below 1, a duplicate member or a non-positive flops;
    ModelError for an unknown spec.
    """
    layers = costs.layers(spec)
    check_batch(batch)
    if not members:
        raise ValueError("a cluster needs members")
    check_devices(members)
    return divide(layers, members, batch, wire)


def divide(layers: Sequence[LayerCost], members: Sequence[DeviceInfo], batch: int, wire: Wire) -> Division:
    """``divide_filters`` on the layers of a spec, unchecked."""
    k = len(members)
    units = [la.units for la in layers]
    if k == 1:
        counts = [[u] for u in units]  # counts[l][i]
    else:
        shared = _shared_counts([in_groups(la) for la in layers], members, batch, wire)
        counts = [[n * la.group for n in row] for row, la in zip(shared, layers, strict=True)]
    held = _by_member(counts, k)
    seconds = tuple(step_time(layers, d, held[i], batch, k, wire).total_s for i, d in enumerate(members))
    predicted = cluster_seconds(layers, members, held, batch, wire)
    memory = tuple(costs.member_memory_bytes(layers, held[i], batch) for i in range(k))
    return Division(members=tuple(d.device for d in members),
                    counts={la.name: tuple(counts[li]) for li, la in enumerate(layers)}, member_seconds=seconds,
                    predicted_s=predicted, member_memory_bytes=memory,
                    fits=all(m <= d.memory_bytes for m, d in zip(memory, members, strict=True)))


def in_groups(layer: LayerCost) -> LayerCost:
    """``layer`` with its groups as units (a grouped convolution's; any other layer as it is): the per-unit figures
    of one group, so that dividing it gives every member whole groups."""
    g = layer.group
    if g == 1:
        return layer
    return replace(layer, units=layer.units // g, macs_per_unit=layer.macs_per_unit * g,
                   params_per_unit=layer.params_per_unit * g, out_per_unit=layer.out_per_unit * g,
                   gathered_per_unit=layer.gathered_per_unit * g, group=1)


def _shared_counts(layers: Sequence[LayerCost], members: Sequence[DeviceInfo], batch: int,
                   wire: Wire) -> list[list[int]]:
    """Units per layer and member, ``[l][i]``, of two or more members (steps 1 to 4 of the module docstring)."""
    k = len(members)
    units = [la.units for la in layers]
    m0, q = memory_coefficients(layers, batch)
    full_memory = sum(qi * u for qi, u in zip(q, units, strict=True))
    caps = [min(1.0, max(0.0, (d.memory_bytes - m0) / full_memory)) for d in members]
    memory_bound = sum(caps) >= 1.0 - TOLERANCE
    if not memory_bound:
        caps = [1.0] * k  # nothing fits: divide for time alone (fits will say so)
    room = [d.memory_bytes - m0 if memory_bound else math.inf for d in members]
    forms = [layer_coefficients(layers, d, batch, k, wire) for d in members]
    fixed = [2 * link_rates(d)[2] for d in members]  # the push and the update message's latencies
    counts = _improve(_layer_counts(units, forms, caps, q, room), forms, fixed, q, room)
    # the splits by speed and the even split, should they do better still
    best_s = cluster_seconds(layers, members, _by_member(counts, k), batch, wire)
    for other in (_proportional(units, [d.flops for d in members]), _proportional(units, [1.0] * k)):
        fits = all(sum(q[li] * other[li][i] for li in range(len(units))) <= room[i] for i in range(k))
        other_s = cluster_seconds(layers, members, _by_member(other, k), batch, wire) if fits else math.inf
        if other_s < best_s:
            counts, best_s = other, other_s
    return counts


Forms = Sequence[tuple[Sequence[float], Sequence[float], Sequence[float]]]
"""Every member's ``layer_coefficients``: ``forms[i] = (a, w, p)``."""


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
        weight = [max(MIN_WEIGHT, f[1][li] + f[2][li]) for f in forms]
        level = water_level(const, [w * u for w in weight], caps)
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
    loads = _Loads(counts, forms, fixed, q)
    for _ in range(len(forms) * sum(map(sum, counts))):
        move = loads.best_move(room)
        if move is None:
            break
        loads.move(*move)
    return counts


class _Loads:
    """What the local search weighs as it moves units (``counts[l][i]``, changed in place): every member's seconds
    on every layer (``t[l][i]``), its parameter-server exchange (``ps[i]``) and memory (``used[i]``), and every
    layer's slowest member's seconds (``tops[l]``)."""

    def __init__(self, counts: list[list[int]], forms: Forms, fixed: Sequence[float], q: Sequence[int]) -> None:
        k, n_layers = len(forms), len(counts)
        self.counts, self.forms, self.q = counts, forms, q
        self.t = [[forms[i][0][li] + forms[i][1][li] * counts[li][i] for i in range(k)] for li in range(n_layers)]
        self.ps = [fixed[i] + sum(forms[i][2][li] * counts[li][i] for li in range(n_layers)) for i in range(k)]
        self.used = [sum(q[li] * counts[li][i] for li in range(n_layers)) for i in range(k)]
        self.tops = [max(row) for row in self.t]

    def best_move(self, room: Sequence[float]) -> tuple[int, int, int] | None:
        """``(layer, from, to)`` of the move that shortens the iteration most, by more than ``MIN_MOVE_GAIN`` of it;
        None if none does."""
        ps_top = max(self.ps)
        best, best_gain = None, MIN_MOVE_GAIN * (sum(self.tops) + ps_top)  # every move shortens the iteration
        for li, i, j in self._moves(room, self.ps.index(ps_top)):
            gain = self._gain(li, i, j, ps_top)
            if gain > best_gain:
                best, best_gain = (li, i, j), gain
        return best

    def _moves(self, room: Sequence[float], slowest_ps: int) -> Iterator[tuple[int, int, int]]:
        """The moves worth weighing: one unit of a layer off the member that sets the layer's time or the slowest
        exchange, to a member whose memory holds it."""
        k = len(self.ps)
        for li, row in enumerate(self.t):
            for i in {row.index(self.tops[li]), slowest_ps}:
                if self.counts[li][i] == 0:
                    continue
                for j in range(k):
                    if j != i and self.used[j] + self.q[li] <= room[j]:
                        yield li, i, j

    def _gain(self, li: int, i: int, j: int, ps_top: float) -> float:
        """How much one unit of layer ``li`` moved from member ``i`` to ``j`` shortens the iteration: the layer's
        slowest member and the slowest exchange, before and after."""
        row, ps, form_i, form_j = self.t[li], self.ps, self.forms[i], self.forms[j]
        ti, tj = row[i] - form_i[1][li], row[j] + form_j[1][li]
        pi, pj = ps[i] - form_i[2][li], ps[j] + form_j[2][li]
        if len(ps) > 2:
            others = [m for m in range(len(ps)) if m != i and m != j]
            layer, exchange = max(ti, tj, *(row[m] for m in others)), max(pi, pj, *(ps[m] for m in others))
        else:
            layer, exchange = max(ti, tj), max(pi, pj)
        return self.tops[li] + ps_top - layer - exchange

    def move(self, li: int, i: int, j: int) -> None:
        """One unit of layer ``li`` from member ``i`` to ``j``."""
        form_i, form_j, t = self.forms[i], self.forms[j], self.t[li]
        self.counts[li][i] -= 1
        self.counts[li][j] += 1
        t[i] -= form_i[1][li]
        t[j] += form_j[1][li]
        self.ps[i] -= form_i[2][li]
        self.ps[j] += form_j[2][li]
        self.used[i] -= self.q[li]
        self.used[j] += self.q[li]
        self.tops[li] = max(t)


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


def water_level(const: Sequence[float], weight: Sequence[float], cap: Sequence[float]) -> float:
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
        if reached >= 1.0 - TOLERANCE:
            return prev + max(0.0, 1.0 - covered) / slope
        covered, prev = reached, at
        slope += change
    return math.inf
