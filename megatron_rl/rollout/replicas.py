"""Prompts dealt to the vLLM replicas of a world and their samples gathered back.

A world of W ranks with engine TP ``t`` holds W / t independent engines (replicas). Every
rank holds the same prompts; each replica generates a contiguous share, and one rank per
replica reports it, so every rank ends with the same samples in prompt order. The world is
the training ranks' when the engines are colocated and the rollout ranks' own when they
are disaggregated (:mod:`megatron_rl.rollout.remote`); the code is the same.
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from megatron_rl.data import PromptBatch
from megatron_rl.rollout.engine import RolloutEngine, Sample, Sampling
from megatron_rl.rollout.seeds import prompt_seeds

Generate = Callable[[PromptBatch, Sampling], list[list[Sample]]]
"""``sampling.n`` samples per prompt, in prompt order, the same on every rank that asks."""
Continue = Callable[[list[Sample], Sampling], list[Sample]]
"""Every unfinished sample extended by one more window, the same on every rank that asks."""


def generate_groups(engine: RolloutEngine, prompts: PromptBatch, sampling: Sampling) -> list[list[Sample]]:
    """``sampling.n`` samples per prompt of ``prompts``, the same list on every rank."""
    world = dist.get_world_size()
    per_replica = -(-len(prompts) // engine.num_replicas)
    mine = list(range(engine.replica * per_replica, min(len(prompts), (engine.replica + 1) * per_replica)))
    seeds = None
    if sampling.prompt_seed is not None:  # the same samples whichever replica draws them
        seeds = prompt_seeds(
            sampling.prompt_seed,
            [prompts.epochs[i] for i in mine],
            [prompts.dataset_indices[i] for i in mine],
            sampling.n,
        )
    local = engine.generate([prompts.prompt_ids[i] for i in mine], sampling, seeds) if mine else []
    leader = dist.get_rank() % engine.tp == 0  # one rank per replica reports its groups
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (mine, local) if leader else None)
    groups: list = [None] * len(prompts)
    for item in everyone:
        if item is None:
            continue
        for index, samples in zip(*item):
            groups[index] = samples
    return groups


def continue_samples(engine: RolloutEngine, samples: list[Sample], sampling: Sampling) -> list[Sample]:
    """Every sample extended by one more window (``engine.continue_``), the same list on every rank."""
    world = dist.get_world_size()
    per_replica = -(-len(samples) // engine.num_replicas)
    start = engine.replica * per_replica
    mine = samples[start : start + per_replica]
    local = engine.continue_(mine, sampling) if mine else []
    leader = dist.get_rank() % engine.tp == 0
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (start, local) if leader else None)
    result: list = [None] * len(samples)
    for item in everyone:
        if item is not None:
            result[item[0] : item[0] + len(item[1])] = item[1]
    return result
