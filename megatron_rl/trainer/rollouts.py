"""One step's rollouts: prompts -> groups of responses -> rewards -> the kept groups.

Every rank holds the same prompt batch. Groups are dealt to the vLLM replicas (each
replica = one engine, possibly TP-split over several ranks), generated there, and
gathered back so every rank sees the same list of samples in group order. Rewards,
overlong shaping and DAPO's dynamic sampling (drop groups whose rewards are all equal,
refill from new prompts, up to max_gen_batches) are then computed identically on every
rank, so no further communication is needed to agree on the training batch.

T-PPO (``generation_window``) runs :func:`windowed_rollouts` instead: the unfinished
responses of the window pool are continued (dealt to the replicas and gathered back the
same way), new prompts fill the free rows, and only responses that finished are scored.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
import torch.distributed as dist

from megatron_rl.algorithms import dynamic_sampling_keep, overlong_penalty
from megatron_rl.algorithms.recipes import AlgorithmRecipe
from megatron_rl.data import PromptBatch
from megatron_rl.rollout import RolloutEngine, Sample, Sampling
from megatron_rl.rollout.seeds import prompt_seeds
from megatron_rl.trainer.windows import StepCounts, WindowPool, WindowSample


@dataclasses.dataclass
class Group:
    """G responses to one prompt, scored."""

    prompt_ids: list[int]
    answer: str
    samples: list[Sample]
    correct: list[float]
    """Verifier score of each sample (before shaping)."""
    rewards: list[float]
    """Score plus shaping (overlong penalty): what advantages are computed from."""


@dataclasses.dataclass
class RolloutResult:
    groups: list[Group]
    """Kept groups (dynamic sampling applied), at most the step's prompt count."""
    generated_groups: int
    generation_batches: int
    mean_correct_all: float
    """Accuracy over every generated sample of the step (kept or not)."""
    mean_length_all: float
    seconds: float
    verifier_stats: dict


@dataclasses.dataclass
class TrainRows:
    """The step's training rows, whatever produced them (groups, or the T-PPO window pool)."""

    samples: list[Sample]
    rewards: list[float]
    """Per row; 0 for a response still in flight (it has no outcome yet)."""
    correct: list[float]
    group_index: list[int]
    """Rows of one prompt share it."""
    loss_start: list[int]
    """First response token of each row in the policy loss (earlier ones are context)."""
    fresh_start: list[int]
    """First response token each row's vLLM sampled under the current weights."""
    truncated: list[bool]
    """Cut off by the generation window: EGAE bootstraps it, the critic skips it."""

    def __len__(self) -> int:
        return len(self.samples)

    @classmethod
    def from_groups(cls, groups: list[Group]) -> "TrainRows":
        samples = [s for g in groups for s in g.samples]
        zeros = [0] * len(samples)
        return cls(samples, [r for g in groups for r in g.rewards], [c for g in groups for c in g.correct],
                   [i for i, g in enumerate(groups) for _ in g.samples], zeros, list(zeros),
                   [False] * len(samples))

    @classmethod
    def from_window_rows(cls, rows: list[WindowSample]) -> "TrainRows":
        return cls([r.sample for r in rows], [r.reward if r.finished else 0.0 for r in rows],
                   [r.correct if r.finished else 0.0 for r in rows], [r.prompt_key for r in rows],
                   [r.trained for r in rows], [r.fresh for r in rows], [not r.finished for r in rows])


def shaped_rewards(recipe: AlgorithmRecipe, scores: list[float], lengths: torch.Tensor) -> torch.Tensor:
    """[samples] float64: the verifier's scores plus the recipe's shaping (DAPO's overlong penalty)."""
    rewards = torch.tensor(scores, dtype=torch.float64)
    if recipe.overlong is not None:
        o = recipe.overlong
        rewards = rewards + overlong_penalty(lengths, o.max_len, o.buffer_len, o.factor).double()
    return rewards


def generate_groups(engine: RolloutEngine, prompts: PromptBatch, sampling: Sampling) -> list[list[Sample]]:
    """``sampling.n`` samples per prompt of ``prompts``, the same list on every rank."""
    world = dist.get_world_size()
    per_replica = -(-len(prompts) // engine.num_replicas)
    mine = list(range(engine.replica * per_replica, min(len(prompts), (engine.replica + 1) * per_replica)))
    seeds = None
    if sampling.prompt_seed is not None:  # the same samples whichever replica draws them
        seeds = prompt_seeds(sampling.prompt_seed, [prompts.epochs[i] for i in mine],
                             [prompts.dataset_indices[i] for i in mine], sampling.n)
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
    mine = samples[start: start + per_replica]
    local = engine.continue_(mine, sampling) if mine else []
    leader = dist.get_rank() % engine.tp == 0
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (start, local) if leader else None)
    result: list = [None] * len(samples)
    for item in everyone:
        if item is not None:
            result[item[0]: item[0] + len(item[1])] = item[1]
    return result


@dataclasses.dataclass
class WindowedRollout:
    counts: StepCounts
    generation_batches: int
    mean_correct_finished: float
    """Accuracy over the responses that finished this step (nan when none did)."""
    mean_length_finished: float
    new_tokens: int
    """Tokens sampled this step (every window generated, new prompts and continuations)."""
    seconds: float
    verifier_stats: dict


def windowed_rollouts(
    engine: RolloutEngine,
    pool: WindowPool,
    take_prompts: Callable[[int], PromptBatch],
    sampling: Sampling,
    recipe: AlgorithmRecipe,
    score: Callable[[list[str], list[str]], tuple[list[float], dict]],
    decode: Callable[[list[int]], str],
) -> WindowedRollout:
    """One T-PPO generation step on ``pool``: continue the unfinished, add new prompts, score the finished."""
    start = time.perf_counter()
    before = {id(s): s.length for s in pool.samples}
    todo = pool.begin_step()
    batches = 0
    if todo:
        pool.continued(continue_samples(engine, todo, sampling))
        batches += 1
    new_prompts = pool.new_prompt_count()
    if new_prompts:
        prompts = take_prompts(new_prompts)
        for answer, group in zip(prompts.answers, generate_groups(engine, prompts, sampling)):
            pool.add_group(answer, group)
        batches += 1
    entries = pool.to_score()
    stats: dict = {}
    correct: list[float] = []
    if entries:
        correct, stats = score([decode(e.sample.token_ids) for e in entries], [e.answer for e in entries])
        rewards = shaped_rewards(recipe, correct, torch.tensor([e.length for e in entries]))
        pool.set_scores(entries, correct, rewards.tolist())
    nan = float("nan")
    return WindowedRollout(
        counts=StepCounts(carried=len(todo), new_prompts=new_prompts, finished=len(entries)),
        generation_batches=batches,
        mean_correct_finished=sum(correct) / len(correct) if correct else nan,
        mean_length_finished=sum(e.length for e in entries) / len(entries) if entries else nan,
        new_tokens=sum(s.length - before.get(id(s), 0) for s in pool.samples),
        seconds=time.perf_counter() - start,
        verifier_stats=stats,
    )


def collect_rollouts(
    engine: RolloutEngine,
    next_prompts: Callable[[], PromptBatch],
    sampling: Sampling,
    recipe: AlgorithmRecipe,
    score: Callable[[list[str], list[str]], tuple[list[float], dict]],
    decode: Callable[[list[int]], str],
    num_groups: int,
) -> RolloutResult:
    """Generate until ``num_groups`` groups are kept (or max_gen_batches is reached)."""
    start = time.perf_counter()
    kept: list[Group] = []
    generated = batches = 0
    all_correct: list[float] = []
    all_lengths: list[int] = []
    stats_total: dict = {}
    while len(kept) < num_groups and batches < (recipe.max_gen_batches if recipe.dynamic_sampling else 1):
        prompts = next_prompts()
        batches += 1
        samples = generate_groups(engine, prompts, sampling)
        texts = [decode(s.token_ids) for group in samples for s in group]
        answers = [a for a, group in zip(prompts.answers, samples) for _ in group]
        scores, stats = score(texts, answers)
        for key, value in stats.items():
            stats_total[key] = stats_total.get(key, 0) + value
        lengths = torch.tensor([len(s.token_ids) for group in samples for s in group])
        rewards = shaped_rewards(recipe, scores, lengths)
        all_correct += scores
        all_lengths += lengths.tolist()
        group_index = torch.tensor([g for g, group in enumerate(samples) for _ in group])
        keep = (dynamic_sampling_keep(torch.tensor(scores), group_index) if recipe.dynamic_sampling
                else torch.ones(len(scores), dtype=torch.bool))
        cursor = 0
        for g, group in enumerate(samples):
            n = len(group)
            generated += 1
            if bool(keep[cursor]) and len(kept) < num_groups:
                kept.append(Group(list(prompts.prompt_ids[g]), prompts.answers[g], group,
                                  scores[cursor:cursor + n], rewards[cursor:cursor + n].tolist()))
            cursor += n
    return RolloutResult(
        groups=kept,
        generated_groups=generated,
        generation_batches=batches,
        mean_correct_all=sum(all_correct) / max(len(all_correct), 1),
        mean_length_all=sum(all_lengths) / max(len(all_lengths), 1),
        seconds=time.perf_counter() - start,
        verifier_stats=stats_total,
    )
