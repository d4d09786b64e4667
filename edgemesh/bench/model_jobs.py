"""The models ``bench models`` trains, and the job file of each cell (a model, a sync policy, a seed).

* ``plain-cnn``: the digits CNN's architecture for 3x32x32 images (conv 16, relu, conv 32, relu, then a 4x4
  max pool instead of 2x2, so that its linear layer takes 32x8x8 values, not 32x16x16);
* ``bn-cnn``: three conv + batch norm + relu blocks without bias, max pooling, global average pooling,
  dropout before the last layer;
* ``mobilenetv2``: the ``[model]`` of ``examples/mobilenetv2-32.toml`` (inverted residual blocks, depthwise
  convolutions, relu6, global average pooling);
* ``resnet8``: the ``[model]`` of ``examples/resnet8-32.toml`` (three residual stages, projections);
* ``entry-point``: the user's own module (:data:`ENTRY_POINT_NET`, written to the work directory's ``models``, which
  the fleet's hosts allow and search, and named by ``entry_point`` and ``module_path``): batch norm,
  depthwise-separable residual blocks, a strided convolution;
* ``gn-cnn``: ``bn-cnn`` with group norm (4 groups) in place of each batch norm: normalization that does not depend
  on the batch, for devices whose inputs differ (not in a full ``bench models`` run unless named).

Each job's ``[training]`` takes the learning rate and batch size of its model (the examples' own for the two
taken from ``examples/``), the cell's sync policy and seed; ``[data]`` and ``[evaluation]`` are those of the
glyph folders :mod:`edgemesh.bench.glyphs` draws.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgemesh.bench.glyphs import GLYPHS, SIZE
from edgemesh.common.jobs import render_job

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
"""The repository's example job files."""
DATA_PATH = "glyphs"
"""The image folder under each device's ``worker.data_dir``."""
EVAL_PATH = "glyphs-eval"
"""The held-out image folder under the parameter server host's ``ps.data_dir``."""
EVAL_EVERY = 5
"""Model versions between the PS's held-out evaluations (``evaluation.every``)."""
MEAN_STD = (0.5, 0.25)
"""The jobs' normalization of inputs in [0, 1] (the examples')."""
ENTRY_POINT_MODULE = "glyph_net"
"""The entry-point model's module: what a host (``models.allowed``) or a rebuild must allow."""
ENTRY_POINT = f"{ENTRY_POINT_MODULE}:build"
ENTRY_POINT_FILE = f"{ENTRY_POINT_MODULE}.py"

ENTRY_POINT_NET = '''"""A user's own small network for 32x32 images (bench models' entry point): batch norm,
depthwise-separable blocks with a residual, a strided convolution between them, global average pooling."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 3, padding=1, groups=channels, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.pointwise = nn.Conv2d(channels, channels, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.pointwise(torch.relu(self.bn1(self.depthwise(x))))))


class Net(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU())
        self.block1 = Block(16)
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32),
                                  nn.ReLU())
        self.block2 = Block(32)
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.head(self.block2(self.down(self.block1(self.stem(x)))).mean(dim=(2, 3)))


def build(num_classes):
    return Net(num_classes)
'''


@dataclass(frozen=True, slots=True)
class BenchModel:
    """One model of the matrix: its ``[model]`` table (without shape and classes) and its training settings."""

    name: str
    description: str
    model: dict[str, Any]
    lr: float
    batch_size: int

    @property
    def entry_point(self) -> bool:
        return "entry_point" in self.model


def _example(file: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``[model]`` (without input shape and classes) and ``[training]`` tables of an example job file."""
    tree = tomllib.loads((EXAMPLES / file).read_text())
    model = {k: v for k, v in tree["model"].items() if k not in ("input_shape", "classes")}
    return model, tree["training"]


def catalogue() -> dict[str, BenchModel]:
    """Every model of the matrix, by name (reads the two examples)."""
    mobilenet, mobilenet_training = _example("mobilenetv2-32.toml")
    resnet, resnet_training = _example("resnet8-32.toml")
    classes = len(GLYPHS)
    plain = [{"conv2d": 16, "kernel": 3, "padding": 1}, "relu", {"conv2d": 32, "kernel": 3, "padding": 1}, "relu",
             {"maxpool2d": 4}, "flatten", {"linear": 64}, "relu", {"linear": classes}]
    bn = [{"conv2d": 16, "kernel": 3, "padding": 1, "bias": False}, "batchnorm", "relu", {"maxpool2d": 2},
          {"conv2d": 32, "kernel": 3, "padding": 1, "bias": False}, "batchnorm", "relu", {"maxpool2d": 2},
          {"conv2d": 64, "kernel": 3, "padding": 1, "bias": False}, "batchnorm", "relu",
          "globalavgpool", {"dropout": 0.2}, {"linear": classes}]
    gn = [{"groupnorm": 4} if layer == "batchnorm" else layer for layer in bn]
    return {m.name: m for m in (
        BenchModel("plain-cnn", "the digits CNN for 3x32x32 (a 4x4 max pool)", {"layers": plain}, 0.02, 16),
        BenchModel("bn-cnn", "conv + batch norm + relu blocks without bias, dropout", {"layers": bn}, 0.05, 16),
        BenchModel("mobilenetv2", "examples/mobilenetv2-32.toml", mobilenet, float(mobilenet_training["lr"]),
                   int(mobilenet_training["batch_size"])),
        BenchModel("resnet8", "examples/resnet8-32.toml", resnet, float(resnet_training["lr"]),
                   int(resnet_training["batch_size"])),
        BenchModel("entry-point", "an entry-point module: batch norm, depthwise residual blocks",
                   {"entry_point": ENTRY_POINT}, 0.05, 16),
        BenchModel("gn-cnn", "bn-cnn with group norm (4 groups) in place of batch norm", {"layers": gn}, 0.05, 16),
    )}


def job_name(model: str, policy: str, seed: int) -> str:
    return f"models-{model}-{policy}-s{seed}"


def job_text(entry: BenchModel, *, policy: str, seed: int, target: float, max_minutes: float, max_versions: int,
             module_path: Path) -> str:
    """The job file of one cell."""
    model: dict[str, Any] = {"input_shape": [3, SIZE, SIZE], "classes": list(GLYPHS), **entry.model}
    if entry.entry_point:
        model["module_path"] = str(module_path)
    return render_job({
        "job": {"name": job_name(entry.name, policy, seed), "description": entry.description,
                "target_accuracy": target, "max_minutes": max_minutes, "max_versions": max_versions},
        "model": model,
        "data": {"format": "image-folder", "path": DATA_PATH, "mean": [MEAN_STD[0]], "std": [MEAN_STD[1]]},
        "evaluation": {"path": EVAL_PATH, "every": EVAL_EVERY},
        "training": {"sync_policy": policy, "lr": entry.lr, "batch_size": entry.batch_size, "seed": seed},
    })


def write_entry_point(directory: Path) -> Path:
    """The entry-point model's module in ``directory`` (the jobs' ``module_path``, each host's ``models.path``: write
    it before the fleet starts, ``job_fleet.spawn_fleet``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ENTRY_POINT_FILE).write_text(ENTRY_POINT_NET)
    return directory
