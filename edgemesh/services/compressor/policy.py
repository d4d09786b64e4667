"""Which codec each device uses: a pure function of configuration and measurements, no I/O.

Precedence of the codec: an operator's ``set-codec`` beats a per-device ``compressor.overrides``
entry, which beats the choice below.

* ``static`` mode (the behaviour before adaptive compression): the codec is
  ``compressor.default_codec``, at density 1 (dense codecs) or ``static_density`` (sparsifying).
* ``adaptive`` mode (docs/compression.md): the codec and density follow the device's latest
  ``DeviceStats`` so that the estimated communication time of one update stays under
  ``comm_share`` × its step time. A pinned sparsifying codec (operator or override) keeps
  its codec and gets the adaptive density; a pinned dense codec is sent as is.

Cost model
----------
``n = gradient_bytes / 4`` values per update (the worker reports ``gradient_bytes``, the float32
size of one full gradient). The estimated wire bytes of one update (``wire_bytes``), after the
payload formats of ``edgemesh.common.codecs``, are

* ``none``: 4 n; ``fp16``: 2 n; ``qsgd``: (1 + 4) / 8 n (sign + level id of its default 15
  levels). Dense codecs ignore the density.
* a sparsifying codec at density ρ: ρ n (``index_bits(ρ)`` + ``VALUE_BITS[codec]``) / 8, where
  ``index_bits(ρ) = log2(1/ρ) + INDEX_OVERHEAD_BITS`` is the Rice-coded gap of a kept index
  (about 8.6 bits at 1 %, 5.3 at 10 %), and a kept value costs 32 bits (``topk``/``threshold``:
  float32) or 5 (``grid``: sign + the id of one of its default 16 intervals). Headers and the
  grid's interval means are a few hundred bytes per tensor and left out.

The budget of one update is ``comm_share × step_time_s × link_rate_bps`` bytes, divided by
``1 + delay_pressure × max(0, delay_index − reference_delay)`` so that a device lagging behind
the fleet's median delay compresses harder (the adaptive bounded-delay paper's "compress harder"). Then:

1. unknown link rate, step time or gradient size (any of them 0): the configured codec, at
   ``static_density`` if it is a sparsifying one, else density 1;
2. the dense ladder: ``default_codec`` if it is ``none`` or ``fp16`` and its bytes fit the
   budget, else ``fp16`` (if the default was ``none``) when that fits;
3. otherwise ``adaptive_codec`` at the largest ρ whose bytes fit the budget (``sparse_density``,
   a bisection: the bytes grow with ρ), clamped to [``min_density``, ``max_density``] and
   rounded to ``DENSITY_DIGITS`` significant digits.

Hysteresis keeps noisy stats from flapping: the codec a device already uses is kept while its
estimated bytes stay within ``(1 + density_hysteresis)`` × budget (a switch needs a 25 % margin by
default), and a new density is published only when it differs from the current one by more
than ``density_hysteresis`` (relative).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from edgemesh.common.config import CompressorConfig
from edgemesh.common.messages import CodecPolicy, DeviceStats
from edgemesh.common.vocabulary import SPARSE_CODECS, CodecName

FIRST_VERSION = 1
"""Version of a device's first policy; each change adds one."""

REASON_DEFAULT = "default"
REASON_OVERRIDE = "override"
REASON_OPERATOR = "operator"
"""Reason of a policy an operator chose with ``set-codec``; the compressor restores such
choices from the retained policies after a restart."""
REASON_ADAPTIVE = "adaptive"
"""Reason of a policy chosen from the device's link rate and step time."""

FP32_BYTES = 4
"""Bytes of one float32 gradient value; ``gradient_bytes / FP32_BYTES`` is the value count."""
DENSE_BYTES_PER_VALUE: dict[CodecName, float] = {"none": 4.0, "fp16": 2.0, "qsgd": 5 / 8}
"""Wire bytes per gradient value of the dense codecs."""
VALUE_BITS: dict[CodecName, float] = {"topk": 32.0, "threshold": 32.0, "grid": 5.0}
"""Bits per kept value of each sparsifying codec, its index aside."""
INDEX_OVERHEAD_BITS = 2.0
"""Bits of a Rice-coded index beyond ``log2(1/density)`` (the unary part and the parameter's slack)."""
DENSITY_DIGITS = 3
"""Significant digits of a published density."""
BISECTION_STEPS = 60
"""Steps of the density search on log density (its error is far below the rounding)."""


def is_sparse(codec: CodecName) -> bool:
    """Whether ``codec`` keeps a share of the values given by the policy's density."""
    return codec in SPARSE_CODECS


def index_bits(density: float) -> float:
    """Estimated bits of one kept index at ``density``."""
    return math.log2(1.0 / density) + INDEX_OVERHEAD_BITS


def wire_bytes(codec: CodecName, values: int, density: float = 1.0) -> float:
    """Estimated wire bytes of ``values`` gradient values encoded with ``codec`` at ``density``."""
    if is_sparse(codec):
        return density * values * (index_bits(density) + VALUE_BITS[codec]) / 8
    return DENSE_BYTES_PER_VALUE.get(codec, float(FP32_BYTES)) * values


def value_count(stats: DeviceStats) -> int:
    """Values in one full gradient of the device."""
    return stats.gradient_bytes // FP32_BYTES


def budget_bytes(stats: DeviceStats, settings: CompressorConfig, reference_delay: float = 0.0) -> float:
    """Bytes one update of the device may take on the wire (0 when a measurement is missing)."""
    if stats.link_rate_bps <= 0 or stats.step_time_s <= 0 or stats.gradient_bytes <= 0:
        return 0.0
    excess = max(0.0, stats.delay_index - reference_delay)
    return settings.comm_share * stats.step_time_s * stats.link_rate_bps / (1.0 + settings.delay_pressure * excess)


def sparse_density(codec: CodecName, values: int, budget: float, settings: CompressorConfig) -> float:
    """The largest density at which ``codec`` fits ``budget``, clamped and rounded."""
    lo, hi = settings.min_density, settings.max_density
    if wire_bytes(codec, values, hi) <= budget:
        return hi
    if wire_bytes(codec, values, lo) >= budget:
        return lo
    log_lo, log_hi = math.log(lo), math.log(hi)
    for _ in range(BISECTION_STEPS):
        mid = (log_lo + log_hi) / 2
        if wire_bytes(codec, values, math.exp(mid)) <= budget:
            log_lo = mid
        else:
            log_hi = mid
    return min(hi, max(lo, _round(math.exp(log_lo))))


def adaptive_choice(
    stats: DeviceStats | None,
    settings: CompressorConfig,
    *,
    previous: CodecPolicy | None,
    pinned: CodecName | None = None,
    reference_delay: float = 0.0,
) -> tuple[CodecName, float] | None:
    """(codec, density) for the device, or None when its measurements do not allow a choice.

    ``pinned`` is a codec an operator or override fixed: only its density is chosen (sparsifying
    codecs), dense ones keep density 1. ``previous`` drives the hysteresis.
    """
    if stats is None:
        return None
    budget = budget_bytes(stats, settings, reference_delay)
    values = value_count(stats)
    if budget <= 0 or values <= 0:
        return None
    current = previous.codec if previous is not None else None
    margin = 1.0 + settings.density_hysteresis

    codec: CodecName
    if pinned is not None:
        codec = pinned
    else:
        default = settings.default_codec
        ladder: list[CodecName] = [default] if default in ("none", "fp16") else []
        if default == "none":
            ladder.append("fp16")
        for dense in ladder:
            allowance = budget * margin if dense == current else budget
            if wire_bytes(dense, values) <= allowance:
                return dense, 1.0
        codec = settings.adaptive_codec
    if not is_sparse(codec):
        return codec, 1.0
    density = sparse_density(codec, values, budget, settings)
    if previous is not None and previous.codec == codec and _close(density, previous.density, settings):
        density = previous.density
    return codec, density


def choose_policy(
    device: str,
    settings: CompressorConfig,
    *,
    previous: CodecPolicy | None,
    stats: DeviceStats | None = None,
    operator: Mapping[str, CodecName] | None = None,
    gateway: bool = False,
    reference_delay: float = 0.0,
) -> CodecPolicy:
    """The codec policy of ``device`` under the ``[compressor]`` ``settings``.

    The codec is ``operator[device]`` if set (an operator's ``set-codec``), else
    ``settings.overrides[device]``, else ``settings.default_codec`` at density 1 (a dense codec)
    or ``static_density`` (a sparsifying one) — or, in ``adaptive`` mode with usable ``stats``, the
    adaptive choice (see the module docstring), which also sets the density of a pinned sparsifying
    codec. ``gateway`` marks a device that cannot encode: it sends ``grad-raw`` and the compressor
    encodes with this policy for it.

    If the result says the same as ``previous`` (codec, density, grid levels, gateway),
    ``previous`` itself is returned, version unchanged (with the new ``reason`` if that
    changed); otherwise the result carries ``previous.version + 1`` (``FIRST_VERSION`` for a
    new device).
    """
    pinned: CodecName | None
    if operator and device in operator:
        pinned, reason = operator[device], REASON_OPERATOR
    elif device in settings.overrides:
        pinned, reason = settings.overrides[device], REASON_OVERRIDE
    else:
        pinned, reason = None, REASON_DEFAULT
    codec = pinned or settings.default_codec
    density = settings.static_density if is_sparse(codec) else 1.0
    if settings.mode == "adaptive":
        choice = adaptive_choice(stats, settings, previous=previous, pinned=pinned, reference_delay=reference_delay)
        if choice is not None:
            codec, density = choice
            if pinned is None:
                reason = REASON_ADAPTIVE
    candidate = CodecPolicy(
        device=device,
        codec=codec,
        density=density,
        grid_levels=0,
        gateway=gateway,
        version=FIRST_VERSION if previous is None else previous.version + 1,
        reason=reason,
    )
    if previous is not None and _same(candidate, previous):
        if previous.reason != reason:  # same policy, now chosen for another reason: version stays
            return dataclasses.replace(previous, reason=reason)
        return previous
    return candidate


def change_kind(previous: CodecPolicy | None, policy: CodecPolicy) -> str:
    """Why ``policy`` replaces ``previous``, as a low-cardinality label: new, codec, gateway,
    density, reason (only the reason changed) or same."""
    if previous is None:
        return "new"
    if previous.codec != policy.codec:
        return "codec"
    if previous.gateway != policy.gateway:
        return "gateway"
    if previous.density != policy.density or previous.grid_levels != policy.grid_levels:
        return "density"
    if previous.reason != policy.reason:
        return "reason"
    return "same"


def _close(new: float, old: float, settings: CompressorConfig) -> bool:
    """Whether ``new`` is within the hysteresis of ``old``."""
    return old > 0 and abs(new - old) <= settings.density_hysteresis * old


def _round(density: float) -> float:
    digits = DENSITY_DIGITS - 1 - math.floor(math.log10(density))
    return min(1.0, round(density, digits))


def _same(a: CodecPolicy, b: CodecPolicy) -> bool:
    """Whether two policies tell the device the same thing (version and reason aside)."""
    return dataclasses.replace(a, version=0, reason="") == dataclasses.replace(b, version=0, reason="")

