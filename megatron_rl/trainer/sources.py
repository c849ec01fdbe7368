"""Rollout sources: where a step's training rows come from.

A source owns the prompt stream and everything generation carries between steps. Each
step the trainer asks it for rows (``collect``: generate, score, shape and filter, since
DAPO's dynamic sampling refills by generating again), trains on them, then tells it so
(``trained``). Its state goes into the checkpoint beside the model, so a resumed run
neither loses nor repeats a prompt.

Today's sources:
- :class:`GroupSource`: every step, new prompts -> groups of G responses (lockstep), from
  the colocated engines or the rollout ranks (``rollout.placement``).
- :class:`WindowSource`: T-PPO; responses cut off by the generation window are carried
  in a :class:`WindowPool` and continued by the next step's weights (colocated only).
An asynchronous source implements the same three calls.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable

from megatron_rl.algorithms.recipes import AlgorithmRecipe
from megatron_rl.data import PromptBatch, PromptLoader
from megatron_rl.rollout import RolloutEngine, Sampling
from megatron_rl.rollout.replicas import Generate
from megatron_rl.trainer.rollouts import TrainRows, collect_rollouts, windowed_rollouts
from megatron_rl.trainer.rows import usable_groups
from megatron_rl.trainer.windows import WindowPool, WindowSample

Score = Callable[[list[str], list[str]], tuple[list[float], dict]]
Decode = Callable[[list[int]], str]


@dataclasses.dataclass
class Rollout:
    """One step's rows and what producing them took."""

    rows: TrainRows
    metrics: dict
    """reward/mean, response_length/mean, rollout/*, timing/rollout_s (metrics.jsonl names)."""
    generated_tokens: float
    """Tokens sampled this step (throughput)."""


class RolloutSource(abc.ABC):
    """The trainer's one way to get rows; implementations differ in where and when they generate."""

    @abc.abstractmethod
    def collect(self, sampling: Sampling) -> Rollout:
        """This step's scored, filtered rows (the same on every rank)."""

    def trained(self) -> None:
        """Called after the update on the rows of the last ``collect``."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Entries for the checkpoint's ``extra`` (JSON-like)."""

    @abc.abstractmethod
    def load_state_dict(self, extra: dict) -> str:
        """Restore from a checkpoint's ``extra``; returns a note for the resume message."""


class GroupSource(RolloutSource):
    """Lockstep groups: ``num_groups`` prompts, G responses each, from the colocated engines
    or from rollout ranks of their own (whatever ``generate`` asks)."""

    def __init__(self, generate: Generate, loader: PromptLoader, recipe: AlgorithmRecipe, score: Score,
                 decode: Decode, num_groups: int, group_size: int, row_multiple: int):
        self.generate, self.loader, self.recipe = generate, loader, recipe
        self.score, self.decode = score, decode
        self.num_groups, self.group_size, self.row_multiple = num_groups, group_size, row_multiple

    def collect(self, sampling: Sampling) -> Rollout:
        result = collect_rollouts(self.generate, self.loader.next_batch, sampling, self.recipe, self.score,
                                  self.decode, self.num_groups)
        groups = result.groups[: usable_groups(len(result.groups), self.group_size, self.row_multiple)]
        metrics = {
            "reward/mean": result.mean_correct_all,
            "response_length/mean": result.mean_length_all,
            "rollout/kept_groups": len(groups),
            "rollout/generated_groups": result.generated_groups,
            "rollout/generation_batches": result.generation_batches,
            "data/prompts_drawn": self.loader.prompts_drawn,
            "timing/rollout_s": result.seconds,
        }
        generated = result.mean_length_all * result.generated_groups * self.group_size
        return Rollout(TrainRows.from_groups(groups), metrics, generated)

    def state_dict(self) -> dict:
        return {"data": self.loader.state_dict()}

    def load_state_dict(self, extra: dict) -> str:
        self.loader.load_state_dict(extra["data"])
        return ""


class WindowSource(RolloutSource):
    """T-PPO: the window pool continued by each step's weights, refilled with new prompts."""

    def __init__(self, engine: RolloutEngine, loader: PromptLoader, pool: WindowPool, recipe: AlgorithmRecipe,
                 score: Score, decode: Decode):
        if loader.batch_size != 1:
            raise ValueError("the window pool refills single rows: its loader must hand out one prompt at a time")
        self.engine, self.loader, self.pool, self.recipe = engine, loader, pool, recipe
        self.score, self.decode = score, decode
        self._rows: list[WindowSample] = []

    def _take_prompts(self, count: int) -> PromptBatch:
        """``count`` prompts, one loader batch each (the loader's position stays exact for resume)."""
        batches = [self.loader.next_batch() for _ in range(count)]
        return PromptBatch(prompt_ids=[b.prompt_ids[0] for b in batches], answers=[b.answers[0] for b in batches],
                           dataset_indices=[b.dataset_indices[0] for b in batches],
                           epochs=[b.epochs[0] for b in batches], group_ids=list(range(count)))

    def collect(self, sampling: Sampling) -> Rollout:
        result = windowed_rollouts(self.engine, self.pool, self._take_prompts, sampling, self.recipe,
                                   self.score, self.decode)
        self._rows = self.pool.training_rows()
        rows = self._rows
        metrics = {
            "reward/mean": result.mean_correct_finished,  # responses that finished this step
            "response_length/mean": result.mean_length_finished,
            "rollout/kept_groups": len({r.prompt_key for r in rows}),
            "rollout/generated_groups": result.counts.new_prompts,
            "rollout/generation_batches": result.generation_batches,
            "rollout/new_prompts": result.counts.new_prompts,
            "data/prompts_drawn": self.loader.prompts_drawn,
            "rollout/carried_samples": result.counts.carried,
            "rollout/finished_samples": result.counts.finished,
            "rollout/trained_rows": len(rows),
            "rollout/truncated_rows": sum(not r.finished for r in rows),
            "rollout/held_rows": len(self.pool.samples) - len(rows),
            "rollout/context_response_tokens": sum(r.trained for r in rows),
            "rollout/max_windows": max((r.windows for r in rows), default=0),
            "timing/rollout_s": result.seconds,
        }
        return Rollout(TrainRows.from_window_rows(rows), metrics, result.new_tokens)

    def trained(self) -> None:
        self.pool.trained(self._rows)  # finished rows leave; unfinished ones keep their tokens as context
        self._rows = []

    def state_dict(self) -> dict:
        return {"data": self.loader.state_dict(), "windows": self.pool.state_dict()}

    def load_state_dict(self, extra: dict) -> str:
        self.loader.load_state_dict(extra["data"])
        if "windows" not in extra:
            return " (the checkpoint has no window pool: T-PPO starts with new prompts only)"
        self.pool.load_state_dict(extra["windows"])
        return f" with {len(self.pool.samples)} in-flight responses of the window pool"
