"""Gradient codecs (DESIGN.md §6): the reference codecs ``none`` and ``fp16``, the registry, error feedback."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgemesh.common.codecs import ErrorFeedback, available_codecs, get_codec
from edgemesh.common.errors import CodecError, WireError

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
