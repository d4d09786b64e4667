"""A small MLP for windows of sensor features: the entry point ``sensor_mlp:build`` of examples/sensors.toml."""

from torch import nn


def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Called with the job's ``model.input_shape`` and number of classes; returns a fresh module."""
    (features,) = input_shape
    return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))
