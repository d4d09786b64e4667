"""Robust aggregation: how one step's contributions become the gradient its SGD step applies (pure).

A step's contributions are ``(weight, shards)`` (``optimizer.ShardGrad``), one per update the step takes.
The rule (``ps.aggregation``, ``set-aggregation``; docs/reliability.md#robust-aggregation) bounds what a
faulty or malicious device can do to the model:

* ``mean``: the weighted sum, as ``ModelState.step`` takes it.
* ``clip`` (the default): every contribution's L2 norm is clipped to ``clip_factor`` x the median norm of the recent
  contributions (the last ``CLIP_WINDOW`` applied, and this step's), then the weighted sum.
* ``median``: the coordinate-wise median.
* ``trimmed-mean``: per coordinate, the ``trim_fraction`` largest and smallest values dropped, the rest averaged.
* ``krum``: multi-Krum. Each contribution is scored by the sum of its squared distances to its n - f - 2
  nearest others (``f = krum_f``, the attackers assumed); the n - f best scored are averaged.

Median, trimmed mean and Krum work per row segment: every parameter's rows are cut at every shard
boundary of the step, so whole tensors (data parallel) and a cluster's slices (model parallel) line up.
The contributions covering a segment are combined; a segment one contribution alone covers is taken as
it is. They give each contribution one vote, whatever its weight, and scale what they give by the
step's total weight on the segment: a round the adaptive deadline cut short still takes a smaller step.

Median, trimmed mean and Krum need several contributions per step, which only the round policies
(``sync``, ``adaptive``) give; under ``async`` and ``ssp`` every step is one update, and they reduce to it
(:func:`idle_under`). ``clip`` compares with recent steps, so it bounds a device under every policy.
They also need dense gradients: under a sparsifying codec most coordinates of most contributions are
zero, and so is their median.

Under every rule but ``clip`` (which cuts a large norm instead), a contribution whose L2 norm is more than
``ps.norm_factor`` x the median norm of the last ``CLIP_WINDOW`` contributions applied is refused before the rule
runs: left out of the step, counted (``robust_refused{reason="norm"}``) and logged. The filter waits until
``ps.norm_warmup`` norms are known; when refusals are most of the last ``CLIP_WINDOW`` judged, it is the fleet's
gradients that grew, not one device's, and the reference starts again. A step's refusals are its
:attr:`Aggregation.chosen` (the contributions combined), so shard 0's choice is every shard's and a replay's.

Every step logs the :class:`Aggregation` it used (with clip's threshold and the updates Krum kept), so a replay of the
write-ahead log combines its contributions exactly as the step did.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from edgemesh.common.config import ParameterServerConfig
from edgemesh.common.metrics import ServiceMetrics
from edgemesh.common.vocabulary import AGGREGATION_RULES, AggregationRule, SyncPolicy
from edgemesh.services.parameter_server.gain import NoiseScale
from edgemesh.services.parameter_server.optimizer import Refused, ShardGrad

logger = logging.getLogger(__name__)

CLIP_WINDOW = 32
"""Norms of applied contributions ``clip`` keeps: the median of these (and the step's) is its reference."""
LOGGED_NORMS = 8
"""Most refused norms one warning names (the largest): a round of a thousand devices refuses hundreds at once."""
ROUND_RULES: tuple[AggregationRule, ...] = ("median", "trimmed-mean", "krum")
"""Rules that compare the contributions of one step: only a round policy gives a step several."""
SINGLE_UPDATE_POLICIES: tuple[SyncPolicy, ...] = ("async", "ssp")
"""Policies whose every step is one update."""

Contribution = tuple[float, Sequence[ShardGrad]]
"""``(weight, shards)``: one update's part of a step."""
Segment = tuple[str, int, int]
"""``(param, start, stop)``: rows of a parameter."""


@dataclass(frozen=True, slots=True)
class Aggregation:
    """One step's rule and its parameters, as the step used them (logged with it)."""

    rule: AggregationRule = "mean"
    clip_threshold: float | None = None
    """``clip``: the norm contributions were clipped to (None: no reference yet)."""
    trim_fraction: float = 0.2
    krum_f: int = 1
    elsewhere: tuple[float, ...] = ()
    """On shard 0 of a sharded server, what the other shards measured over their rows (their ``ShardNorms``);
    empty: this process holds every row. ``clip``: each contribution's squared norm, so that its norm is the whole
    update's. ``krum``: the squared distance of every pair of contributions ``(0, 1), (0, 2), ..., (1, 2), ...``,
    so that Krum scores the whole updates."""
    chosen: tuple[int, ...] | None = None
    """The contributions the rule combined: under ``krum`` those it averaged, under the others those the norm filter
    did not refuse (on another shard: those shard 0 chose); None: all of them, or under ``krum`` not decided yet
    (``combine`` decides and sets it)."""
    norm_limit: float | None = None
    """The norm above which a contribution was refused (``ps.norm_factor`` x the median of recent norms; None: the
    step was not judged by norm)."""
    gain: float = 1.0
    """What the step's weights were multiplied by after the rule: the gain ``ps.round_scaling = "adascale"`` measured
    for the round (``gain``); 1: none."""

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of_record(cls, record: Mapping[str, Any] | None) -> Aggregation:
        """The aggregation a log record names; a record from before robust rules was a ``mean``."""
        if not record:
            return cls()
        rule: AggregationRule = next((r for r in AGGREGATION_RULES if r == record.get("rule")), "mean")
        threshold, chosen, limit = record.get("clip_threshold"), record.get("chosen"), record.get("norm_limit")
        return cls(rule, None if threshold is None else float(threshold), float(record.get("trim_fraction", 0.2)),
                   int(record.get("krum_f", 1)), tuple(float(v) for v in record.get("elsewhere", ())),
                   None if chosen is None else tuple(int(i) for i in chosen), None if limit is None else float(limit),
                   float(record.get("gain", 1.0)))


@dataclass(slots=True)
class Combined:
    """What the SGD step sums, and what the rule did."""

    contributions: list[Contribution]
    how: Aggregation = field(default_factory=Aggregation)
    norms: list[float] = field(default_factory=list)
    """L2 norm of every contribution as applied (clipped, under ``clip``; those Krum left out are not)."""
    clipped: int = 0
    """Contributions whose norm ``clip`` cut."""
    scales: list[float] = field(default_factory=list)
    """``clip``: what each contribution was multiplied by (1 where it was not cut)."""
    excluded: int = 0
    """Contributions left out: by Krum, those not among the best scored; by the trimmed mean, the ones each
    coordinate drops (not those the norm filter refused)."""
    refused: int = 0
    """Contributions the norm filter refused (``Aggregation.chosen`` leaves them out)."""


def norm(shards: Iterable[ShardGrad], elsewhere: float = 0.0) -> float:
    """L2 norm of a contribution's gradient (with ``elsewhere``, the squared norm of its rows other shards hold):
    float32 dot products (BLAS, no float64 copy: a seventh of the time, and clip compares norms only to a
    multiple of their median), summed in float64."""
    return float(np.sqrt(squared(shards) + elsewhere))


def squared(shards: Iterable[ShardGrad]) -> float:
    """Squared L2 norm of these rows of a gradient (what a shard tells shard 0 for ``clip``)."""
    total = 0.0
    for g in shards:
        flat = g.values.reshape(-1)
        total += float(np.dot(flat, flat))
    return total


def pair_squared(a: Iterable[ShardGrad], b: Iterable[ShardGrad]) -> float:
    """Squared distance between two gradients over the rows both cover (what a shard tells shard 0 for ``krum``)."""
    total = 0.0
    for parts in segments([(1.0, list(a)), (1.0, list(b))]).values():
        if len(parts) == 2:  # noqa: PLR2004 - both cover it
            total += float(np.square(parts[0][1] - parts[1][1], dtype=np.float64).sum())
    return total


def combine(contributions: Sequence[Contribution], how: Aggregation) -> Combined:
    """The contributions ``ModelState.step`` sums for one step under ``how``."""
    if how.chosen is not None and how.rule != "krum":  # the norm filter's refusals: the rule takes the others
        kept = sorted(set(how.chosen))
        far = [how.elsewhere[i] for i in kept] if how.rule == "clip" and how.elsewhere else []
        out = combine([contributions[i] for i in kept], replace(how, chosen=None, elsewhere=tuple(far)))
        out.refused = len(contributions) - len(kept)
        out.how = how
        return out
    if not contributions:  # a shard's step of none of its updates (``shard_steps``): nothing to judge
        out = Combined([], norms=[])
    elif how.rule == "clip":
        out = _clip(contributions, how.clip_threshold, how.elsewhere or (0.0,) * len(contributions))
    elif how.rule == "krum":
        chosen = list(how.chosen) if how.chosen is not None else krum_choice(contributions, how.krum_f, how.elsewhere)
        out = _krum(contributions, chosen)
        how = replace(how, chosen=tuple(chosen))
    elif how.rule == "median":
        out = _by_segment(contributions, lambda values: np.median(values, axis=0), _norms(contributions))
    elif how.rule == "trimmed-mean":
        out = _trimmed(contributions, how.trim_fraction)
    else:
        out = Combined(list(contributions), norms=_norms(contributions))
    if how.gain != 1.0:
        out.contributions = [(weight * how.gain, shards) for weight, shards in out.contributions]
    out.how = how
    return out


def trim_count(n: int, fraction: float) -> int:
    """Values dropped at each end of ``n``: ``fraction`` of them, keeping at least one."""
    return min(int(fraction * n), (n - 1) // 2)


def idle_under(rule: AggregationRule, policy: SyncPolicy) -> bool:
    """Whether ``rule`` has only one contribution per step to judge under ``policy``."""
    return rule in ROUND_RULES and policy in SINGLE_UPDATE_POLICIES


class Aggregator:
    """The rule in force (``ps.aggregation``, then ``set-aggregation``), the norms ``clip`` and the norm filter
    compare with, and the counts of what the rules did (``edgemesh_ps_robust_*``) and of the steps the model
    refused (``edgemesh_ps_steps_refused_total``)."""

    def __init__(self, ps: ParameterServerConfig, metrics: ServiceMetrics) -> None:
        self.rule: AggregationRule = ps.aggregation
        self.clip_factor = ps.clip_factor
        self.trim_fraction = ps.trim_fraction
        self.krum_f = ps.krum_f
        self.norm_factor = ps.norm_factor
        self.norm_warmup = ps.norm_warmup
        self.judges = ps.shard == 0
        """Whether this process refuses contributions by norm: not a sharded server's shard other than 0, whose
        steps carry shard 0's choice (``Step.chosen``)."""
        self.norms: deque[float] = deque(maxlen=CLIP_WINDOW)
        """Norms of the last contributions applied, under any rule (so a switch to ``clip`` has them)."""
        self.noise = NoiseScale()
        """``ps.round_scaling = "adascale"``: the gradient noise and signal the rounds measured (``gain``)."""
        self.verdicts: deque[bool] = deque(maxlen=CLIP_WINDOW)
        """Whether the norm filter refused each of the last contributions it judged."""
        self._warned: tuple[AggregationRule, SyncPolicy] | None = None
        self.m_clipped = metrics.counter("robust_clipped", "Contributions whose norm the clip rule cut")
        self.m_excluded = metrics.counter("robust_excluded", "Contributions a robust rule left out of a step",
                                          ["rule"])
        self.m_refused = metrics.counter("robust_refused", "Contributions refused before the rule ran, by reason "
                                         "(norm: far above the median norm of those applied recently)", ["reason"])
        self.m_gain = metrics.gauge("step_gain", "The last round step's AdaScale gain under ps.round_scaling = "
                                    "adascale: what it multiplied the step by, between 1 and the batches it averaged")
        self.m_steps_refused = metrics.counter("steps_refused", "Steps not applied because they would have made the "
                                               "model not finite or grown a tensor's norm past the bound", ["reason"])

    def combine(self, contributions: Sequence[Contribution], *, rule: AggregationRule | None = None,
                elsewhere: Sequence[float] = (), chosen: Sequence[int] | None = None, gain_limit: float = 1.0,
                samples: Sequence[int] = ()) -> Combined:
        """One step's contributions under the rule in force, or ``rule`` (``Combined.how`` is logged with the
        step); ``elsewhere`` and ``chosen``: see :class:`Aggregation` (``chosen`` given: shard 0 decided, none is
        judged here). ``gain_limit`` above 1 (a round under ``ps.round_scaling = "adascale"``, ``Step.gain_limit``):
        the step is multiplied by the gain its contributions of ``samples`` samples measure (``gain``). An overflow
        in the rule's arithmetic leaves infinities, no warning: the model refuses the step (``ModelState.apply``)
        and it is counted."""
        rule = rule or self.rule
        limit, kept = None, list(range(len(contributions)))
        with np.errstate(over="ignore", invalid="ignore"):
            if chosen is None and rule != "clip":
                limit, kept = self._judge(contributions)
                if len(kept) < len(contributions):
                    chosen = kept if rule != "krum" else [kept[i] for i in krum_choice(
                        [contributions[i] for i in kept], self.krum_f, _pairs_among(elsewhere, len(contributions),
                                                                                    kept))]
            threshold = None
            if rule == "clip":
                recent = [*self.norms, *(norm(shards, *elsewhere[i:i + 1])
                                         for i, (_, shards) in enumerate(contributions))]
                threshold = self.clip_factor * float(np.median(recent)) if recent else None
            combined = combine(contributions, Aggregation(
                rule, threshold, self.trim_fraction, self.krum_f, tuple(elsewhere) if rule in ("clip", "krum") else (),
                None if chosen is None else tuple(chosen), limit))
        if rule == "krum" and limit is not None:  # Krum's count leaves out those the filter refused
            combined.refused = len(contributions) - len(kept)
            combined.excluded -= combined.refused
        if gain_limit > 1.0 and self.judges:
            combined = self._gained(combined, contributions, samples, gain_limit)
        self.norms.extend(combined.norms)
        self.m_clipped.inc(combined.clipped)
        self.m_excluded.labels(rule=rule).inc(combined.excluded)
        return combined

    def _gained(self, combined: Combined, contributions: Sequence[Contribution], samples: Sequence[int],
                limit: float) -> Combined:
        """``combined`` multiplied by the gain its round measures: on the gradients as the rule left them (clipped;
        the raw ones under a rule that merges them), of the contributions it kept."""
        kept = list(range(len(contributions)) if combined.how.chosen is None else combined.how.chosen)
        merged = len(combined.contributions) != len(kept)
        grads = [contributions[i][1] for i in kept] if merged else [shards for _, shards in combined.contributions]
        with np.errstate(over="ignore", invalid="ignore"):
            gain = self.noise.gain(grads, [samples[i] for i in kept], limit)
        self.m_gain.set(gain)
        how = replace(combined.how, gain=gain)
        return replace(combined, how=how, contributions=[(w * gain, g) for w, g in combined.contributions])

    def _judge(self, contributions: Sequence[Contribution]) -> tuple[float | None, list[int]]:
        """The norm filter: the limit it applied (None: none yet, or off) and the contributions within it. Each
        refusal is counted and logged; refusals that are most of the last ``CLIP_WINDOW`` judged start the
        reference again (module docstring)."""
        everyone = list(range(len(contributions)))
        if not self.judges or not self.norm_factor or len(self.norms) < self.norm_warmup:
            return None, everyone
        limit = self.norm_factor * float(np.median(self.norms))
        sizes = [norm(shards) for _, shards in contributions]
        kept = [i for i in everyone if sizes[i] <= limit]
        self.verdicts.extend(size > limit for size in sizes)
        if len(kept) < len(contributions):
            self.m_refused.labels(reason="norm").inc(len(contributions) - len(kept))
            refused = sorted((sizes[i] for i in everyone if i not in kept), reverse=True)
            shown = ", ".join(f"{size:.4g}" for size in refused[:LOGGED_NORMS])
            more = f" and {len(refused) - LOGGED_NORMS} more" if len(refused) > LOGGED_NORMS else ""
            logger.warning("refused %d of a step's %d updates: L2 norm %s%s above %g x the median of the last %d "
                           "applied (%.4g)", len(refused), len(contributions), shown, more, self.norm_factor,
                           len(self.norms), limit / self.norm_factor)
        if len(self.verdicts) == self.verdicts.maxlen and 2 * sum(self.verdicts) > len(self.verdicts):
            logger.warning("the norm filter refused %d of the last %d updates: the fleet's gradients grew, not one "
                           "device's; its reference starts again (%d norms to learn)", sum(self.verdicts),
                           len(self.verdicts), self.norm_warmup)
            self.norms.clear()
            self.verdicts.clear()
        return limit, kept

    def step_refused(self, version: int, refused: Refused, combined: Combined) -> None:
        """The model refused the step that would have made ``version`` (``ModelState.apply``): counted, logged, and
        its contributions' norms are not the recent norms of applied ones."""
        self.m_steps_refused.labels(reason=refused.reason).inc()
        logger.warning("step to version %d refused (%s): %s; the model stays as it was", version, refused.reason,
                       refused.detail)
        for size in combined.norms:
            with contextlib.suppress(ValueError):  # gone from the window already
                self.norms.remove(size)

    def kept(self) -> dict[str, Any]:
        """What a checkpoint keeps: the rule and the recent norms."""
        return {"aggregation": self.rule, "norms": list(self.norms)}

    def warn_if_idle(self, policy: SyncPolicy) -> None:
        """Log a warning, once per rule and policy, when ``policy`` gives the rule one contribution per step."""
        if idle_under(self.rule, policy) and self._warned != (self.rule, policy):
            logger.warning("aggregation %r compares the updates of a step, but under %r every step is one "
                           "update: it applies each as it is; use a round policy (sync, adaptive) or clip",
                           self.rule, policy)
        self._warned = (self.rule, policy)


def _pairs_among(elsewhere: Sequence[float], n: int, kept: Sequence[int]) -> list[float]:
    """Of the pairs' distances ``elsewhere`` holds for ``n`` contributions (``Aggregation.elsewhere`` under krum),
    those of the pairs among ``kept``, in the same order (empty if none were given)."""
    if not elsewhere:
        return []
    index = {pair: i for i, pair in enumerate(itertools.combinations(range(n), 2))}
    return [elsewhere[index[pair]] for pair in itertools.combinations(kept, 2)]


def _clip(contributions: Sequence[Contribution], threshold: float | None, elsewhere: Sequence[float]) -> Combined:
    out = Combined([])
    for (weight, shards), far in zip(contributions, elsewhere, strict=True):
        size, scale = norm(shards, far), 1.0
        if threshold is not None and size > threshold:
            scale = threshold / size
            shards = [ShardGrad(g.param, g.start, g.stop, g.values * np.float32(scale)) for g in shards]
            out.clipped += 1
            size = threshold
        out.contributions.append((weight, shards))
        out.norms.append(size)
        out.scales.append(scale)
    return out


def segments(contributions: Sequence[Contribution]) -> dict[Segment, list[tuple[int, np.ndarray]]]:
    """Every parameter's rows cut at every shard boundary of the step: segment -> (contribution index,
    its values there), for the contributions covering it."""
    cuts: dict[str, set[int]] = {}
    for _, shards in contributions:
        for g in shards:
            cuts.setdefault(g.param, set()).update((g.start, g.stop))
    bounds = {param: sorted(c) for param, c in cuts.items()}
    out: dict[Segment, list[tuple[int, np.ndarray]]] = {}
    for i, (_, shards) in enumerate(contributions):
        for g in shards:
            b = bounds[g.param]
            first, last = bisect.bisect_left(b, g.start), bisect.bisect_left(b, g.stop)
            for start, stop in zip(b[first:last], b[first + 1:last + 1], strict=True):
                out.setdefault((g.param, start, stop), []).append((i, g.values[start - g.start:stop - g.start]))
    return out


def _by_segment(contributions: Sequence[Contribution], center: Callable[[np.ndarray], np.ndarray],
                norms: list[float], chosen: Sequence[int] | None = None) -> Combined:
    """Per segment, ``center`` of the stacked values of the contributions covering it (those ``chosen``,
    if given), times their total weight there: one contribution of weight 1 carrying every segment."""
    shards = []
    for (param, start, stop), parts in segments(contributions).items():
        values = [v for i, v in parts if chosen is None or i in chosen]
        if not values:
            continue  # covered only by contributions left out
        total = np.float32(sum(contributions[i][0] for i, _ in parts))
        shards.append(ShardGrad(param, start, stop, (center(np.stack(values)) * total).astype(np.float32)))
    return Combined([(1.0, shards)], norms=norms)


def _norms(contributions: Sequence[Contribution]) -> list[float]:
    return [norm(shards) for _, shards in contributions]


def _trimmed(contributions: Sequence[Contribution], fraction: float) -> Combined:
    def center(values: np.ndarray) -> np.ndarray:
        t = trim_count(len(values), fraction)
        return np.sort(values, axis=0)[t:len(values) - t].mean(axis=0)

    out = _by_segment(contributions, center, _norms(contributions))
    out.excluded = 2 * trim_count(len(contributions), fraction)
    return out


def krum_choice(contributions: Sequence[Contribution], f: int, elsewhere: Sequence[float] = ()) -> list[int]:
    """Multi-Krum: the indices of the n - f contributions with the smallest sums of squared distances
    to their n - f - 2 nearest others (at least one of each), on the rows both cover, plus ``elsewhere``
    (:attr:`Aggregation.elsewhere`). All of them when n <= 2: two cannot tell which one is wrong."""
    n = len(contributions)
    if n <= 2:
        return list(range(n))
    distance = np.zeros((n, n))
    if elsewhere:
        upper = np.triu_indices(n, 1)
        distance[upper] = elsewhere
        distance += distance.T
    for parts in segments(contributions).values():
        for a, (i, x) in enumerate(parts):
            for j, y in parts[a + 1:]:
                d = float(np.square(x - y, dtype=np.float64).sum())
                distance[i, j] += d
                distance[j, i] += d
    nearest = max(1, n - f - 2)
    scores = [float(np.sort(np.delete(distance[i], i))[:nearest].sum()) for i in range(n)]
    return sorted(sorted(range(n), key=lambda i: (scores[i], i))[:max(1, n - f)])


def _krum(contributions: Sequence[Contribution], chosen: Sequence[int]) -> Combined:
    out = _by_segment(contributions, lambda values: values.mean(axis=0),
                      [norm(contributions[i][1]) for i in chosen], chosen)
    out.excluded = len(contributions) - len(chosen)
    return out
