"""The worker: one device training its share of the model."""

from __future__ import annotations

import socket

from edgemesh.common.config import Config


def device_name(config: Config) -> str:
    """The device's name: ``worker.device``, else the host name (torch-free: ``edgemesh worker`` names the device
    before it loads torch)."""
    return config.worker.device or socket.gethostname().split(".")[0]
