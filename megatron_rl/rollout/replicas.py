"""Prompts dealt to the vLLM replicas of a world and their samples gathered back.

A world of W ranks with engine TP ``t`` holds W / t independent engines (replicas). Every
rank holds the same prompts; each replica generates a contiguous share, and one rank per
replica reports it, so every rank ends with the same samples in prompt order. The world is
the training ranks' when the engines are colocated and the rollout ranks' own when they
are disaggregated (:mod:`megatron_rl.rollout.remote`); the code is the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch.distributed as dist

from megatron_rl.data import PromptBatch
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.seeds import prompt_seeds
from megatron_rl.rollout.types import Sample, Sampling

if TYPE_CHECKING:
    from megatron_rl.environments.driver import DriverTimes, EpisodeDriver
    from megatron_rl.environments.episode import EpisodeResult
    from megatron_rl.environments.interface import EpisodeRecord

Generate = Callable[[PromptBatch, Sampling], list[list[Sample]]]
"""``sampling.n`` samples per prompt, in prompt order, the same on every rank that asks."""
Continue = Callable[[list[Sample], Sampling], list[Sample]]
"""Every unfinished sample extended by one more window, the same on every rank that asks."""


def generate_groups(engine: RolloutEngine, prompts: PromptBatch, sampling: Sampling) -> list[list[Sample]]:
    """``sampling.n`` samples per prompt of ``prompts``, the same list on every rank."""
    mine = _share(engine, len(prompts))
    seeds = None
    if sampling.prompt_seed is not None:  # the same samples whichever replica draws them
        seeds = prompt_seeds(
            sampling.prompt_seed,
            [prompts.epochs[i] for i in mine],
            [prompts.dataset_indices[i] for i in mine],
            sampling.n,
        )
    local = engine.generate([prompts.prompt_ids[i] for i in mine], sampling, seeds) if mine else []
    return gather_in_order(engine, len(prompts), mine, local)


def generate_eval(
    engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], sampling: Sampling, seeds: Sequence[int]
) -> list[list[Sample]]:
    """``sampling.n`` samples per prompt, prompt i's seeded from ``seeds[i]`` (so whichever
    replica draws them), the same list on every rank; leaves the rollouts as they were: every
    random generator of the process is put back afterwards (vLLM's CPU sampler draws from
    torch's global one even for seeded requests), and the prefix cache is dropped, as after a
    weight sync, so the next rollout finds the cache it would have found without this."""
    from megatron_rl.checkpoint import rng

    if len(seeds) != len(prompt_ids):
        raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts")
    mine = _share(engine, len(prompt_ids))
    saved = rng.capture()
    try:
        local = engine.generate([list(prompt_ids[i]) for i in mine], sampling, [seeds[i] for i in mine]) if mine else []
    finally:
        rng.restore(saved)
        engine.drop_prefix_cache()
    return gather_in_order(engine, len(prompt_ids), mine, local)


def contiguous_share(count: int, parts: int, part: int) -> range:
    """The indices of part ``part`` when ``count`` items are dealt to ``parts`` in contiguous
    shares of equal size (the last ones shorter or empty)."""
    size = -(-count // parts)
    return range(min(count, part * size), min(count, (part + 1) * size))


def _share(engine: RolloutEngine, count: int) -> list[int]:
    """The items of ``count`` this rank's replica works on."""
    return list(contiguous_share(count, engine.num_replicas, engine.replica))


def gather_in_order(engine: RolloutEngine, count: int, mine: list[int], local: list) -> list:
    """Every replica's results (``local[k]`` for item ``mine[k]``; one rank per replica
    reports them), in item order on every rank."""
    leader = dist.get_rank() % engine.tp == 0
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, local) if leader else None)
    results: list = [None] * count
    for item in everyone:
        if item is None:
            continue
        for index, result in zip(*item):
            results[index] = result
    return results


def run_episodes(
    engine: RolloutEngine,
    driver: EpisodeDriver,
    records: Sequence[EpisodeRecord],
    seeds: Optional[Sequence[int]],
    version: int,
) -> tuple[list[EpisodeResult], DriverTimes]:
    """Multi-turn episodes, one per record, each replica running a contiguous share on its
    own driver (its tools on its own rank); the results in record order and the drivers'
    times summed, the same on every rank. Seeded episodes (``seeds``) are the same
    whichever replica runs them. Replicas must be single ranks (engine TP 1): a replica's
    ranks would each run the tools and could see different answers."""
    from megatron_rl.environments.driver import DriverTimes

    if engine.tp != 1:
        raise ValueError(f"episodes run on replicas of one rank each, not engine TP {engine.tp}")
    mine = _share(engine, len(records))
    my_seeds = None if seeds is None else [seeds[i] for i in mine]
    local = driver.run([records[i] for i in mine], policy_version=version, seeds=my_seeds)
    times = driver.times
    if engine.num_replicas == 1:
        return local, times
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, times)
    return gather_in_order(engine, len(records), mine, local), DriverTimes.total(everyone)


def continue_samples(engine: RolloutEngine, samples: list[Sample], sampling: Sampling) -> list[Sample]:
    """Every sample extended by one more window (``engine.continue_``), the same list on every rank."""
    mine = _share(engine, len(samples))
    local = engine.continue_([samples[i] for i in mine], sampling) if mine else []
    return gather_in_order(engine, len(samples), mine, local)
