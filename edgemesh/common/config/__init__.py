"""Configuration: nested dataclass sections (``sections``, ``parameter_server``) loaded in one function
(``loading.load_config``).

Precedence: defaults < TOML file < ``EDGEMESH_*`` environment < command-line flags (docs/operations.md).
"""

from edgemesh.common.config.loading import describe, load_config, to_toml, with_settings
from edgemesh.common.config.parameter_server import AdaptiveConfig, GuardConfig, ParameterServerConfig
from edgemesh.common.config.sections import (
    BrokerConfig,
    CompressorConfig,
    Config,
    DemoConfig,
    MetricsConfig,
    ModelsConfig,
    PlannerConfig,
    TrainingConfig,
    WorkerConfig,
)

__all__ = [
    "AdaptiveConfig", "BrokerConfig", "GuardConfig", "CompressorConfig", "Config", "DemoConfig", "MetricsConfig",
    "ModelsConfig", "ParameterServerConfig", "PlannerConfig", "TrainingConfig", "WorkerConfig", "describe",
    "load_config", "to_toml", "with_settings",
]
