"""The model state in and out of a model, and a training step and evaluation on numpy batches.

The model state is every parameter and every persistent buffer (batch norm's running statistics and its
counter, a standardization's constants, a user's own buffers): what the parameter server holds, versions,
checkpoints, broadcasts, evaluates and exports. It crosses process boundaries as ``dict[str, np.ndarray]``
(float32, a 0-d buffer as one row) keyed by ``state_dict`` names; batches are ``x`` of shape
(N, *sample_shape) and integer labels ``y`` (N,).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from edgemesh.common.data import Dataset
from edgemesh.common.errors import DataError, ModelError

ParamLayout = dict[str, tuple[tuple[int, ...], str]]
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as it travels: every parameter, then every persistent buffer (batch norm's running
    statistics and counter, a standardization's constants, a user's own), by ``state_dict`` name."""
    own: dict[str, torch.Tensor] = dict(model.named_parameters())
    for name, value in model.state_dict(keep_vars=True).items():
        if name not in own:
            own[name] = value
    return own


def buffer_kinds(model: nn.Module) -> dict[str, bool]:
    """Every persistent buffer of the model by name, and whether it holds integers (a counter such as
    ``num_batches_tracked``) rather than floating values (running statistics)."""
    params = dict(model.named_parameters())
    return {name: not (value.dtype.is_floating_point or value.dtype.is_complex)
            for name, value in model.state_dict(keep_vars=True).items() if name not in params}


def buffer_momenta(model: nn.Module) -> dict[str, float]:
    """The running statistics of the model's batch norm layers that move as an exponential average, by name, with
    their momentum (``running_mean`` and ``running_var`` of a layer whose ``momentum`` is set). A layer with
    ``momentum=None`` (a cumulative average) and a user's own buffers are not here."""
    state = model.state_dict(keep_vars=True)
    momenta: dict[str, float] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, BATCH_NORMS) and module.track_running_stats and module.momentum is not None:
            for stat in ("running_mean", "running_var"):
                name = f"{prefix}.{stat}" if prefix else stat
                if name in state:
                    momenta[name] = float(module.momentum)
    return momenta


def param_layout(model: nn.Module) -> ParamLayout:
    """Name -> (shape, dtype name such as ``"float32"``) of the model state: parameters in ``named_parameters()``
    order, then persistent buffers. A 0-d tensor (a counter) is laid out as one row, shape ``(1,)``: the state
    is sharded by rows."""
    return {name: (tuple(t.shape) or (1,), str(t.dtype).removeprefix("torch.")) for name, t in _state(model).items()}


def gradient_layout(model: nn.Module) -> ParamLayout:
    """Name -> (shape, dtype name) of the parameters alone, in ``named_parameters()`` order: what a gradient
    covers."""
    return {name: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()}


def get_params(model: nn.Module) -> dict[str, np.ndarray]:
    """Float32 numpy copies of the model state (parameters and persistent buffers), keyed by name; a 0-d buffer
    as shape ``(1,)``."""
    return {
        name: np.atleast_1d(t.detach().cpu().numpy().astype(np.float32, copy=True)) for name, t in _state(model).items()
    }


def set_params(model: nn.Module, params: Mapping[str, np.ndarray]) -> None:
    """Copy ``params`` (the model state: parameters and persistent buffers) into ``model``; names and shapes must
    match exactly (a 0-d buffer may come as shape ``(1,)``), integer buffers are rounded.

    Everything is validated before the first tensor is written, so a rejected update
    leaves the model unchanged.
    """
    own = _state(model)
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
        if array.shape != tuple(target.shape) and not (target.dim() == 0 and array.shape == (1,)):
            raise ModelError(
                f"parameter {name!r} has shape {array.shape}, model expects {tuple(target.shape)}"
            )
        array = array.reshape(tuple(target.shape))
        if not target.dtype.is_floating_point:
            converted[name] = torch.from_numpy(np.asarray(np.rint(array), dtype=np.int64)).to(target.dtype)
            continue
        # a view where the array allows one (the copy into the model is then the only pass over it)
        viewable = array.flags.writeable and array.flags.c_contiguous and array.dtype == np.float32
        converted[name] = torch.from_numpy(array) if viewable else \
            torch.tensor(np.ascontiguousarray(array), dtype=target.dtype)
    with torch.no_grad():
        for name, target in own.items():
            target.copy_(converted[name])


def _batch_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    x_arr, y_arr = np.asarray(x), np.asarray(y)
    if x_arr.ndim < 2 or y_arr.ndim != 1 or x_arr.shape[0] != y_arr.shape[0] or y_arr.shape[0] == 0:
        raise ModelError(
            f"expected a non-empty batch x (N, *sample_shape) and y (N,), got {x_arr.shape} and {y_arr.shape}"
        )
    if not np.issubdtype(y_arr.dtype, np.integer):
        raise ModelError(f"labels must be integers, got {y_arr.dtype}")
    # torch.tensor copies, so read-only views of a cached data set are fine.
    return torch.tensor(x_arr, dtype=torch.float32), torch.tensor(y_arr, dtype=torch.int64)


def _forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Logits for ``x``; shape and label-range problems, and a batch of one that batch norm cannot train on, become
    :class:`ModelError`."""
    try:
        logits = model(x)
    except RuntimeError as exc:
        raise ModelError(f"model rejected input of shape {tuple(x.shape)}: {exc}") from exc
    except ValueError as exc:
        if x.shape[0] > 1:
            raise
        raise ModelError(f"a batch of one sample cannot be trained on ({exc}): a batch norm layer cannot normalize "
                         "one value per channel; give this device batches of 2 or more (planner.min_batch, "
                         "training.batch_size)") from exc
    num_classes = logits.shape[-1]
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ModelError(f"labels must lie in [0, {num_classes}), got [{int(y.min())}, {int(y.max())}]")
    return logits


@dataclass(frozen=True, slots=True)
class Update:
    """What one training step on a batch gives: its loss, the gradient of every parameter and the change of every
    persistent buffer (batch norm's running statistics move with each batch a model trains on)."""

    loss: float
    grads: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray]
    """Buffer name -> its value after the step minus before (float32, a 0-d buffer as shape ``(1,)``); a buffer the
    step left alone (a constant) has zeros."""


def compute_update(model: nn.Module, x: np.ndarray, y: np.ndarray) -> Update:
    """Cross-entropy loss of one batch, the float32 gradient of every parameter, and the change the forward pass
    made to every persistent buffer, a batch norm's running variance taking the spread of the batches' means too
    (``mixture_variance_change``). The model keeps its moved buffers (as one process training on would).

    Gradients are zeroed first; parameters that take no part in the loss get zeros.
    """
    x_t, y_t = _batch_tensors(x, y)
    model.train()
    model.zero_grad(set_to_none=True)
    kinds = buffer_kinds(model)
    state = model.state_dict(keep_vars=True)
    before = {name: state[name].detach().clone() for name in kinds}
    loss = F.cross_entropy(_forward(model, x_t, y_t), y_t)
    loss.backward()
    grads = {  # views of the gradients: the next step's ``zero_grad`` drops them, it does not write into them
        name: (
            p.grad.detach().cpu().numpy().astype(np.float32, copy=False)
            if p.grad is not None
            else np.zeros(tuple(p.shape), dtype=np.float32)
        )
        for name, p in model.named_parameters()
    }
    after = model.state_dict(keep_vars=True)  # a module may assign a buffer anew rather than write into it
    changes = {name: np.atleast_1d((after[name].detach().to(torch.float64) - before[name].to(torch.float64)).numpy())
               for name in kinds}
    for var, mean, momentum in running_pairs(buffer_momenta(model)):
        changes[var] = mixture_variance_change(changes[var], changes[mean], momentum)
        with torch.no_grad():  # the model keeps the running variance the update reports
            after[var].copy_((before[var].to(torch.float64) + torch.from_numpy(changes[var])).to(after[var].dtype))
    moved = {name: change.astype(np.float32) for name, change in changes.items()}
    return Update(float(loss.item()), grads, moved)


def mixture_variance_change(var_change: np.ndarray, mean_change: np.ndarray, momentum: float) -> np.ndarray:
    """A batch norm's running-variance change over one step, as the variance of every batch averaged so far around
    the running mean, not only within each batch: ``nn.BatchNorm``'s change ``m (v - S)`` plus
    ``m (1 - m) (mu - r)^2``, i.e. ``(1 - m) / m`` times the square of the running mean's change ``m (mu - r)``
    (``m`` the layer's momentum, ``mu`` and ``v`` the batch's mean and variance, ``r`` and ``S`` the running ones).

    An exponentially weighted variance of the batches' mixture: on devices whose data differ, each batch's variance
    is that of its own device, and their average misses how far the devices' means lie apart, so the pooled data
    would be normalized by too small a variance; batches drawn from the same data add only the spread of their
    means (a few per cent on a small batch). docs/synchronization.md measures both."""
    if not 0.0 < momentum < 1.0:
        return var_change
    return var_change + (1.0 - momentum) / momentum * np.square(mean_change.astype(np.float64))


def running_pairs(momenta: Mapping[str, float]) -> list[tuple[str, str, float]]:
    """``(running_var, running_mean, momentum)`` of each batch norm whose statistics move as an exponential
    average (``buffer_momenta``)."""
    return [(name, f"{name[:-len('var')]}mean", momentum) for name, momentum in momenta.items()
            if name.endswith("running_var") and f"{name[:-len('var')]}mean" in momenta]


def compute_gradients(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Cross-entropy loss of one batch and the float32 gradient of every parameter (``compute_update`` without
    the buffers' changes)."""
    update = compute_update(model, x, y)
    return update.loss, update.grads


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
