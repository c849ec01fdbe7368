"""The configuration tree: one dataclass per component, a docstring under every field.

Each section validates only its own fields (raising, never rewriting); the one check that
spans sections (does the layout fit the model and the world size?) is
:func:`megatron_rl.config.loader.validate`. Later components add their sections here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl.parallel.config import ParallelConfig


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what is allowed."""


def _choice(section: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{name}={value!r} is not allowed; choose one of {sorted(allowed)}")


TINY_PRESETS = ("tiny-dense", "tiny-moe")


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Which model to build and in which numerics."""

    hf_path: Optional[str] = None
    """Directory of a Hugging Face model (config.json is read for the architecture)."""
    preset: Optional[str] = "tiny-moe"
    """Built-in tiny architecture used when hf_path is not set: tiny-dense | tiny-moe."""
    dtype: str = "fp32"
    """Parameter dtype: fp32 | bf16 | fp16."""
    moe_token_dispatcher_type: str = "alltoall"
    """Megatron MoE token dispatcher: alltoall | allgather."""
    moe_aux_loss_coeff: float = 0.0
    """MoE load-balancing loss weight; 0 turns it off."""
    recompute_activations: bool = False
    """Recompute each layer's activations in backward (saves memory)."""

    def __post_init__(self) -> None:
        if self.hf_path is None and self.preset is None:
            raise ConfigError("model needs hf_path or preset; neither is set")
        if self.hf_path is None:
            _choice("model", "preset", self.preset, TINY_PRESETS)
        _choice("model", "dtype", self.dtype, ("fp32", "bf16", "fp16"))
        _choice("model", "moe_token_dispatcher_type", self.moe_token_dispatcher_type, ("alltoall", "allgather"))
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0")


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    """The run: where it writes, how long it runs, its seed."""

    run_dir: str = "runs/default"
    """Directory for metrics.jsonl, config.yaml and checkpoints."""
    max_steps: int = 20
    """Number of optimizer steps."""
    seed: int = 1234
    """Seed for init, data order and sampling."""
    lr: float = 1e-3
    """Peak learning rate of the actor."""
    micro_batch_size: int = 2
    """Sequences per microbatch."""
    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks."""
    seq_length: int = 32
    """Tokens per sequence (smoke job)."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "micro_batch_size", "global_batch_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name}={getattr(self, name)} must be >= 1")
        if self.lr <= 0:
            raise ConfigError(f"trainer.lr={self.lr} must be > 0")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"trainer.global_batch_size={self.global_batch_size} must be a multiple of "
                f"trainer.micro_batch_size={self.micro_batch_size}"
            )


@dataclasses.dataclass(kw_only=True)
class Config:
    """The whole run."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model (actor; the critic shares its architecture)."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """The actor's parallel layout."""
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    """The run itself."""
