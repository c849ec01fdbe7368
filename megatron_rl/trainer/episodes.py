"""Multi-turn episodes as a rollout source: a step's prompts x G episodes, run by the
:class:`~megatron_rl.environments.driver.EpisodeDriver` on the run's vLLM engine, become
the same rows the single-turn groups give.

An episode is one row: its prompt (rendered with the tools the environment lists), then
everything after it as the "response": the sampled turns with vLLM's logprobs, and the
environment's tokens between them marked not sampled (``Sample.sampled``), which the
assembly keeps out of the policy loss. Its reward is the environment's; an episode a limit
ended (``max_turns``, ``max_episode_tokens``, a turn cut at ``rollout.max_new_tokens``)
scores 0, as a single-turn answer cut by its budget scores nothing, and the recipe's
overlong shaping applies to its length as to an answer's. From there the groups go through
the single-turn path unchanged (:func:`~megatron_rl.trainer.rollouts.collect_rollouts`:
DAPO's dynamic sampling and refills, then advantages and assembly).

Resume: the episodes of a step all end within it (collected in lockstep), so a checkpoint,
taken between steps, holds no episode in flight and the prompt position is the source's
whole state; vLLM samples unseeded turns from torch's generator, whose state the
checkpoint restores, so with lockstep rounds (``environment.overlap=false``) a resumed run
samples what the uninterrupted one did. With
``rollout.seed_per_prompt`` every episode is seeded from its prompt (run seed, epoch,
dataset index; ``rollout.seeds.episode_seeds``) and each turn from that seed: the episodes
then depend on the weights and the prompts alone, not on what else drew from the generator.

Where: with colocated engines every replica (one rank each) runs a contiguous share of the
batch on its own driver, its tools on its own rank, and the results are gathered in order
(:class:`~megatron_rl.environments.replicas.EpisodeReplicas`); seeded episodes are the same
whichever replica runs them. With disaggregated rollouts the rollout ranks build the
drivers beside their engines (the :class:`~megatron_rl.environments.spec.EpisodeSpec`
travels in a command of its own once the engines are up,
:mod:`megatron_rl.environments.served`) and run whole batches of episodes as commands,
ahead of training by ``rollout.max_staleness`` batches as single-turn batches are
(:mod:`megatron_rl.trainer.ahead`): an episode batch runs between two weight updates, so
every turn of it samples one policy version, and a checkpoint's data position comes
before the batches in flight, which a resumed run draws again.

What it does not cover yet (from_config.checks refuses each): replicas of several ranks (engine
TP > 1), partial rollouts, T-PPO windows, the eval phase.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from megatron_rl.algorithms.recipes import AlgorithmRecipe
from megatron_rl.config import Config
from megatron_rl.data import PromptBatch, PromptLoader
from megatron_rl.environments.driver import DriverConfig, DriverTimes
from megatron_rl.environments.episode import EpisodeLimits, EpisodeResult
from megatron_rl.environments.interface import EpisodeRecord
from megatron_rl.environments.replicas import EpisodeReplicas
from megatron_rl.environments.served import EpisodeGeneration, GenerateEpisodes
from megatron_rl.environments.spec import EpisodeSpec, build_driver
from megatron_rl.from_config import verifier_name
from megatron_rl.from_config.rows import usable_groups
from megatron_rl.rollout import Sample, Sampling
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.replicas import Replicas
from megatron_rl.rollout.seeds import episode_seeds
from megatron_rl.trainer.ahead import AheadGeneration
from megatron_rl.trainer.rollouts import Drawn, TrainRows, collect_rollouts
from megatron_rl.trainer.sources import Rollout, RolloutSource, collection_metrics, staleness_metrics

EPISODE_COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "observation_tokens", "sampled_tokens")
"""EpisodeCounts logged as episode/<name>: the mean per episode of a step."""


def episode_sample(result: EpisodeResult) -> Sample:
    """One episode as a Sample: the prompt, then every later token as the response, with
    vLLM's logprobs where sampled (0 elsewhere) and which tokens were sampled."""
    p = result.prompt_length
    tokens = result.tokens.tolist()
    # The result's arrays are prediction-aligned: response token i (position p + i) is predicted at p - 1 + i.
    return Sample(
        prompt_ids=tokens[:p],
        token_ids=tokens[p:],
        logprobs=result.old_logprobs[p - 1 : -1].tolist(),
        finish_reason="length" if result.truncated else "stop",
        routes=result.routes,
        sampled=result.loss_mask[p - 1 : -1].tolist(),
    )


@dataclasses.dataclass
class EpisodeTally:
    """What a step's episodes (every generated one, kept or not) did."""

    episodes: int = 0
    turns: int = 0
    truncated: int = 0
    env_seconds: float = 0.0
    wait_seconds: float = 0.0
    """The driver waiting for tools with no turn to generate."""
    engine_calls: int = 0
    counts: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(EPISODE_COUNTS, 0))

    def reset(self) -> None:
        """Start a step's count (in place: the rollout requests hold this tally)."""
        fresh = EpisodeTally()
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(fresh, field.name))

    def add(self, results: list[EpisodeResult], times: DriverTimes) -> None:
        self.wait_seconds += times.wait_s
        self.engine_calls += times.engine_calls
        for r in results:
            self.episodes += 1
            self.turns += r.counts.turns
            self.truncated += r.truncated
            self.env_seconds += r.counts.env_seconds
            for name in EPISODE_COUNTS:
                self.counts[name] += getattr(r.counts, name)

    def metrics(self) -> dict:
        n = max(self.episodes, 1)
        return {
            "episode/turns_mean": self.turns / n,
            **{f"episode/{name}": value / n for name, value in self.counts.items()},
            "episode/truncated": self.truncated / n,
            "timing/tool_s": self.env_seconds,
            "timing/tool_wait_s": self.wait_seconds,
            "rollout/engine_calls": self.engine_calls,
        }


class EpisodePrompts:
    """A prompt batch as G episode records per prompt, and their seeds."""

    def __init__(self, loader: PromptLoader, group_size: int, max_turns: int):
        self.loader, self.group_size, self.max_turns = loader, group_size, max_turns

    def records(self, prompts: PromptBatch) -> list[EpisodeRecord]:
        return [self._record(i) for i in prompts.dataset_indices for _ in range(self.group_size)]

    def seeds(self, prompts: PromptBatch, sampling: Sampling) -> Optional[list[int]]:
        """Per-episode seeds from the prompt (``rollout.seed_per_prompt``, module docstring), else None."""
        if sampling.prompt_seed is None:
            return None
        return episode_seeds(
            sampling.prompt_seed, prompts.epochs, prompts.dataset_indices, self.group_size, self.max_turns
        )

    def drawn(self, prompts: PromptBatch, results: list[EpisodeResult]) -> Drawn:
        """The batch's episodes as groups of rows, scored by the environment."""
        samples = [episode_sample(r) for r in results]
        n = self.group_size
        groups = [samples[g * n : (g + 1) * n] for g in range(len(prompts))]
        # The prompts as the episodes rendered them (with the tools), as every row holds them.
        prompts = dataclasses.replace(prompts, prompt_ids=[group[0].prompt_ids for group in groups])
        scores = [0.0 if r.truncated else float(r.reward) for r in results]
        return Drawn(prompts, groups, scores=scores)

    def _record(self, index: int) -> EpisodeRecord:
        record = self.loader.dataset[index]
        if not record.messages:
            raise ValueError(
                f"{record.location}: the prompt source gives no chat messages for an episode to start from"
            )
        return EpisodeRecord.from_messages(record.messages, record.answer, record.location)


@dataclasses.dataclass
class EpisodeRequests:
    """Episode batches generated ahead on the rollout ranks (:class:`~megatron_rl.trainer.ahead.AheadGeneration`)."""

    prompts: EpisodePrompts
    tally: EpisodeTally

    def command(self, prompts: PromptBatch, sampling: Sampling) -> GenerateEpisodes:
        return GenerateEpisodes(self.prompts.records(prompts), self.prompts.seeds(prompts, sampling))

    def drawn(self, prompts: PromptBatch, answer: EpisodeGeneration) -> Drawn:
        self.tally.add(answer.results, answer.times)
        return self.prompts.drawn(prompts, answer.results)


class EpisodeSource(RolloutSource):
    """Lockstep groups of G episodes per prompt: run by the colocated engines' drivers when
    the step asks (``colocated``), or by the rollout ranks' drivers (``client``,
    disaggregated), ``depth`` batches ahead of training (0: when asked)."""

    def __init__(
        self,
        loader: PromptLoader,
        recipe: AlgorithmRecipe,
        decode: Callable[[list[int]], str],
        num_groups: int,
        group_size: int,
        row_multiple: int,
        *,
        max_turns: int,
        colocated: Optional[EpisodeReplicas] = None,
        client: Optional[RolloutClient] = None,
        depth: int = 0,
    ):
        if (colocated is None) == (client is None):
            raise ValueError("episodes run either on colocated drivers or on the rollout ranks")
        self.recipe, self.decode, self.colocated = recipe, decode, colocated
        self.num_groups, self.group_size, self.row_multiple = num_groups, group_size, row_multiple
        self.prompts = EpisodePrompts(loader, group_size, max_turns)
        self.tally = EpisodeTally()
        self.ahead = None
        if client is not None:
            self.ahead = AheadGeneration(client, loader, depth, EpisodeRequests(self.prompts, self.tally))
        self.position = self.ahead if self.ahead is not None else loader
        """The data position (what a checkpoint saves): the loader's, or before the batches in flight."""

    def collect(self, sampling: Sampling) -> Rollout:
        self.tally.reset()
        draw = self.ahead.draw if self.ahead is not None else self._draw
        result = collect_rollouts(draw, sampling, self.recipe, _unscored, self.decode, self.num_groups)
        groups = result.groups[: usable_groups(len(result.groups), self.group_size, self.row_multiple)]
        metrics = {**collection_metrics(result, groups, self.position.prompts_drawn), **self.tally.metrics()}
        version = None
        if self.ahead is not None:
            version = self.ahead.version
            metrics.update(self.ahead.step_times.metrics(), **staleness_metrics(groups, version))
        return Rollout(TrainRows.from_groups(groups, version), metrics, float(self.tally.counts["sampled_tokens"]))

    def _draw(self, sampling: Sampling) -> Drawn:
        """The next prompts, G episodes each, run to their ends by the colocated replicas."""
        prompts = self.prompts.loader.next_batch()
        records, seeds = self.prompts.records(prompts), self.prompts.seeds(prompts, sampling)
        results, times = self.colocated.run(records, seeds, version=0)
        self.tally.add(results, times)
        return self.prompts.drawn(prompts, results)

    def state_dict(self) -> dict:
        return {"data": self.position.state_dict()}

    def load_state_dict(self, extra: dict) -> str:
        self.position.load_state_dict(extra["data"])
        return ""

    def close(self) -> None:
        if self.colocated is not None:
            self.colocated.close()


def _unscored(responses) -> tuple[list[float], dict]:
    raise AssertionError("episodes are scored by their environment")  # every Drawn here carries scores


def episode_spec(cfg: Config, reward: str) -> EpisodeSpec:
    """The run's episodes as plain values (what the rollout ranks build their drivers from)."""
    env, rollout = cfg.environment, cfg.rollout
    limits = EpisodeLimits(
        max_turns=env.max_turns, max_tokens=env.max_episode_tokens, max_turn_tokens=rollout.max_new_tokens
    )
    driver = DriverConfig(
        limits=limits,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        env_threads=env.env_threads,
        overlap=env.overlap,
    )
    return EpisodeSpec(
        environment=env.name, reward=reward, tools=env.tools, sandbox=env.sandbox, parser=env.parser, driver=driver
    )


def episode_source(
    cfg: Config,
    replicas: Optional[Replicas],
    client: Optional[RolloutClient],
    tokenizer,
    loader: PromptLoader,
    recipe: AlgorithmRecipe,
    decode,
    row_multiple: int,
) -> EpisodeSource:
    """The run's episodes: on the rollout ranks (``client``; they built their drivers from
    :func:`episode_spec` once their engines were up), else on the colocated ``replicas``,
    each rank building a driver on its engine (rank 0 reports the sandbox)."""
    import torch.distributed as dist

    rollout = cfg.rollout
    counts = (rollout.prompts_per_step, rollout.n_samples, row_multiple)
    turns = cfg.environment.max_turns
    if client is not None:
        depth = rollout.max_staleness
        return EpisodeSource(loader, recipe, decode, *counts, max_turns=turns, client=client, depth=depth)
    announce = not dist.is_initialized() or dist.get_rank() == 0
    driver = build_driver(episode_spec(cfg, verifier_name(cfg)), replicas.engine, tokenizer, announce=announce)
    colocated = EpisodeReplicas(replicas, driver)
    return EpisodeSource(loader, recipe, decode, *counts, max_turns=turns, colocated=colocated)
