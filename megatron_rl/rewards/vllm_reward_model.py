"""A reward model exported by ``megatron-rl convert megatron-to-hf`` served by vLLM: one raw
scalar per token sequence.

vLLM loads ``<Family>ForSequenceClassification`` as its ``<Family>ForCausalLM`` with the
sequence-classification adapter (``as_seq_cls_model``: a bias-free ``score`` layer, read at
each sequence's last token): the same score as transformers' and Megatron's last-token
reward. Two of vLLM's defaults would change it, so both are pinned: the pooling (``LAST``,
vLLM's default for decoders, pinned against a config that names another) and the activation
(a sigmoid for one label unless the config's ``problem_type`` is ``regression``, which the
export writes; ``use_activation=False`` holds for any directory).

vLLM keeps process-wide state: build one per process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, Union

from megatron_rl.rollout import vllm_env

DEFAULTS = dict(dtype="float32", enforce_eager=True, max_model_len=1024)
"""Engine options a reward model is served with unless the caller names others."""


class VllmRewardModel:
    """A one-label sequence classifier in an in-process vLLM pooling engine.

    ``engine_options`` go to ``vllm.LLM`` over :data:`DEFAULTS`; ``log_level`` is vLLM's
    (megatron_rl.rollout.vllm_env); ``kv_cache_gib`` the KV cache on CPU. The directory
    needs its tokenizer: vLLM's pooling entrypoint builds its scoring input processor from
    it at start, even for token ids.
    """

    def __init__(self, hf_dir: Union[str, os.PathLike], kv_cache_gib: float = 1.0, **engine_options):
        vllm_env.prepare_environment(None, kv_cache_gib, None, engine_options.pop("log_level", "warning"))
        from vllm import LLM
        from vllm.config import PoolerConfig

        options = {**DEFAULTS, **engine_options}
        self.llm = LLM(
            model=str(Path(hf_dir)),
            runner="pooling",
            pooler_config=PoolerConfig(seq_pooling_type="LAST", use_activation=False),
            **options,
        )

    def score(self, token_id_lists: Sequence[Sequence[int]]) -> list[float]:
        """The raw score of each sequence (the score head at its last token), in order."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in token_id_lists]
        outputs = self.llm.classify(prompts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        scores = []
        for out in outputs:
            values = out.outputs.probs
            if len(values) != 1:
                raise ValueError(f"a reward model has one label; this model gives {len(values)} values per sequence")
            scores.append(float(values[0]))
        return scores

    def close(self) -> None:
        """Drop the engine; the process's exit frees what vLLM keeps process-wide."""
        self.llm = None


WORKER = "megatron_rl.rewards.vllm_reward_model:RewardModelWorker"
"""What a served model scorer's pool workers build (rewards.timed_pool, ``module:class``)."""


class RewardModelWorker:
    """A pool worker's reward model: called with a list of token id lists, returns their scores."""

    def __init__(self, hf_dir: str, max_model_len: int, kv_cache_gib: float, gpu_memory: float, seed: int):
        self.model = VllmRewardModel(
            hf_dir, kv_cache_gib, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory, seed=seed
        )

    def __call__(self, token_id_lists: Sequence[Sequence[int]]) -> list[float]:
        return self.model.score(token_id_lists)
