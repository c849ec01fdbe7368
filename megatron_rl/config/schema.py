"""The configuration tree: one dataclass per component, a docstring under every field.

Each section validates only its own fields (raising, never rewriting); everything that
spans sections (layouts against the real model, recipe compatibility, batch sizes, data,
reward and task names) is the one pass :func:`megatron_rl.from_config.checks.validate`. Later
components add their sections here.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.reward import RewardConfig
from megatron_rl.config.sandbox import SandboxConfig
from megatron_rl.data.reasoning_gym import SOURCE_PREFIX as GYM_PREFIX
from megatron_rl.models.presets import PRESETS
from megatron_rl.monitor.config import OnlineConfig
from megatron_rl.parallel.config import ParallelConfig
from megatron_rl.utils import dtypes

TASK_PREFIX = "task:"
"""``data.source`` of a built-in synthetic task (megatron_rl.tasks)."""
PAIRS_PREFIX = "pairs:"
"""``data.source`` of preference pairs (reward-model training): ``pairs:PATH`` (JSONL or
Parquet, megatron_rl.data.pairs), or ``pairs:task:<name>``: pairs the task writes itself."""
REWARD_MODEL = "reward_model"
"""``algorithm.recipe`` that trains a reward model (Bradley-Terry) instead of a policy."""
SFT = "sft"
"""``algorithm.recipe`` that fine-tunes the policy on chat conversations (supervised, no rollouts)."""
SUPERVISED = (REWARD_MODEL, SFT)
"""The recipes that train on data alone: no rollouts, no RL recipe."""
MODEL_ROLE = "model_role"
"""The checkpoint ``extra`` entry a reward model's steps carry (value: REWARD_MODEL), so that
tools reading a checkpoint know its last layer is a scalar head, not an LM head."""


def _choice(section: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{name}={value!r} is not allowed; choose one of {sorted(allowed)}")


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "experts")
"""model.lora.targets' values (models.lora.TARGETS): attention QKV and output, dense MLP FC1 and
FC2, and FC1 and FC2 of every MoE expert."""
LORA_SYNC_MODES = ("merged", "adapter")
"""model.lora.sync: ``merged`` syncs the base with the adapters folded in (every weight);
``adapter`` the adapters alone into vLLM's LoRA slot (rollout.adapter_sync, dense models:
vLLM 0.32 runs an engine's MoE layers with LoRA on GPU Triton kernels only). Measured on
CPU (docs/benchmarks.md): the adapter sync moves 0.74 % of the bytes and takes 1/11 of the
time, but vLLM's CPU LoRA kernels slow generation 2.9x, so the step is 1.8x slower: merged
is the default."""


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    """LoRA: the actor's base frozen, low-rank adapters trained beside the target linears
    (models.lora); vLLM gets the adapters alone at every sync, or the base with them merged
    in (``sync``)."""

    rank: int = 8
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on each adapter's input, in training."""
    targets: list = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    """Which linears get adapters, among qkv, proj, fc1, fc2 (dense MLPs) and experts (FC1 and
    FC2 of every MoE expert, each its own adapters); targets a model lacks are skipped."""
    sync: str = "merged"
    """How vLLM gets the trained policy (:data:`LORA_SYNC_MODES`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"model.lora.rank={self.rank!r} must be an integer >= 1")
        if not isinstance(self.alpha, (int, float)) or self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha={self.alpha!r} must be a number > 0")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout={self.dropout!r} must be in [0, 1)")
        unknown = [t for t in self.targets if t not in LORA_TARGETS] if isinstance(self.targets, list) else None
        if unknown is None or unknown or not self.targets:
            raise ConfigError(f"model.lora.targets={self.targets!r}: a non-empty list of {', '.join(LORA_TARGETS)}")
        if self.sync not in LORA_SYNC_MODES:
            raise ConfigError(f"model.lora.sync={self.sync!r}; allowed: {', '.join(LORA_SYNC_MODES)}")


MOE_DISPATCHERS = ("alltoall", "allgather", "local")
"""model.moe_token_dispatcher_type's values (models.builder.DISPATCHERS)."""


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Which model to build and in which numerics."""

    hf_path: Optional[str] = None
    """Directory of a Hugging Face model (config.json is read for the architecture)."""
    preset: Optional[str] = "tiny-moe"
    """Built-in model used when hf_path is not set, by name (models.presets: tiny-moe is
    qwen3_moe, 2 layers, 8 experts; tiny-dense is qwen3, 2 layers). For RL on task:<name>
    data the trainer builds it as the task's supervised base; trainer.job=smoke builds it as
    it stands. RL on a prompt file has no built-in base: it needs hf_path."""
    dtype: str = "fp32"
    """Parameter dtype: fp32 | bf16 | fp16."""
    moe_token_dispatcher_type: str = "alltoall"
    """MoE token dispatcher: Megatron's alltoall | allgather, or local: every expert on each
    rank (expert and expert-tensor parallel size 1), without Megatron's host syncs and copies
    of every token (models.local_dispatch; the same results bit for bit)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE load-balancing loss weight; 0 turns it off."""
    recompute_activations: bool = False
    """Recompute each layer's activations in backward (saves memory)."""
    lora: Optional[LoraConfig] = None
    """Train LoRA adapters instead of the whole actor (None: full training)."""
    ckpt: Optional[str] = None
    """RL from a megatron_rl checkpoint (an SFT run's, another RL run's ``checkpoints/``, any
    layout): the actor, the critic's backbone and the KL reference start from its newest
    step's weights instead of the HF directory's (hf_path, or the task's base), which still
    gives the architecture, the tokenizer and vLLM's first build (the weights are then
    synced in). None: the HF directory's weights."""

    def __post_init__(self) -> None:
        if self.hf_path is None and self.preset is None:
            raise ConfigError("model needs hf_path or preset; neither is set")
        if self.hf_path is None:
            _choice("model", "preset", self.preset, PRESETS)
        _choice("model", "dtype", self.dtype, dtypes.SHORT_NAMES)
        _choice("model", "moe_token_dispatcher_type", self.moe_token_dispatcher_type, MOE_DISPATCHERS)
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} must be >= 0")


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    """The run: where it writes, how long it runs, its seed."""

    job: str = "rl"
    """What `train` runs: rl (algorithm.recipe's trainer: the RL loop, or for
    recipe=reward_model the reward model's training, for recipe=sft supervised fine-tuning)
    or smoke (supervised model smoke job)."""
    run_dir: str = "runs/default"
    """Directory for metrics.jsonl, config.yaml and checkpoints."""
    max_steps: int = 20
    """Number of optimizer steps."""
    seed: int = 1234
    """Seed for init, data order and sampling."""
    lr: float = 1e-3
    """Peak learning rate of the actor."""
    micro_batch_size: int = 2
    """Rows per micro-batch of padded rows (RL training uses it only without
    max_tokens_per_micro_batch; the smoke job always; reward_model: pairs per micro-batch;
    sft: conversations per micro-batch without max_tokens_per_micro_batch)."""
    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks (trainer.job=smoke, and
    pairs per step for recipe=reward_model, conversations per step for recipe=sft: an RL step
    trains rollout.prompts_per_step x rollout.n_samples rows)."""
    seq_length: int = 32
    """Longest training sequence (prompt + response). Padded rows (no token budget) are
    all this long."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Sequence packing: each micro-batch is one row of whole sequences, at most this many
    tokens (>= seq_length; a multiple of TP under sequence parallelism). null: padded rows,
    trainer.micro_batch_size per micro-batch."""
    lr_warmup_steps: int = 0
    """Linear learning-rate warm-up, then constant."""
    dist_timeout_s: float = 600.0
    """Longest wait of any collective of the training ranks (the default group and
    Megatron's groups) before the rank fails: what bounds the hang when a node dies or
    its network is cut. Above the longest a rank may wait for the others (a checkpoint
    save, the slowest rank's generation)."""
    loggers: tuple[str, ...] = ("tensorboard",)
    """Where the per-step scalars go besides metrics.jsonl (always written): tensorboard
    (RUN_DIR/tensorboard), wandb (offline under RUN_DIR unless WANDB_MODE says otherwise),
    mlflow (a file store in RUN_DIR/mlruns unless MLFLOW_TRACKING_URI is set); [] for none."""
    project: str = "megatron-rl"
    """The wandb project and MLflow experiment a run is logged under (its name: the run dir's)."""
    save_rollouts: bool = False
    """Write each step's training rows to RUN_DIR/rollouts/step_NNNNNN.jsonl (rank 0, one JSON
    line per row: tokens, vLLM's and Megatron's logprobs, advantages, reward, group, the
    policy-loss tokens; trainer/rollout_log.py), to read what the policy wrote or replay the
    update elsewhere. RL runs only (trainer.job=rl)."""

    def __post_init__(self) -> None:
        _choice("trainer", "job", self.job, ("rl", "smoke"))
        if self.save_rollouts and self.job != "rl":
            raise ConfigError(f"trainer.save_rollouts=true needs trainer.job=rl; {self.job} has no rollouts")
        if self.dist_timeout_s <= 0:
            raise ConfigError(f"trainer.dist_timeout_s={self.dist_timeout_s} must be > 0")
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"trainer.lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        for name in ("max_steps", "micro_batch_size", "global_batch_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name}={getattr(self, name)} must be >= 1")
        if self.lr <= 0:
            raise ConfigError(f"trainer.lr={self.lr} must be > 0")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and budget < self.seq_length:
            raise ConfigError(
                f"trainer.max_tokens_per_micro_batch={budget} is smaller than trainer.seq_length="
                f"{self.seq_length}, the longest sequence a micro-batch must hold"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"trainer.global_batch_size={self.global_batch_size} must be a multiple of "
                f"trainer.micro_batch_size={self.micro_batch_size}"
            )


@dataclasses.dataclass(kw_only=True)
class TeacherConfig:
    """The teacher of on-policy distillation (a recipe with distill_coef > 0, e.g. opd)."""

    path: str = ""
    """The teacher's HF directory (model and tokenizer: the student's tokenizer and chat
    template, checked), or ``task``: with task:<name> data the run builds the task's teacher
    (a dense model about ten times the tiny bases, warmed up on true answers; cached like
    the base). It runs frozen in the actor's layout beside it, so its shape must fit that
    layout (a larger teacher: more layers or width, the same vocabulary)."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("algorithm.teacher.path must name the teacher's HF directory")


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """The RL algorithm: a recipe of megatron_rl.algorithms (ppo, grpo, dapo, vapo, tppo, hapo),
    or reward_model (Bradley-Terry training of a scalar reward model on preference pairs), or
    sft (supervised fine-tuning on chat conversations)."""

    recipe: str = "dapo"
    """Name of the recipe (see megatron_rl.algorithms.RECIPES), or reward_model (with
    data.source=pairs:PATH or pairs:task:<name>), or sft (with data.source a JSONL/Parquet
    file of ``messages`` rows, or task:<name>: the task's solutions as conversations)."""
    overrides: dict = dataclasses.field(default_factory=dict)
    """Recipe fields to change, e.g. {clip_high: 0.3, overlong: {max_len: 64, buffer_len: 16}}."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    mini_batches_per_step: int = 1
    """Optimizer steps per PPO epoch (the rollout batch is split into this many)."""
    shuffle_mini_batches: bool = False
    """Shuffle the step's rows before each epoch splits them into mini-batches, as verl's and
    OpenRLHF's trainers do; false keeps them in rollout order, so that each mini-batch holds
    whole groups of consecutive prompts. The order is drawn from trainer.seed, the step and
    the epoch: the same on every rank and after a resume."""
    teacher: Optional[TeacherConfig] = None
    """On-policy distillation's teacher ({path: HF_DIR}); needed by recipes with
    distill_coef > 0 (opd, or algorithm.overrides={distill_coef: ...} beside any reward)."""
    max_empty_steps: int = 5
    """Steps in a row that keep no trainable group (dynamic sampling dropped them all) before
    the run stops with exit code 2: the actor no longer changes, so generating on is waste."""

    def __post_init__(self) -> None:
        # The recipe itself is checked by checks.validate (building it imports torch).
        for name in ("ppo_epochs", "mini_batches_per_step", "max_empty_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"algorithm.{name}={getattr(self, name)} must be >= 1")
        if not isinstance(self.overrides, dict):
            raise ConfigError(f"algorithm.overrides must be a mapping of recipe fields, got {self.overrides!r}")

    @property
    def trains_reward_model(self) -> bool:
        """Whether `train` trains a reward model (trainer.reward_model) rather than a policy."""
        return self.recipe == REWARD_MODEL

    @property
    def supervised(self) -> bool:
        """Whether `train` runs a supervised recipe (reward_model, sft): no rollouts, no RL recipe."""
        return self.recipe in SUPERVISED

    def build(self):
        """The AlgorithmRecipe with the overrides applied (an RL recipe's)."""
        from megatron_rl.algorithms.recipes import RECIPES, get_recipe

        _choice("algorithm", "recipe", self.recipe, (*RECIPES, *SUPERVISED))
        if self.supervised:
            raise ConfigError(f"algorithm.recipe={self.recipe} is supervised: it has no RL recipe to build")
        try:
            return get_recipe(self.recipe, **self.overrides)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"algorithm.overrides: {err}") from None


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """Generation with vLLM: on the training ranks, or on rollout ranks of their own."""

    placement: str = "colocated"
    """colocated: every rank trains and generates, in turn. disaggregated: the last
    ``num_ranks`` ranks of the launch only generate (vLLM), the others only train; weights
    go to them over a bridge group after every update."""
    num_ranks: int = 0
    """disaggregated: how many ranks of the launch run vLLM (a multiple of
    tensor_parallel_size); the training layout gets the rest."""
    timeout_s: float = 3600.0
    """disaggregated: how long the training ranks wait for an answer of the rollout ranks (a
    whole generation batch included) before stopping with an error that names them."""
    start_timeout_s: float = 3600.0
    """disaggregated: how long the training ranks wait for the rollout ranks to build their
    engines (vLLM's start: model load, memory profiling, CUDA graphs on GPU), which can take
    far longer than any later answer; timeout_s can then be set for the steps alone."""
    max_staleness: int = 0
    """disaggregated: how many generation batches the rollout ranks run ahead of training
    (0: synchronous). A batch trained at step s then samples policy version >= s - 1 - k;
    the loss needs algorithm.overrides.rollout_correction to reweight such samples."""
    partial: bool = False
    """disaggregated, max_staleness >= 1: a generation in flight when new weights arrive is
    continued under them (partial rollouts): the rollout ranks generate
    ``partial_chunk_tokens`` at a time and load waiting weights between chunks; every token
    keeps the policy version that sampled it. Off: a generation finishes under the weights
    it started with."""
    partial_chunk_tokens: int = 32
    """partial: new tokens per sample between two looks for new weights (smaller: fresher
    tokens, more vLLM calls). Every chunk after the first prefills the sample's prefix again:
    on ~95-token answers 4-token chunks made generation 3.5x slower, 32-token ones 1.1x."""
    tensor_parallel_size: int = 1
    """vLLM's TP (may differ from training TP); must divide the ranks that run vLLM."""
    prompts_per_step: int = 16
    """Prompts per training step (before dynamic-sampling refills)."""
    n_samples: int = 8
    """Responses per prompt (the group size G)."""
    max_new_tokens: int = 16
    """Response budget per sample."""
    temperature: float = 1.0
    top_p: float = 1.0
    bucket_mb: float = 512.0
    """Weight-sync bucket size."""
    parity_every: int = 0
    """Run the post-sync parity guard every this many steps (0 = never): vLLM's weights are
    read back and its logprobs compared with Megatron's (limits per dtype, docs/design.md)."""
    parity_threshold: Optional[float] = None
    """An extra limit on the largest |logprob difference| (None: the dtype's default limits only)."""
    router_replay: bool = False
    """MoE (R3): vLLM records the experts it routed every token to, and the actor's old-
    logprob recomputation and training forward/backward replay them. MoE models always
    record them for rollout/router_agreement; this switch applies them."""
    seed_per_prompt: bool = False
    """Seed every prompt's samples from (trainer.seed, its epoch, its dataset index): a run
    resumed from a checkpoint, or run with another number of vLLM replicas, samples what
    the uninterrupted run would have. Off: each vLLM replica's own generator (faster on GPU,
    where vLLM samples seeded requests one by one). Not with T-PPO windows."""
    kv_cache_gib: float = 1.0
    """CPU only: vLLM's KV cache size, whole GiB (>= 1)."""
    cpu_linear: str = "packed"
    """CPU only: how vLLM keeps linear weights: packed (oneDNN, vLLM's default: faster
    decode, each sync re-packs) or plain (torch's linear: a sync is a copy)."""
    gpu_memory_utilization: float = 0.4
    """GPU only: vLLM's share of GPU memory."""
    log_level: str = "warning"
    """vLLM's own logging (VLLM_LOGGING_LEVEL): debug | info | warning | error. At info its
    engine and weight-load messages bury the progress line."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "prompts_per_step", "n_samples", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature={self.temperature} must be > 0")
        if self.parity_threshold is not None and not self.parity_threshold > 0:
            raise ConfigError(
                f"rollout.parity_threshold={self.parity_threshold} must be > 0 (or null: the dtype's limits)"
            )
        _choice("rollout", "cpu_linear", self.cpu_linear, ("packed", "plain"))
        _choice("rollout", "placement", self.placement, ("colocated", "disaggregated"))
        if self.placement == "colocated" and self.num_ranks:
            raise ConfigError(
                f"rollout.num_ranks={self.num_ranks} only applies to rollout.placement=disaggregated "
                "(colocated: every rank generates)"
            )
        for key in ("timeout_s", "start_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"rollout.{key}={getattr(self, key)} must be > 0")
        if not (float(self.kv_cache_gib).is_integer() and self.kv_cache_gib >= 1):
            # Refused here, not only when the engine starts: a fault there is requeued by Slurm.
            raise ConfigError(
                f"rollout.kv_cache_gib={self.kv_cache_gib} must be a whole number >= 1 "
                "(vLLM's CPU backend takes whole GiB)"
            )
        if self.max_staleness < 0:
            raise ConfigError(f"rollout.max_staleness={self.max_staleness} must be >= 0 (0: synchronous)")
        if self.placement == "colocated" and self.max_staleness:
            raise ConfigError(
                f"rollout.max_staleness={self.max_staleness} needs rollout.placement=disaggregated "
                "(colocated engines generate only between updates)"
            )
        if self.partial and (self.placement != "disaggregated" or self.max_staleness < 1):
            raise ConfigError(
                f"rollout.partial=true needs rollout.placement=disaggregated and rollout.max_staleness "
                f">= 1 (got {self.placement}, {self.max_staleness}): only a generation running "
                "beside training can receive new weights"
            )
        if self.partial_chunk_tokens < 1:
            raise ConfigError(f"rollout.partial_chunk_tokens={self.partial_chunk_tokens} must be >= 1")
        if self.placement == "disaggregated" and self.num_ranks < 1:
            raise ConfigError(
                f"rollout.num_ranks={self.num_ranks}: rollout.placement=disaggregated needs >= 1 rank for vLLM"
            )
        _choice("rollout", "log_level", self.log_level, ("debug", "info", "warning", "error"))


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """Where prompts come from and how responses are scored."""

    source: str = "task:digits_max"
    """A JSONL/Parquet file of prompts with answers, task:<name> for a built-in synthetic task,
    or reasoning_gym:<dataset> for a reasoning-gym dataset (its questions, scored by its own
    score_answer). algorithm.recipe=reward_model reads preference pairs: pairs:PATH (a
    JSONL/Parquet file of chosen/rejected conversations, or prompt with chosen/rejected
    answers) or pairs:task:<name> (the task's correct against wrong answers, written by the run)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    reward: str = "auto"
    """Verifier name (math, digits, reasoning_gym); auto = the source's own: the task's verifier
    for task:<name>, reasoning_gym for reasoning_gym:<dataset>, math for files."""
    options: dict = dataclasses.field(default_factory=dict)
    """reasoning_gym:<dataset> only: keyword arguments of the dataset's config, e.g.
    {min_terms: 2, max_terms: 2} for chain_sum (data.options.max_n=15 on the command line)."""
    seed: Optional[int] = None
    """The seed of the data and the base built for it (null: trainer.seed): for task:<name>
    the prompts, tokenizer and warm-up of the task's base, for reasoning_gym:<dataset> the
    training set and the base's warm-up. Fixed, with trainer.seed varied, it gives runs
    that start from one base and differ only in sampling and updates. A prompt file (with
    model.hf_path) has no such seed."""
    size: int = 1000
    """reasoning_gym:<dataset> only: entries in the training set."""

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("data.source must name a file, task:<name> or reasoning_gym:<dataset>")
        if not isinstance(self.options, dict):
            raise ConfigError(f"data.options must be a mapping of the dataset's options, got {self.options!r}")
        if self.size < 1:
            raise ConfigError(f"data.size={self.size} must be >= 1")
        if not self.source.startswith(GYM_PREFIX) and self.options:
            raise ConfigError(f"data.options apply to reasoning_gym:<dataset> sources only, not {self.source!r}")
        if self.seed is not None and not self.source.startswith((GYM_PREFIX, TASK_PREFIX, PAIRS_PREFIX + TASK_PREFIX)):
            raise ConfigError(
                f"data.seed applies to task:<name>, pairs:task:<name> and reasoning_gym:<dataset> sources only, "
                f"not {self.source!r}"
            )
        if self.source.startswith(PAIRS_PREFIX) and not self.source[len(PAIRS_PREFIX) :]:
            raise ConfigError("data.source=pairs: needs a file or task:<name> after it, e.g. pairs:prefs.jsonl")


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """When and how the run is saved (under <run_dir>/checkpoints)."""

    save_interval: int = 0
    """Save every this many steps (0 = only at the end)."""
    async_save: bool = True
    """Write in the background; training blocks only for the host copy."""
    snapshot: str = "before_update"
    """When an async save copies the state to host memory: at_save (the save blocks for the
    copy) | before_update (the copy runs in the background during the next rollout; the next
    optimizer update waits only if it is not done)."""
    keep_last: int = 2
    """Committed steps kept on disk."""
    on_corrupt: str = "fallback"
    """What resuming does when the newest step fails its checksums: fallback (warn, rename
    it to step_<N>.corrupt, resume from the newest intact step) | fail (stop with exit 2).
    A damaged step is never deleted."""

    def __post_init__(self) -> None:
        if self.save_interval < 0 or self.keep_last < 1:
            raise ConfigError("checkpoint.save_interval must be >= 0 and checkpoint.keep_last >= 1")
        _choice("checkpoint", "snapshot", self.snapshot, ("at_save", "before_update"))
        _choice("checkpoint", "on_corrupt", self.on_corrupt, ("fallback", "fail"))


EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""What an eval set may be called: it becomes part of metric names (val/<set>/...) and files."""
HELD_OUT = "held_out"
"""eval set source: the held-out split of the training task (its base's eval.jsonl)."""
GYM_EVAL_SIZE = 100
"""Prompts of a reasoning-gym eval set unless its size says otherwise."""


@dataclasses.dataclass(kw_only=True)
class EvalSetConfig:
    """One named eval set: prompts that training never draws, scored with the run's reward
    (a reasoning-gym set with reasoning-gym's). (Its errors name the field alone; the loader
    puts ``eval.sets.<name>.`` before them.)"""

    source: str = HELD_OUT
    """held_out: the held-out split of data.source's task (the task base's eval.jsonl, none of
    whose prompts is among the train.jsonl prompts training draws from); a JSONL/Parquet
    file of prompts with answers (fields data.prompt_key and data.answer_key); or
    reasoning_gym:<dataset>: questions of that reasoning-gym dataset, scored by its own
    score_answer, whatever the training data."""
    max_prompts: Optional[int] = None
    """held_out and files: evaluate only the set's first this many prompts (null: all)."""
    options: dict = dataclasses.field(default_factory=dict)
    """reasoning_gym:<dataset> only: keyword arguments of the dataset's config, as data.options."""
    seed: int = 0
    """reasoning_gym:<dataset> only: the seed reasoning-gym generates the set from."""
    size: int = GYM_EVAL_SIZE
    """reasoning_gym:<dataset> only: prompts in the set: the first this many distinct questions
    of that seed that are not training prompts."""

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError(
                f"source must be {HELD_OUT}, a prompt file or reasoning_gym:<dataset>, got an empty string"
            )
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"max_prompts={self.max_prompts} must be >= 1 (or null: all)")
        if not isinstance(self.options, dict):
            raise ConfigError(f"options must be a mapping of the dataset's options, got {self.options!r}")
        if self.size < 1:
            raise ConfigError(f"size={self.size} must be >= 1")
        if self.gym:
            if self.max_prompts is not None:
                raise ConfigError(f"max_prompts applies to held_out and files; a {self.source} set has size")
            return
        given = [
            name
            for name, default in (("options", {}), ("seed", 0), ("size", GYM_EVAL_SIZE))
            if getattr(self, name) != default
        ]
        if given:
            raise ConfigError(f"{given[0]} applies to reasoning_gym:<dataset> sets only, not {self.source!r}")

    @property
    def gym(self) -> bool:
        """Whether reasoning-gym generates the set."""
        return self.source.startswith(GYM_PREFIX)


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation between steps, on the job's own vLLM engines with the current
    weights, on its own random stream: a run evaluates as often as it likes and trains the
    same. Off unless a set is named and one of every / at_start / at_end asks for it, so
    ``eval.sets={}`` turns a recipe's evaluation off in one override."""

    sets: dict[str, EvalSetConfig] = dataclasses.field(default_factory=dict)
    """Eval sets by name (letters, digits, _ . -), e.g. {held_out: {source: held_out}}."""
    every: int = 0
    """Evaluate after every this many steps (0: never between steps)."""
    at_start: bool = False
    """Evaluate the starting weights before step 1 (a fresh run; logged as step 0)."""
    at_end: bool = False
    """Evaluate after the last step (trainer.max_steps)."""
    n_samples: int = 4
    """Samples per prompt (the n of avg@n and pass@k)."""
    temperature: float = 1.0
    """Sampling temperature; 0: greedy (then n_samples must be 1: every sample is the same)."""
    top_p: float = 1.0
    max_new_tokens: Optional[int] = None
    """Response budget per sample (null: rollout.max_new_tokens)."""
    pass_k: list[int] = dataclasses.field(default_factory=lambda: [1])
    """The k of each val/<set>/pass@<k> (each 1..n_samples)."""
    seed: int = 0
    """Seeds every sample (with its set, prompt and index), apart from the training stream."""

    def __post_init__(self) -> None:
        for name in self.sets:
            if not EVAL_SET_NAME.fullmatch(name):
                raise ConfigError(
                    f"eval.sets: the name {name!r} may hold only letters, digits, '_', '.' and '-' "
                    "(it is part of the metric names val/<set>/...)"
                )
        if self.every < 0:
            raise ConfigError(f"eval.every={self.every} must be >= 0 (0: never between steps)")
        if self.n_samples < 1:
            raise ConfigError(f"eval.n_samples={self.n_samples} must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.temperature == 0 and self.n_samples > 1:
            raise ConfigError(
                f"eval.temperature=0 (greedy) draws the same response {self.n_samples} times: set eval.n_samples=1"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"eval.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"eval.max_new_tokens={self.max_new_tokens} must be >= 1 (or null: rollout's)")
        bad = [k for k in self.pass_k if not 1 <= k <= self.n_samples]
        if bad:
            raise ConfigError(
                f"eval.pass_k={self.pass_k}: each k must be in 1..eval.n_samples={self.n_samples} "
                f"(pass@k needs at least k samples per prompt), got {bad}"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.sets) and bool(self.every or self.at_start or self.at_end)

    def due(self, step: int, max_steps: int) -> bool:
        """Whether the weights after ``step`` are evaluated (step 0: the starting weights)."""
        if not self.enabled:
            return False
        if step == 0:
            return self.at_start
        return bool(self.every and step % self.every == 0) or (self.at_end and step == max_steps)


SINGLE_TURN = "single_turn"
"""environment.name of today's rollouts: one answer per prompt, scored by data.reward."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvironmentConfig:
    """What an episode is (megatron_rl.environments): one answer scored by the reward
    (single_turn), or assistant turns that call tools, whose output comes back as tokens the
    policy is not trained on, until a final answer scored by the reward (tools). Names are
    checked against the registries by checks.validate."""

    name: str = SINGLE_TURN
    """Environment by name (environments.ENVIRONMENTS): single_turn | tools."""
    tools: tuple[str, ...] = ()
    """Tools the prompt lists and the policy may call (environments.tools.TOOLS: python);
    the tools environment needs at least one, single_turn none."""
    max_turns: int = 4
    """Assistant turns of one episode; one still calling tools after the last is truncated."""
    max_episode_tokens: int = 256
    """All tokens of one episode, prompt, turns and tool output (<= trainer.seq_length); an
    episode that reaches it is truncated. Each turn is at most rollout.max_new_tokens."""
    parser: str = "hermes"
    """How the policy writes tool calls (environments.tool_calls.TOOL_PARSERS)."""
    env_threads: int = 8
    """Environment steps (each a turn's tool calls) run at once."""
    overlap: bool = True
    """Generate the next turns of episodes whose tools have answered while other episodes'
    tools still run; false: lockstep rounds, each waiting for its slowest tool call. With
    overlap, which turns share an engine call depends on the tools' timing: a run is
    reproducible only without it (rollout.seed_per_prompt then fixes what is sampled but
    not the last bits of vLLM's logprobs)."""
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    """Limits of one python tool call and whether a run may go on with weaker isolation
    (config.sandbox.SandboxConfig, enforced by environments.sandbox)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_episode_tokens", "env_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"environment.{name}={getattr(self, name)} must be >= 1")
        if self.name == SINGLE_TURN and self.tools:
            raise ConfigError(f"environment.tools={list(self.tools)} needs a multi-turn environment, not single_turn")
        if self.name != SINGLE_TURN and not self.tools:
            raise ConfigError(f"environment.name={self.name} needs environment.tools, e.g. [python]")
        if len(set(self.tools)) != len(self.tools):
            raise ConfigError(f"environment.tools={list(self.tools)} names a tool twice")

    @property
    def episodes(self) -> bool:
        """Whether rollouts are multi-turn episodes (trainer.episodes), not single answers."""
        return self.name != SINGLE_TURN


@dataclasses.dataclass(kw_only=True)
class Config:
    """The whole run."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model (actor; the critic shares its architecture)."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """The actor's parallel layout."""
    critic_parallel: Optional[ParallelConfig] = None
    """The critic's own parallel layout (recipes with a critic); null = the actor's. The
    critic gets its own Megatron process groups, so e.g. a TP2·EP2 actor can train beside
    a PP2 critic on the same ranks."""
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    """The run itself."""
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    """The RL recipe and PPO epoch structure."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Generation with vLLM."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Prompts and rewards."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    monitor: OnlineConfig = dataclasses.field(default_factory=OnlineConfig)
    """Faulty-machine detection beside training (Minder); off unless monitor.enabled=true."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Held-out evaluation between steps; off unless eval.sets names a set and it is due."""
    environment: EnvironmentConfig = dataclasses.field(default_factory=EnvironmentConfig)
    """What an episode is: single answers (single_turn, the default) or tool-using turns."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """The scorers a response's reward is the weighted sum of (none: data.reward alone)."""

    @property
    def critic_layout(self) -> ParallelConfig:
        """The layout the critic is built in."""
        return self.critic_parallel or self.parallel
