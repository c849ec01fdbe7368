"""What a rollout engine is built with, what a generation asks for and what it answers.

Plain values, apart from vLLM (nothing here imports it): the trainer, the rollout ranks'
commands and the layers above rollout (episodes, evaluation) use them without loading an
engine. :class:`~megatron_rl.rollout.engine.RolloutEngine` builds vLLM from an
:class:`EngineConfig` and turns a :class:`Sampling` into vLLM's own parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from megatron_rl.algorithms.hapo import EntropyStats
from megatron_rl.platform import vllm_compat
from megatron_rl.utils import dtypes

LORA_SLOT_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The LoRA ranks a vLLM 0.32 engine can be built for (``vllm.config.lora.MaxLoRARanks``); a
slot holds any adapter of that rank or less."""


def lora_slot_rank(rank: int) -> int:
    """The smallest LoRA slot rank vLLM offers that holds an adapter of ``rank``."""
    return next(slot for slot in LORA_SLOT_RANKS if slot >= rank)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine is built (independent of the training layout)."""

    tensor_parallel_size: int = 1
    dtype: str = "float32"
    """float32 | bfloat16 | float16."""
    max_model_len: int = 1024
    seed: int = 0
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory for weights + KV cache (GPU only; training holds the rest)."""
    cpu_kv_cache_gib: float = 1.0
    """KV cache size on CPU."""
    threads: Optional[int] = None
    """torch threads per rank on CPU, set before vLLM freezes them (None: leave as is)."""
    cache_dir: Optional[str] = None
    """Compile caches (vLLM, inductor); e.g. inside the run dir."""
    load_tokenizer: bool = True
    """False: token ids only (stop strings and text prompts are then unavailable)."""
    adaptive_temperature: bool = True
    """Register HAPO's adaptive-temperature logits processor (a no-op for requests whose
    Sampling has no entropy_stats); False leaves vLLM's sampler exactly as shipped."""
    record_routes: bool = False
    """MoE: record the experts vLLM's routers chose for every token of every sample
    (``Sample.routes``, :mod:`megatron_rl.rollout.routes`); needs eager mode."""
    log_level: str = "warning"
    """vLLM's own logging: debug | info | warning | error (set through VLLM_LOGGING_LEVEL)."""
    cpu_linear: str = "packed"
    """CPU only: ``packed`` keeps vLLM's kernel-format linear weights (oneDNN: fastest
    decode, but each weight sync re-packs every weight, 5-28x the cost of copying it);
    ``plain`` keeps plain weights used through torch's linear, so a sync is a copy into
    them (decode GEMMs slower at small batches; docs/benchmarks.md has both)."""
    lora_rank: int = 0
    """> 0: the engine keeps one LoRA slot of this rank (vLLM's LoRA support, rounded up to a
    rank vLLM offers), which :meth:`~megatron_rl.rollout.engine.RolloutEngine.load_adapter`
    fills and every request then goes through; 0: none."""
    lora_modules: tuple[str, ...] = ()
    """The HF modules the slot's adapters adapt (``q_proj``, ``down_proj``, ...): vLLM wraps
    only these with its LoRA layers (empty: every module it can, the LM head included, whose
    LoRA logits fail on vLLM 0.32's CPU backend for prompt logprobs)."""

    def validate(self, world_size: int) -> None:
        if self.tensor_parallel_size < 1 or world_size % self.tensor_parallel_size:
            raise ValueError(
                f"rollout tensor_parallel_size={self.tensor_parallel_size} must divide the world size {world_size}"
            )
        if not (float(self.cpu_kv_cache_gib).is_integer() and self.cpu_kv_cache_gib >= 1):
            raise ValueError(
                f"rollout cpu_kv_cache_gib={self.cpu_kv_cache_gib}: vLLM's CPU backend takes whole GiB (>= 1)"
            )
        if self.dtype not in dtypes.LONG_NAMES:
            raise ValueError(f"rollout dtype={self.dtype!r}; allowed: {', '.join(dtypes.LONG_NAMES)}")
        if self.record_routes and not self.enforce_eager:
            raise ValueError("rollout record_routes needs enforce_eager=True (a CUDA graph skips the route capture)")
        if not 0 <= self.lora_rank <= LORA_SLOT_RANKS[-1]:
            raise ValueError(f"rollout lora_rank={self.lora_rank}: vLLM serves LoRA ranks up to {LORA_SLOT_RANKS[-1]}")
        if self.cpu_linear not in vllm_compat.CPU_LINEAR_FORMATS:
            raise ValueError(
                f"rollout cpu_linear={self.cpu_linear!r}; allowed: {', '.join(vllm_compat.CPU_LINEAR_FORMATS)}"
            )


@dataclasses.dataclass
class Sample:
    """One response to one prompt."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each response token under the sampling distribution (after temperature)."""
    finish_reason: str
    """"stop" (EOS or a stop sequence), "length" (the response budget is used up) or
    "window" (the per-call window ended first: continue it with :meth:`continue_`)."""
    routes: Optional[torch.Tensor] = None
    """MoE with ``EngineConfig.record_routes``: [P + R - 1, layers, top_k] int16, the experts
    each layer routed the token at each input position to (-1: not computed by vLLM, e.g.
    a prefix-cache hit; dense layers)."""
    versions: Optional[list[int]] = None
    """Partial rollouts: the policy version (weight updates) that sampled each response
    token (:mod:`megatron_rl.rollout.partial`); None: every token of one version, the one
    the generation ran under."""

    sampled: Optional[list[bool]] = None
    """Multi-turn episodes: per response token, whether the policy sampled it (True) or the
    environment appended it (False: tool output and its chat framing, never trained on);
    None: every response token was sampled."""

    @property
    def finished(self) -> bool:
        return self.finish_reason != "window"


OnGroup = Callable[[int, list[Sample]], None]
"""Told a prompt's index and its samples as soon as all of them have finished, while the
rest of the batch still generates (what overlaps scoring with generation)."""


@dataclasses.dataclass(frozen=True)
class EvalSamples:
    """What an eval generation answers (:meth:`~megatron_rl.rollout.backend.RolloutBackend.generate_eval`)."""

    groups: list[list[Sample]]
    """``sampling.n`` samples per prompt, in prompt order."""
    policy_version: Optional[int] = None
    """Rollout ranks of their own: the weight updates they had loaded when they drew these
    samples (the client's count); None: the engines
    colocated with training, which serve the weights the training ranks hold."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """Sampling settings of one generate call."""

    n: int = 1
    max_tokens: int = 64
    """Response budget (total over all windows)."""
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = True
    window: Optional[int] = None
    """At most this many new tokens per call (T-PPO); None: the whole budget at once."""
    temperature_tau: float = 0.0
    """HAPO adaptive temperature: token t is sampled at T·(1 + τ·ĥ_t), ĥ_t from the entropy
    of softmax(logits / T) under `entropy_stats`. Needs EngineConfig.adaptive_temperature."""
    entropy_stats: Optional[EntropyStats] = None
    """The previous training step's ĥ statistics (floats); None (first step) or τ = 0: plain T."""
    prompt_seed: Optional[int] = None
    """Run seed of per-prompt seeding (`rollout.seeds`); None: the engine's own generator."""

    @property
    def adaptive(self) -> bool:
        return self.entropy_stats is not None and self.temperature_tau > 0
