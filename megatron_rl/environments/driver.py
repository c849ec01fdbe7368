"""Runs a batch of multi-turn episodes on a rollout engine, round by round.

Each round: one engine call generates the next assistant turn of every live episode from
its exact token sequence (token in); each episode's environment reads the turn's text and
answers; an answer that ends the episode records its reward, one that goes on is appended
as observation tokens (loss mask 0) and the episode stays live. Rounds go on until every
episode is done or stopped by a limit (:class:`~megatron_rl.environments.episode.EpisodeLimits`).

Concurrency: the environment steps of one round run in a thread pool (tool calls are
subprocesses or remote calls: they wait, and waiting threads overlap), but after the
round's generation and before the next: the engine's ``generate`` blocks, and the next
round's prompts need this round's observations. Overlapping them (generating for the
episodes already answered while the others' tools run) would need an engine that takes
requests as they come; with one blocking call per round, the slowest tool call of the
round delays the next round.

A turn must end with the EOS token (the chat template's end of an assistant turn) for the
episode to go on, as the observation tokens are the template's continuation after it;
generation stops only there (no stop strings), and a turn cut by a budget ends the
episode. Turn t of an episode with seed s is sampled with seed s + t: give episodes seeds
at least ``max_turns`` apart (``rollout.seeds`` spaces prompts MAX_SAMPLES apart).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Protocol, Sequence

from megatron_rl.environments.episode import Episode, EpisodeLimits, EpisodeResult, ObservationEncoder, encode_prompt
from megatron_rl.environments.interface import Environment, EpisodeRecord, Step
from megatron_rl.rollout.engine import Sample, Sampling


class TurnGenerator(Protocol):
    """What the driver needs of an engine (:class:`~megatron_rl.rollout.engine.RolloutEngine`)."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        seeds: Optional[Sequence[int]] = None,
        max_tokens: Optional[Sequence[int]] = None,
    ) -> list[list[Sample]]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriverConfig:
    """How episodes are sampled and bounded."""

    limits: EpisodeLimits = EpisodeLimits()
    temperature: float = 1.0
    top_p: float = 1.0
    env_threads: int = 8
    """Environment steps (tool calls) run at once."""

    def __post_init__(self) -> None:
        if self.env_threads < 1:
            raise ValueError(f"env_threads={self.env_threads} must be >= 1")


class EpisodeDriver:
    """Episodes of one environment on one engine; ``close`` ends its thread pool."""

    def __init__(
        self, engine: TurnGenerator, tokenizer, environment: Environment, config: DriverConfig = DriverConfig()
    ):
        self.engine, self.tokenizer, self.environment, self.config = engine, tokenizer, environment, config
        self.observations = ObservationEncoder(tokenizer)
        self._pool = ThreadPoolExecutor(config.env_threads, thread_name_prefix="env-step")

    def run(
        self, records: Sequence[EpisodeRecord], *, policy_version: int = 0, seeds: Optional[Sequence[int]] = None
    ) -> list[EpisodeResult]:
        """One episode per record, in order; ``policy_version``: the weights the engine serves."""
        if seeds is not None and len(seeds) != len(records):
            raise ValueError(f"{len(seeds)} seeds for {len(records)} records")
        episodes = [self._open(record) for record in records]
        while live := [i for i, e in enumerate(episodes) if not e.finished]:
            samples = self._generate([episodes[i] for i in live], None if seeds is None else [seeds[i] for i in live])
            asking = []
            for i, sample in zip(live, samples):
                episodes[i].add_turn(sample, policy_version)
                if self._turn_closed(episodes[i], sample):
                    asking.append(episodes[i])
            texts = [self.tokenizer.decode(e.last_turn, skip_special_tokens=True) for e in asking]
            answers = list(self._pool.map(self._step, [e.state for e in asking], texts))
            for episode, (step, seconds) in zip(asking, answers):
                self._answer(episode, step, seconds)
        return [e.result() for e in episodes]

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> EpisodeDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, record: EpisodeRecord) -> Episode:
        start = self.environment.reset(record)
        ids = encode_prompt(self.tokenizer, start.messages, start.tools)
        if len(ids) >= self.config.limits.max_tokens:
            raise ValueError(
                f"{record.location or 'a record'}: the prompt's {len(ids)} tokens leave no room in "
                f"max_tokens={self.config.limits.max_tokens}"
            )
        return Episode(ids, start.state)

    def _generate(self, episodes: list[Episode], seeds: Optional[list[int]]) -> list[Sample]:
        limits = self.config.limits
        budgets = [min(limits.max_turn_tokens, limits.max_tokens - len(e.tokens)) for e in episodes]
        sampling = Sampling(
            max_tokens=max(budgets),
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )
        turn_seeds = None if seeds is None else [s + e.counts.turns for s, e in zip(seeds, episodes)]
        groups = self.engine.generate([e.tokens for e in episodes], sampling, turn_seeds, budgets)
        return [group[0] for group in groups]

    def _turn_closed(self, episode: Episode, sample: Sample) -> bool:
        """Whether the turn ended with EOS; if not, a budget cut it and the episode stops."""
        if sample.token_ids and sample.token_ids[-1] == self.tokenizer.eos_token_id:
            return True
        at_episode_limit = len(episode.tokens) >= self.config.limits.max_tokens
        episode.stop("max_tokens" if at_episode_limit else "turn_length")
        return False

    def _step(self, state, text: str) -> tuple[Step, float]:
        """The environment's answer to one turn and its wall-clock seconds (tool calls)."""
        start = time.perf_counter()
        step = self.environment.step(state, text)
        return step, time.perf_counter() - start

    def _answer(self, episode: Episode, step: Step, seconds: float = 0.0) -> None:
        if step.done:
            episode.add_step(step, seconds=seconds)
            episode.finish(step.reward)
            return
        limits = self.config.limits
        if episode.counts.turns >= limits.max_turns:
            episode.add_step(step, seconds=seconds)
            episode.stop("max_turns")
            return
        ids = self.observations.encode(step.observation)
        if len(episode.tokens) + len(ids) >= limits.max_tokens:  # no room left to answer it
            episode.add_step(step, seconds=seconds)
            episode.stop("max_tokens")
            return
        episode.add_step(step, ids, seconds)
