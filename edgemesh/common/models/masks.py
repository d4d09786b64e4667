"""Dropout masks the members of a model-parallel cluster share (docs/mesh.md).

Members of a cluster compute slices of one forward pass, so a dropout must drop the same values on every member:
each draws the mask of the whole tensor from a seed the cluster shares (the plan's seed, the step and the dropout
module's name) and applies its slice of it. The result is what one process drawing that same mask computes, not
what torch's own dropout draws from its global generator: the two take different random streams.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch


def mask_seed(seed: int, step: int, name: str) -> int:
    """The generator seed of dropout ``name``'s mask at ``step`` of a plan seeded ``seed``: the same on every member,
    another for another step or module."""
    words = [seed % 2**64, step % 2**64, zlib.crc32(name.encode())]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> 1)


def dropout_mask(shape: Sequence[int], p: float, seed: int, step: int, name: str) -> torch.Tensor:
    """The float32 keep-mask (1 kept, 0 dropped, each kept with probability ``1 - p``) of a whole tensor of ``shape``,
    drawn from ``mask_seed``."""
    generator = torch.Generator().manual_seed(mask_seed(seed, step, name))
    return torch.empty(tuple(shape), dtype=torch.float32).bernoulli_(1.0 - p, generator=generator)


def apply_mask(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` through dropout of probability ``p`` with ``mask`` (of ``x``'s shape): kept values scaled by
    ``1 / (1 - p)``, as ``nn.Dropout`` scales them in training."""
    if p >= 1:
        return x * 0.0
    return x * (mask * (1.0 / (1.0 - p)))
