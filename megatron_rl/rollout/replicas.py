"""The vLLM replicas of a world as one rollout backend: prompts dealt to them, samples gathered back.

A world of W ranks with engine TP ``t`` holds W / t independent engines (replicas). Every
rank holds the same prompts; each replica generates a contiguous share, and one rank per
replica reports it, so every rank ends with the same samples in prompt order. The world is
the training ranks' when the engines are colocated and the rollout ranks' own when they
are disaggregated (:mod:`megatron_rl.rollout.server`); the code is the same.

:class:`Replicas` wraps this rank's :class:`~megatron_rl.rollout.engine.RolloutEngine`,
which only generates what its own rank is given: the dealing and gathering live here, so
the engine never calls back up into them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.data import PromptBatch
from megatron_rl.rollout.seeds import prompt_seeds
from megatron_rl.rollout.types import EngineConfig, EvalSamples, OnGroup, Sample, Sampling

if TYPE_CHECKING:
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.weight_check import WeightCheckResult

Generate = Callable[..., list[list[Sample]]]
"""``(prompts, sampling, on_group=None)``: ``sampling.n`` samples per prompt, in prompt
order, the same on every rank that asks; ``on_group`` (rollout.types.OnGroup) hears of
this replica's groups as they finish."""
Continue = Callable[[list[Sample], Sampling], list[Sample]]
"""Every unfinished sample extended by one more window, the same on every rank that asks."""


def contiguous_share(count: int, parts: int, part: int) -> range:
    """The indices of part ``part`` when ``count`` items are dealt to ``parts`` in contiguous
    shares of equal size (the last ones shorter or empty)."""
    size = -(-count // parts)
    return range(min(count, part * size), min(count, (part + 1) * size))


class Replicas:
    """This rank's engine and its world's other replicas as one
    :class:`~megatron_rl.rollout.backend.RolloutBackend`: generation is dealt over the
    replicas and gathered back (collective over the world, the same result on every rank);
    the prompt logprobs and the weight calls go to this rank's engine, as every rank makes
    them alike."""

    config: EngineConfig

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self.config = engine.config
        self.tp, self.num_replicas, self.replica = engine.tp, engine.num_replicas, engine.replica

    # -- generation, dealt over the replicas --------------------------------------------

    def generate_groups(
        self, prompts: PromptBatch, sampling: Sampling, on_group: Optional[OnGroup] = None
    ) -> list[list[Sample]]:
        """``sampling.n`` samples per prompt of ``prompts``, the same list on every rank.
        ``on_group`` hears of each group this rank's replica generates (by its index in
        ``prompts``) as it finishes; give it on every rank or none, so the ranks of one
        engine drive it alike."""
        mine = self.share(len(prompts))
        seeds = None
        if sampling.prompt_seed is not None:  # the same samples whichever replica draws them
            seeds = prompt_seeds(
                sampling.prompt_seed,
                [prompts.epochs[i] for i in mine],
                [prompts.dataset_indices[i] for i in mine],
                sampling.n,
            )
        streamed = None if on_group is None else lambda k, samples: on_group(mine[k], samples)
        local = (
            self.engine.generate([prompts.prompt_ids[i] for i in mine], sampling, seeds, on_group=streamed)
            if mine
            else []
        )
        return self.gather(len(prompts), mine, local)

    def generate_eval(
        self, prompt_ids: Sequence[Sequence[int]], sampling: Sampling, seeds: Sequence[int]
    ) -> EvalSamples:
        """``sampling.n`` samples per prompt, prompt i's seeded from ``seeds[i]`` (so whichever
        replica draws them), the same on every rank; leaves the rollouts as they were: every
        random generator of the process is put back afterwards (vLLM's CPU sampler draws from
        torch's global one even for seeded requests), and the prefix cache is dropped, as after
        a weight sync, so the next rollout finds the cache it would have found without this."""
        from megatron_rl.checkpoint import rng

        if len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
        mine = self.share(len(prompt_ids))
        saved = rng.capture()
        try:
            local = (
                self.engine.generate([list(prompt_ids[i]) for i in mine], sampling, [seeds[i] for i in mine])
                if mine
                else []
            )
        finally:
            rng.restore(saved)
            self.engine.drop_prefix_cache()
        return EvalSamples(self.gather(len(prompt_ids), mine, local))

    def continue_samples(self, samples: list[Sample], sampling: Sampling) -> list[Sample]:
        """Every sample extended by one more window (``engine.continue_``), the same list on every rank."""
        mine = self.share(len(samples))
        local = self.engine.continue_([samples[i] for i in mine], sampling) if mine else []
        return self.gather(len(samples), mine, local)

    # -- this rank's engine ---------------------------------------------------------------

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return self.engine.prompt_logprobs(sequences)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        return self.engine.load_weights(named_tensors)

    def check_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightCheckResult:
        return self.engine.check_weights(named_tensors)

    def load_adapter(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
        self.engine.load_adapter(tensors, peft_config)

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()

    def close(self) -> None:
        self.engine.close()

    # -- dealing and gathering ------------------------------------------------------------

    def share(self, count: int) -> list[int]:
        """The items of ``count`` this rank's replica works on."""
        return list(contiguous_share(count, self.num_replicas, self.replica))

    def gather(self, count: int, mine: list[int], local: list) -> list:
        """Every replica's results (``local[k]`` for item ``mine[k]``; one rank per replica
        reports them), in item order on every rank."""
        leader = dist.get_rank() % self.tp == 0
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, local) if leader else None)
        results: list = [None] * count
        for item in everyone:
            if item is None:
                continue
            for index, result in zip(*item):
                results[index] = result
        return results
