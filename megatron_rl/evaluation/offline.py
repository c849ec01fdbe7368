"""The eval phase outside a run (`megatron-rl eval`): the weights of a checkpoint step or an
HF directory in the colocated vLLM engines a run would have, then the run's Evaluator.

A checkpoint goes the way training's weights go: the actor is built in the config's
``parallel`` layout, the step loaded into it (any saved layout reshards), and its weights
synced into engines started from the HF directory the run started from. The engines get the
trainer's settings (from_config.setup.engine_config) and every sample its eval seed, so the
numbers are the ones the run's eval phase logged for the same weights.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.checkpoint.format import resolve_step
from megatron_rl.config import Config
from megatron_rl.evaluation.cli import Target
from megatron_rl.evaluation.phase import Evaluator, eval_sampling
from megatron_rl.evaluation.sets import eval_rewards, load_sets
from megatron_rl.from_config import setup
from megatron_rl.from_config.adapter_checks import check_adapter_base
from megatron_rl.models.hf_config import ModelArch, arch_from_hf


@dataclasses.dataclass(frozen=True)
class EvalResult:
    metrics: dict[str, float]
    """val/<set>/... of every set, and timing/eval_s."""
    sizes: dict[str, tuple[int, int]]
    """Set -> (prompts, samples)."""
    reports: bool
    """Whether this rank reports (rank 0)."""


def evaluate_target(cfg: Config, target: Target, records: Optional[Path]) -> EvalResult:
    """Collective: evaluate ``target`` on ``cfg.eval``'s sets; ``records``: where rank 0
    writes the per-prompt lines (None: nowhere)."""
    from transformers import AutoTokenizer

    from megatron_rl.rewards import build_verifier
    from megatron_rl.rollout import RolloutEngine
    from megatron_rl.rollout.replicas import Replicas

    platform.init_distributed(cfg.trainer.dist_timeout_s)
    torch.manual_seed(cfg.trainer.seed)
    rank = dist.get_rank()
    arch = arch_from_hf(target.base_dir)
    if target.ckpt_root is not None:
        step = resolve_step(Path(target.ckpt_root), target.step)
        check_adapter_base(target.ckpt_root, step, cfg.model.lora, target.base_dir)
    actor = _load_actor(cfg, arch, target) if target.ckpt_root is not None else None
    tokenizer = AutoTokenizer.from_pretrained(target.base_dir)
    training = setup.prompt_dataset(cfg, target.base_dir, tokenizer)  # the sets stay apart from it, as in the run
    sets = load_sets(cfg, target.base_dir, tokenizer, (r.prompt_ids for r in training.records))
    with tempfile.TemporaryDirectory(prefix="megatron-rl-eval-cache-") as cache:
        engine = Replicas(RolloutEngine(target.base_dir, setup.engine_config(cfg, arch, Path(cache))))
        if actor is not None:
            from megatron_rl.rollout.adapter_sync import PolicySync
            from megatron_rl.rollout.sync import WeightSync

            # a LoRA checkpoint's adapters merged in: this engine has no LoRA slot
            PolicySync(WeightSync(actor, arch, engine, bucket_bytes=int(cfg.rollout.bucket_mb * (1 << 20)))).sync()
            del actor
        verifiers = {name: build_verifier(name) for name in eval_rewards(cfg)}
        try:
            evaluator = Evaluator(
                cfg.eval,
                sets,
                engine,
                {name: v.score_batch for name, v in verifiers.items()},
                functools.partial(tokenizer.decode, skip_special_tokens=True),
                eval_sampling(cfg, tokenizer.eos_token_id),
                records.parent if records is not None else Path("."),
                write=rank == 0 and records is not None,
                records_name=records.name if records is not None else None,
            )
            metrics = evaluator.evaluate(target.step or 0)
        finally:
            for verifier in verifiers.values():
                verifier.close()
    sizes = {s.name: (len(s), len(s) * cfg.eval.n_samples) for s in sets}
    return EvalResult(metrics, sizes, reports=rank == 0)


def _load_actor(cfg: Config, arch: ModelArch, target: Target) -> list[torch.nn.Module]:
    """The actor's chunks in the config's layout, holding the checkpoint step's weights (no
    optimizer: its state is not needed to generate)."""
    from megatron_rl.bridge import load_hf
    from megatron_rl.checkpoint import Checkpointer
    from megatron_rl.models.builder import build_model
    from megatron_rl.models.lora import add_adapters
    from megatron_rl.parallel import initialize

    layout = initialize(cfg.parallel, seed=cfg.trainer.seed, model=arch.shape(), timeout_s=cfg.trainer.dist_timeout_s)
    with layout.active():
        chunks = build_model("actor", arch, cfg.parallel, setup.build_options(cfg))
        lora = setup.lora_settings(cfg)
        if lora is not None:  # a LoRA run's checkpoint holds its adapters; the base is the run's
            load_hf(chunks, target.base_dir, arch)
            add_adapters(chunks, lora)
        with Checkpointer() as checkpointer, warnings.catch_warnings():
            # a step saved in another layout warns that its RNG states are not restored: no
            # eval sample draws from them (each has its own seed)
            warnings.filterwarnings("ignore", message="checkpoint layout .* RNG states not restored")
            checkpointer.load(target.ckpt_root, model=chunks, step=target.step, trainable_only=lora is not None)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks
