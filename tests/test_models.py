"""Tests for edgemesh.common.models: specs, deterministic builds, parameter exchange, training."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from edgemesh.common import costs
from edgemesh.common.costs import LayerCost, ModelCost
from edgemesh.common.data import BatchIterator, Dataset, load_dataset
from edgemesh.common.errors import DataError, ModelError
from edgemesh.common.models import (
    CHANNELWISE,
    MODEL_SPECS,
    LeanMaxPool2d,
    LeanReLU,
    build_model,
    compute_gradients,
    derive_costs,
    evaluate,
    get_params,
    get_spec,
    measure_cost,
    measure_layers,
    param_layout,
    set_params,
)

DIGITS_LAYOUT = {
    "conv1.weight": ((16, 1, 3, 3), "float32"),
    "conv1.bias": ((16,), "float32"),
    "conv2.weight": ((32, 16, 3, 3), "float32"),
    "conv2.bias": ((32,), "float32"),
    "fc1.weight": ((64, 512), "float32"),
    "fc1.bias": ((64,), "float32"),
    "fc2.weight": ((10, 64), "float32"),
    "fc2.bias": ((10,), "float32"),
    "input.mean": ((1, 1, 1, 1), "float32"),  # the standardization's constants: buffers, part of the model state
    "input.std": ((1, 1, 1, 1), "float32"),
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _batch(n: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, size=n).astype(np.int64)


def test_digits_cnn_param_names_shapes_and_order() -> None:
    layout = param_layout(build_model("digits-cnn"))
    assert layout == DIGITS_LAYOUT
    assert list(layout) == list(DIGITS_LAYOUT)  # named_parameters() order, then the buffers
    params = get_params(build_model("digits-cnn"))
    assert list(params) == list(DIGITS_LAYOUT)
    assert all(a.dtype == np.float32 and a.shape == DIGITS_LAYOUT[n][0] for n, a in params.items())


@pytest.mark.parametrize("name", sorted(MODEL_SPECS))
def test_every_spec_maps_its_input_shape_to_its_classes(name: str) -> None:
    spec = get_spec(name)
    assert spec.name == name and spec.description
    out = build_model(name)(torch.zeros((2, *spec.input_shape)))
    assert tuple(out.shape) == (2, spec.num_classes)


def test_cifar_cnn_layout() -> None:
    layout = param_layout(build_model("cifar-cnn"))
    assert layout["conv3.weight"][0] == (128, 64, 3, 3)
    assert layout["fc1.weight"][0] == (256, 128 * 4 * 4)
    assert layout["fc2.weight"][0] == (10, 256)


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(ModelError, match="cifar-cnn.*digits-cnn"):
        get_spec("resnet-9000")
    with pytest.raises(ModelError):
        build_model("resnet-9000")


def test_build_is_deterministic_per_seed() -> None:
    a = get_params(build_model("digits-cnn", 1))
    b = get_params(build_model("digits-cnn", 1))
    c = get_params(build_model("digits-cnn", 2))
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not any(np.array_equal(a[n], c[n]) for n in a if n.endswith("weight"))


def test_build_does_not_disturb_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("digits-cnn", seed=9)
    np.testing.assert_array_equal(torch.rand(3).numpy(), expected.numpy())


def test_get_params_returns_copies_and_set_params_round_trips() -> None:
    model = build_model("digits-cnn", 0)
    params = get_params(model)
    params["fc2.bias"][:] = 42.0
    assert not np.any(get_params(model)["fc2.bias"] == 42.0)
    target = build_model("digits-cnn", 5)
    set_params(target, params)
    assert all(np.array_equal(v, params[n]) for n, v in get_params(target).items())
    # float64 input is converted, not rejected
    set_params(target, {n: v.astype(np.float64) * 0 for n, v in params.items()})
    assert all(not v.any() for v in get_params(target).values())
    # read-only buffers (a decoded payload), reversed views and plain arrays are all copied in, never shared
    given = {n: np.frombuffer(v.tobytes(), np.float32).reshape(v.shape) if i % 3 == 0 else
             (v[::-1].copy()[::-1] if i % 3 == 1 else v.copy()) for i, (n, v) in enumerate(params.items())}
    set_params(target, given)
    assert all(np.array_equal(v, params[n]) for n, v in get_params(target).items())
    for v in given.values():
        if v.flags.writeable:
            v[...] = 7.0
    assert all(np.array_equal(v, params[n]) for n, v in get_params(target).items())


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda p: p.update({"fc1.weight": np.zeros((64, 511), np.float32)}), "shape"),
        (lambda p: p.pop("conv2.bias"), "missing.*conv2.bias"),
        (lambda p: p.update({"fc3.weight": np.zeros(1, np.float32)}), "unexpected.*fc3.weight"),
        (lambda p: p.update({"fc2.bias": np.array(["a"] * 10, dtype=object)}), "numeric"),
    ],
)
def test_set_params_rejects_mismatches_and_leaves_model_unchanged(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    model = build_model("digits-cnn", 0)
    before = get_params(model)
    params = {n: v + 1.0 for n, v in before.items()}
    mutate(params)
    with pytest.raises(ModelError, match=match):
        set_params(model, params)
    assert all(np.array_equal(v, before[n]) for n, v in get_params(model).items())


def test_compute_gradients_matches_autograd() -> None:
    model = build_model("digits-cnn", 3)
    x, y = _batch()
    loss, grads = compute_gradients(model, x, y)

    reference = build_model("digits-cnn", 3)
    ref_loss = F.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y))
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
    assert list(grads) == [n for n in DIGITS_LAYOUT if not n.startswith("input.")]  # parameters alone
    for name, p in reference.named_parameters():
        assert grads[name].dtype == np.float32 and grads[name].shape == tuple(p.shape)
        assert np.all(np.isfinite(grads[name]))
        assert p.grad is not None
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert any(np.abs(g).sum() > 0 for g in grads.values())


def test_compute_gradients_zeroes_grads_first() -> None:
    model = build_model("digits-cnn", 0)
    x, y = _batch()
    _, first = compute_gradients(model, x, y)
    _, second = compute_gradients(model, x, y)
    assert all(np.allclose(first[n], second[n]) for n in first)  # not accumulated


def test_compute_gradients_rejects_bad_batches() -> None:
    model = build_model("digits-cnn", 0)
    x, y = _batch()
    with pytest.raises(ModelError, match="labels"):
        compute_gradients(model, x, np.full_like(y, 10))
    with pytest.raises(ModelError, match="shape"):
        compute_gradients(model, np.zeros((8, 3, 32, 32), np.float32), y)
    with pytest.raises(ModelError):
        compute_gradients(model, x, y[:4])
    with pytest.raises(ModelError):
        compute_gradients(model, x[:0], y[:0])


def test_a_batch_of_one_that_batch_norm_cannot_train_on_is_a_model_error_saying_so() -> None:
    """``BatchNorm1d`` on feature vectors has one value per channel in a batch of one: torch refuses it, and the
    step says why and what to change, as a ModelError (a job's error, not a crash of the host)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    x = np.random.default_rng(0).random((5, 4), dtype=np.float32)
    y = np.array([0, 1, 2, 0, 1])
    compute_gradients(model, x[:2], y[:2])  # two samples: trained
    with pytest.raises(ModelError, match="a batch of one sample cannot be trained on.*planner.min_batch"):
        compute_gradients(model, x[:1], y[:1])


def test_evaluate_is_batch_size_independent_and_restores_mode() -> None:
    model = build_model("digits-cnn", 0)
    test = load_dataset("digits")[1]
    model.train()
    loss_a, acc_a = evaluate(model, test)
    assert model.training
    model.eval()
    loss_b, acc_b = evaluate(model, test, batch_size=7)
    assert not model.training
    assert loss_a == pytest.approx(loss_b, rel=1e-5) and acc_a == acc_b
    assert loss_a == pytest.approx(np.log(10), rel=0.1)  # untrained: near-uniform predictions
    assert 0.0 <= acc_a <= 0.3


def test_evaluate_counts_correct_predictions() -> None:
    model = build_model("digits-cnn", 0)
    params = {n: v if n.startswith("input.") else np.zeros_like(v) for n, v in get_params(model).items()}
    params["fc2.bias"][3] = 5.0  # always predicts class 3 (the standardization's std stays > 0)
    set_params(model, params)
    y = np.array([3, 3, 1, 3], dtype=np.int64)
    ds = Dataset("fixed", np.zeros((4, 1, 8, 8), np.float32), y, 10)
    loss, acc = evaluate(model, ds, batch_size=3)
    assert acc == 0.75
    logits = torch.zeros(4, 10)
    logits[:, 3] = 5.0
    assert loss == pytest.approx(F.cross_entropy(logits, torch.from_numpy(y)).item(), rel=1e-5)
    with pytest.raises(DataError):
        evaluate(model, Dataset("empty", np.zeros((0, 1, 8, 8), np.float32), np.zeros(0, np.int64), 10))


def test_sgd_with_compute_gradients_learns_digits() -> None:
    train, test = load_dataset("digits")
    model = build_model("digits-cnn", seed=0)
    params = get_params(model)
    velocity = {n: np.zeros_like(v) for n, v in params.items()}
    batches = BatchIterator(train, 32, seed=0)
    accuracy = 0.0
    for _ in range(10):
        epoch = batches.epoch
        while batches.epoch == epoch:
            x, y = next(batches)
            loss, grads = compute_gradients(model, x, y)
            assert np.isfinite(loss)
            for name, grad in grads.items():
                velocity[name] = 0.9 * velocity[name] + grad
                params[name] -= 0.05 * velocity[name]
            set_params(model, params)
        _, accuracy = evaluate(model, test)
        if accuracy >= 0.95:
            break
    assert accuracy >= 0.95


# --------------------------------------------------------------------------- cost model


COSTS = {
    "digits-cnn": ModelCost(params=38_282, macs_per_sample=337_536, activations_per_sample=7_434),
    "cifar-cnn": ModelCost(params=620_362, macs_per_sample=10_848_768, activations_per_sample=137_738),
    # by hand: conv1 32 x 64 positions x 9, conv2 64 x 64 x 32 x 9, conv3 64 x 16 x 64 x 9, fc1 64 x 256, fc2 10 x 64
    "digits-wide-cnn": ModelCost(params=72_842, macs_per_sample=1_804_928, activations_per_sample=16_138),
}
"""The figures the planner was tuned with when they were a hand-kept table; derivation must give them."""
LAYERS = {
    "digits-cnn": (
        LayerCost("conv1", 16, 576, 10, 64, 64, 64),
        LayerCost("conv2", 32, 9_216, 145, 64, 16, 1_024),
        LayerCost("fc1", 64, 512, 513, 1, 1, 512),
        LayerCost("fc2", 10, 64, 65, 1, 1, 64),
    ),
    "cifar-cnn": (
        LayerCost("conv1", 32, 27_648, 28, 1_024, 256, 3_072),
        LayerCost("conv2", 64, 73_728, 289, 256, 64, 8_192),
        LayerCost("conv3", 128, 36_864, 577, 64, 16, 4_096),
        LayerCost("fc1", 256, 2_048, 2_049, 1, 1, 2_048),
        LayerCost("fc2", 10, 256, 257, 1, 1, 256),
    ),
    "digits-wide-cnn": (
        LayerCost("conv1", 32, 576, 10, 64, 64, 64),
        LayerCost("conv2", 64, 18_432, 289, 64, 16, 2_048),
        LayerCost("conv3", 64, 9_216, 577, 16, 4, 1_024),
        LayerCost("fc1", 64, 256, 257, 1, 1, 256),
        LayerCost("fc2", 10, 64, 65, 1, 1, 64),
    ),
}


@pytest.mark.parametrize("name", sorted(MODEL_SPECS))
def test_costs_derived_from_the_modules_are_the_known_figures(name: str) -> None:
    spec = get_spec(name)
    assert derive_costs(build_model(name), spec.input_shape) == (COSTS[name], LAYERS[name])
    assert measure_cost(name) == COSTS[name] and measure_layers(name) == LAYERS[name]
    assert costs.cost(name) == COSTS[name] and costs.layers(name) == LAYERS[name]  # what the planner reads


class _NoMeta(nn.Module):
    """``inner`` behind a forward that refuses meta tensors, as a module without meta support does."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            raise NotImplementedError("no meta kernel")
        out: torch.Tensor = self.inner(x)
        return out


def test_a_large_model_is_probed_on_the_meta_device_and_one_without_meta_support_on_a_real_sample(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from edgemesh.common.models import probe

    meta_seen: list[bool] = []
    plain = build_model("digits-cnn")
    plain.register_forward_pre_hook(lambda _, args: meta_seen.append(args[0].is_meta))
    assert derive_costs(plain, (1, 8, 8)) == (COSTS["digits-cnn"], LAYERS["digits-cnn"])
    monkeypatch.setattr(probe, "REAL_PROBE_MAX_PARAMS", 0)  # every model counts as large: the meta device first
    assert derive_costs(plain, (1, 8, 8)) == (COSTS["digits-cnn"], LAYERS["digits-cnn"])
    assert meta_seen == [False, True]  # a small model: one real zero sample; a large one: on the meta device
    model = _NoMeta(build_model("digits-cnn"))
    model.train()
    model.inner.get_submodule("fc1").eval()
    assert derive_costs(model, (1, 8, 8)) == (COSTS["digits-cnn"], None)  # not sequential: no layer figures
    assert model.training and not model.inner.get_submodule("fc1").training  # modes restored
    assert all(p.grad is None for p in model.parameters())


def test_a_model_that_rejects_the_sample_is_a_model_error() -> None:
    with pytest.raises(ModelError, match=r"rejects a zero sample of shape \(1, 3, 32, 32\)"):
        derive_costs(build_model("digits-cnn"), (3, 32, 32))


def test_digits_cnn_cost_by_hand() -> None:
    c = derive_costs(build_model("digits-cnn"), (1, 8, 8))[0]
    conv1, conv2 = 16 * 8 * 8 * 1 * 9, 32 * 8 * 8 * 16 * 9
    assert c.macs_per_sample == conv1 + conv2 + 512 * 64 + 64 * 10
    assert c.params == sum(int(np.prod(shape)) for name, (shape, _) in DIGITS_LAYOUT.items() if ".std" not in name
                           and ".mean" not in name)  # parameters: the standardization's constants are buffers
    assert c.train_flops_per_sample == 6 * c.macs_per_sample


def test_memory_estimate_grows_with_the_batch_and_bounds_it() -> None:
    one, many = costs.training_memory_bytes("cifar-cnn", 1), costs.training_memory_bytes("cifar-cnn", 64)
    per_sample = costs.ACTIVATION_COPIES * 4 * costs.cost("cifar-cnn").activations_per_sample
    assert many - one == 63 * per_sample
    budget = costs.training_memory_bytes("cifar-cnn", 100)
    assert costs.max_batch_for_memory("cifar-cnn", budget) == 100
    assert costs.max_batch_for_memory("cifar-cnn", budget - 1) == 99
    assert costs.max_batch_for_memory("cifar-cnn", costs.RUNTIME_BYTES) == 0
    with pytest.raises(ModelError, match="known"):
        costs.cost("resnet-9000")
    assert costs.step_seconds_estimate("digits-cnn", 32, 1e9) == pytest.approx(
        32 * 6 * 337_536 / (1e9 * costs.TRAIN_EFFICIENCY))


def _input_and_grad(shape: tuple[int, ...], levels: int | None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random input (rounded to ``levels`` values, so windows hold ties and ReLU sees zeros)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if levels is not None:
        x = torch.randint(-(levels // 2), levels - levels // 2, shape, generator=gen).float()
    return x, torch.randn(shape, generator=gen)


def _run(module: nn.Module, x: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_(True)
    out = module(leaf)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    assert leaf.grad is not None
    return out.detach(), leaf.grad


def _saved(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x.clone().requires_grad_(True))
    return saved


@pytest.mark.parametrize("levels", [None, 3])
@pytest.mark.parametrize("shape", [(2, 3, 7, 9), (5, 11)])
def test_lean_relu_matches_torch_and_keeps_a_bool_mask(shape: tuple[int, ...], levels: int | None) -> None:
    x, _ = _input_and_grad(shape, levels)
    if levels is not None:
        assert (x == 0).any()  # torch gives zero gradient at 0
    for got, want in zip(_run(LeanReLU(), x), _run(nn.ReLU(), x), strict=True):
        assert torch.equal(got, want)
    assert [t.dtype for t in _saved(LeanReLU(), x)] == [torch.bool]
    assert isinstance(LeanReLU(), CHANNELWISE)


def test_lean_relu_passes_the_gradient_of_nan_like_torch() -> None:
    x = torch.tensor([float("nan"), -1.0, 0.0, 2.0])
    for got, want in zip(_run(LeanReLU(), x), _run(nn.ReLU(), x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("levels", [None, 2, 3])
@pytest.mark.parametrize(("shape", "kernel"), [
    ((2, 3, 8, 8), 2), ((2, 3, 7, 9), 2), ((2, 3, 7, 9), 3), ((4, 7, 9), 2), ((1, 2, 9, 10), (3, 2)),
])
def test_lean_max_pool_matches_torch_with_ties_and_odd_sizes(
    shape: tuple[int, ...], kernel: int | tuple[int, int], levels: int | None
) -> None:
    x, _ = _input_and_grad(shape, levels)
    for got, want in zip(_run(LeanMaxPool2d(kernel), x), _run(nn.MaxPool2d(kernel), x), strict=True):
        assert torch.equal(got, want)
    assert [t.dtype for t in _saved(LeanMaxPool2d(kernel), x)] == [torch.uint8]


@pytest.mark.parametrize("options", [
    {"kernel_size": 3, "stride": 2}, {"kernel_size": 2, "padding": 1}, {"kernel_size": 2, "ceil_mode": True},
    {"kernel_size": 2, "dilation": 2}, {"kernel_size": 17},
])
def test_lean_max_pool_falls_back_to_torch_for_other_windows(options: dict[str, int | bool]) -> None:
    x, _ = _input_and_grad((2, 3, 35, 34), 3)
    for got, want in zip(_run(LeanMaxPool2d(**options), x), _run(nn.MaxPool2d(**options), x), strict=True):
        assert torch.equal(got, want)
    assert torch.int64 in [t.dtype for t in _saved(LeanMaxPool2d(**options), x)]  # torch's own indices


def _plain(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with torch's own ReLU and max-pool, the reference for the lean ones."""
    ref = copy.deepcopy(model)
    for name, module in ref.named_children():
        if isinstance(module, LeanReLU):
            setattr(ref, name, nn.ReLU())
        elif isinstance(module, LeanMaxPool2d):
            setattr(ref, name, nn.MaxPool2d(module.kernel_size))
    return ref


def _activation_bytes(
    model: nn.Module, x: torch.Tensor, only: tuple[type[nn.Module], ...]
) -> tuple[int, set[torch.dtype]]:
    """Bytes (and dtypes) autograd saves inside modules of types ``only``, each storage counted once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    dtypes: set[torch.dtype] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            dtypes.add(t.dtype)
        return t

    inside = False

    def enter(module: nn.Module, args: object) -> None:
        nonlocal inside
        inside = isinstance(module, only)

    def leave(module: nn.Module, args: object, out: object) -> None:
        nonlocal inside
        inside = False

    def hooks() -> Iterator[torch.utils.hooks.RemovableHandle]:
        for m in model.children():
            yield m.register_forward_pre_hook(enter)
            yield m.register_forward_hook(leave)

    handles = list(hooks())
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return sum(storages.values()), dtypes


def test_cifar_cnn_relu_and_pool_save_a_third_of_the_bytes_and_train_identically() -> None:
    lean = build_model("cifar-cnn")
    ref = _plain(lean)
    assert [type(m) for m in ref.children()] != [type(m) for m in lean.children()]
    x = torch.rand((8, 3, 32, 32), generator=torch.Generator().manual_seed(0))
    lean_bytes, lean_dtypes = _activation_bytes(lean, x, (nn.ReLU, nn.MaxPool2d))
    ref_bytes, _ = _activation_bytes(ref, x, (nn.ReLU, nn.MaxPool2d))
    assert lean_dtypes == {torch.bool, torch.uint8}
    assert 3 * lean_bytes <= ref_bytes
    # Whole model: conv and linear layers still keep their float32 inputs.
    assert _activation_bytes(lean, x, (nn.Module,))[0] < 0.4 * _activation_bytes(ref, x, (nn.Module,))[0]

    batch = (x.numpy(), np.arange(8, dtype=np.int64) % 10)
    (lean_loss, lean_grads), (ref_loss, ref_grads) = compute_gradients(lean, *batch), compute_gradients(ref, *batch)
    assert lean_loss == ref_loss
    assert all(np.array_equal(lean_grads[n], ref_grads[n]) for n in ref_grads)
