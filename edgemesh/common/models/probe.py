"""One zero sample through a model, to learn its shapes and costs: for real when the model is small, on the
meta device when it is large.

A meta-device forward pass computes every output's shape and none of its values, so probing a large
model costs no arithmetic and no activation memory; but a process's first meta forward loads torch's
meta kernels (1.6 s on the development host), while one real sample through an edge-sized model takes
milliseconds. So a model of at most ``REAL_PROBE_MAX_PARAMS`` parameters is probed with a real zero
sample, a larger one on the meta device. Modules that do not support meta tensors (an op without a
meta kernel, a tensor kept as a plain attribute, ``.item()``) are probed with a real zero sample on the
model's own device instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn
from torch.func import functional_call

logger = logging.getLogger(__name__)

T = TypeVar("T")
REAL_PROBE_MAX_PARAMS = 20_000_000
"""Largest model (parameters) probed with a real zero sample rather than on the meta device."""
Forward = Callable[[], Any]
"""Runs one forward pass of one zero sample (a batch of 1) and returns the model's output."""


@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode (batch norm on one sample, no dropout draws), each module's own mode restored afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def on_sample(model: nn.Module, input_shape: tuple[int, ...], measure: Callable[[Forward], T]) -> T:
    """``measure(forward)``, where ``forward()`` runs one zero sample of ``input_shape`` through ``model``.

    ``measure`` registers what it watches (hooks, a dispatch mode), calls ``forward`` once and returns
    what it saw; it is called again from scratch if the meta-device attempt fails. Both attempts run
    in eval mode without gradients; the real one raises whatever the model raises.
    """
    shape = (1, *input_shape)
    with _evaluating(model), torch.no_grad():
        state = {name: torch.empty_like(t.detach(), device="meta")
                 for name, t in (*model.named_parameters(), *model.named_buffers())}

        def meta() -> Any:
            return functional_call(model, state, (torch.zeros(shape, device="meta"),), tie_weights=True)

        device = _device(model)
        if sum(t.numel() for t in state.values()) > REAL_PROBE_MAX_PARAMS:
            try:
                return measure(meta)
            except Exception as exc:  # any module may lack meta support; the real pass says what is wrong
                logger.debug("meta-device forward of %s failed (%s); using a real zero sample",
                             type(model).__name__, exc)
        return measure(lambda: model(torch.zeros(shape, device=device)))


def output_shape(model: nn.Module, input_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The per-sample shape of ``model``'s output (None: the output is not a tensor); raises what the model raises."""
    out = on_sample(model, input_shape, lambda forward: forward())
    return tuple(out.shape[1:]) if isinstance(out, torch.Tensor) else None

