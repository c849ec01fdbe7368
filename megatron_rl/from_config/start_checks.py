"""RL from a megatron_rl checkpoint (``model.ckpt``: an SFT run's, another RL run's), checked
before any model is built: the step it starts from exists, holds a policy's full weights,
and is a model of the architecture of the HF directory the run builds from (which gives the
tokenizer and vLLM's first build)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

from megatron_rl.checkpoint.format import CheckpointError, read_metadata, resolve_step
from megatron_rl.config import Config, ConfigError
from megatron_rl.config.schema import MODEL_ROLE, REWARD_MODEL
from megatron_rl.models.hf_config import arch_from_dict, arch_from_hf


class StartCheckpoint(NamedTuple):
    """Where an RL run's weights start: ``model.ckpt``'s newest committed step."""

    root: Path
    step: int


def start_checkpoint(cfg: Config, base_dir: Path) -> Optional[StartCheckpoint]:
    """``model.ckpt``'s newest step (None without one); a ConfigError (exit 2) naming what is
    wrong with it otherwise."""
    if cfg.model.ckpt is None:
        return None
    root = Path(cfg.model.ckpt)
    try:
        step = resolve_step(root)
        extra = read_metadata(root, step).extra
    except CheckpointError as err:
        raise ConfigError(f"model.ckpt={root}: {err}") from None
    where = f"model.ckpt={root} step {step}"
    if extra.get(MODEL_ROLE) == REWARD_MODEL:
        raise ConfigError(f"{where} is a reward model's: an actor starts from a policy's checkpoint (SFT or RL)")
    if (extra.get("lora") or {}).get("adapters_only"):
        raise ConfigError(
            f"{where} holds LoRA adapters only: export it merged (megatron-rl convert megatron-to-hf --merge) "
            "and start from model.hf_path"
        )
    if cfg.model.lora is not None:
        raise ConfigError(
            f"model.ckpt with model.lora: a LoRA run's base is an HF directory (its checkpoints record its "
            f"digest); export {root} (megatron-rl convert megatron-to-hf) and set model.hf_path"
        )
    if not extra.get("hf_config"):
        raise ConfigError(f"{where} records no HF architecture (extra['hf_config']): it was not saved by a trainer")
    if arch_from_dict(extra["hf_config"]) != arch_from_hf(base_dir):
        raise ConfigError(
            f"{where} is a model of another architecture than this run's base {base_dir}: set model.hf_path "
            "to the HF directory it was trained from"
        )
    return StartCheckpoint(root, step)
