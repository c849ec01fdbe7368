"""The run's settings: dataclasses, one per config section, and the YAML loader with dotted
CLI overrides. A section checks its own fields when it is built; the checks that need
several sections, the world size, the model or the data are made where a run is built from
its config (:mod:`megatron_rl.from_config`)."""

from megatron_rl.config.loader import dump_yaml, load_config, to_dict
from megatron_rl.config.schema import Config, ConfigError, ModelConfig, TrainerConfig

__all__ = ["Config", "ConfigError", "ModelConfig", "TrainerConfig", "dump_yaml", "load_config", "to_dict"]
