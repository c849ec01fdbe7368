"""The configuration tree, its YAML loader with dotted overrides, and validation."""

from megatron_rl.config.loader import dump_yaml, load_config, model_arch, to_dict, validate
from megatron_rl.config.schema import Config, ConfigError, ModelConfig, TrainerConfig

__all__ = ["Config", "ConfigError", "ModelConfig", "TrainerConfig", "dump_yaml", "load_config", "model_arch", "to_dict", "validate"]
