"""What a run needs before its first step: the base model on disk, the trainable actor,
the prompt data and the reward function.

The embedded default has no model hub to start from, so ``task:<name>`` data builds (or
reuses, by content hash) the task's tiny supervised base with megatron_rl.tasks.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.bridge import load_hf
from megatron_rl.bridge.load import VALUE_HEAD_PREFIX
from megatron_rl.bridge.lora_export import hf_modules
from megatron_rl.checkpoint import Checkpointer
from megatron_rl.config import Config
from megatron_rl.data import PromptDataset, PromptFields
from megatron_rl.data.reasoning_gym import GymPrompts
from megatron_rl.from_config.sources import TASK_TEACHER, base_settings, gym_spec, prompt_file, teacher_settings
from megatron_rl.models.builder import BuildOptions, build_model, wrap_for_training
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.models.lora import LoraSettings, add_adapters
from megatron_rl.models.value_head import freeze_bias
from megatron_rl.parallel.config import ParallelConfig
from megatron_rl.parallel.state import ParallelContext
from megatron_rl.rollout.types import EngineConfig
from megatron_rl.tasks import base_model
from megatron_rl.tasks.base_model import BASE_CACHE_ENV
from megatron_rl.utils import dtypes


def base_model_path(cfg: Config, cache: Optional[str]) -> Path:
    """Where the run's starting HF directory is: model.hf_path, or the task base of
    from_config.sources.base_settings in the run dir, or, given a base cache, under the
    settings' hash there, where runs with the same settings share one build."""
    settings = base_settings(cfg)
    if settings is None:
        return Path(cfg.model.hf_path)
    return Path(cache) / settings.content_hash() if cache else Path(cfg.trainer.run_dir) / "base_model"


def base_model_dir(cfg: Config, rank: int) -> Path:
    """The HF directory the actor starts from (:func:`base_model_path`, the cache named by
    ``MEGATRON_RL_BASE_CACHE``), a task base built there first (the settings validation
    checked the layouts against)."""
    directory = base_model_path(cfg, os.environ.get(BASE_CACHE_ENV))
    settings = base_settings(cfg)
    if settings is None:
        return directory
    if rank == 0:
        base_model.make_tiny_base(directory, settings)
    torch.distributed.barrier()
    return directory


def teacher_model_dir(cfg: Config, rank: int) -> Path:
    """algorithm.teacher's HF directory; for ``path: task`` the task's teacher, built (rank 0)
    in the base cache or the run directory first, as the student's base is."""
    path = cfg.algorithm.teacher.path
    if path != TASK_TEACHER:
        return Path(path)
    settings = teacher_settings(cfg)
    cache = os.environ.get(BASE_CACHE_ENV)
    directory = Path(cache) / settings.content_hash() if cache else Path(cfg.trainer.run_dir) / "teacher_model"
    if rank == 0:
        base_model.make_tiny_base(directory, settings)
    torch.distributed.barrier()
    return directory


def build_options(cfg: Config) -> BuildOptions:
    """How the run's models are built (dtype and the MoE and recompute knobs of ``model``).
    LoRA adapts Megatron's local linears (models.lora): with ``model.lora`` the layers are the
    local spec's even where Transformer Engine is installed, and experts that get adapters
    run as SequentialMLP (the grouped experts bypass their linears)."""
    lora = cfg.model.lora
    return BuildOptions(
        dtype=cfg.model.dtype,
        moe_token_dispatcher_type=cfg.model.moe_token_dispatcher_type,
        moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
        recompute_activations=cfg.model.recompute_activations,
        attention="sdpa" if lora is not None else "auto",
        experts="sequential" if lora is not None and "experts" in lora.targets else "auto",
    )


def engine_config(cfg: Config, arch: ModelArch, cache_dir: Optional[Path], lora_slot: bool = False):
    """The colocated vLLM engines' settings (the trainer's, and `megatron-rl eval`'s, which
    must sample as the run's eval phase did); ``lora_slot``: with a LoRA slot of
    ``model.lora.rank`` (the trainer's engines when the adapters sync alone)."""
    return EngineConfig(
        lora_rank=cfg.model.lora.rank if lora_slot else 0,
        lora_modules=hf_modules(arch, cfg.model.lora.targets) if lora_slot else (),
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


def prompt_dataset(cfg: Config, base_dir: Path, tokenizer):
    """The training prompts: generated by reasoning-gym for ``reasoning_gym:<dataset>`` data,
    else read from the prompt files."""
    spec = gym_spec(cfg)
    if spec is not None:
        return GymPrompts(spec, tokenizer)
    fields = PromptFields(prompt=cfg.data.prompt_key, answer=cfg.data.answer_key)
    return PromptDataset(prompt_files(cfg, base_dir), tokenizer, fields=fields)


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
    freeze_head_bias: bool = False,
    lora=None,
    start=None,
) -> Trainable:
    """Build ``role``'s chunks in ``layout``, load the HF weights into them, wrap for training.
    ``freeze_head_bias``: a critic's value-head bias is not trained (a reward model's,
    models.value_head.freeze_bias). ``lora`` (models.lora.LoraSettings): the loaded weights
    frozen and adapters added, before the wrap, so DDP and the optimizer hold adapters only.
    ``start`` (from_config.start_checks.StartCheckpoint): then that checkpoint's weights
    (a critic's backbone), also before the wrap, whose optimizer copies them."""
    with layout.active():
        wrapped = _build_wrapped(
            role, arch, layout.config, options, lr, hf_dir, clip_grad, freeze_head_bias, lora, start
        )
        return Trainable(*wrapped, lr, layout)


def load_start_weights(chunks, start, role: str = "actor") -> None:
    """``start``'s model weights into ``chunks`` (any saved layout; no optimizer state, no RNG);
    a critic takes the backbone: its value head has no counterpart in a policy's checkpoint."""
    backbone = (lambda name: not name.startswith(VALUE_HEAD_PREFIX)) if role == "critic" else None
    with Checkpointer() as checkpointer:
        checkpointer.load(start.root, model=chunks, step=start.step, restore_rng=False, only=backbone)


def syncs_adapters(cfg: Config) -> bool:
    """Whether the actor's LoRA adapters sync alone into vLLM's LoRA slot (``model.lora.sync``)."""
    return cfg.model.lora is not None and cfg.model.lora.sync == "adapter"


def lora_settings(cfg: Config):
    """models.lora.LoraSettings of ``model.lora`` (None: full training)."""
    if cfg.model.lora is None:
        return None
    lora = cfg.model.lora
    return LoraSettings(
        rank=lora.rank,
        alpha=float(lora.alpha),
        dropout=float(lora.dropout),
        targets=tuple(lora.targets),
        seed=cfg.trainer.seed,
    )


def _build_wrapped(
    role: str,
    arch: ModelArch,
    parallel: ParallelConfig,
    options: BuildOptions,
    lr: float,
    hf_dir: Optional[Path],
    clip_grad: float,
    freeze_head_bias: bool = False,
    lora=None,
    start=None,
):
    chunks = build_model(role, arch, parallel, options)
    if hf_dir is not None:  # the critic starts from the actor's backbone and a fresh value head
        load_hf(chunks, hf_dir, arch, backbone_only=role == "critic")
    if start is not None:
        load_start_weights(chunks, start, role)
    if freeze_head_bias:
        freeze_bias(chunks)
    if lora is not None:  # a critic's value head is new: it trains in full beside the adapters
        add_adapters(chunks, lora, keep_training=(VALUE_HEAD_PREFIX,) if role == "critic" else ())
    return wrap_for_training(chunks, dtype=options.dtype, lr=lr, clip_grad=clip_grad)
