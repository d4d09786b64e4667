"""The compressor's codec policy (``services/compressor/policy.py``), pure: the precedence of
operator, override and default, versions, the adaptive cost model and its hysteresis.

The service on real brokers is tested in ``test_compressor.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from helpers import GRADIENT_BYTES, STEP_S, device_stats, rate_for

from edgemesh.common.codecs import get_codec
from edgemesh.common.config import CompressorConfig, load_config
from edgemesh.common.errors import ConfigError
from edgemesh.common.messages import CodecPolicy, DeviceStats
from edgemesh.common.vocabulary import CodecName
from edgemesh.services.compressor.policy import budget_bytes, choose_policy, wire_bytes

STATIC = CompressorConfig(mode="static", default_codec="fp16", static_density=1.0)
"""Codecs from config alone: the default codec fp16, a sparsifying codec sent whole."""
SETTINGS = CompressorConfig(mode="adaptive", default_codec="fp16", adaptive_codec="grid", comm_share=0.5,
                            min_density=0.001, max_density=0.25, density_hysteresis=0.25, delay_pressure=0.1,
                            static_density=1.0)
"""The adaptive mode of these tests (a pinned sparsifying codec without measurements is sent whole)."""


def static(overrides: Mapping[str, CodecName] | None = None) -> CompressorConfig:
    """``STATIC`` with per-device ``overrides``."""
    return dataclasses.replace(STATIC, overrides=dict(overrides or {}))


def adaptive(device: str = "pi-1", previous: CodecPolicy | None = None, default: CodecName = "fp16",
             overrides: Mapping[str, CodecName] | None = None, **kw: Any) -> CodecPolicy:
    """The adaptive policy of ``device`` under ``SETTINGS`` with ``default`` codec and ``overrides``."""
    settings = dataclasses.replace(SETTINGS, default_codec=default, overrides=dict(overrides or {}))
    return choose_policy(device, settings, previous=previous, **kw)


# --------------------------------------------------------------------------- precedence and versions


def test_a_new_device_gets_the_default_codec_at_version_1() -> None:
    policy = choose_policy("pi-1", STATIC, previous=None)
    assert (policy.device, policy.codec, policy.density, policy.version, policy.gateway) == (
        "pi-1", "fp16", 1.0, 1, False)
    assert policy.reason == "default"


def test_a_config_override_beats_the_default_and_an_operator_beats_both() -> None:
    overrides = static({"pi-1": "none"})
    assert choose_policy("pi-1", overrides, previous=None).codec == "none"
    assert choose_policy("pi-2", overrides, previous=None).codec == "fp16"
    chosen = choose_policy("pi-1", overrides, previous=None, operator={"pi-1": "fp16"})
    assert (chosen.codec, chosen.reason) == ("fp16", "operator")


def test_the_version_moves_only_when_the_codec_changes() -> None:
    first = choose_policy("pi-1", STATIC, previous=None)
    same = choose_policy("pi-1", STATIC, previous=first)
    assert same is first
    changed = choose_policy("pi-1", static({"pi-1": "none"}), previous=same)
    assert (changed.codec, changed.version) == ("none", 2)
    back = choose_policy("pi-1", STATIC, previous=changed)
    assert (back.codec, back.version) == ("fp16", 3)


def test_the_same_codec_for_another_reason_keeps_the_version() -> None:
    first = choose_policy("pi-1", STATIC, previous=None)
    pinned = choose_policy("pi-1", STATIC, previous=first, operator={"pi-1": "fp16"})
    assert (pinned.codec, pinned.version, pinned.reason) == ("fp16", 1, "operator")


def test_static_mode_ignores_stats() -> None:
    """In ``compressor.mode = "static"`` the codec comes from config alone."""
    slow = DeviceStats(device="pi-1", link_rate_bps=1e3, delay_index=40.0, step_time_s=0.1, comm_time_s=9.0,
                       gradient_bytes=1 << 20)
    first = choose_policy("pi-1", STATIC, previous=None)
    assert choose_policy("pi-1", STATIC, previous=first, stats=slow) is first


def test_static_mode_ignores_a_link_of_one_byte_per_second() -> None:
    first = choose_policy("pi-1", STATIC, previous=None)
    assert choose_policy("pi-1", STATIC, previous=first, stats=device_stats(1.0)) is first


# --------------------------------------------------------------------------- adaptive mode


def test_a_fast_link_keeps_the_dense_default_codec() -> None:
    fast = device_stats(rate_for(2 * GRADIENT_BYTES))  # float32 fits twice over, fp16 (half of it) four times
    policy = adaptive(stats=fast)
    assert (policy.codec, policy.density, policy.reason) == ("fp16", 1.0, "adaptive")
    # a default of none is kept when float32 fits, and stepped down to fp16 when only that fits
    assert adaptive(default="none", stats=fast).codec == "none"
    assert adaptive(default="none", stats=device_stats(rate_for(0.6 * GRADIENT_BYTES))).codec == "fp16"


def test_a_slower_link_gets_the_adaptive_codec_at_a_lower_density() -> None:
    values = GRADIENT_BYTES // 4
    target = 0.05
    rate = rate_for(wire_bytes("grid", values, target))
    slow = adaptive(stats=device_stats(rate))
    assert (slow.codec, slow.reason) == ("grid", "adaptive")
    assert slow.density == pytest.approx(target, rel=0.01)
    # the estimate of the chosen policy fits the budget
    assert wire_bytes("grid", values, slow.density) <= budget_bytes(device_stats(rate), SETTINGS) * 1.01
    slower = adaptive(stats=device_stats(rate_for(wire_bytes("grid", values, target / 10))))
    assert slower.density == pytest.approx(target / 10, rel=0.01)
    # a longer step leaves more time to send: a higher density, twice the bytes
    longer = adaptive(stats=device_stats(rate, step=2 * STEP_S))
    assert longer.density > target
    assert wire_bytes("grid", values, longer.density) == pytest.approx(2 * wire_bytes("grid", values, target),
                                                                       rel=0.01)


def test_density_is_clamped_to_the_configured_range() -> None:
    values = GRADIENT_BYTES // 4
    assert adaptive(stats=device_stats(1.0)).density == SETTINGS.min_density  # 1 byte/s
    just_too_slow_for_fp16 = device_stats(rate_for(GRADIENT_BYTES / 2) / 1.01)
    policy = adaptive(stats=just_too_slow_for_fp16)
    assert (policy.codec, policy.density) == ("grid", SETTINGS.max_density)
    assert wire_bytes("grid", values, SETTINGS.max_density) < wire_bytes("fp16", values)


def test_noisy_stats_do_not_flap_the_policy() -> None:
    values = GRADIENT_BYTES // 4
    rate = rate_for(wire_bytes("grid", values, 0.05))
    first = adaptive(stats=device_stats(rate))
    for noise in (0.85, 1.15, 0.9, 1.1):  # density within 25 %: the same policy object, version unchanged
        assert adaptive(previous=first, stats=device_stats(rate * noise)) is first
    lower = adaptive(previous=first, stats=device_stats(rate / 2))
    assert (lower.codec, lower.version) == ("grid", first.version + 1)
    assert lower.density < first.density / 1.25

    # around the fp16 boundary: fp16 is kept up to 25 % over budget, and comes back only when it fits
    edge = rate_for(GRADIENT_BYTES / 2)  # fp16 takes exactly the budget
    dense = adaptive(stats=device_stats(edge))
    assert dense.codec == "fp16"
    assert adaptive(previous=dense, stats=device_stats(edge / 1.2)) is dense
    sparse = adaptive(previous=dense, stats=device_stats(edge / 1.3))
    assert sparse.codec == "grid"
    assert adaptive(previous=sparse, stats=device_stats(edge / 1.1)) is sparse
    back = adaptive(previous=sparse, stats=device_stats(edge))
    assert (back.codec, back.version) == ("fp16", sparse.version + 1)


@pytest.mark.parametrize("unknown", [
    device_stats(0.0), device_stats(1e6, step=0.0), device_stats(1e6, gradient_bytes=0), None,
], ids=["no-link-rate", "no-step-time", "no-gradient-size", "no-stats"])
def test_a_device_with_unknown_measurements_gets_the_default_codec(unknown: DeviceStats | None) -> None:
    policy = adaptive(stats=unknown)
    assert (policy.codec, policy.density, policy.reason) == ("fp16", 1.0, "default")


def test_operator_and_override_pin_the_codec_and_a_pinned_sparse_codec_gets_the_adaptive_density() -> None:
    slow = device_stats(1.0)
    pinned_dense = adaptive(overrides={"pi-1": "none"}, stats=slow)
    assert (pinned_dense.codec, pinned_dense.density, pinned_dense.reason) == ("none", 1.0, "override")
    operator = adaptive(overrides={"pi-1": "none"}, operator={"pi-1": "topk"}, stats=slow)
    assert (operator.codec, operator.density, operator.reason) == ("topk", SETTINGS.min_density, "operator")
    # unknown measurements: the pinned codec as configured (``static_density``, here 1)
    assert adaptive(operator={"pi-1": "topk"}).density == 1.0


def test_a_device_lagging_behind_the_fleet_compresses_harder() -> None:
    values = GRADIENT_BYTES // 4
    rate = rate_for(wire_bytes("grid", values, 0.05))
    on_par = adaptive(stats=device_stats(rate, delay=3.0), reference_delay=3.0)
    lagging = adaptive(stats=device_stats(rate, delay=13.0), reference_delay=3.0)  # 10 versions over the median
    assert wire_bytes("grid", values, lagging.density) == pytest.approx(
        wire_bytes("grid", values, on_par.density) / (1 + SETTINGS.delay_pressure * 10), rel=0.01)


def test_the_gateway_flag_is_part_of_the_policy() -> None:
    first = adaptive(stats=device_stats(0.0))
    gateway = adaptive(previous=first, stats=device_stats(0.0), gateway=True)
    assert (gateway.gateway, gateway.codec, gateway.version) == (True, "fp16", first.version + 1)


def test_adaptive_settings_are_validated() -> None:
    for key, value in (("compressor.comm_share", 0), ("compressor.min_density", 0),
                       ("compressor.max_density", 1.5), ("compressor.density_hysteresis", 1),
                       ("compressor.delay_pressure", -1), ("compressor.adaptive_codec", "fp16"),
                       ("compressor.mode", "smart"), ("worker.link_rate_bps", -1)):
        with pytest.raises(ConfigError, match=key.split(".")[1]):
            load_config(env={}, overrides={key: value})
    with pytest.raises(ConfigError, match="max_density"):
        load_config(env={}, overrides={"compressor.min_density": 0.5, "compressor.max_density": 0.1})


# --------------------------------------------------------------------------- the cost model


@pytest.mark.parametrize("codec", ["grid", "topk", "threshold", "qsgd", "fp16", "none"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 0.25])
def test_the_cost_model_matches_the_codecs(codec: CodecName, density: float) -> None:
    """The estimate is within 20 % of what the codec really sends."""
    values = 200_000
    grad = np.random.default_rng(0).standard_normal(values).astype(np.float32)
    sent = len(get_codec(codec).encode(grad, CodecPolicy(device="pi-1", codec=codec, density=density)))
    estimate = wire_bytes(codec, values, density)
    assert sent / 1.2 <= estimate <= sent * 1.2, (codec, density, sent, estimate)
