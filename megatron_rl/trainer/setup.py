"""What a run needs before its first step: the base model on disk, the trainable actor,
the prompt data and the reward function.

The embedded default has no model hub to start from, so ``task:<name>`` data builds (or
reuses, by content hash) the task's tiny supervised base with megatron_rl.tasks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.config import Config
from megatron_rl.config.sources import base_settings, prompt_file, task_name
from megatron_rl.models.builder import BuildOptions, build_model, wrap_for_training
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.config import ParallelConfig
from megatron_rl.parallel.state import ParallelContext
from megatron_rl.utils import dtypes


def base_model_dir(cfg: Config, rank: int) -> Path:
    """The HF directory the actor starts from: model.hf_path, or the task base built here from
    config.sources.base_settings (the settings validation checked the layouts against)."""
    settings = base_settings(cfg)
    if settings is None:
        return Path(cfg.model.hf_path)
    from megatron_rl.tasks.base_model import make_tiny_base

    directory = Path(cfg.trainer.run_dir) / "base_model"
    if rank == 0:
        make_tiny_base(directory, settings)
    torch.distributed.barrier()
    return directory


def build_options(cfg: Config) -> BuildOptions:
    """How the run's models are built (dtype and the MoE and recompute knobs of ``model``)."""
    return BuildOptions(
        dtype=cfg.model.dtype,
        moe_token_dispatcher_type=cfg.model.moe_token_dispatcher_type,
        moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
        recompute_activations=cfg.model.recompute_activations,
    )


def engine_config(cfg: Config, arch: ModelArch, cache_dir: Optional[Path]):
    """The colocated vLLM engines' settings (the trainer's, and `megatron-rl eval`'s, which
    must sample as the run's eval phase did)."""
    from megatron_rl.rollout import EngineConfig

    return EngineConfig(
        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
        dtype=dtypes.long_name(cfg.model.dtype),
        max_model_len=min(arch.max_position_embeddings, cfg.trainer.seq_length),
        seed=cfg.trainer.seed,
        cpu_kv_cache_gib=cfg.rollout.kv_cache_gib,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        cpu_linear=cfg.rollout.cpu_linear,
        log_level=cfg.rollout.log_level,
        cache_dir=None if cache_dir is None else str(cache_dir),
        record_routes=arch.is_moe,
    )


def prompt_files(cfg: Config, base_dir: Path) -> list[Path]:
    return [prompt_file(cfg) or base_dir / "train.jsonl"]


def verifier_name(cfg: Config) -> str:
    if cfg.data.reward != "auto":
        return cfg.data.reward
    return "digits" if task_name(cfg) is not None else "math"


@dataclasses.dataclass
class Trainable:
    """Model chunks wrapped in Megatron DDP with their distributed optimizer, and the
    layout (process groups) they were built in."""

    chunks: list
    optimizer: object
    peak_lr: float
    layout: ParallelContext

    def active(self):
        """A context in which Megatron works in this model's layout (its forward, backward,
        optimizer step and ``sharded_state_dict`` all read Megatron's current groups)."""
        return self.layout.active()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr


def build_trainable(
    role: str,
    arch: ModelArch,
    layout: ParallelContext,
    options: BuildOptions,
    lr: float,
    hf_dir: Optional[Path],
    clip_grad: float = 1.0,
) -> Trainable:
    """Build ``role``'s chunks in ``layout``, load the HF weights into them, wrap for training."""
    with layout.active():
        return Trainable(*_build_wrapped(role, arch, layout.config, options, lr, hf_dir, clip_grad), lr, layout)


def _build_wrapped(
    role: str,
    arch: ModelArch,
    parallel: ParallelConfig,
    options: BuildOptions,
    lr: float,
    hf_dir: Optional[Path],
    clip_grad: float,
):
    from megatron_rl.bridge import load_hf

    chunks = build_model(role, arch, parallel, options)
    if hf_dir is not None:  # the critic starts from the actor's backbone and a fresh value head
        load_hf(chunks, hf_dir, arch, backbone_only=role == "critic")
    return wrap_for_training(chunks, dtype=options.dtype, lr=lr, clip_grad=clip_grad)
