"""Named model specs, so the parameter server and every worker agree on parameter names and shapes.

Parameters cross process boundaries as ``dict[str, np.ndarray]`` (float32) keyed by
``named_parameters()`` names; this module converts between those and torch modules.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.utils import _pair

from edgemesh.common.costs import LayerCost, ModelCost
from edgemesh.common.data import Dataset
from edgemesh.common.errors import DataError, ModelError

logger = logging.getLogger(__name__)

ParamLayout = dict[str, tuple[tuple[int, ...], str]]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A named architecture: what it eats, how many classes it predicts, how to build it."""

    name: str
    input_shape: tuple[int, int, int]
    num_classes: int
    builder: Callable[[], nn.Module]
    description: str


class Standardize(nn.Module):
    """``(x - mean) / std`` per input channel with fixed constants of the data set.

    Part of the spec, not of the data: constants are buffers (they never travel as
    parameters), and inputs stay in [0, 1] whatever loads them. Standardized inputs halve
    the steps the digits CNN needs to reach 95% (about 50 rounds of 4x32 instead of 100).
    """

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class _MaskedReLU(torch.autograd.Function):
    """ReLU that keeps a 1-byte mask for backward instead of the 4-byte output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(x)
        # "not out <= 0" rather than "out > 0": torch's threshold_backward passes the gradient
        # of a NaN output, and gradients must match nn.ReLU bit for bit.
        ctx.save_for_backward(out.le(0).logical_not_())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (alive,) = ctx.saved_tensors
        # threshold_backward is torch's own ReLU backward (0 where the mask is 0, grad elsewhere);
        # on CPU it and a uint8 -> float cast are several times faster than masked_fill or where.
        result: torch.Tensor = torch.ops.aten.threshold_backward(grad, alive.view(torch.uint8).to(grad.dtype), 0)
        return result


class LeanReLU(nn.ReLU):
    """``nn.ReLU`` whose backward needs a bool mask (1 byte per element) instead of the float32 output.

    The saved outputs were most of a CNN's activation memory, which decides the batch that
    fits on a 1 GiB board. Still an ``nn.ReLU``, so model parallelism treats it as
    channel-wise; in-place is not offered since the point is not to keep the output.
    """

    def __init__(self) -> None:
        super().__init__(inplace=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and input.requires_grad:
            out: torch.Tensor = _MaskedReLU.apply(input)
            return out
        return torch.relu(input)


_MAX_WINDOW_AREA: Final = 256
"""Largest pooling window whose offsets (0 .. area - 1) fit in a uint8."""


def _window_starts(out_hw: tuple[int, ...], kernel: tuple[int, int], width: int, device: torch.device) -> torch.Tensor:
    """Flat index (into an input plane ``width`` wide) of each window's top-left element, shape ``out_hw``."""
    (oh, ow), (kh, kw) = out_hw, kernel
    return torch.arange(oh, device=device).mul_(kh * width).view(oh, 1) + torch.arange(ow, device=device).mul_(kw)


class _OffsetMaxPool2d(torch.autograd.Function):
    """Non-overlapping max-pooling that keeps each window's argmax as a uint8 offset.

    Torch's own kernel picks the maxima (so ties and NaNs resolve as in nn.MaxPool2d), then
    its int64 flat indices (8 bytes per output) shrink to the offset within the window
    (1 byte); the input itself is not kept. Backward rebuilds the flat indices.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
        out, idx = F.max_pool2d(x, (kh, kw), return_indices=True)
        width = x.shape[-1]
        # idx - start = row * width + col within the window, small enough for fast int32 division.
        local = (idx - _window_starts(out.shape[-2:], (kh, kw), width, x.device)).to(torch.int32)
        row = local.div(width, rounding_mode="floor")
        ctx.save_for_backward(local.sub_(row.mul_(width - kw)).to(torch.uint8))  # row * kw + col
        ctx.input_shape, ctx.kernel = x.shape, (kh, kw)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (offset,) = ctx.saved_tensors
        kh, kw = ctx.kernel
        shape: torch.Size = ctx.input_shape
        row = offset.div(kw, rounding_mode="floor")
        col = offset - row * kw
        starts = _window_starts(offset.shape[-2:], (kh, kw), shape[-1], grad.device)
        idx = (row.long().mul_(shape[-1]).add_(col).add_(starts)).flatten(-2)
        # Windows do not overlap, so indices are unique: a plain scatter is exact. Rows and
        # columns past the last whole window (floor mode) keep a zero gradient, as in torch.
        grad_in = grad.new_zeros((*shape[:-2], shape[-2] * shape[-1]))
        grad_in.scatter_(-1, idx, grad.reshape(idx.shape))
        return grad_in.view(shape), None, None


class LeanMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` whose backward keeps a uint8 window offset instead of the input and int64 indices.

    Per pre-pool element of a 2x2 pool that is 1/4 byte instead of 4 + 2 bytes. Only
    non-overlapping, unpadded, undilated, floor-mode windows take the lean path; any other
    configuration (or a forward without autograd) runs nn.MaxPool2d unchanged.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        kh, kw = _pair(self.kernel_size)
        lean = (
            _pair(self.stride) == (kh, kw)
            and _pair(self.padding) == (0, 0)
            and _pair(self.dilation) == (1, 1)
            and not self.ceil_mode
            and not self.return_indices
            and kh * kw <= _MAX_WINDOW_AREA
        )
        if lean and input.dim() in (3, 4) and torch.is_grad_enabled() and input.requires_grad:
            out: torch.Tensor = _OffsetMaxPool2d.apply(input, kh, kw)
            return out
        result: torch.Tensor = super().forward(input)
        return result


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
            name="cifar-cnn",
            input_shape=(3, 32, 32),
            num_classes=10,
            builder=_cifar_cnn,
            description="three conv blocks (32, 64, 128) with max-pool, two linear layers; for CIFAR-10",
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    """Return the spec called ``name``."""
    try:
        return MODEL_SPECS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(MODEL_SPECS))}") from None


def build_model(name: str, seed: int = 0) -> nn.Module:
    """Build the named model with an initialisation fixed by ``seed``.

    The global torch RNG state is forked and restored, so building a model does not change
    what later random draws produce.
    """
    spec = get_spec(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.builder()
    return model.to(torch.float32)


def measure_cost(name: str) -> ModelCost:
    """The per-sample training cost of spec ``name``, measured on its modules with one forward pass.

    ``costs.COSTS`` holds the same figures for hosts without torch; a test keeps them equal.
    """
    spec = get_spec(name)
    model = build_model(name)
    macs = 0
    activations = math.prod(spec.input_shape)

    def count(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal macs, activations
        activations += output[0].numel()
        if isinstance(module, nn.Conv2d):
            per_output = module.in_channels // module.groups * math.prod(module.kernel_size)
            macs += output[0].numel() * per_output
        elif isinstance(module, nn.Linear):
            macs += module.in_features * module.out_features

    leaves = [m for m in model.modules() if not list(m.children())]
    _forward_once(model, spec, [(m, count) for m in leaves])
    params = sum(p.numel() for p in model.parameters())
    return ModelCost(params=params, macs_per_sample=macs, activations_per_sample=activations)


def _forward_once(model: nn.Module, spec: ModelSpec, hooks: list[tuple[nn.Module, Callable[..., None]]]) -> None:
    """One forward pass of a zero sample with ``hooks`` on their modules (removed afterwards)."""
    handles = [module.register_forward_hook(hook) for module, hook in hooks]
    try:
        with torch.no_grad():
            model(torch.zeros((1, *spec.input_shape)))
    finally:
        for handle in handles:
            handle.remove()


CHANNELWISE: Final = (nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.MaxPool2d, nn.AvgPool2d)
"""Modules that act on each channel alone: model parallelism runs them on a member's slice."""
REPLICATED: Final = (Standardize, nn.Flatten, nn.Identity)
"""Parameterless modules that mix channels or positions: every member runs them on the whole input."""


@dataclass(frozen=True, slots=True)
class Stage:
    """One divisible layer of a spec, as model parallelism runs it (docs/mesh.md).

    A member applies ``pre`` to the whole (gathered) input, its slice of ``layer``'s output
    units, then ``tail`` to that slice; the slices are then all-gathered along dim 1.
    """

    layer: str
    """Name of the conv or linear module; its output units are what the filter division divides."""
    pre: tuple[str, ...]
    tail: tuple[str, ...]


def mesh_stages(model: nn.Module) -> tuple[Stage, ...]:
    """Split a sequential model into its divisible stages.

    Raises ModelError for a model model parallelism cannot divide: not sequential, a module with
    parameters that is neither conv nor linear (batch norm), or one that is random (dropout)
    or unknown, since each member must compute exactly what one process would.
    """
    if not isinstance(model, nn.Sequential):
        raise ModelError("model parallelism needs a sequential model")
    stages: list[Stage] = []
    layer: str | None = None  # the stage being built
    pre: list[str] = []
    tail: list[str] = []
    pending: list[str] = []  # replicated modules before the next layer
    for name, module in model.named_children():
        if isinstance(module, nn.Conv2d | nn.Linear):
            if layer is not None:
                stages.append(Stage(layer, tuple(pre), tuple(tail)))
            layer, pre, tail, pending = name, pending, [], []
        elif isinstance(module, CHANNELWISE):
            (tail if layer is not None else pending).append(name)
        elif isinstance(module, REPLICATED):
            if layer is not None:
                stages.append(Stage(layer, tuple(pre), tuple(tail)))
                layer = None
            pending.append(name)
        else:
            raise ModelError(f"model parallelism cannot divide module {name!r} ({type(module).__name__})")
    if layer is None:
        raise ModelError("the model must end with a conv or linear layer (and channel-wise modules)")
    stages.append(Stage(layer, tuple(pre), tuple(tail)))
    return tuple(stages)


def measure_layers(name: str) -> tuple[LayerCost, ...]:
    """Per-layer division figures of spec ``name`` (``costs.LAYERS`` holds the same; a test keeps them equal)."""
    spec = get_spec(name)
    model = build_model(name)
    stages = {s.layer: s for s in mesh_stages(model)}
    modules = dict(model.named_children())
    shapes: dict[str, tuple[int, ...]] = {}

    def keep(module_name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            shapes[module_name] = tuple(output.shape[1:])
            shapes[module_name + ":in"] = tuple(inputs[0].shape[1:])
        return hook

    _forward_once(model, spec, [(m, keep(n)) for n, m in modules.items()])
    out = []
    for stage in stages.values():
        module = modules[stage.layer]
        assert isinstance(module, nn.Conv2d | nn.Linear)
        units = shapes[stage.layer][0]
        per_unit_out = math.prod(shapes[stage.layer][1:])
        last = stage.tail[-1] if stage.tail else stage.layer
        gathered = math.prod(shapes[last][1:])
        first = stage.pre[0] if stage.pre else stage.layer
        in_values = math.prod(shapes[first + ":in"])
        if isinstance(module, nn.Conv2d):
            macs = per_unit_out * module.in_channels // module.groups * math.prod(module.kernel_size)
        else:
            macs = module.in_features
        params = sum(p.numel() for p in module.parameters()) // units
        out.append(LayerCost(stage.layer, units, macs, params, per_unit_out, gathered, in_values))
    return tuple(out)


def param_layout(model: nn.Module) -> ParamLayout:
    """Name -> (shape, dtype name such as ``"float32"``), in ``named_parameters()`` order."""
    return {
        name: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()
    }


def get_params(model: nn.Module) -> dict[str, np.ndarray]:
    """Float32 numpy copies of every parameter, keyed by name."""
    return {
        name: p.detach().cpu().numpy().astype(np.float32, copy=True) for name, p in model.named_parameters()
    }


def set_params(model: nn.Module, params: Mapping[str, np.ndarray]) -> None:
    """Copy ``params`` into ``model``; all names and shapes must match exactly.

    Everything is validated before the first parameter is written, so a rejected update
    leaves the model unchanged.
    """
    own = dict(model.named_parameters())
    missing = [n for n in own if n not in params]
    extra = [n for n in params if n not in own]
    if missing or extra:
        raise ModelError(f"parameter names do not match the model: missing {missing}, unexpected {extra}")
    converted: dict[str, torch.Tensor] = {}
    for name, target in own.items():
        try:
            array = np.asarray(params[name], dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise ModelError(f"parameter {name!r} is not a numeric array") from exc
        if array.shape != tuple(target.shape):
            raise ModelError(
                f"parameter {name!r} has shape {array.shape}, model expects {tuple(target.shape)}"
            )
        converted[name] = torch.tensor(array, dtype=target.dtype)
    with torch.no_grad():
        for name, target in own.items():
            target.copy_(converted[name])


def _batch_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    x_arr, y_arr = np.asarray(x), np.asarray(y)
    if x_arr.ndim != 4 or y_arr.ndim != 1 or x_arr.shape[0] != y_arr.shape[0] or y_arr.shape[0] == 0:
        raise ModelError(
            f"expected a non-empty batch x (N, C, H, W) and y (N,), got {x_arr.shape} and {y_arr.shape}"
        )
    if not np.issubdtype(y_arr.dtype, np.integer):
        raise ModelError(f"labels must be integers, got {y_arr.dtype}")
    # torch.tensor copies, so read-only views of a cached data set are fine.
    return torch.tensor(x_arr, dtype=torch.float32), torch.tensor(y_arr, dtype=torch.int64)


def _forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Logits for ``x``; shape and label-range problems become :class:`ModelError`."""
    try:
        logits = model(x)
    except RuntimeError as exc:
        raise ModelError(f"model rejected input of shape {tuple(x.shape)}: {exc}") from exc
    num_classes = logits.shape[-1]
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ModelError(f"labels must lie in [0, {num_classes}), got [{int(y.min())}, {int(y.max())}]")
    return logits


def compute_gradients(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Cross-entropy loss of one batch and the float32 gradient of every parameter.

    Gradients are zeroed first; parameters that take no part in the loss get zeros.
    """
    x_t, y_t = _batch_tensors(x, y)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(_forward(model, x_t, y_t), y_t)
    loss.backward()
    grads = {
        name: (
            p.grad.detach().cpu().numpy().astype(np.float32, copy=True)
            if p.grad is not None
            else np.zeros(tuple(p.shape), dtype=np.float32)
        )
        for name, p in model.named_parameters()
    }
    return float(loss.item()), grads


def evaluate(model: nn.Module, dataset: Dataset, batch_size: int = 512) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) of ``model`` on ``dataset``, without gradients.

    The model's train/eval mode is restored afterwards.
    """
    if len(dataset) == 0:
        raise DataError(f"cannot evaluate on empty dataset {dataset.name!r}")
    if batch_size < 1:
        raise ModelError(f"batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    model.eval()
    total_loss, correct = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, len(dataset), batch_size):
                x_t, y_t = _batch_tensors(
                    dataset.x[start : start + batch_size], dataset.y[start : start + batch_size]
                )
                logits = _forward(model, x_t, y_t)
                total_loss += float(F.cross_entropy(logits, y_t, reduction="sum").item())
                correct += int((logits.argmax(dim=1) == y_t).sum().item())
    finally:
        model.train(was_training)
    return total_loss / len(dataset), correct / len(dataset)
