"""Named model specs and their registry: the built-in ones, and those a job brings (layer lists, entry points)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from edgemesh.common import costs
from edgemesh.common.errors import ModelError
from edgemesh.common.models.lean import LeanMaxPool2d, LeanReLU, Standardize


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A named architecture: what it eats, how many classes it predicts, how to build it."""

    name: str
    input_shape: tuple[int, ...]
    """Shape of one sample: (C, H, W) for images, (F,) for feature vectors; any rank."""
    num_classes: int
    builder: Callable[[], nn.Module]
    """Builds a fresh module on every call (``build_model`` seeds the RNG first)."""
    description: str


def check_io(name: str, input_shape: Sequence[Any], num_classes: Any) -> tuple[int, ...]:
    """``input_shape`` as a tuple; ModelError unless it is non-empty positive ints and ``num_classes`` >= 1."""
    if (isinstance(input_shape, str | bytes) or not isinstance(input_shape, Sequence) or not input_shape
            or not all(_positive_int(d) for d in input_shape)):
        raise ModelError(f"model {name!r}: input_shape must be one or more positive integers, got {input_shape!r}")
    if not _positive_int(num_classes):
        raise ModelError(f"model {name!r}: num_classes must be a positive integer, got {num_classes!r}")
    return tuple(input_shape)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def standardize(name: str, input_shape: tuple[int, ...], mean: Sequence[float],
                std: Sequence[float]) -> Callable[[], Standardize] | None:
    """A builder of the ``input`` module for ``mean``/``std`` (None when both are empty), checked now:
    one value per channel (``input_shape[0]``), stds > 0."""
    if not mean and not std:
        return None
    mean, std = tuple(mean), tuple(std)
    channels = input_shape[0]
    if len(mean) != channels or len(std) != channels:
        raise ModelError(f"model {name!r}: mean and std need one value per channel (input_shape[0] = {channels}), "
                         f"got {len(mean)} and {len(std)}")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (*mean, *std)):
        raise ModelError(f"model {name!r}: mean and std must be numbers, got {mean!r} and {std!r}")
    if not all(s > 0 for s in std):
        raise ModelError(f"model {name!r}: std must be > 0, got {std!r}")
    rank = len(input_shape)
    return lambda: Standardize(mean, std, sample_rank=rank)


DIGITS_MEAN_STD = ((0.3055,), (0.3761,))
"""Pixel mean and standard deviation of the digits training split (pixels scaled to [0, 1])."""
CIFAR_MEAN_STD = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
"""Per-channel mean and standard deviation of the CIFAR-10 training set."""


def _digits_cnn() -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            [
                ("input", Standardize(*DIGITS_MEAN_STD)),
                ("conv1", nn.Conv2d(1, 16, 3, padding=1)),
                ("relu1", LeanReLU()),
                ("conv2", nn.Conv2d(16, 32, 3, padding=1)),
                ("relu2", LeanReLU()),
                ("pool", LeanMaxPool2d(2)),
                ("flatten", nn.Flatten()),
                ("fc1", nn.Linear(32 * 4 * 4, 64)),
                ("relu3", LeanReLU()),
                ("fc2", nn.Linear(64, 10)),
            ]
        )
    )


def _digits_wide_cnn() -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            [
                ("input", Standardize(*DIGITS_MEAN_STD)),
                ("conv1", nn.Conv2d(1, 32, 3, padding=1)),
                ("relu1", LeanReLU()),
                ("conv2", nn.Conv2d(32, 64, 3, padding=1)),
                ("relu2", LeanReLU()),
                ("pool1", LeanMaxPool2d(2)),
                ("conv3", nn.Conv2d(64, 64, 3, padding=1)),
                ("relu3", LeanReLU()),
                ("pool2", LeanMaxPool2d(2)),
                ("flatten", nn.Flatten()),
                ("fc1", nn.Linear(64 * 2 * 2, 64)),
                ("relu4", LeanReLU()),
                ("fc2", nn.Linear(64, 10)),
            ]
        )
    )


def _cifar_cnn() -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            [
                ("input", Standardize(*CIFAR_MEAN_STD)),
                ("conv1", nn.Conv2d(3, 32, 3, padding=1)),
                ("relu1", LeanReLU()),
                ("pool1", LeanMaxPool2d(2)),
                ("conv2", nn.Conv2d(32, 64, 3, padding=1)),
                ("relu2", LeanReLU()),
                ("pool2", LeanMaxPool2d(2)),
                ("conv3", nn.Conv2d(64, 128, 3, padding=1)),
                ("relu3", LeanReLU()),
                ("pool3", LeanMaxPool2d(2)),
                ("flatten", nn.Flatten()),
                ("fc1", nn.Linear(128 * 4 * 4, 256)),
                ("relu4", LeanReLU()),
                ("fc2", nn.Linear(256, 10)),
            ]
        )
    )


MODEL_SPECS: Final[dict[str, ModelSpec]] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="digits-cnn",
            input_shape=(1, 8, 8),
            num_classes=10,
            builder=_digits_cnn,
            description="two 3x3 conv layers (16, 32), max-pool, two linear layers; for sklearn digits",
        ),
        ModelSpec(
            name="digits-wide-cnn",
            input_shape=(1, 8, 8),
            num_classes=10,
            builder=_digits_wide_cnn,
            description="three 3x3 conv layers (32, 64, 64), two max-pools, two linear layers; for sklearn digits, "
                        "with five times the compute of digits-cnn per sample (edgemesh bench fleet)",
        ),
        ModelSpec(
            name="cifar-cnn",
            input_shape=(3, 32, 32),
            num_classes=10,
            builder=_cifar_cnn,
            description="three conv blocks (32, 64, 128) with max-pool, two linear layers; for CIFAR-10",
        ),
    )
}
"""The built-in specs (``register_spec`` adds to the registry, not to this)."""

_SPECS: dict[str, ModelSpec] = dict(MODEL_SPECS)
_BUILDING = threading.Lock()
"""Held while a model is built from the global torch RNG (``build_model``)."""
"""Every spec this process knows by name: the built-ins and the registered ones."""


def register_spec(spec: ModelSpec) -> None:
    """Make ``spec`` known by its name, replacing a spec of the same name and forgetting that one's
    cost figures (figures registered for a name no spec had yet, as a job's carried ones, are kept)."""
    if not isinstance(spec, ModelSpec):
        raise ModelError(f"expected a ModelSpec, got {type(spec).__name__}")
    replaced = _SPECS.get(spec.name)
    _SPECS[spec.name] = spec
    if replaced is not None and replaced is not spec:
        costs.forget(spec.name)


def get_spec(name: str) -> ModelSpec:
    """Return the spec called ``name``."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(_SPECS))}") from None


def build_model(name: str, seed: int = 0) -> nn.Module:
    """Build the named model with an initialisation fixed by ``seed``.

    The global torch RNG state is forked and restored, so building a model does not change
    what later random draws produce; one thread at a time draws from it here (two parameter server
    shards in one process, or a service beside its workers, would otherwise interleave their draws).
    """
    spec = get_spec(name)
    with _BUILDING, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.builder()
    return model.to(torch.float32)
