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

What it does not cover yet (config.checks refuses each): several vLLM replicas,
rollouts ahead of training, T-PPO windows, the eval phase.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from megatron_rl.algorithms.recipes import AlgorithmRecipe
from megatron_rl.config import Config
from megatron_rl.data import PromptLoader
from megatron_rl.environments.driver import DriverConfig, DriverTimes, EpisodeDriver
from megatron_rl.environments.episode import EpisodeLimits, EpisodeResult
from megatron_rl.environments.interface import EpisodeRecord
from megatron_rl.rollout import Sample, Sampling
from megatron_rl.rollout.seeds import episode_seeds
from megatron_rl.trainer.rollouts import Drawn, TrainRows, collect_rollouts
from megatron_rl.trainer.rows import usable_groups
from megatron_rl.trainer.sources import Rollout, RolloutSource, collection_metrics

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


class EpisodeSource(RolloutSource):
    """Lockstep groups of G episodes per prompt, on one engine (the driver's)."""

    def __init__(
        self,
        driver: EpisodeDriver,
        loader: PromptLoader,
        recipe: AlgorithmRecipe,
        decode: Callable[[list[int]], str],
        num_groups: int,
        group_size: int,
        row_multiple: int,
    ):
        self.driver, self.loader, self.recipe, self.decode = driver, loader, recipe, decode
        self.num_groups, self.group_size, self.row_multiple = num_groups, group_size, row_multiple
        self._tally = EpisodeTally()

    def collect(self, sampling: Sampling) -> Rollout:
        self._tally = EpisodeTally()
        result = collect_rollouts(self._draw, sampling, self.recipe, _unscored, self.decode, self.num_groups)
        groups = result.groups[: usable_groups(len(result.groups), self.group_size, self.row_multiple)]
        metrics = {**collection_metrics(result, groups, self.loader.prompts_drawn), **self._tally.metrics()}
        return Rollout(TrainRows.from_groups(groups), metrics, float(self._tally.counts["sampled_tokens"]))

    def _draw(self, sampling: Sampling) -> Drawn:
        """The next prompts, G episodes each, run to their ends and scored by the environment."""
        prompts = self.loader.next_batch()
        records = [self._record(i) for i in prompts.dataset_indices for _ in range(self.group_size)]
        seeds = None
        if sampling.prompt_seed is not None:  # episodes a function of weights and prompts (module docstring)
            turns = self.driver.config.limits.max_turns
            seeds = episode_seeds(sampling.prompt_seed, prompts.epochs, prompts.dataset_indices, self.group_size, turns)
        results = self.driver.run(records, seeds=seeds)
        self._tally.add(results, self.driver.times)
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

    def state_dict(self) -> dict:
        return {"data": self.loader.state_dict()}

    def load_state_dict(self, extra: dict) -> str:
        self.loader.load_state_dict(extra["data"])
        return ""

    def close(self) -> None:
        self.driver.close()
        self.driver.environment.close()


def _unscored(texts: list[str], answers: list[str]) -> tuple[list[float], dict]:
    raise AssertionError("episodes are scored by their environment")  # every Drawn here carries scores


def episode_source(
    cfg: Config,
    engine,
    tokenizer,
    loader: PromptLoader,
    recipe: AlgorithmRecipe,
    decode,
    reward: str,
    row_multiple: int,
) -> EpisodeSource:
    """The run's environment (tools in their sandbox, the reward) and driver on ``engine``."""
    from megatron_rl.environments.interface import EnvironmentSetup
    from megatron_rl.environments.isolation import probe_isolation
    from megatron_rl.environments.registry import get_environment
    from megatron_rl.environments.tools import build_tools

    env, rollout = cfg.environment, cfg.rollout
    report = probe_isolation()
    print(report.line(), flush=True)  # the run's one line about the sandbox (validation refused a missing one)
    specs, runner = build_tools(env.tools, env.sandbox, report)
    setup = EnvironmentSetup(reward=reward, tools=specs, tool_runner=runner, tool_parser=env.parser)
    limits = EpisodeLimits(
        max_turns=env.max_turns, max_tokens=env.max_episode_tokens, max_turn_tokens=rollout.max_new_tokens
    )
    config = DriverConfig(
        limits=limits,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        env_threads=env.env_threads,
        overlap=env.overlap,
    )
    driver = EpisodeDriver(engine, tokenizer, get_environment(env.name, setup), config)
    return EpisodeSource(driver, loader, recipe, decode, rollout.prompts_per_step, rollout.n_samples, row_multiple)
