"""Gradient codecs (docs/compression.md): references ``none``/``fp16``, sparse ``threshold``/``topk``/``grid``,
``qsgd``, their shared bit packing and index coding, the registry and error feedback."""

from __future__ import annotations

import math
import struct
import typing

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgemesh.common.codecs import ErrorFeedback, available_codecs, get_codec, quick_to_decode
from edgemesh.common.codecs import grid as grid_mod
from edgemesh.common.codecs import sparse as sparse_mod
from edgemesh.common.codecs.bitpack import PayloadReader, pack_uint, pack_unary, packed_size, unpack_uint
from edgemesh.common.codecs.indices import decode_indices, encode_indices
from edgemesh.common.codecs.qsgd import HEADER as QSGD_HEADER
from edgemesh.common.codecs.qsgd import QSGDCodec
from edgemesh.common.errors import CodecError, WireError
from edgemesh.common.messages import CodecPolicy, ShardUpdate
from edgemesh.common.vocabulary import CODECS, CodecName

FP16_MAX = float(np.finfo(np.float16).max)
FP16_EPS = float(np.finfo(np.float16).eps)
FP16_TINY = float(np.finfo(np.float16).smallest_subnormal)

SETTINGS = settings(max_examples=80, deadline=None)

_BIG = float(np.float32(3e38))
_grads = hnp.arrays(np.float32, st.integers(0, 300),
                    elements=st.floats(-_BIG, _BIG, allow_nan=False, allow_infinity=False, width=32))


def test_reference_codecs_are_registered() -> None:
    assert {"none", "fp16"} <= set(available_codecs())
    assert get_codec("none").lossless and not get_codec("fp16").lossless
    for name in available_codecs():
        assert get_codec(name).name == name


def test_an_unknown_codec_is_a_codec_error() -> None:
    with pytest.raises(CodecError) as exc:
        get_codec("bogus")
    assert isinstance(exc.value, WireError)
    assert exc.value.reason and "bogus" in str(exc.value)


# --------------------------------------------------------------------------- round trips


@SETTINGS
@given(grad=_grads)
def test_none_round_trips_exactly(grad: np.ndarray) -> None:
    codec = get_codec("none")
    data = codec.encode(grad, None)
    assert len(data) == 4 * grad.size
    out = codec.decode(data, grad.size)
    assert out.dtype == np.float32 and out.shape == (grad.size,)
    assert out.tobytes() == grad.tobytes()


@SETTINGS
@given(grad=_grads)
def test_fp16_round_trips_within_half_precision_and_clips_to_its_range(grad: np.ndarray) -> None:
    codec = get_codec("fp16")
    data = codec.encode(grad, None)
    assert len(data) == 2 * grad.size  # half the bytes of fp32
    out = codec.decode(data, grad.size)
    assert out.dtype == np.float32 and out.shape == (grad.size,)
    clipped = np.clip(grad, -FP16_MAX, FP16_MAX)
    assert np.isfinite(out).all()
    # relative error of round-to-nearest half precision, plus the subnormal floor
    assert np.all(np.abs(out - clipped) <= np.abs(clipped) * FP16_EPS / 2 + FP16_TINY)
    assert np.all((np.sign(out) == np.sign(clipped)) | (out == 0))


def test_fp16_clips_huge_values_and_infinity_instead_of_sending_inf() -> None:
    codec = get_codec("fp16")
    grad = np.array([1e6, -1e6, np.inf, -np.inf, 1.0], dtype=np.float32)
    out = codec.decode(codec.encode(grad, None), grad.size)
    assert out.tolist() == [FP16_MAX, -FP16_MAX, FP16_MAX, -FP16_MAX, 1.0]


@pytest.mark.parametrize("name", ["none", "fp16"])
def test_encode_flattens_any_shape_and_dtype(name: str) -> None:
    codec = get_codec(name)
    grad = np.arange(12, dtype=np.float64).reshape(3, 4)
    out = codec.decode(codec.encode(grad, None), 12)
    assert out.shape == (12,) and np.array_equal(out, np.arange(12, dtype=np.float32))


@pytest.mark.parametrize("name", ["none", "fp16"])
def test_payload_is_little_endian(name: str) -> None:
    codec = get_codec(name)
    dtype = "<f4" if name == "none" else "<f2"
    assert codec.encode(np.array([1.5, -2.0], dtype=np.float32), None) == np.array([1.5, -2.0], dtype=dtype).tobytes()


# --------------------------------------------------------------------------- bad payloads


@pytest.mark.parametrize("name,itemsize", [("none", 4), ("fp16", 2)])
def test_truncated_or_wrong_numel_payload_is_a_codec_error(name: str, itemsize: int) -> None:
    codec = get_codec(name)
    data = codec.encode(np.ones(10, dtype=np.float32), None)
    for bad, numel in ((data[:-1], 10), (data[:-itemsize], 10), (data, 11), (data, 9), (data + b"\x00", 10),
                       (b"", 10), (data, 0)):
        with pytest.raises(CodecError) as exc:
            codec.decode(bad, numel)
        assert isinstance(exc.value, WireError) and exc.value.reason


@pytest.mark.parametrize("name,dtype", [("none", "<f4"), ("fp16", "<f2")])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_in_a_payload_is_refused_with_reason_nan(name: str, dtype: str, bad: float) -> None:
    data = np.array([0.0, bad, 1.0], dtype=dtype).tobytes()
    with pytest.raises(CodecError) as exc:
        get_codec(name).decode(data, 3)
    assert exc.value.reason == "nan"


def test_empty_gradient_round_trips() -> None:
    for name in ("none", "fp16"):
        codec = get_codec(name)
        assert codec.decode(codec.encode(np.zeros(0, dtype=np.float32), None), 0).shape == (0,)


# --------------------------------------------------------------------------- error feedback


def test_error_feedback_sends_everything_eventually_with_fp16() -> None:
    """Sum of what was decoded + the final residual == sum of the raw gradients."""
    rng = np.random.default_rng(0)
    codec = get_codec("fp16")
    ef = ErrorFeedback()
    raw_sum = np.zeros(1000, dtype=np.float64)
    sent_sum = np.zeros(1000, dtype=np.float64)
    naive_sum = np.zeros(1000, dtype=np.float64)
    for step in range(200):
        # small values lose most of their bits in fp16; a few huge ones are clipped
        grad = (rng.standard_normal(1000) * 1e-3 + 1e-5).astype(np.float32)
        if step % 50 == 0:
            grad[:3] = [1e5, -1e5, 7e4]
        raw_sum += grad
        sent_sum += codec.decode(ef.encode("fc.weight[0:1000]", grad, codec, None), grad.size)
        naive_sum += codec.decode(codec.encode(grad, None), grad.size)
    residual = ef.residual("fc.weight[0:1000]")
    assert residual is not None and residual.shape == (1000,) and np.abs(residual).max() > 0
    np.testing.assert_allclose(sent_sum + residual, raw_sum, rtol=1e-5, atol=1e-4)
    # without error feedback the clipped mass is lost for good
    assert np.abs(naive_sum - raw_sum).max() > 1e5


def test_error_feedback_adds_the_residual_to_the_next_gradient() -> None:
    codec = get_codec("fp16")
    ef = ErrorFeedback()
    first = np.array([1e5, 1.0 + 2**-12], dtype=np.float32)
    ef.encode("k", first, codec, None)
    r = ef.residual("k")
    assert r is not None
    np.testing.assert_allclose(r, first - np.array([FP16_MAX, 1.0], dtype=np.float32), rtol=1e-6)
    out = codec.decode(ef.encode("k", np.zeros(2, dtype=np.float32), codec, None), 2)
    np.testing.assert_allclose(out, np.float16(r).astype(np.float32), rtol=1e-3)


def test_error_feedback_keeps_residuals_per_key_and_resets() -> None:
    codec = get_codec("fp16")
    ef = ErrorFeedback()
    ef.encode("a", np.array([1e5], dtype=np.float32), codec, None)
    assert ef.residual("b") is None
    out_b = codec.decode(ef.encode("b", np.array([0.0], dtype=np.float32), codec, None), 1)
    assert out_b.tolist() == [0.0]  # a's residual does not leak into b
    ef.reset()
    assert ef.residual("a") is None


def test_error_feedback_keeps_no_residual_for_a_lossless_codec() -> None:
    ef = ErrorFeedback()
    grad = np.linspace(-1, 1, 7, dtype=np.float32)
    ef.encode("k", np.array([1e5] * 7, dtype=np.float32), get_codec("fp16"), None)
    data = ef.encode("k", grad, get_codec("none"), None)  # the policy switched to lossless
    assert ef.residual("k") is None
    out = get_codec("none").decode(data, 7)
    np.testing.assert_allclose(out, grad + (1e5 - FP16_MAX), rtol=1e-6)  # the old residual went out with it


def test_error_feedback_drops_a_residual_of_another_shape() -> None:
    codec = get_codec("fp16")
    ef = ErrorFeedback()
    ef.encode("k", np.array([1e5, 1e5], dtype=np.float32), codec, None)
    out = codec.decode(ef.encode("k", np.array([0.5, 0.25, 0.0], dtype=np.float32), codec, None), 3)
    assert out.tolist() == [0.5, 0.25, 0.0]


# =========================================================================== the lossy codecs

SPARSE = ("threshold", "topk", "grid")
LOSSY = ("fp16", "threshold", "topk", "grid", "qsgd")
SMALL = settings(max_examples=40, deadline=None)

_moderate = hnp.arrays(np.float32, st.integers(0, 400),
                       elements=st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32))
_densities = st.floats(0.001, 1.0)


def policy(codec: str, density: float = 0.01, grid_levels: int = 0) -> CodecPolicy:
    return CodecPolicy(device="dev-1", codec=typing.cast(CodecName, codec), density=density, grid_levels=grid_levels)


def kept_count(data: bytes) -> int:
    """The value count every sparse payload starts with."""
    return int(struct.unpack_from("<I", data)[0])


def test_every_codec_of_the_design_is_registered() -> None:
    assert set(available_codecs()) == set(CODECS)
    for name in LOSSY:
        assert not get_codec(name).lossless


# --------------------------------------------------------------------------- bit packing, index coding


@SETTINGS
@given(width=st.integers(0, 32), data=st.data())
def test_pack_uint_round_trips_in_exactly_count_times_width_bits(width: int, data: st.DataObject) -> None:
    values = np.array(data.draw(st.lists(st.integers(0, 2**width - 1), max_size=300)), dtype=np.uint64)
    packed = pack_uint(values, width)
    assert packed.size == packed_size(values.size, width) == math.ceil(values.size * width / 8)
    assert np.array_equal(unpack_uint(packed, values.size, width).astype(np.uint64), values)
    if 0 < width < 8 and values.size:  # a plain LSB-first bit stream
        bits = ((values[:, None] >> np.arange(width, dtype=np.uint64)) & 1).astype(np.uint8).ravel()
        assert np.array_equal(packed, np.packbits(bits, bitorder="little"))


@st.composite
def _index_sets(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    numel = draw(st.integers(1, 20_000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["random", "runs", "edges"]))
    if kind == "random":
        idx = rng.choice(numel, size=draw(st.integers(0, min(numel, 3000))), replace=False)
    elif kind == "runs":  # whole rows of a weight matrix: runs of neighbours and long gaps
        starts = rng.integers(0, numel, size=draw(st.integers(1, 20)))
        idx = np.concatenate([np.arange(s, min(numel, s + rng.integers(1, 300))) for s in starts])
    else:
        idx = np.array([0, numel - 1][: draw(st.integers(1, 2))])
    return np.unique(idx).astype(np.int64), numel


@SETTINGS
@given(case=_index_sets())
def test_index_coding_round_trips(case: tuple[np.ndarray, int]) -> None:
    idx, numel = case
    data = encode_indices(idx, numel)
    reader = PayloadReader(data, "test")
    assert np.array_equal(decode_indices(reader, idx.size, numel), idx)
    reader.finish()


def test_index_coding_is_compact() -> None:
    rng = np.random.default_rng(0)
    numel = 1_000_000
    scattered = np.sort(rng.choice(numel, size=10_000, replace=False))  # a random 1 %
    assert len(encode_indices(scattered, numel)) * 8 / scattered.size < 9.0  # entropy ~8.1, fp32 index 32
    runs = np.arange(5_000, 15_000)  # neighbours cost about a bit each
    assert len(encode_indices(runs, numel)) * 8 / runs.size < 1.2


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", ["threshold", "topk", "grid", "qsgd"])
@SMALL
@given(grad=_grads, density=_densities, levels=st.integers(0, 12))
def test_lossy_codecs_round_trip_to_a_finite_tensor_of_the_right_size(name: str, grad: np.ndarray, density: float,
                                                                      levels: int) -> None:
    codec = get_codec(name)
    out = codec.decode(codec.encode(grad, policy(name, density, levels)), grad.size)
    assert out.dtype == np.float32 and out.shape == (grad.size,) and np.isfinite(out).all()


@pytest.mark.parametrize("name", ["threshold", "topk"])
@SETTINGS
@given(grad=_grads, density=_densities)
def test_threshold_and_topk_send_kept_entries_exactly_and_drop_only_smaller_ones(name: str, grad: np.ndarray,
                                                                                 density: float) -> None:
    codec = get_codec(name)
    data = codec.encode(grad.reshape(-1, 1) if grad.size else grad, policy(name, density))
    out = codec.decode(data, grad.size)
    kept = out != 0
    assert np.array_equal(out[kept], grad[kept])
    if kept.any():
        assert np.abs(grad[~kept]).max(initial=0) <= np.abs(grad[kept]).min()
    if name == "topk":
        assert kept_count(data) == math.ceil(density * grad.size)  # zeros may be among them
    elif np.any(grad != 0):
        assert kept.any()  # a non-zero gradient always sends something
    k = kept_count(data)  # 4 B per value, at most log2(n) + 3 bits per index, a byte per 256 indices
    assert len(data) <= 4 + 4 * k + math.ceil(k * (grad.size.bit_length() + 3) / 8) + math.ceil(k / 256) + 2


@SETTINGS
@given(grad=_moderate, density=_densities)
def test_threshold_keeps_the_exact_quantile_of_a_small_tensor(grad: np.ndarray, density: float) -> None:
    """Tensors up to SAMPLE_MAX values are their own sample: |g| >= the ceil(density n)-th largest |g|."""
    out = get_codec("threshold").decode(get_codec("threshold").encode(grad, policy("threshold", density)), grad.size)
    mags = np.abs(grad)
    if grad.size:
        t = max(np.sort(mags)[grad.size - math.ceil(density * grad.size)], sparse_mod.TINY)
        assert np.array_equal(np.flatnonzero(out), np.flatnonzero(mags >= t))


@pytest.mark.parametrize("name", ["threshold", "grid"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_threshold_and_grid_honour_density_on_a_large_tensor(name: str, density: float) -> None:
    grad = np.random.default_rng(1).laplace(size=400_000).astype(np.float32)  # sampled: 65,536 of 400,000
    data = get_codec(name).encode(grad, policy(name, density))
    assert kept_count(data) == pytest.approx(density * grad.size, rel=0.2)


def test_topk_keeps_exactly_k_when_the_sample_misleads() -> None:
    """The strided sample sees every large value: the candidate threshold is too high and topk must fall back."""
    n = 262_144
    stride = -(-n // sparse_mod.SAMPLE_MAX)
    grad = np.random.default_rng(2).standard_normal(n).astype(np.float32) * 1e-3
    grad[: 5_000 * stride: stride] = np.linspace(1, 2, 5_000)
    for density in (0.001, 0.01, 0.03, 0.3):
        data = get_codec("topk").encode(grad, policy("topk", density))
        out = get_codec("topk").decode(data, n)
        k = math.ceil(density * n)
        assert kept_count(data) == k == np.count_nonzero(out)
        assert np.array_equal(np.sort(np.abs(out[out != 0])), np.sort(np.abs(grad))[-k:])


@pytest.mark.parametrize("name", SPARSE)
def test_a_lone_non_zero_value_outside_the_sample_is_sent(name: str) -> None:
    grad = np.zeros(1_000_000, dtype=np.float32)
    grad[12_345] = -3e-40  # subnormal, and not on the sample's stride
    out = get_codec(name).decode(get_codec(name).encode(grad, policy(name, 0.01)), grad.size)
    assert np.flatnonzero(out).tolist() == [12_345] and out[12_345] == grad[12_345]


@pytest.mark.parametrize("name", ["threshold", "topk", "grid", "qsgd"])
def test_empty_and_all_zero_gradients_round_trip(name: str) -> None:
    codec = get_codec(name)
    for grad in (np.zeros(0, dtype=np.float32), np.zeros(1000, dtype=np.float32)):
        data = codec.encode(grad, policy(name, 0.5))
        out = codec.decode(data, grad.size)
        assert out.shape == grad.shape and not out.any()
        if name in ("threshold", "grid"):  # nothing above the threshold: a bare header
            assert len(data) == (5 if name == "grid" else 4) and kept_count(data) == 0
        elif name == "topk":  # exactly k, zeros or not
            assert kept_count(data) == math.ceil(0.5 * grad.size)


# --------------------------------------------------------------------------- grid


def _groups(grad: np.ndarray, out: np.ndarray) -> list[np.ndarray]:
    """Original magnitudes of the kept entries, grouped by their decoded magnitude, by increasing magnitude."""
    kept = out != 0
    sent, orig = np.abs(out[kept]), np.abs(grad[kept])
    return [orig[sent == m] for m in np.unique(sent)]


@SETTINGS
@given(grad=_grads, density=_densities, levels=st.integers(0, 10))
def test_grid_selects_like_threshold_and_each_value_lies_in_its_interval(grad: np.ndarray, density: float,
                                                                         levels: int) -> None:
    data = get_codec("grid").encode(grad, policy("grid", density, levels))
    out = get_codec("grid").decode(data, grad.size)
    reference = get_codec("threshold").decode(get_codec("threshold").encode(grad, policy("threshold", density)),
                                              grad.size)
    kept = out != 0
    assert np.array_equal(kept, reference != 0)  # same selection
    assert np.array_equal(np.signbit(out[kept]), np.signbit(grad[kept]))  # sign kept
    groups = _groups(grad, out)
    bits = levels if levels > 0 else grid_mod.DEFAULT_BITS
    assert len(groups) <= 2 ** min(bits, grid_mod.MAX_BITS)
    for mag, group in zip(np.unique(np.abs(out[kept])), groups, strict=True):
        assert group.min() <= mag <= group.max()
    for below, above in zip(groups, groups[1:], strict=False):
        assert below.max() < above.min()  # intervals: disjoint ranges of |g|


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8])
def test_grid_uses_two_to_the_grid_levels_intervals_on_a_dense_tensor(bits: int) -> None:
    grad = np.random.default_rng(3).laplace(size=200_000).astype(np.float32)
    out = get_codec("grid").decode(get_codec("grid").encode(grad, policy("grid", 0.05, bits)), grad.size)
    assert np.unique(np.abs(out[out != 0])).size == 2**bits


@pytest.mark.parametrize("dist", ["normal", "laplace", "student-t"])
def test_grid_is_finer_where_values_are_dense(dist: str) -> None:
    """Multi-resolution: narrow intervals near the threshold where most values are, wide ones in the tail.

    Against an equal-width grid of as many intervals the error is lower.
    """
    rng = np.random.default_rng(4)
    x = {"normal": rng.standard_normal, "laplace": rng.laplace,
         "student-t": lambda size: rng.standard_t(3, size=size)}[dist](size=1_000_000)
    mags = np.abs(x).astype(np.float32)
    mags = mags[mags >= np.quantile(mags, 0.99)]
    interval, means = grid_mod.cluster(mags, 16)
    assert means.size == 16 and np.all(np.diff(means) > 0)
    widths = np.array([np.ptp(mags[interval == i]) for i in range(16)])
    counts = np.bincount(interval, minlength=16)
    assert widths[0] < widths[-1] / 4 and counts[0] > 4 * counts[-1]
    edges = np.linspace(mags.min(), mags.max(), 17)
    uniform = np.clip(np.searchsorted(edges, mags, side="right") - 1, 0, 15)
    uniform_means = np.bincount(uniform, weights=mags, minlength=16) / np.maximum(np.bincount(uniform, minlength=16), 1)
    assert np.linalg.norm(means[interval] - mags) < 0.9 * np.linalg.norm(uniform_means[uniform] - mags)


def test_grid_clusters_equal_values_into_one_interval() -> None:
    interval, means = grid_mod.cluster(np.full(1000, 0.25, dtype=np.float32), 16)
    assert means.tolist() == [0.25] and not interval.any()
    mags = np.array([1.0] * 500 + [np.nextafter(np.float32(1.0), np.float32(2.0))] * 500, dtype=np.float32)
    interval, means = grid_mod.cluster(mags, 16)
    assert np.array_equal(means[interval], mags)  # two neighbouring floats still split apart


@pytest.fixture(scope="module")
def digits_gradients() -> dict[str, np.ndarray]:
    from edgemesh.common.data import load_dataset
    from edgemesh.common.models import build_model, compute_gradients

    train, _ = load_dataset("digits")
    _, grads = compute_gradients(build_model("digits-cnn", seed=0), train.x[:64], train.y[:64])
    return grads


@pytest.mark.parametrize("density", [0.01, 0.05])
def test_grid_sends_at_most_half_the_bytes_of_threshold_on_cnn_gradients(
        digits_gradients: dict[str, np.ndarray], density: float) -> None:
    """The paper's claim, per parameter tensor as a worker sends them (tiny biases included)."""
    sizes = {name: sum(len(get_codec(name).encode(g, policy(name, density))) for g in digits_gradients.values())
             for name in ("grid", "threshold")}
    assert sizes["grid"] <= 0.5 * sizes["threshold"]


def test_grid_sends_at_most_half_the_bytes_of_threshold_on_a_laplacian_tensor() -> None:
    grad = np.random.default_rng(5).laplace(size=1_000_000).astype(np.float32)
    for density in (0.001, 0.01, 0.1):
        grid = len(get_codec("grid").encode(grad, policy("grid", density)))
        threshold = len(get_codec("threshold").encode(grad, policy("threshold", density)))
        assert grid <= 0.45 * threshold


# --------------------------------------------------------------------------- qsgd


def test_qsgd_is_unbiased() -> None:
    grad = np.random.default_rng(6).standard_normal(64).astype(np.float32)
    codec = QSGDCodec(seed=7)
    rounds = 4000
    mean = np.zeros(grad.size)
    for _ in range(rounds):
        mean += codec.decode(codec.encode(grad, None), grad.size)
    mean /= rounds
    step = np.abs(grad).max() / 15
    # each draw is within one step of g (variance <= step^2 / 4): the mean is within a few sigma
    assert np.abs(mean - grad).max() < 5 * step / (2 * math.sqrt(rounds))


@SETTINGS
@given(grad=_grads, levels=st.integers(0, 40))
def test_qsgd_sends_levels_of_max_abs_within_one_step(grad: np.ndarray, levels: int) -> None:
    codec = QSGDCodec(seed=8)
    data = codec.encode(grad, policy("qsgd", 1.0, levels))
    s = levels or 15
    assert len(data) == QSGD_HEADER.size + math.ceil(grad.size * (1 + s.bit_length()) / 8)
    out = codec.decode(data, grad.size)
    if grad.size:
        step = np.float32(float(np.abs(grad).max()) / s)
        level = np.abs(out) / step if step > 0 else np.zeros(grad.size)
        assert np.allclose(level, np.round(level), atol=1e-3) and level.max() <= s + 1e-3
        assert np.all(np.abs(out - grad) <= step * (1 + 1e-5) + 1e-38)
        assert np.all((np.signbit(out) == np.signbit(grad)) | (out == 0))


# --------------------------------------------------------------------------- error feedback, every codec


@pytest.mark.parametrize("name", sorted(CODECS))
def test_error_feedback_conserves_the_gradient_sum_for_every_codec(name: str) -> None:
    """Sum of what was decoded + the final residual == sum of the raw gradients, whatever the codec."""
    rng = np.random.default_rng(9)
    codec = get_codec(name)
    ef = ErrorFeedback()
    raw_sum = np.zeros(2000)
    sent_sum = np.zeros(2000)
    for step in range(40):
        grad = (rng.laplace(size=2000) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
        raw_sum += grad
        sent_sum += codec.decode(ef.encode("conv.weight[0:2000]", grad, codec, policy(name, 0.05, step % 5)), 2000)
    residual = ef.residual("conv.weight[0:2000]")
    if codec.lossless:
        assert residual is None
        residual = np.zeros(2000, dtype=np.float32)
    else:
        assert residual is not None and residual.shape == (2000,)
    scale = np.abs(raw_sum).max()
    np.testing.assert_allclose(sent_sum + residual, raw_sum, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("name", ["threshold", "topk", "grid", "qsgd"])
def test_encode_with_residual_is_exactly_the_decoding_error(name: str) -> None:
    grad = np.random.default_rng(10).laplace(size=100_003).astype(np.float32)
    encoder, decoder = (QSGDCodec(seed=11), QSGDCodec(seed=11)) if name == "qsgd" else (get_codec(name),) * 2
    data, residual = encoder.encode_with_residual(grad, policy(name, 0.01))
    assert data == decoder.encode(grad, policy(name, 0.01))
    assert residual.tobytes() == (grad - decoder.decode(data, grad.size)).tobytes()


@pytest.mark.parametrize("name", ["threshold", "topk", "grid", "qsgd"])
def test_error_feedback_eventually_sends_what_was_held_back(name: str) -> None:
    grad = np.random.default_rng(12).laplace(size=1000).astype(np.float32)
    codec = QSGDCodec(seed=13) if name == "qsgd" else get_codec(name)
    ef = ErrorFeedback()
    sent = codec.decode(ef.encode("k", grad, codec, policy(name, 0.1)), grad.size).astype(np.float64)
    for _ in range(30):
        sent += codec.decode(ef.encode("k", np.zeros_like(grad), codec, policy(name, 0.1)), grad.size)
    np.testing.assert_allclose(sent, grad, rtol=0, atol=1e-3 * np.abs(grad).max())


def test_error_feedback_carries_over_a_change_of_density() -> None:
    """What one density did not send is sent under the next: nothing is lost when the policy changes."""
    rng = np.random.default_rng(2)
    feedback, codec = ErrorFeedback(), get_codec("grid")
    grads = [rng.standard_normal(5000).astype(np.float32) for _ in range(3)]
    sent = np.zeros(5000, np.float32)
    for grad, density in zip(grads, (0.25, 0.01, 0.05), strict=True):
        sent += codec.decode(feedback.encode("fc1.weight", grad, codec, policy("grid", density)), grad.size)
    residual = feedback.residual("fc1.weight")
    assert residual is not None
    np.testing.assert_allclose(sent + residual, np.sum(grads, axis=0), atol=1e-4)


# --------------------------------------------------------------------------- bad input, bad payloads


def _small_payload(name: str) -> tuple[bytes, int]:
    grad = np.random.default_rng(14).laplace(size=300).astype(np.float32)
    grad[::7] = 0
    return get_codec(name).encode(grad, policy(name, 0.2, 3)), grad.size


@pytest.mark.parametrize("name", ["threshold", "topk", "grid", "qsgd"])
def test_every_truncation_or_extension_of_a_payload_is_a_codec_error(name: str) -> None:
    data, numel = _small_payload(name)
    codec = get_codec(name)
    assert codec.decode(data, numel).shape == (numel,)
    for cut in range(len(data)):
        with pytest.raises(CodecError):
            codec.decode(data[:cut], numel)
    for extra in (b"\x00", b"\x01", b"\xff" * 9):
        with pytest.raises(CodecError):
            codec.decode(data + extra, numel)


@pytest.mark.parametrize("name", ["threshold", "topk", "grid", "qsgd"])
def test_a_bit_flip_anywhere_is_a_codec_error_or_a_finite_tensor(name: str) -> None:
    data, numel = _small_payload(name)
    codec = get_codec(name)
    header_bits = 8 * (5 if name == "grid" else 4) if name in SPARSE else 0
    for bit in range(8 * len(data)):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            out = codec.decode(bytes(flipped), numel)
        except CodecError as exc:
            assert exc.reason
            continue
        assert bit >= header_bits, f"flipped header bit {bit} accepted"
        assert out.shape == (numel,) and out.dtype == np.float32 and np.isfinite(out).all()


@pytest.mark.parametrize("name", ["threshold", "topk", "grid", "qsgd"])
@SETTINGS
@given(data=st.binary(max_size=64), numel=st.integers(-2, 300))
def test_arbitrary_bytes_are_a_codec_error_or_a_finite_tensor(name: str, data: bytes, numel: int) -> None:
    try:
        out = get_codec(name).decode(data, numel)
    except CodecError:
        return
    assert out.shape == (numel,) and np.isfinite(out).all()


def _sparse(count: int, values: list[float], idx: list[int], numel: int) -> bytes:
    return (struct.pack("<I", count) + np.array(values, dtype="<f4").tobytes()
            + encode_indices(np.array(idx, dtype=np.int64), numel))


def _grid(count: int, last: int, means: list[float], codes: list[int], width: int, idx: list[int], numel: int) -> bytes:
    return (struct.pack("<IB", count, last) + np.array(means, dtype="<f4").tobytes()
            + pack_uint(np.array(codes), width).tobytes() + encode_indices(np.array(idx, dtype=np.int64), numel))


_BAD = [
    ("threshold", _sparse(3, [1, 2, 3], [1, 5, 9], 10), 9, "codec"),  # index 9 of a 9-value tensor
    ("threshold", _sparse(11, [1] * 11, list(range(11)), 11), 10, "codec"),  # more values than the tensor
    ("threshold", struct.pack("<I", 2**32 - 1) + b"\x00" * 16, 10, "codec"),  # huge count, tiny payload
    ("threshold", _sparse(2, [1, float("nan")], [1, 5], 10), 10, "nan"),
    ("topk", _sparse(2, [1, float("inf")], [1, 5], 10), 10, "nan"),
    ("threshold", _sparse(2, [1, 2], [1, 5], 10)[:12] + b"\x28" + bytes(10) + b"\x03", 10,
     "codec"),  # Rice parameter 40, with its 2 x 40 low bits and the unary stream present
    ("threshold", _sparse(2, [1, 2], [1, 5], 10)[:12] + b"\x05" + b"\xff\x03" + b"\x03", 10,
     "codec"),  # Rice parameter 5 > bits of the largest gap in 10 values
    ("threshold", _sparse(2, [1, 2], [1, 5], 10) + b"\x01", 10, "codec"),  # a third value in the unary stream
    ("threshold", _sparse(3, [1, 2, 3], [1, 5, 9], 10), -1, "shape"),
    ("grid", _grid(3, 3, [1, 2, 3, 4], [0, 2, 4], 3, [1, 2, 3], 10), 10, "codec"),  # 4 intervals for 3 values
    ("grid", _grid(0, 1, [], [], 1, [], 10), 10, "codec"),  # intervals without values
    ("grid", _grid(3, 2, [1, 2, 3], [0, 2, 6], 3, [1, 2, 3], 10), 10, "codec"),  # interval id 3 of 3
    ("grid", _grid(3, 2, [1, float("nan"), 3], [0, 2, 4], 3, [1, 2, 3], 10), 10, "nan"),
    ("grid", _grid(3, 2, [1, -2, 3], [0, 2, 4], 3, [1, 2, 3], 10), 10, "codec"),  # negative mean
    ("qsgd", QSGD_HEADER.pack(float("nan"), 15) + b"\x00" * 7, 10, "nan"),
    ("qsgd", QSGD_HEADER.pack(-1.0, 15) + b"\x00" * 7, 10, "codec"),
    ("qsgd", QSGD_HEADER.pack(1.0, 0) + b"\x00" * 2, 10, "codec"),  # 0 levels
    ("qsgd", QSGD_HEADER.pack(1.0, 5) + pack_uint(np.array([12] + [0] * 9), 4).tobytes(), 10, "codec"),  # level 6 > 5
]


@pytest.mark.parametrize("name,data,numel,reason", _BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(_BAD)])
def test_inconsistent_payloads_are_refused_with_a_reason(name: str, data: bytes, numel: int, reason: str) -> None:
    with pytest.raises(CodecError) as exc:
        get_codec(name).decode(data, numel)
    assert exc.value.reason == reason


def test_the_crafted_payloads_are_valid_when_consistent() -> None:
    """The builders above make valid payloads: the refusals come from the inconsistency alone."""
    assert get_codec("threshold").decode(_sparse(3, [1, 2, 3], [1, 5, 9], 10), 10).tolist() == [
        0, 1, 0, 0, 0, 2, 0, 0, 0, 3]
    out = get_codec("grid").decode(_grid(3, 2, [1, 2, 3], [0, 3, 4], 3, [1, 2, 3], 10), 10)
    assert out[:4].tolist() == [0, 1, -2, 3]
    out = get_codec("qsgd").decode(QSGD_HEADER.pack(1.0, 5) + pack_uint(np.array([10, 11] + [0] * 8), 4).tobytes(), 10)
    assert out[:2].tolist() == [1.0, -1.0]
    assert pack_unary(np.array([0, 3])).tolist() == [0b10001]


@pytest.mark.parametrize("name", ["threshold", "topk", "grid", "qsgd"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nan_or_inf_gradient_is_refused_at_encode(name: str, bad: float) -> None:
    grad = np.random.default_rng(15).standard_normal(300_001).astype(np.float32)
    grad[123_457] = bad  # off the sample's stride
    with pytest.raises(CodecError) as exc:
        get_codec(name).encode(grad, policy(name, 0.01))
    assert exc.value.reason == "nan"


@pytest.mark.parametrize("name", SPARSE)
@pytest.mark.parametrize("density", [0.0, -0.5, 1.5, float("nan")])
def test_a_density_outside_zero_one_is_a_codec_error(name: str, density: float) -> None:
    with pytest.raises(CodecError) as exc:
        get_codec(name).encode(np.ones(10, dtype=np.float32), policy(name, density))
    assert exc.value.reason == "policy"


def test_only_float32_payloads_of_a_few_megabytes_are_decoded_where_they_arrive() -> None:
    def shard(codec: str, size: int) -> ShardUpdate:
        return ShardUpdate(param="w", start=0, stop=1, codec=codec, data=bytes(size))

    assert quick_to_decode([shard("none", 1 << 20), shard("none", 2 << 20)])
    assert not quick_to_decode([shard("none", 1 << 20), shard("fp16", 1024)])  # a conversion: in a thread
    assert not quick_to_decode([shard("none", (4 << 20) + 4)])  # too long to hold the event loop for
    assert quick_to_decode([])
