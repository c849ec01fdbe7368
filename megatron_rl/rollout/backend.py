"""What the trainer uses of vLLM, whichever side of the launch runs it.

Two implementations: :class:`megatron_rl.rollout.replicas.Replicas`, the engines colocated
with training (one per rank, a batch dealt over the replicas), and
:class:`megatron_rl.rollout.client.RolloutClient`, the training ranks' handle on engines of
rollout ranks of their own. Every method is collective over the training world, and
returns the same value on every training rank (``load_weights`` excepted: it reports the
path that rank took).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from megatron_rl.data import PromptBatch
    from megatron_rl.rollout.types import EngineConfig, EvalSamples, Sample, Sampling
    from megatron_rl.rollout.weight_check import WeightCheckResult


@runtime_checkable
class RolloutBackend(Protocol):
    """Generation, the weight sync's loads and the parity guard's reads, on vLLM."""

    config: EngineConfig
    """The engines' configuration (dtype, TP, sequence length)."""

    def generate_groups(self, prompts: PromptBatch, sampling: Sampling, on_group=None) -> list[list[Sample]]:
        """``sampling.n`` samples per prompt, one group per prompt in prompt order;
        ``on_group`` (rollout.types.OnGroup), where the backend can, hears of each group as
        it finishes."""
        ...

    def generate_eval(
        self, prompt_ids: Sequence[Sequence[int]], sampling: Sampling, seeds: Sequence[int]
    ) -> EvalSamples:
        """Held-out evaluation: prompt i's samples seeded from ``seeds[i]``, in prompt order,
        leaving what training draws as it was; stamped with the policy version that drew them
        where the engines are not the training ranks' own."""
        ...

    def continue_samples(self, samples: list[Sample], sampling: Sampling) -> list[Sample]:
        """Every unfinished sample extended by one more window (T-PPO); finished ones as they are."""
        ...

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """The logprob of every token after the first under the current weights (T = 1)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load one bucket of HF-named full tensors (whole decoder layers); the path taken."""
        ...

    def check_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightCheckResult:
        """What the engines serve for a loaded bucket, read back and compared with it exactly."""
        ...

    def load_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
        """Serve a LoRA adapter (whole tensors by PEFT key, its adapter_config.json) over the
        base the engines hold, for every request from now on (engines built with a LoRA slot)."""
        ...

    def finish_weight_update(self) -> None:
        """The last bucket is loaded: from now on, generation samples the new weights."""
        ...

    def close(self) -> None:
        """Release the engines' side of the launch (nothing to do for colocated engines)."""
        ...
