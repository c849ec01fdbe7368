"""The configuration tree, its YAML loader with dotted overrides, and validation."""

from megatron_rl.config.checks import validate
from megatron_rl.config.loader import dump_yaml, load_config, to_dict
from megatron_rl.config.schema import Config, ConfigError, ModelConfig, TrainerConfig
from megatron_rl.config.sources import base_settings, model_arch, model_shape, verifier_name

__all__ = [
    "Config",
    "ConfigError",
    "ModelConfig",
    "TrainerConfig",
    "base_settings",
    "dump_yaml",
    "load_config",
    "model_arch",
    "model_shape",
    "to_dict",
    "validate",
    "verifier_name",
]
