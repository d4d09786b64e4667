"""Modules a spec is made of that torch does not offer as such: input standardization, ReLU and
max-pooling that keep less for their backward pass, global average pooling and residual blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.utils import _pair

from edgemesh.common.errors import ModelError


class Standardize(nn.Module):
    """``(x - mean) / std`` per input channel (dim 1) with fixed constants of the data set.

    Part of the spec, not of the data: constants are buffers (they never travel as
    parameters), and inputs stay in [0, 1] whatever loads them. Standardized inputs halve
    the steps the digits CNN needs to reach 95% (about 50 rounds of 4x32 instead of 100).

    ``sample_rank`` is the number of dimensions of one sample: the buffers are shaped
    ``(1, C)`` followed by ``sample_rank - 1`` ones, so they broadcast over dim 1 of a batch
    ``(N, C, ...)``: ``(1, C, 1, 1)`` for (C, H, W) images (the default), ``(1, F)`` for
    (F,) feature vectors with one constant per feature.
    """

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: Sequence[float], std: Sequence[float], sample_rank: int = 3) -> None:
        super().__init__()
        if len(mean) != len(std) or not mean:
            raise ModelError(f"standardization needs as many means as stds (at least one), got {len(mean)} "
                             f"and {len(std)}")
        if not all(s > 0 for s in std):
            raise ModelError(f"standardization stds must be > 0, got {tuple(std)}")
        if sample_rank < 1:
            raise ModelError(f"sample_rank must be >= 1, got {sample_rank}")
        shape = (1, len(mean), *(1,) * (sample_rank - 1))
        self.register_buffer("mean", torch.tensor(tuple(mean), dtype=torch.float32).view(shape))
        self.register_buffer("std", torch.tensor(tuple(std), dtype=torch.float32).view(shape))

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


class GlobalAvgPool(nn.Module):
    """The mean of each channel over its positions: ``(N, C, H, W) -> (N, C)``.

    ``nn.AdaptiveAvgPool2d(1)`` and a flatten in one module; a plain mean, so it exports to ONNX as
    one ``ReduceMean``. Each channel's output depends on that channel alone.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.mean(dim=(-2, -1))


class Residual(nn.Module):
    """A skip connection around ``body``: ``act(body(x) + skip(x))``.

    ``skip`` is None for the identity (the body keeps its input's shape), else a module giving the
    body's output shape (a projection); ``act`` is None for no activation after the sum.
    """

    skip: nn.Module | None
    act: nn.Module | None

    def __init__(self, body: nn.Module, skip: nn.Module | None = None, act: nn.Module | None = None) -> None:
        super().__init__()
        self.body = body
        self.skip = skip
        self.act = act

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(input) + (input if self.skip is None else self.skip(input))
        return out if self.act is None else self.act(out)
