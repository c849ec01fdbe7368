"""The run's reward as built from its config: data.reward alone, or ``reward.scorers``.

A judge scorer (kind ``judge``) runs its own vLLM engine in a worker process beside rank 0
(rollout.judge), started while the trainer builds the rest, so its start-up overlaps the
run's; rank 0 scores and sends the scores to every rank. Its timeout bounds each batch. It
is a served scorer: colocated lockstep rollouts hand it each group as the group finishes
(trainer.overlapped_scoring).

A model scorer (kind ``model``) is a reward model trained by algorithm.recipe=reward_model.
On ``engine: vllm`` rank 0 exports it to HF once (``<run_dir>/scorers/<name>/step-<k>``) and
serves it like a judge, a served scorer. On ``engine: megatron`` (the default) it is built
in the actor's layout beside it and loaded from its checkpoint (resharded as needed,
the run's random streams untouched), frozen. It scores a response as the reward model was
trained to: its scalar head at the last token of the whole conversation, here the
policy's prompt and response ids as generated (the tokenizers were checked to be the
same). Colocated, this forward costs a fraction of the step's training forward-backward
on the same rows and needs no second engine or weight copy in vLLM; every rank computes
it together and gets every score, as every rank needs them for the advantages.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.bridge.convert import megatron_to_hf
from megatron_rl.checkpoint import Checkpointer
from megatron_rl.checkpoint import format as fmt
from megatron_rl.config import Config
from megatron_rl.config.reward import BASE, JUDGE, MODEL, RULE, VLLM, ScorerConfig
from megatron_rl.from_config import setup
from megatron_rl.from_config.scorer_checks import reward_model_arch, reward_model_root
from megatron_rl.models.builder import build_model
from megatron_rl.rewards import TimedWorkerPool, build_verifier
from megatron_rl.rewards.judge import JudgeScorer, Verdicts
from megatron_rl.rewards.registry import Verifier
from megatron_rl.rewards.scoring import (
    Responses,
    RuleScorer,
    ScorerOutput,
    SingleRule,
    WeightedReward,
    WeightedScorer,
    penalize_unfinished,
)
from megatron_rl.rewards.served_model import ServedModelScorer
from megatron_rl.rewards.vllm_reward_model import WORKER as REWARD_MODEL_WORKER
from megatron_rl.rollout import judge
from megatron_rl.schedules.packing import Microbatching
from megatron_rl.schedules.preference import sequence_rewards


class ModelScorer:
    """A frozen reward model's score of each response, on every rank (collective)."""

    def __init__(self, where: str, scorer: ScorerConfig, cfg: Config, dp_size: int, pad_token_id: int):
        arch = reward_model_arch(where, scorer)
        self.chunks = build_model("critic", arch, cfg.parallel, setup.build_options(cfg))
        with Checkpointer() as checkpointer:
            checkpointer.load(reward_model_root(scorer.path), model=self.chunks, step=scorer.step, restore_rng=False)
        for chunk in self.chunks:
            chunk.eval()
            chunk.requires_grad_(False)
        self.seq_length = cfg.trainer.seq_length
        self.pad_token_id = pad_token_id
        self.micro = Microbatching(
            micro_batch_size=cfg.trainer.micro_batch_size, max_tokens=cfg.trainer.max_tokens_per_micro_batch
        )
        self.multiple = dp_size * cfg.trainer.micro_batch_size
        self.missing_eos_penalty = scorer.missing_eos_penalty

    @torch.no_grad()
    def score(self, responses: Responses) -> ScorerOutput:
        rows = [list(p) + list(r) for p, r in zip(responses.prompt_ids, responses.response_ids)]
        scores = sequence_rewards(self.chunks, rows, self.seq_length, self.pad_token_id, self.micro, self.multiple)
        return ScorerOutput(
            penalize_unfinished(scores.double().tolist(), responses.truncated, self.missing_eos_penalty)
        )

    def close(self) -> None:
        self.chunks = []


JUDGE_MAX_MODEL_LEN = 4096
"""The judge engine's context, at most (its own config's limit when lower)."""
JUDGE_KV_CACHE_GIB = 1.0
"""The judge engine's KV cache on CPU (vLLM's CPU backend takes whole GiB)."""


def served_model_len(model_dir: Path) -> int:
    """A served scorer engine's context: JUDGE_MAX_MODEL_LEN, or the model's own limit when lower."""
    limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", JUDGE_MAX_MODEL_LEN)
    return min(limit, JUDGE_MAX_MODEL_LEN)


def build_judge(scorer: ScorerConfig, base_dir: Path, seed: int) -> JudgeScorer:
    """The judge's worker pool (started now) and its prompt and verdict settings."""
    model_dir = Path(base_dir if scorer.path == BASE else scorer.path)
    pool = TimedWorkerPool(
        judge.TARGET,
        timeout_s=scorer.timeout_s,
        init_args=[
            str(model_dir),
            scorer.max_new_tokens,
            served_model_len(model_dir),
            JUDGE_KV_CACHE_GIB,
            scorer.gpu_memory_utilization,
            seed,
        ],
    )
    pool.start()
    verdicts = Verdicts(scorer.verdict_pattern, scorer.verdict_scores)
    return JudgeScorer(pool, scorer.template, verdicts, scorer.on_malformed, scorer.batch_size)


SCORERS_DIR = "scorers"
"""Where in the run directory a served reward model's HF export lives."""


def build_served_model(name: str, scorer: ScorerConfig, run_dir: Path, seed: int) -> ServedModelScorer:
    """The reward model exported to HF (once per run and step) and its worker pool (started now)."""
    root = reward_model_root(scorer.path)
    hf_dir = export_reward_model(root, fmt.resolve_step(root, scorer.step), run_dir / SCORERS_DIR / name)
    pool = TimedWorkerPool(
        REWARD_MODEL_WORKER,
        timeout_s=scorer.timeout_s,
        init_args=[
            str(hf_dir),
            served_model_len(hf_dir),
            JUDGE_KV_CACHE_GIB,
            scorer.gpu_memory_utilization,
            seed,
        ],
    )
    pool.start()
    return ServedModelScorer(pool, scorer.batch_size, scorer.on_malformed, scorer.missing_eos_penalty)


def export_reward_model(root: Path, step: int, where: Path) -> Path:
    """``where``/step-<step>: the reward model of checkpoint ``root`` at ``step`` as an HF
    directory, written beside and renamed into place, so a run that stops while exporting
    leaves no half directory for a resumed run to read; a resumed run reuses the export."""
    out = where / f"step-{step}"
    if out.is_dir():
        return out
    partial = where / f"step-{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    megatron_to_hf(root, partial, step)
    partial.rename(out)
    return out


def share_from_rank_zero(outputs: dict) -> dict:
    """Rank 0's ``outputs`` on every rank (a collective)."""
    box = [outputs]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return dict(box[0])


def build_reward(
    cfg: Config, verifier: Verifier, rule_name: str, *, base_dir: Path, run_dir: Path, dp_size: int, pad_token_id: int
):
    """What scores the run's responses: ``verifier`` (data.reward's) alone, or the weighted
    scorers of ``reward.scorers`` (a rule of data.reward's name shares ``verifier``).
    ``base_dir``: a judge's ``base``; ``run_dir``: where served reward models are exported."""
    if not cfg.reward.scorers:
        return SingleRule(verifier)
    rank = dist.get_rank() if dist.is_initialized() else 0
    scorers = []
    for name, scorer in cfg.reward.scorers.items():
        where = f"reward.scorers.{name}"
        served = scorer.kind == JUDGE or scorer.engine == VLLM
        if scorer.kind == MODEL and served:
            built = build_served_model(name, scorer, run_dir, cfg.trainer.seed) if rank == 0 else None
        elif scorer.kind == MODEL:
            built = ModelScorer(where, scorer, cfg, dp_size, pad_token_id)
        elif scorer.kind == JUDGE:
            built = build_judge(scorer, base_dir, cfg.trainer.seed) if rank == 0 else None
        else:
            built = _rule_scorer(scorer, verifier, rule_name)
        kinds = dict(is_rule=scorer.kind == RULE, served=served)
        scorers.append(WeightedScorer(name, built, scorer.weight, **kinds))
    return WeightedReward(scorers, share=share_from_rank_zero)


def _rule_scorer(scorer: ScorerConfig, verifier: Verifier, rule_name: str) -> RuleScorer:
    """A rule of data.reward's name borrows the run's verifier (eval shares it, its owner
    closes it); any other rule gets a verifier of its own."""
    name = rule_name if scorer.reward == "auto" else scorer.reward
    if name == rule_name:
        return RuleScorer(verifier, owns_verifier=False)
    return RuleScorer(build_verifier(name))
