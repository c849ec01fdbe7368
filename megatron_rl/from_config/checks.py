"""The one validation pass over a loaded config, before anything heavy is built.

Sections check their own fields when they are built (schema.py); everything that needs
several sections, the world size, the model or the data is checked here, in one function
the CLI and the trainers call first. Every problem is a one-line :class:`ConfigError`
naming the key. The cheap checks run first and import no torch, so a bad layout, data
file or name fails in well under two seconds; only the recipe build imports torch.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from megatron_rl.config.schema import HELD_OUT, SFT, Config, ConfigError, EvalSetConfig
from megatron_rl.data import DatasetFormatError, PromptFields, parse_row, read_rows
from megatron_rl.data.reasoning_gym import SOURCE_PREFIX, GymSpec, check_spec
from megatron_rl.environments import isolation
from megatron_rl.environments.registry import ENVIRONMENTS
from megatron_rl.environments.tool_calls import TOOL_PARSERS
from megatron_rl.environments.tools import check_tool_names
from megatron_rl.from_config import sources
from megatron_rl.from_config.loggers import check_loggers
from megatron_rl.from_config.pair_checks import check_reward_model, refuse_pairs_for_rl
from megatron_rl.from_config.rows import check_window_pool, train_row_multiple, usable_groups
from megatron_rl.from_config.scorer_checks import check_scorers
from megatron_rl.from_config.sft_checks import check_sft
from megatron_rl.from_config.teacher_checks import check_teacher
from megatron_rl.parallel.config import LayoutError, ModelShape, sequence_multiple
from megatron_rl.rewards.registry import REWARDS
from megatron_rl.rollout.seeds import MAX_SAMPLES
from megatron_rl.tasks import get_task

FIRST_ROWS = 8
"""Rows of a prompt file read by the check (the trainer reads and reports all of them)."""


def validate(config: Config, world_size: int) -> Config:
    """Check that ``config`` can run on a launch of ``world_size`` ranks; return it unchanged."""
    check_loggers(config.trainer.loggers)
    refuse_pairs_for_rl(config)
    shape = sources.model_shape(config)  # the model the job builds (file data without hf_path fails here)
    vllm_ranks = _check_placement(config, world_size)
    world_size = training_world_size(config, world_size)  # what the layouts get
    _check_layouts(config, world_size, shape)
    _check_token_budget(config)
    if config.rollout.router_replay and not shape.num_moe_experts:
        raise ConfigError("rollout.router_replay=true needs a MoE model; this model has no experts")
    lora = config.model.lora
    if lora is not None and lora.sync == "adapter" and shape.num_moe_experts:
        raise ConfigError(
            "model.lora.sync=adapter needs a dense model: vLLM 0.32 builds a MoE model with a LoRA slot "
            "only on its GPU Triton kernels (untested here); use sync: merged"
        )
    if vllm_ranks % config.rollout.tensor_parallel_size:
        raise ConfigError(
            f"rollout.tensor_parallel_size={config.rollout.tensor_parallel_size} must divide "
            f"the {vllm_ranks} ranks that run vLLM"
        )
    if config.trainer.job == "smoke":
        _check_smoke_batch(config, world_size)
        config.algorithm.build()  # unknown recipe, bad override names or values
        _check_eval(config)
        return config
    if config.algorithm.trains_reward_model:
        check_reward_model(config, world_size)
        return config
    if config.algorithm.recipe == SFT:
        check_sft(config, world_size)
        return config
    _check_prompts(config)
    _check_reward(config)
    check_scorers(config, world_size)
    recipe = check_recipe(config)
    check_teacher(config, recipe, world_size)
    _check_staleness(config, recipe)
    _check_rows_per_step(config, world_size, recipe)
    _check_eval(config)
    _check_environment(config, world_size, recipe)
    return config


def training_world_size(config: Config, world_size: int) -> int:
    """Ranks of a ``world_size`` launch that train (all of them unless rollouts are disaggregated)."""
    return world_size - config.rollout.num_ranks if config.rollout.placement == "disaggregated" else world_size


def _check_placement(config: Config, world_size: int) -> int:
    """Disaggregated rollouts leave at least one rank to train and support what they can;
    returns how many ranks run vLLM."""
    rollout = config.rollout
    if rollout.placement != "disaggregated":
        return world_size
    if config.trainer.job == "smoke":
        raise ConfigError("rollout.placement=disaggregated: trainer.job=smoke has no rollouts; use colocated")
    if rollout.num_ranks >= world_size:
        raise ConfigError(
            f"rollout.num_ranks={rollout.num_ranks} leaves no training rank in a launch of "
            f"{world_size}; allowed: 1..{world_size - 1}"
        )
    return rollout.num_ranks


def _check_staleness(config: Config, recipe) -> None:
    """Rollouts ahead of training (``rollout.max_staleness`` > 0) need a recipe that can
    train on an older policy's samples."""
    staleness = config.rollout.max_staleness
    if not staleness:
        return
    if recipe.generation_window is not None:
        raise ConfigError(
            f"rollout.max_staleness={staleness} cannot be combined with generation_window "
            "(tppo): its window pool is continued in step with training; use 0"
        )
    if recipe.rollout_correction is None:
        raise ConfigError(
            f"rollout.max_staleness={staleness} trains on samples of an older policy: "
            "set algorithm.overrides.rollout_correction (e.g. {kind: token_tis, cap: 2.0}) so the "
            "loss reweights them by Megatron's over vLLM's probabilities"
        )


def _check_layouts(config: Config, world_size: int, shape: ModelShape) -> None:
    """Actor and critic layouts against the world size and the real model."""
    layouts = [("parallel", config.parallel)]
    if config.critic_parallel is not None:  # also for a recipe without a critic: the section is wrong either way
        layouts.append(("critic_parallel", config.critic_parallel))
    for section, layout in layouts:
        try:
            layout.validate(world_size, shape)
        except LayoutError as err:
            raise ConfigError(f"{section}: {err}") from None
        if config.model.moe_token_dispatcher_type == "local" and (layout.ep > 1 or layout.etp > 1):
            raise ConfigError(
                f"model.moe_token_dispatcher_type=local keeps every expert on each rank, but {section} has "
                f"expert_model_parallel_size={layout.ep}, expert_tensor_parallel_size={layout.etp}; "
                "use alltoall or allgather"
            )


def _check_token_budget(config: Config) -> None:
    """Sequences and packed rows must split evenly over the layout's ranks: under context
    parallelism every sequence into 2·CP chunks, and under sequence parallelism every CP rank's
    share over the TP ranks once more. Padded rows are trainer.seq_length long; a packed row
    at most trainer.max_tokens_per_micro_batch (>= seq_length is the schema's check)."""
    budget = config.trainer.max_tokens_per_micro_batch
    for section, layout in (("parallel", config.parallel), ("critic_parallel", config.critic_parallel)):
        if layout is None:
            continue
        tp = layout.tp if layout.sequence_parallel_enabled else 1
        multiple = sequence_multiple(layout.cp, tp)
        why = (
            f"{section}: context_parallel_size={layout.cp} splits every sequence into 2·CP chunks"
            + (f", each a multiple of tensor_model_parallel_size={layout.tp} (sequence parallelism)" if tp > 1 else "")
            if layout.cp > 1
            else f"sequence parallelism splits every packed row over {section}.tensor_model_parallel_size={layout.tp}"
        )
        if budget is None:
            if layout.cp > 1 and config.trainer.seq_length % multiple:
                length = config.trainer.seq_length
                raise ConfigError(f"trainer.seq_length={length} must be a multiple of {multiple}: {why}")
        elif budget % multiple:
            raise ConfigError(f"trainer.max_tokens_per_micro_batch={budget} must be a multiple of {multiple}: {why}")


def _check_smoke_batch(config: Config, world_size: int) -> None:
    """The smoke job splits trainer.global_batch_size over the actor's DP ranks and micro-batches."""
    dp, mbs = config.parallel.dp(world_size), config.trainer.micro_batch_size
    if config.trainer.global_batch_size % (mbs * dp):
        raise ConfigError(
            f"trainer.global_batch_size={config.trainer.global_batch_size} must be a multiple of "
            f"trainer.micro_batch_size x data-parallel size = {mbs}x{dp} (trainer.job=smoke)"
        )


def _check_prompts(config: Config) -> None:
    """The prompt file exists and its first rows hold a prompt and an answer (the data module's
    own reader and row parser); task:<name> data names a known task; reasoning_gym:<dataset>
    data names a dataset whose config takes data.options."""
    spec = sources.gym_spec(config)
    if spec is not None:
        try:
            check_spec(spec)
        except ValueError as err:
            raise ConfigError(f"data.source={config.data.source!r}: {err}") from None
        return
    name = sources.task_name(config)
    if name is not None and name not in sources.TOOL_TASKS:
        try:
            get_task(name)
        except ValueError as err:  # lists the valid ones
            raise ConfigError(f"data.source={config.data.source!r}: {err}") from None
    path = sources.prompt_file(config)
    if path is None:  # the trainer builds the task base and writes its prompts
        return

    where = f"data.source={config.data.source!r} with model.hf_path" if name else "data.source"
    _check_prompt_rows(config, path, where)


def _check_prompt_rows(config: Config, path: Path, where: str) -> None:
    """The file exists and its first rows hold a prompt and an answer (the data module's own
    reader and row parser, with the data section's field names)."""
    try:
        rows = list(itertools.islice(read_rows(path), FIRST_ROWS))
    except DatasetFormatError as err:  # no such file, unknown suffix
        raise ConfigError(f"{where}: {err}") from None
    except (ValueError, OSError) as err:  # unreadable, not Parquet after all (pyarrow's ArrowInvalid)
        raise ConfigError(f"{where}: {path} cannot be read: {err}") from None
    if not rows:
        raise ConfigError(f"{where}: {path} holds no rows")
    fields = PromptFields(prompt=config.data.prompt_key, answer=config.data.answer_key)
    try:
        for location, row in rows:
            parse_row(location, row, fields)
    except DatasetFormatError as err:
        raise ConfigError(
            f"{where}: {err}; data.prompt_key={fields.prompt!r}, data.answer_key={fields.answer!r}"
        ) from None


def _check_eval(config: Config) -> None:
    """Eval runs in an RL job (on its colocated engines or its rollout ranks), and every set
    names prompts training never draws: the task's held-out split, a file other than the
    training data, or a reasoning-gym dataset its config accepts. The size and the answers
    of a set are checked when the trainer reads it."""
    ev = config.eval
    if not ev.enabled:
        return
    if config.trainer.job != "rl":
        raise ConfigError(f"eval needs trainer.job=rl (trainer.job={config.trainer.job} generates nothing)")
    if ev.n_samples > MAX_SAMPLES:
        raise ConfigError(f"eval.n_samples={ev.n_samples} exceeds the {MAX_SAMPLES} that per-sample seeds allow")
    training_file = sources.prompt_file(config)
    for name, spec in ev.sets.items():
        where = f"eval.sets.{name}.source={spec.source!r}"
        if spec.gym:
            _check_gym_set(where, spec)
            continue
        if spec.source == HELD_OUT:
            if sources.gym_spec(config) is not None:
                raise ConfigError(
                    f"{where} needs task:<name> data; for {config.data.source} data name a set of its own, "
                    f"e.g. eval.sets.{name}.source={config.data.source} eval.sets.{name}.seed=1 (questions "
                    "training draws are skipped)"
                )
            if sources.task_name(config) is None:
                raise ConfigError(
                    f"{where} needs task:<name> data (data.source={config.data.source!r} is a file): name "
                    f"a file of held-out prompts (eval.sets.{name}.source=FILE) or turn eval off with eval.sets={{}}"
                )
            held_out = sources.held_out_file(config)
            if held_out is not None and not held_out.is_file():
                raise ConfigError(f"{where}: {held_out} does not exist (model.hf_path holds no held-out split)")
            continue
        path = Path(spec.source)
        if training_file is not None and path.resolve() == training_file.resolve():
            raise ConfigError(f"{where} is the training data; evaluate on prompts training never draws")
        _check_prompt_rows(config, path, where)


def _check_gym_set(where: str, spec: EvalSetConfig) -> None:
    """The dataset exists and its config takes the set's options (reasoning-gym's own checks)."""
    try:
        check_spec(GymSpec(spec.source[len(SOURCE_PREFIX) :], dict(spec.options), spec.seed, spec.size))
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None


def _check_reward(config: Config) -> None:
    """A named reward exists; ``auto`` needs no lookup (nor the verifiers' imports).
    reasoning-gym prompts carry references only its reward reads, and only they carry them."""
    gym = sources.gym_spec(config) is not None
    if config.data.reward not in ("auto", "reasoning_gym") and gym:
        raise ConfigError(
            f"data.reward={config.data.reward!r}: reasoning_gym:<dataset> data is scored by "
            "data.reward=reasoning_gym (or auto)"
        )
    if config.data.reward == "reasoning_gym" and not gym:
        raise ConfigError(
            f"data.reward=reasoning_gym needs data.source=reasoning_gym:<dataset>, not {config.data.source!r}"
        )
    if config.data.reward == "auto":
        return

    if config.data.reward not in REWARDS:
        raise ConfigError(
            f"data.reward={config.data.reward!r} is not allowed; choose one of {sorted(['auto', *REWARDS])}"
        )


def check_recipe(config: Config):
    """The recipe builds, and its pieces work together in the trainer (also what
    ``megatron-rl config`` checks: it needs no world size); None for the supervised recipes
    (reward_model, sft), which have no RL recipe."""
    if config.algorithm.supervised and config.trainer.job != "smoke":
        return None
    recipe = config.algorithm.build()  # unknown recipe, bad override names or values
    if recipe.generation_window is not None and recipe.token_aware:
        raise ConfigError(
            "algorithm: generation_window (tppo) cannot be combined with the HAPO pieces "
            "(temperature_tau, entropy_clip_alpha, redistribution_beta): a response's windows "
            "would be sampled under different entropy statistics"
        )
    if recipe.generation_window is not None and config.rollout.seed_per_prompt:
        raise ConfigError(
            "rollout.seed_per_prompt=true cannot be combined with generation_window (tppo): "
            "a window continued at a later step has no per-prompt seed yet; use false"
        )
    if recipe.generation_window is not None and recipe.dynamic_sampling:
        raise ConfigError(
            "algorithm: generation_window (tppo) cannot be combined with dynamic_sampling: "
            "responses finish at different steps, so there are no whole groups to filter"
        )
    return recipe


def _check_rows_per_step(config: Config, world_size: int, recipe) -> None:
    """A step's rollout can fill at least one training batch; otherwise every step trains nothing."""
    groups, group_size = config.rollout.prompts_per_step, config.rollout.n_samples
    multiple = train_row_multiple(config, world_size, recipe.use_critic)
    if recipe.generation_window is not None:  # T-PPO trains any rows of its pool
        try:
            check_window_pool(groups * group_size, group_size, multiple)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    elif usable_groups(groups, group_size, multiple) == 0:
        raise ConfigError(
            f"rollout.prompts_per_step={groups} groups of rollout.n_samples={group_size} cannot fill one "
            f"training batch of {multiple} rows in whole groups (data-parallel size x trainer.micro_batch_size "
            "(without a token budget) x algorithm.mini_batches_per_step); "
            "raise rollout.prompts_per_step or lower the others"
        )


def _check_environment(config: Config, world_size: int, recipe) -> None:
    """Names against the registries; multi-turn episodes refuse, one line each, what the
    episode source does not cover yet; the tool sandbox's isolation (probed here, so a
    missing one stops the run before any model is built)."""
    env = config.environment
    if env.name not in ENVIRONMENTS:
        raise ConfigError(f"environment.name={env.name!r} is not allowed; choose one of {sorted(ENVIRONMENTS)}")
    if env.parser not in TOOL_PARSERS:
        raise ConfigError(f"environment.parser={env.parser!r} is not allowed; choose one of {sorted(TOOL_PARSERS)}")
    try:
        check_tool_names(env.tools)
    except ValueError as err:
        raise ConfigError(f"environment.tools: {err}") from None
    if not env.episodes:
        return
    _refuse_for_episodes(config, recipe)
    if env.max_episode_tokens > config.trainer.seq_length:
        raise ConfigError(
            f"environment.max_episode_tokens={env.max_episode_tokens} must be <= trainer.seq_length="
            f"{config.trainer.seq_length}: a whole episode is one training row"
        )
    if config.rollout.parity_every and env.max_episode_tokens >= config.trainer.seq_length:
        raise ConfigError(
            f"rollout.parity_every={config.rollout.parity_every} scores whole episodes in vLLM, which needs a position "
            f"past the longest: environment.max_episode_tokens={env.max_episode_tokens} must be < trainer.seq_length="
            f"{config.trainer.seq_length}"
        )
    if config.rollout.seed_per_prompt and config.rollout.n_samples * env.max_turns > MAX_SAMPLES:
        raise ConfigError(
            f"rollout.seed_per_prompt=true gives a prompt's episodes {MAX_SAMPLES} seeds, one per turn: "
            f"rollout.n_samples={config.rollout.n_samples} x environment.max_turns={env.max_turns} is more"
        )
    if "python" in env.tools:
        try:
            # Through the module, where a test stands in a probe of another machine.
            isolation.require_isolation(env.sandbox, isolation.probe_isolation())
        except isolation.IsolationError as err:
            raise ConfigError(f"environment.sandbox: {err}") from None


def _refuse_for_episodes(config: Config, recipe) -> None:
    """What multi-turn episodes do not run with yet, one line each."""
    name, rollout = config.environment.name, config.rollout
    refusals = [
        (rollout.partial, "rollout.partial=true (partial rollouts)"),
        (recipe.generation_window is not None, "generation_window (tppo's windows)"),
        (recipe.token_aware, "the HAPO pieces (per-token temperatures)"),
        (config.eval.enabled, "eval (the eval phase is single-turn; turn it off with eval.sets={})"),
        (
            rollout.tensor_parallel_size > 1,
            f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} (each vLLM replica runs its episodes' "
            "tools on its one rank: use 1)",
        ),
    ]
    for refused, what in refusals:
        if refused:
            raise ConfigError(f"environment.name={name} is not supported yet with {what}")
