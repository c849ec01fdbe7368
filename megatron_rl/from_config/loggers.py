"""The loggers trainer.loggers may name, and the check that each is installed.

Here and not beside the loggers (megatron_rl.trainer.loggers) because the config's one
validation pass runs before torch or any logger package is imported.
"""

from __future__ import annotations

import importlib.util

from megatron_rl.config.schema import ConfigError

LOGGERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""trainer.loggers name -> the module it needs."""
PINS = {"tensorboard": "tensorboard==2.21.0", "wandb": "wandb==0.31.0", "mlflow": "mlflow-skinny==3.17.2"}
"""What to install for each: the versions the tests ran."""


def check_loggers(names) -> None:
    """One line naming the problem: an unknown logger, a repeated one, or one whose package
    is not installed."""
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"trainer.loggers: {name!r} is not a logger; choose from {sorted(LOGGERS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"trainer.loggers={list(names)} names a logger twice")
    for name in names:
        if importlib.util.find_spec(LOGGERS[name]) is None:
            raise ConfigError(f"trainer.loggers: {name} needs `pip install {PINS[name]}`")
