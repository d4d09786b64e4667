"""Which codec each device uses: a pure function of configuration and history, no I/O.

In this release the codec comes from configuration: an operator's ``set-codec`` beats a
per-device ``compressor.overrides`` entry, which beats ``compressor.default_codec``. Density
stays 1.0 (sparsifying codecs keep their own defaults) and no device is served by the gateway.

Seam for the adaptive policy (DESIGN.md §6, a later issue): ``choose_policy`` already receives
the device's latest ``DeviceStats`` (link rate, delay index, step and communication time) and
the previous policy; the adaptive version will pick codec, density and grid levels from them
so that communication stays under a target share of step time. The service calls it on every
hello and every stats message and publishes only what changed, so that version needs no change
to the service.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from edgemesh.common.messages import CodecName, CodecPolicy, DeviceStats

FIRST_VERSION = 1
"""Version of a device's first policy; each change adds one."""

REASON_DEFAULT = "default"
REASON_OVERRIDE = "override"
REASON_OPERATOR = "operator"
"""Reason of a policy an operator chose with ``set-codec``; the compressor restores such
choices from the retained policies after a restart."""


def choose_policy(
    device: str,
    *,
    default_codec: str,
    overrides: Mapping[str, str],
    previous: CodecPolicy | None,
    stats: DeviceStats | None = None,
    operator: Mapping[str, str] | None = None,
) -> CodecPolicy:
    """The codec policy of ``device``.

    The codec is ``operator[device]`` if set (an operator's ``set-codec``), else
    ``overrides[device]`` (config), else ``default_codec``; density is 1.0. If that says the
    same as ``previous`` (codec, density, grid levels, gateway), ``previous`` itself is
    returned, version unchanged (with the new ``reason`` if that changed); otherwise the
    result carries ``previous.version + 1`` (``FIRST_VERSION`` for a new device).

    ``stats`` (the device's latest measurements, or None) is ignored in this release: it is
    the seam for the adaptive policy that will choose from link rate and delay index.
    Codec names are not checked here; the service validates them against the codecs built in.
    """
    del stats  # the adaptive policy will use it
    if operator and device in operator:
        codec, reason = operator[device], REASON_OPERATOR
    elif device in overrides:
        codec, reason = overrides[device], REASON_OVERRIDE
    else:
        codec, reason = default_codec, REASON_DEFAULT
    candidate = CodecPolicy(
        device=device,
        codec=_codec_name(codec),
        density=1.0,
        grid_levels=0,
        gateway=False,
        version=FIRST_VERSION if previous is None else previous.version + 1,
        reason=reason,
    )
    if previous is not None and _same(candidate, previous):
        if previous.reason != reason:  # same codec, now chosen for another reason: version stays
            return dataclasses.replace(previous, reason=reason)
        return previous
    return candidate


def _same(a: CodecPolicy, b: CodecPolicy) -> bool:
    """Whether two policies tell the device the same thing (version and reason aside)."""
    return dataclasses.replace(a, version=0, reason="") == dataclasses.replace(b, version=0, reason="")


def _codec_name(codec: str) -> CodecName:
    return codec  # type: ignore[return-value]  # validated by config and by the service
