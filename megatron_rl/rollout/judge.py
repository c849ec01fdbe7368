"""The judge's engine: a vLLM engine in a worker process of its own, answering judge prompts.

Built by a :class:`~megatron_rl.rewards.timed_pool.TimedWorkerPool` worker (``init_args``),
so the trainer's processes hold no second engine and a judge that hangs or dies is killed
and replaced without touching them. Each prompt is the judge's user message, rendered by
the judge's own chat template (plain text when it has none), and answered greedily.
"""

from __future__ import annotations

from typing import Sequence

from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.types import EngineConfig, Sampling

TARGET = "megatron_rl.rollout.judge:JudgeWorker"
"""What the pool's workers build (``module:class``)."""


class JudgeWorker:
    """One judge engine; called with a list of prompts, returns one answer per prompt."""

    def __init__(
        self, model_dir: str, max_new_tokens: int, max_model_len: int, kv_cache_gib: float, gpu_memory: float, seed: int
    ):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = EngineConfig(
            max_model_len=max_model_len,
            seed=seed,
            cpu_kv_cache_gib=kv_cache_gib,
            gpu_memory_utilization=gpu_memory,
            adaptive_temperature=False,
        )
        self.engine = RolloutEngine(model_dir, config)
        stop = () if self.tokenizer.eos_token_id is None else (self.tokenizer.eos_token_id,)
        self.sampling = Sampling(n=1, max_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop, logprobs=False)
        self.max_prompt = max_model_len - max_new_tokens

    def prompt_ids(self, prompt: str) -> list[int]:
        """The judge prompt as the judge's user message (the tail kept when it is too long)."""
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = prompt
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return ids[-self.max_prompt :]

    def __call__(self, prompts: Sequence[str]) -> list[str]:
        groups = self.engine.generate([self.prompt_ids(p) for p in prompts], self.sampling)
        return [self.tokenizer.decode(group[0].token_ids, skip_special_tokens=True) for group in groups]
