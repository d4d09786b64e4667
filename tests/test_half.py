"""float32 <-> float16 (``edgemesh.common.wire.half``): bit for bit numpy's ``astype``, for every float16 pattern and
for float32 values of every size, subnormal range, signed zeros, the rounding boundaries and NaN included; and the
``fp16`` codec, snapshots and mesh slices that use it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgemesh.common.codecs import get_codec
from edgemesh.common.wire.half import from_half, to_half

FLOAT16_MAX = float(np.finfo(np.float16).max)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit patterns, any NaN equal to any NaN."""
    nan = np.isnan(a.astype(np.float32))
    return bool(np.array_equal(nan, np.isnan(b.astype(np.float32)))
                and np.array_equal(a[~nan].view(np.uint16 if a.itemsize == 2 else np.uint32),
                                   b[~nan].view(np.uint16 if b.itemsize == 2 else np.uint32)))


def test_every_float16_pattern_widens_as_numpy_widens_it() -> None:
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    assert same(from_half(every), every.astype(np.float32))
    assert from_half(every.reshape(256, 256)).shape == (256, 256)


def test_float32_values_of_every_size_narrow_as_numpy_narrows_them() -> None:
    # every 97th float32 pattern of each sign (44 million): the subnormal grid and the ties between its steps,
    # the step up to the smallest normal, every binade, the overflow to inf, inf and NaN
    for start in range(0, 1 << 31, 1 << 27):
        ups = np.arange(start, start + (1 << 27), 97, dtype=np.uint32).view(np.float32)
        for values in (ups, -ups):
            with np.errstate(over="ignore"):
                assert same(to_half(values), values.astype(np.float16)), hex(start)
    edges = np.array([0.0, -0.0, 2.0 ** -25, -(2.0 ** -25), 3 * 2.0 ** -26, 2.0 ** -24, 2.0 ** -14,
                      np.nextafter(np.float32(2.0 ** -14), np.float32(0)), np.nan, FLOAT16_MAX], dtype=np.float32)
    assert same(to_half(edges), edges.astype(np.float16))


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 300), elements=st.floats(-FLOAT16_MAX, FLOAT16_MAX, width=32)
                  | st.just(float("nan"))),
       st.sampled_from([1.0, 1e-3, 1e-5, 1e-7]))
def test_to_half_is_numpys_astype_whatever_the_values(values: np.ndarray, scale: float) -> None:
    scaled = (values * np.float32(scale)).astype(np.float32)
    assert same(to_half(scaled), scaled.astype(np.float16))
    assert same(from_half(to_half(scaled)), scaled.astype(np.float16).astype(np.float32))


def test_the_fp16_codec_sends_what_astype_sends_and_reads_it_back() -> None:
    rng = np.random.default_rng(0)
    grad = (rng.standard_normal(10_000) * 1e-6).astype(np.float32)  # a gradient of a typical size: subnormal
    grad[:3] = [1e6, -1e6, 0.0]  # clipped to float16's range, as before
    codec = get_codec("fp16")
    data = codec.encode(grad, None)
    assert data == np.clip(grad, -FLOAT16_MAX, FLOAT16_MAX).astype("<f2").tobytes()
    back = codec.decode(data, grad.size)
    assert back.dtype == np.float32 and same(back, np.frombuffer(data, "<f2").astype(np.float32))
    back[0] = 1.0  # the decoded gradient is the server's to write in
