"""What an RL run is made of, built once from its checked config: the composition root.

:class:`~megatron_rl.trainer.trainer.RLTrainer` runs the loop over these parts and builds
none of them itself. Two groups, in the order they are built:

- :class:`Models`: the actor, the critic (recipes with one; in its own layout when
  ``critic_parallel`` is set) and the frozen KL reference, with their losses and the MoE
  routers' replay;
- :class:`Rollouts`: the prompts' source, the verifier, vLLM (colocated engines dealt over
  replicas, or a client of the rollout ranks' engines), the eval phase and the weight sync,
  which needs the actor's chunks, hence built second.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megatron_rl.algorithms.recipes import AlgorithmRecipe
from megatron_rl.config import Config
from megatron_rl.data import PromptLoader
from megatron_rl.environments.served import EPISODE_COMMANDS, start_episodes
from megatron_rl.evaluation.phase import Evaluator, eval_sampling
from megatron_rl.evaluation.sets import eval_rewards, load_sets
from megatron_rl.from_config import setup, verifier_name
from megatron_rl.from_config.rows import train_row_multiple
from megatron_rl.launch.roles import RoleWorld
from megatron_rl.models.hf_config import ModelArch, arch_from_hf
from megatron_rl.models.route_replay import RouteReplay
from megatron_rl.monitor.online import OnlineMonitor, torch_gather
from megatron_rl.parallel import initialize, initialize_alongside
from megatron_rl.parallel.state import ParallelContext
from megatron_rl.rewards import build_verifier
from megatron_rl.rewards.scoring import WeightedReward
from megatron_rl.rollout.adapter_sync import AdapterSync, PolicySync
from megatron_rl.rollout.backend import RolloutBackend
from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.replicas import Replicas
from megatron_rl.rollout.sync import WeightSync
from megatron_rl.rollout.types import Sampling
from megatron_rl.schedules import ActorLoss, CriticLoss
from megatron_rl.trainer.ahead import AheadGeneration, GroupRequests
from megatron_rl.trainer.episodes import episode_source, episode_spec
from megatron_rl.trainer.overlapped_scoring import OverlappedScoring
from megatron_rl.trainer.reference import ReferencePolicy
from megatron_rl.trainer.reward_scorers import build_reward
from megatron_rl.trainer.rollouts import responses_of
from megatron_rl.trainer.sources import GroupSource, RolloutSource, WindowSource
from megatron_rl.trainer.windows import WindowPool


@dataclasses.dataclass
class Models:
    """The models a step trains and reads, each in its layout."""

    actor: setup.Trainable
    critic: Optional[setup.Trainable]
    reference: Optional[ReferencePolicy]
    """The frozen KL reference (recipes with a KL penalty)."""
    teacher: Optional[ReferencePolicy]
    """On-policy distillation's frozen teacher (recipes with distill_coef > 0), in the actor's layout."""
    route_replay: Optional[RouteReplay]
    """MoE: every actor router measures agreement with vLLM's routes, and replays them when
    rollout.router_replay is on (models/route_replay.py)."""
    actor_loss: ActorLoss
    critic_loss: Optional[CriticLoss]


def build_models(
    cfg: Config,
    recipe: AlgorithmRecipe,
    arch: ModelArch,
    base_dir: Path,
    rank: int,
    teacher_dir: Optional[Path] = None,
    start=None,
) -> Models:
    """Actor, critic (recipes with one), the frozen KL reference and teacher (recipes with
    them), in their layouts; ``start`` (model.ckpt's step): where actor, critic backbone and
    reference get their weights after the HF directory's."""
    actor_layout = initialize(
        cfg.parallel, seed=cfg.trainer.seed, model=arch.shape(), timeout_s=cfg.trainer.dist_timeout_s
    )
    critic_layout = _critic_layout(cfg, arch, actor_layout, rank) if recipe.use_critic else None
    if cfg.critic_parallel is not None and critic_layout is None and rank == 0:
        print(f"critic_parallel is ignored: algorithm.recipe={cfg.algorithm.recipe} trains no critic", flush=True)
    options = setup.build_options(cfg)
    lora = setup.lora_settings(cfg)
    actor = setup.build_trainable(
        "actor", arch, actor_layout, options, cfg.trainer.lr, base_dir, lora=lora, start=start
    )
    critic = None
    if critic_layout is not None:
        critic_lr = cfg.trainer.lr * recipe.critic_lr_multiplier
        critic = setup.build_trainable(
            "critic", arch, critic_layout, options, critic_lr, base_dir, lora=lora, start=start
        )
    return Models(
        actor=actor,
        critic=critic,
        reference=ReferencePolicy(arch, cfg.parallel, options, base_dir, start) if recipe.kl is not None else None,
        teacher=_teacher(teacher_dir, cfg, options) if recipe.distill_coef > 0 else None,
        route_replay=RouteReplay(actor.chunks) if arch.is_moe else None,
        actor_loss=ActorLoss(recipe, arch.vocab_size),
        critic_loss=CriticLoss.from_recipe(recipe) if critic is not None else None,
    )


def _teacher(teacher_dir: Path, cfg: Config, options) -> ReferencePolicy:
    """The teacher in ``teacher_dir``, frozen in the actor's layout (its own shape and weights)."""
    return ReferencePolicy(arch_from_hf(teacher_dir), cfg.parallel, options, teacher_dir)


def _critic_layout(cfg: Config, arch: ModelArch, actor_layout: ParallelContext, rank: int) -> ParallelContext:
    """The critic's process groups: the actor's, or its own when critic_parallel is set."""
    if cfg.critic_layout == cfg.parallel:
        return actor_layout
    layout = initialize_alongside(
        cfg.critic_parallel, seed=cfg.trainer.seed, model=arch.shape(), timeout_s=cfg.trainer.dist_timeout_s
    )
    if rank == 0:
        world = actor_layout.world_size
        print(
            f"actor layout: {cfg.parallel.describe(world)}\ncritic layout: {cfg.critic_parallel.describe(world)}",
            flush=True,
        )
    return layout


@dataclasses.dataclass
class Rollouts:
    """Where a step's rows come from and how the weights get back to vLLM."""

    engine: RolloutBackend
    client: Optional[RolloutClient]
    """The rollout ranks' handle (disaggregated rollouts), which also takes rollouts ahead."""
    verifier: Any
    reward: Any
    """What scores training's responses (trainer.reward_scorers): the verifier, or reward.scorers."""
    eval_verifiers: dict
    """Verifiers of eval sets scored with another reward than training's (by name)."""
    sampling: Sampling
    source: RolloutSource
    evaluator: Optional[Any]
    weight_sync: PolicySync
    pad_token_id: int


@dataclasses.dataclass(frozen=True)
class RunPlace:
    """Where the run stands: its directories, this rank and, when disaggregated, the launch's split."""

    base_dir: Path
    run_dir: Path
    world: int
    rank: int
    roles: Optional[RoleWorld]


def build_rollouts(
    cfg: Config, recipe: AlgorithmRecipe, arch: ModelArch, place: RunPlace, actor_chunks: list
) -> Rollouts:
    """Prompts, the verifier, vLLM (from the actor's HF weights: colocated engines, or a
    client of the rollout ranks' engines), the source, the eval phase, the weight sync."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(place.base_dir)
    dataset = setup.prompt_dataset(cfg, place.base_dir, tokenizer)
    # T-PPO refills single rows of the pool: its loader hands out one prompt at a time.
    batch_size = 1 if recipe.generation_window is not None else cfg.rollout.prompts_per_step
    loader = PromptLoader(dataset, batch_size=batch_size, seed=cfg.trainer.seed)
    verifier = build_verifier(verifier_name(cfg))
    pad_token_id = tokenizer.pad_token_id or 0
    reward = build_reward(
        cfg,
        verifier,
        verifier_name(cfg),
        base_dir=place.base_dir,
        run_dir=place.run_dir,
        dp_size=cfg.parallel.dp(place.world),
        pad_token_id=pad_token_id,
    )
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    overlap = None
    if isinstance(reward, WeightedReward) and reward.served:
        reward = OverlappedScoring(reward, functools.partial(responses_of, decode=decode))
        overlap = reward.begin
    adapters = setup.syncs_adapters(cfg)
    engine_config = setup.engine_config(cfg, arch, place.run_dir / "cache", lora_slot=adapters)
    client = _rollout_client(cfg, place, engine_config) if place.roles is not None else None
    engine: RolloutBackend = client if client is not None else Replicas(RolloutEngine(place.base_dir, engine_config))
    source = _source(cfg, recipe, place, engine, client, reward.score_batch, loader, decode, tokenizer, overlap)
    evaluator, eval_verifiers = None, {}
    if cfg.eval.enabled:
        evaluator, eval_verifiers = _evaluator(cfg, place, engine, verifier, tokenizer, dataset, decode)
    return Rollouts(
        engine=engine,
        client=client,
        verifier=verifier,
        reward=reward,
        eval_verifiers=eval_verifiers,
        sampling=_sampling(cfg, recipe, tokenizer.eos_token_id),
        source=source,
        evaluator=evaluator,
        weight_sync=_policy_sync(cfg, arch, actor_chunks, engine, adapters),
        pad_token_id=pad_token_id,
    )


def _policy_sync(cfg: Config, arch: ModelArch, actor_chunks, engine: RolloutBackend, adapters: bool) -> PolicySync:
    """The actor's sync into vLLM: whole (LoRA merged in), or the adapters alone."""
    weights = WeightSync(actor_chunks, arch, engine, bucket_bytes=int(cfg.rollout.bucket_mb * (1 << 20)))
    if not adapters:
        return PolicySync(weights)
    lora = cfg.model.lora
    return PolicySync(
        weights, AdapterSync(actor_chunks, arch, engine, dict(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout))
    )


def _sampling(cfg: Config, recipe: AlgorithmRecipe, eos_token_id: int) -> Sampling:
    rollout = cfg.rollout
    return Sampling(
        n=rollout.n_samples,
        max_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        stop_token_ids=(eos_token_id,),
        window=recipe.generation_window,
        prompt_seed=cfg.trainer.seed if rollout.seed_per_prompt else None,
    )


def _rollout_client(cfg: Config, place: RunPlace, engine_config) -> RolloutClient:
    """The rollout ranks' engines, started; for a run of episodes, their episode drivers
    too, built beside the engines from the run's spec (the episode commands are the
    client's besides rollout's own)."""
    start = functools.partial(
        RolloutClient,
        place.roles.bridge,
        engine_config,
        place.base_dir,
        who=place.roles.describe_rollout_ranks(),
        answer_timeout_s=cfg.rollout.timeout_s,
        start_timeout_s=cfg.rollout.start_timeout_s,
    )
    if not cfg.environment.episodes:
        return start()
    client = start(extra_commands=EPISODE_COMMANDS)
    start_episodes(client, episode_spec(cfg, verifier_name(cfg)), place.base_dir, cfg.rollout.start_timeout_s)
    return client


def _source(
    cfg, recipe, place: RunPlace, engine, client, score, loader, decode, tokenizer, overlap=None
) -> RolloutSource:
    """Lockstep groups, or T-PPO's window pool, or multi-turn episodes (``environment``),
    on the colocated engines or the rollout ranks; ``overlap``: served scorers begun on each
    lockstep group as it finishes."""
    row_multiple = train_row_multiple(cfg, place.world, recipe.use_critic)
    if cfg.environment.episodes:
        replicas = engine if client is None else None  # colocated: the backend is the replicas
        return episode_source(cfg, replicas, client, tokenizer, loader, recipe, decode, row_multiple)
    rollout = cfg.rollout
    if recipe.generation_window is None:
        ahead = None
        if client is not None:
            chunk = rollout.partial_chunk_tokens if rollout.partial else None
            ahead = AheadGeneration(client, loader, rollout.max_staleness, GroupRequests(chunk))
        return GroupSource(
            engine.generate_groups,
            loader,
            recipe,
            score,
            decode,
            rollout.prompts_per_step,
            rollout.n_samples,
            row_multiple,
            ahead,
            overlap,
        )
    pool = WindowPool(
        rollout.prompts_per_step * rollout.n_samples, rollout.n_samples, row_multiple, recipe.train_in_flight
    )
    return WindowSource(engine.generate_groups, engine.continue_samples, loader, pool, recipe, score, decode)


def _evaluator(cfg: Config, place: RunPlace, engine, verifier, tokenizer, dataset, decode):
    """The eval phase on the run's engines (colocated, or the rollout ranks': a stamped
    version), and the verifiers of its sets scored otherwise than training."""
    sets = load_sets(cfg, place.base_dir, tokenizer, (r.prompt_ids for r in dataset.records))
    run_reward = verifier_name(cfg)
    # A set scored otherwise than training (a reasoning-gym set of a math run) gets its own pool.
    others = {name: build_verifier(name) for name in eval_rewards(cfg) - {run_reward}}
    scores = {name: v.score_batch for name, v in [(run_reward, verifier), *others.items()]}
    sampling = eval_sampling(cfg, tokenizer.eos_token_id)
    evaluator = Evaluator(cfg.eval, sets, engine, scores, decode, sampling, place.run_dir / "eval", place.rank == 0)
    return evaluator, others


def start_monitor(cfg: Config, run_dir: Path):
    """Minder beside training: every machine samples, rank 0 detects (monitor.enabled)."""
    if not cfg.monitor.enabled:
        return None
    return OnlineMonitor(
        cfg.monitor,
        run_dir,
        is_detector=dist.get_rank() == 0,
        sample_here=int(os.environ.get("LOCAL_RANK", "0")) == 0,
        gather=torch_gather(),
    ).start()
