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

from megatron_rl import platform
from megatron_rl.config import Config, ConfigError
from megatron_rl.models.builder import BuildOptions, build_model
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.config import ParallelConfig
from megatron_rl.parallel.state import ParallelContext

TASK_PREFIX = "task:"


def task_name(cfg: Config) -> Optional[str]:
    source = cfg.data.source
    return source[len(TASK_PREFIX):] if source.startswith(TASK_PREFIX) else None


def base_model_dir(cfg: Config, rank: int) -> Path:
    """The HF directory the actor starts from (built for ``task:`` data without hf_path)."""
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path)
    name = task_name(cfg)
    if name is None:
        raise ConfigError("model.hf_path must be set when data.source is a file (no built-in base for it)")
    from megatron_rl.tasks.base_model import BaseModelSettings, make_tiny_base

    settings = BaseModelSettings(task=name, family="qwen3_moe" if cfg.model.preset == "tiny-moe" else "qwen3",
                                 seed=cfg.trainer.seed)
    directory = Path(cfg.trainer.run_dir) / "base_model"
    if rank == 0:
        make_tiny_base(directory, settings)
    torch.distributed.barrier()
    return directory


def prompt_files(cfg: Config, base_dir: Path) -> list[Path]:
    name = task_name(cfg)
    return [base_dir / "train.jsonl"] if name is not None else [Path(cfg.data.source)]


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


def build_trainable(role: str, arch: ModelArch, layout: ParallelContext, options: BuildOptions,
                    lr: float, hf_dir: Optional[Path], clip_grad: float = 1.0) -> Trainable:
    """Build ``role``'s chunks in ``layout``, load the HF weights into them, wrap for training."""
    with layout.active():
        return Trainable(*_build_wrapped(role, arch, layout.config, options, lr, hf_dir, clip_grad), lr, layout)


def _build_wrapped(role: str, arch: ModelArch, parallel: ParallelConfig, options: BuildOptions,
                   lr: float, hf_dir: Optional[Path], clip_grad: float):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.bridge import load_hf

    chunks = build_model(role, arch, parallel, options)
    if hf_dir is not None:  # the critic starts from the actor's backbone and a fresh value head
        load_hf(chunks, hf_dir, arch, backbone_only=role == "critic")
    config = chunks[0].config
    with platform.megatron_scope():
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False)
        chunks = [DistributedDataParallel(config, ddp, c) for c in chunks]
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, bf16=options.dtype == "bf16", use_distributed_optimizer=True,
                            clip_grad=clip_grad, weight_decay=0.0, adam_beta2=0.999),
            chunks,
        )
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, optimizer
