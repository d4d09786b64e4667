"""An emulated faulty or malicious device (``worker.emulation_attack``, for ``edgemesh bench robust``): what it
does to its gradient before encoding it (pure).

* ``sign-flip``: the gradient negated and scaled by ``worker.emulation_attack_scale``, so that a plain mean
  of the fleet's updates climbs the loss;
* ``noise``: Gaussian noise in place of the gradient, each tensor's with a standard deviation of the scale
  times that tensor's own gradient's RMS (the size an honest update of this device would have).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from edgemesh.common.vocabulary import AttackKind


def attack_rng(seed: int, device: str) -> np.random.Generator:
    """The noise of one device: from the emulation seed and its name, so devices differ and runs repeat."""
    return np.random.default_rng(int.from_bytes(hashlib.sha256(f"attack/{seed}/{device}".encode()).digest()[:8],
                                                "big"))


def falsify(grads: Mapping[str, np.ndarray], kind: AttackKind, scale: float,
            rng: np.random.Generator) -> dict[str, np.ndarray]:
    """What a device emulating ``kind`` sends in place of ``grads`` (``grads`` unchanged when ``kind`` is empty)."""
    if kind == "sign-flip":
        return {name: (g * np.float32(-scale)).astype(np.float32) for name, g in grads.items()}
    if kind == "noise":
        return {name: rng.normal(0.0, scale * float(np.sqrt(np.mean(np.square(g, dtype=np.float64)))),
                                 g.shape).astype(np.float32) for name, g in grads.items()}
    return dict(grads)
