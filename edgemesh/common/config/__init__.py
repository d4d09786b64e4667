"""Configuration: nested dataclass sections (``sections``) loaded in one function
(``loading.load_config``).

Precedence: defaults < TOML file < ``EDGEMESH_*`` environment < command-line flags (docs/operations.md).
"""

from edgemesh.common.config.loading import describe, load_config, to_toml, with_settings
from edgemesh.common.config.sections import (
    AdaptiveConfig,
    BrokerConfig,
    CompressorConfig,
    Config,
    DemoConfig,
    GuardConfig,
    MetricsConfig,
    ModelsConfig,
    ParameterServerConfig,
    PlannerConfig,
    TrainingConfig,
    WorkerConfig,
)

__all__ = [
    "AdaptiveConfig", "BrokerConfig", "GuardConfig", "CompressorConfig", "Config", "DemoConfig", "MetricsConfig",
    "ModelsConfig", "ParameterServerConfig", "PlannerConfig", "TrainingConfig", "WorkerConfig", "describe",
    "load_config", "to_toml", "with_settings",
]
