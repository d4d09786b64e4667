"""How much a round's step may grow with the batches it averages, measured from the round's own gradients (pure).

Under ``ps.round_scaling = "adascale"`` a round step of ``S`` batches (of ``training.batch_size``, the batch the
learning rate is given for) is multiplied by AdaScale's gain (Johnson et al., "AdaScale SGD", ICML 2020)::

    r = (sigma2 + mu2) / (sigma2 / S + mu2),   1 <= r <= S

where ``sigma2`` is the variance of one batch's gradient and ``mu2`` the squared norm of the true gradient. When the
devices' gradients disagree (noise dominates), averaging S of them is worth S steps and ``r`` nears ``S``, the
linear scaling rule; when they agree (the round is past the batch where more samples add information, as when a
thousand devices together hold the whole data set), ``r`` nears 1 and the round is one step at ``training.lr``.

Both are estimated from the round's contributions: ``k`` gradients ``g_i`` of ``n_i`` samples, their sample-weighted
mean ``g``, ``N`` samples in all. ``sum n_i |g_i - g|^2 / (k - 1)`` is an unbiased estimate of the variance of one
sample's gradient; over ``b = N / S`` samples, ``sigma2`` is that over ``b``; ``mu2 = |g|^2 - sigma2 / S``.
Both are exponential averages over about ``1000 / S`` rounds (smoothing ``1 - S / 1000``, as the public AdaScale
implementations smooth), so that one round's noisy estimate does not set the step.

Only the process that decides a step measures its gain (a server of one process, or shard 0 of a sharded one, over
the rows it holds); the gain is logged with the step (``robust.Aggregation.gain``) and goes to the other shards in
the step's weights, so a replay and every shard take the step the decision took. The estimates themselves are not
checkpointed: after a restart they start again from the next round's measure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgemesh.services.parameter_server.optimizer import ShardGrad

SMOOTHING_SPAN = 1000.0
"""Rounds' batches over which the estimates are averaged: the smoothing is ``1 - S / SMOOTHING_SPAN``."""


@dataclass(slots=True)
class NoiseScale:
    """The smoothed estimates of gradient noise and signal the gain is computed from."""

    sigma2: float | None = None
    """Variance of one batch's gradient (summed over coordinates); None: no round of two gradients yet."""
    mu2: float = 0.0
    """Squared norm of the true gradient."""

    def gain(self, grads: Sequence[Sequence[ShardGrad]], samples: Sequence[int], batches: float) -> float:
        """The gain of a round of ``batches`` (S) batches whose contributions are ``grads`` of ``samples`` samples
        each; the estimates first take this round's measure (a round of one gradient measures nothing: the last
        estimates stand, or, with none yet, the gain is 1)."""
        if batches <= 1.0:
            return 1.0
        measured = measure(grads, samples, batches)
        if measured is not None:
            sigma2, mu2 = measured
            if self.sigma2 is None:
                self.sigma2, self.mu2 = sigma2, mu2
            else:
                theta = max(1.0 - batches / SMOOTHING_SPAN, 0.0)
                self.sigma2 = theta * self.sigma2 + (1.0 - theta) * sigma2
                self.mu2 = theta * self.mu2 + (1.0 - theta) * mu2
        return ratio(self.sigma2, self.mu2, batches)


def ratio(sigma2: float | None, mu2: float, batches: float) -> float:
    """AdaScale's gain for these estimates, within ``[1, batches]`` (1 when there is no estimate)."""
    if sigma2 is None or not math.isfinite(sigma2) or not math.isfinite(mu2):
        return 1.0
    below = sigma2 / batches + mu2
    if below <= 0.0:
        return batches if sigma2 > 0.0 else 1.0
    return min(max((sigma2 + mu2) / below, 1.0), batches)


def measure(grads: Sequence[Sequence[ShardGrad]], samples: Sequence[int],
            batches: float) -> tuple[float, float] | None:
    """``(sigma2, mu2)`` of one round (module docstring); None for fewer than two gradients with samples."""
    pairs = [(n, g) for n, g in zip(samples, grads, strict=True) if n > 0 and g]
    if len(pairs) < 2:  # noqa: PLR2004 - a variance wants two
        return None
    total = float(sum(n for n, _ in pairs))
    weighted_squares = 0.0
    mean: dict[tuple[str, int, int], np.ndarray] = {}
    for n, shards in pairs:
        for g in shards:
            flat = g.values.reshape(-1)
            weighted_squares += n * float(np.dot(flat, flat))
            key = (g.param, g.start, g.stop)
            acc = mean.get(key)
            if acc is None:
                mean[key] = flat.astype(np.float64) * n
            else:
                acc += flat * n
    mean_squared = sum(float(np.dot(acc, acc)) for acc in mean.values()) / (total * total)
    per_sample = max(weighted_squares - total * mean_squared, 0.0) / (len(pairs) - 1)
    sigma2 = per_sample * batches / total  # over one batch of N / S samples
    return sigma2, max(mean_squared - per_sample / total, 0.0)
