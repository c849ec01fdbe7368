"""RLTrainer: the RL loop, one method per phase of a step.

:meth:`RLTrainer.step` reads as the algorithm: rollout (the source generates, scores,
shapes and filters) -> the step's rows in the training layout -> forward passes without
gradients (HAPO's per-token temperatures, critic values, old logprobs and the
train/inference mismatch, reference logprobs) -> advantages -> PPO epochs over
mini-batches for the critic and the actor -> weight sync into vLLM (and the parity guard)
-> metrics -> held-out evaluation when due (``eval``: on the engines, apart from
training) -> checkpoint.

The recipe decides which phases do anything (a critic, a KL reference, HAPO's token
fields, T-PPO windows, VAPO's value warm-up); one code path serves every recipe. Where the
rows come from is a :class:`~megatron_rl.trainer.sources.RolloutSource`. The critic trains
in its own layout (``critic_parallel``; the actor's by default): everything done with it
runs inside ``critic.active()``, which switches Megatron's process groups to the critic's.

The trainer builds nothing itself: its parts come from :mod:`megatron_rl.trainer.compose`,
its exit code and summary from :mod:`megatron_rl.trainer.ending`, and the launch that runs
it is :mod:`megatron_rl.trainer.entry`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl import checkpoint, platform
from megatron_rl.algorithms import explained_variance, kl_penalty, mean_reverse_kl, reverse_kl_advantages
from megatron_rl.algorithms.hapo import EntropyStats
from megatron_rl.algorithms.rollout_correction import CorrectionInputs, correct_rollout
from megatron_rl.config import Config, ConfigError, dump_yaml, to_dict
from megatron_rl.from_config import setup, validate
from megatron_rl.from_config.adapter_checks import check_adapter_base
from megatron_rl.from_config.scorer_checks import check_scorer_tokenizers
from megatron_rl.from_config.start_checks import start_checkpoint
from megatron_rl.from_config.teacher_checks import check_teacher_tokenizer
from megatron_rl.launch import startup_gc
from megatron_rl.launch.roles import RoleWorld
from megatron_rl.launch.signals import StopSignals, stop_line
from megatron_rl.launch.slurm_env import SlurmEnv
from megatron_rl.launch.status import write_status
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.rollout.client import RolloutRankError
from megatron_rl.schedules import (
    Microbatching,
    TrainBatch,
    epoch_order,
    gathered_logprobs,
    gathered_values,
    local_batch,
    train_step,
)
from megatron_rl.trainer.advantages import estimate_advantages, window_metrics
from megatron_rl.trainer.assembly import StepBatch, assemble, routes_missing
from megatron_rl.trainer.compose import RunPlace, build_models, build_rollouts, start_monitor
from megatron_rl.trainer.empty_steps import EmptyStepGuard
from megatron_rl.trainer.ending import exit_code, summary
from megatron_rl.trainer.hapo import hapo_token_fields
from megatron_rl.trainer.loggers import open_loggers
from megatron_rl.trainer.metrics import MetricsLog
from megatron_rl.trainer.rollout_log import write_rollouts
from megatron_rl.trainer.rollouts import TrainRows
from megatron_rl.trainer.state import RunCheckpoint, choose_resume_step

ACTOR_METRICS = ("actor/pg_loss", "actor/clipfrac", "actor/entropy", "actor/grad_norm", "actor/kl_loss")


class RLTrainer:
    """Everything a run needs, built once from its config; :meth:`run` trains to trainer.max_steps."""

    def __init__(self, cfg: Config, stop_signals: StopSignals, roles: Optional[RoleWorld] = None):
        platform.init_distributed(cfg.trainer.dist_timeout_s)  # (a split launch has its training world already)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.roles = roles
        """Disaggregated rollouts: this launch's split (vLLM runs on the rollout ranks)."""
        self.cfg = validate(cfg, roles.roles.world if roles is not None else self.world)
        self.recipe = cfg.algorithm.build()
        self.micro = Microbatching(
            micro_batch_size=cfg.trainer.micro_batch_size, max_tokens=cfg.trainer.max_tokens_per_micro_batch
        )
        """Padded rows, or packed micro-batches under a token budget (schedules.packing)."""
        self.stop_signals = stop_signals
        self.run_dir = Path(cfg.trainer.run_dir)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
        # A damaged newest checkpoint is set aside (or stops the run) before anything is built.
        self.resume_step = choose_resume_step(self.run_dir / "checkpoints", cfg.checkpoint.on_corrupt)
        torch.manual_seed(cfg.trainer.seed)
        # The actor's weights come from an HF directory (for task data: the task's tiny base).
        self.base_dir = setup.base_model_dir(cfg, self.rank)
        self.arch = arch_from_hf(self.base_dir)
        check_adapter_base(self.run_dir / "checkpoints", self.resume_step, cfg.model.lora, self.base_dir)
        self.start = start_checkpoint(self.cfg, self.base_dir)
        """model.ckpt's step the weights start from (None: the HF directory's)."""
        check_scorer_tokenizers(self.cfg, self.base_dir)
        teacher_dir = setup.teacher_model_dir(self.cfg, self.rank) if self.cfg.algorithm.teacher else None
        if teacher_dir is not None:
            check_teacher_tokenizer(teacher_dir, self.base_dir)
        models = build_models(self.cfg, self.recipe, self.arch, self.base_dir, self.rank, teacher_dir, self.start)
        self.actor, self.critic, self.reference = models.actor, models.critic, models.reference
        self.teacher = models.teacher
        self.route_replay = models.route_replay
        self.actor_loss, self.critic_loss = models.actor_loss, models.critic_loss
        place = RunPlace(self.base_dir, self.run_dir, self.world, self.rank, roles)
        parts = build_rollouts(self.cfg, self.recipe, self.arch, place, self.actor.chunks)
        self.engine, self.client, self.source, self.sampling = parts.engine, parts.client, parts.source, parts.sampling
        self.verifier, self.eval_verifiers, self.evaluator = parts.verifier, parts.eval_verifiers, parts.evaluator
        self.weight_sync, self.pad_token_id = parts.weight_sync, parts.pad_token_id
        self.reward = parts.reward
        self.checkpointer = checkpoint.Checkpointer()
        self.run_checkpoint = RunCheckpoint(
            self.checkpointer, self.run_dir / "checkpoints", cfg.checkpoint, self.base_dir, lora=cfg.model.lora
        )
        self.entropy_stats: Optional[EntropyStats] = None
        """HAPO: the last step's entropy statistics (None: the next rollout samples at plain T)."""
        self.first_step = self._resume() + 1
        self.log = MetricsLog(
            self.run_dir,
            enabled=self.rank == 0,
            total_steps=cfg.trainer.max_steps,
            resume_after=self.first_step - 1,
            loggers=open_loggers(cfg.trainer.loggers, self.run_dir, cfg.trainer.project, to_dict(cfg))
            if self.rank == 0
            else (),
        )
        self.monitor = start_monitor(cfg, self.run_dir)
        self.slurm = SlurmEnv.from_environ()
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        """The metric rows that hold val/ metrics (the step-0 row of eval.at_start too)."""
        self.probe: Optional[TrainBatch] = None
        """VAPO: the first warm-up batch; the critic's loss on it before and after warm-up."""
        self.last_save_s = 0.0
        self.stop_signal = None
        self.empty_steps = EmptyStepGuard(cfg.algorithm.max_empty_steps)
        self.rollout_error: Optional[str] = None
        """Why the rollout ranks ended the run (disaggregated; exit 1, which is requeued)."""
        self.error: Optional[str] = None
        """Why the run stopped without finishing, when the trainer itself stopped it (exit code 2)."""

    # ---- resume -----------------------------------------------------------------------

    def _resume(self) -> int:
        """Load the step chosen at start (the newest intact one, any saved layout) and push its
        weights into vLLM; that step, or 0 for a fresh run."""
        extra = self.run_checkpoint.resume(self.actor, self.critic, self.resume_step)
        if extra is None and self.start is not None:  # vLLM was built from the HF directory
            self.weight_sync.sync(whole=True)
            if self.rank == 0:
                print(f"started from model.ckpt={self.start.root} step {self.start.step}", flush=True)
        if extra is None:
            return 0
        try:
            note = self.source.load_state_dict(extra)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.weight_sync.sync(whole=True)  # vLLM's base may not be the checkpoint's
        if self.rank == 0:
            print(f"resumed from {self.run_checkpoint.root} step {extra['step']}{note}", flush=True)
        stats = extra.get("hapo_entropy_stats")
        self.entropy_stats = EntropyStats(**stats) if stats else None
        return int(extra["step"])

    # ---- the step -----------------------------------------------------------------------

    def run(self) -> dict:
        """Train from the step after the newest checkpoint to trainer.max_steps, or until told to
        stop. Rollout ranks that fail or hang end the run with exit 1 (requeue) after the saves
        in flight commit."""
        startup_gc.resume()  # the run is built: its garbage collected once, the rest frozen
        step = self.first_step - 1
        try:
            if step == 0 and self.cfg.eval.due(0, self.cfg.trainer.max_steps):  # the starting weights, as step 0
                self.log.write(self.evaluate(0, {"step": 0}))
            for step in range(self.first_step, self.cfg.trainer.max_steps + 1):
                if self.step(step):
                    break
        except RolloutRankError as err:  # every training rank gets it (the client broadcasts it)
            self.rollout_error = (
                f"{err}; the checkpoints committed before are intact (a requeue resumes from the newest)"
            )
            return self.close(max(step - 1, 0))  # (0: the starting weights' evaluation failed)
        return self.close(step)

    def step(self, step: int) -> bool:
        """One RL step; True when the run stops after it (a stop signal or the monitor)."""
        started, snapshot_waited = time.perf_counter(), self.checkpointer.snapshot_wait_seconds()
        rollout = self.source.collect(self.sampling_for_step())  # generate, score, shape, filter
        metrics = {"step": step, **rollout.metrics}
        train_start, trained_tokens, trained_rows = time.perf_counter(), 0, len(rollout.rows)
        if trained_rows:
            batch = assemble(
                rollout.rows,
                self.cfg.trainer.seq_length,
                self.pad_token_id,
                self.cfg.rollout.temperature,
                replay_routes=self.cfg.rollout.router_replay,
                filter_overlong=self.recipe.overlong_filter,
            )
            self.sampled_temperatures(batch, metrics)
            self.critic_values(batch)
            self.old_logprobs(batch, metrics)
            self.rollout_correction(batch, metrics)
            self.reference_logprobs(batch)
            self.teacher_logprobs(batch)
            self.advantages(batch, metrics)
            self.distill(batch, metrics)
            self.save_rollouts(step, batch)
            if self.has_learning_signal(batch):
                trained_tokens = self.update(step, batch, metrics)
            else:
                metrics["actor/updated"], trained_rows = False, 0
        else:
            metrics["actor/updated"] = False
        self.source.trained()
        metrics["timing/train_s"] = time.perf_counter() - train_start
        self.sync_weights(step, rollout.rows, metrics)
        self.step_metrics(metrics, started, snapshot_waited, rollout.generated_tokens + trained_tokens)
        faulty = self.agree_to_stop(metrics)
        if not (faulty or self.stop_signal is not None):  # a stop saves first: eval must not delay a preemption
            self.evaluate(step, metrics)
        self.history.append(metrics)
        self.log.write(metrics)
        self.checkpoint(step, stopping=faulty or self.stop_signal is not None)
        self.announce_stop(step, faulty)
        return self.count_empty(step, trained_rows) or faulty or self.stop_signal is not None

    def count_empty(self, step: int, rows: int) -> bool:
        """Warn about a step that trained nothing; True (stop, exit 2) after
        algorithm.max_empty_steps of them in a row. Every rank holds all rows, so all agree."""
        warning, self.error = self.empty_steps.observe(step, rows)
        if warning and self.rank == 0:
            print(warning, file=sys.stderr, flush=True)
        return self.error is not None

    def evaluate(self, step: int, metrics: dict) -> dict:
        """The eval sets on the weights after ``step`` when eval is due, into ``metrics``
        (after the step's own timings: timing/step_s and throughput leave eval out)."""
        if self.evaluator is not None and self.cfg.eval.due(step, self.cfg.trainer.max_steps):
            metrics.update(self.evaluator.evaluate(step))
            self.eval_history.append(metrics)
        return metrics

    def sampling_for_step(self):
        """HAPO samples each token at its own temperature, from the last step's entropy statistics."""
        if self.recipe.temperature_tau > 0 and self.entropy_stats is not None:
            return dataclasses.replace(
                self.sampling, temperature_tau=self.recipe.temperature_tau, entropy_stats=self.entropy_stats
            )
        return self.sampling

    def sampled_temperatures(self, batch: StepBatch, metrics: dict) -> None:
        """HAPO: the temperature each token was sampled at and its ĥ, from Megatron's entropy at
        T (vLLM does not return them); this step's statistics go to the next rollout."""
        if not self.recipe.token_aware:
            return
        cfg = self.cfg
        fields = hapo_token_fields(
            self.actor.chunks,
            batch.forward_rows(batch.response_mask),
            self.micro,
            self.arch.vocab_size,
            temperature=cfg.rollout.temperature,
            tau=self.recipe.temperature_tau,
            prev_stats=self.entropy_stats,
            pivot_quantile=self.recipe.entropy_pivot_quantile,
        )
        batch.temperature, batch.h_hat, self.entropy_stats = fields.temperature, fields.h_hat, fields.stats
        on_response = batch.temperature[batch.response_mask]
        metrics["rollout/temperature_std"] = float(on_response.std()) if on_response.numel() > 1 else 0.0

    def critic_values(self, batch: StepBatch) -> None:
        """The critic's value of every prefix (recipes with a critic), on every rank."""
        if self.critic is None:
            return
        batch.values = self._values(batch.forward_rows(batch.response_mask))

    def old_logprobs(self, batch: StepBatch, metrics: dict) -> None:
        """log π_old of every token at its sampling temperature, recomputed by Megatron (the PPO
        ratio's denominator), and how far vLLM's logprobs of the same tokens are from it."""
        chunks = self.actor.chunks
        if self.route_replay is not None:
            self.route_replay.begin(replay=batch.replay_routes)
        batch.old_logprobs, _ = gathered_logprobs(chunks, batch.plain(), self.micro, self.arch.vocab_size)
        self.router_metrics(batch, metrics)
        batch.rollout_logprobs = batch.scatter([s.logprobs for s in batch.rows.samples])
        fresh = batch.fresh_mask.float()  # tokens vLLM sampled with the current weights
        if fresh.sum() > 0:
            diff = (batch.old_logprobs - batch.rollout_logprobs).abs()
            metrics["rollout/logprob_abs_diff"] = float((diff * fresh).sum() / fresh.sum())
            # k3 estimate of KL(vLLM ‖ Megatron) from vLLM's samples (float64: for |Δ| ~ 1e-7,
            # exp(Δ) − Δ − 1 ~ Δ²/2 cancels to 0 in float32).
            k3 = kl_penalty(batch.rollout_logprobs.double(), batch.old_logprobs.double(), "k3")
            metrics["rollout/mismatch_k3_kl"] = float((k3 * fresh).sum() / fresh.sum())

    def router_metrics(self, batch: StepBatch, metrics: dict) -> None:
        """MoE: how often Megatron's own top-k equals vLLM's routes (measured in the old-logprob
        pass, with or without replay), and how many input tokens had no vLLM route."""
        if self.route_replay is None or batch.routes is None:
            return
        stats = self.route_replay.stats()
        counts = torch.tensor([stats["agreed"], stats["compared"]], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(counts)
        metrics["rollout/router_agreement"] = float(counts[0] / counts[1]) if counts[1] else 0.0
        metrics["rollout/router_missing_routes"] = routes_missing(batch.rows.samples)

    def rollout_correction(self, batch: StepBatch, metrics: dict) -> None:
        """Per-token weights of the policy loss for the rest of the vLLM/Megatron mismatch
        (algorithm.overrides.rollout_correction), and how many tokens/sequences they change."""
        settings = self.recipe.rollout_correction
        if settings is None:
            return
        out = correct_rollout(CorrectionInputs(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask), settings)
        batch.is_weights = out.weights
        loss_tokens = max(int(batch.loss_mask.sum()), 1)
        metrics["rollout/correction_tokens_affected"] = out.tokens_affected / loss_tokens
        metrics["rollout/correction_sequences_masked"] = out.sequences_masked
        metrics["rollout/correction_weight_mean"] = float(out.weights[batch.loss_mask].mean())

    def reference_logprobs(self, batch: StepBatch) -> None:
        """log π_ref of every token (recipes with a KL penalty)."""
        if self.reference is not None:
            batch.ref_logprobs = self.reference.logprobs(batch.plain(), self.micro)

    def teacher_logprobs(self, batch: StepBatch) -> None:
        """log π_teacher of every token (recipes that distill), at the sampling temperatures."""
        if self.teacher is not None:
            batch.teacher_logprobs = self.teacher.logprobs(batch.plain(), self.micro)

    def distill(self, batch: StepBatch, metrics: dict) -> None:
        """On-policy distillation: each policy-loss token's advantage gains distill_coef x
        (log π_T − log π_old), and ``distill/reverse_kl`` is the mean sampled reverse KL."""
        if batch.teacher_logprobs is None:
            return
        teacher, old, mask = batch.teacher_logprobs, batch.old_logprobs, batch.loss_mask
        batch.advantages = batch.advantages + self.recipe.distill_coef * reverse_kl_advantages(teacher, old, mask)
        metrics["distill/reverse_kl"] = mean_reverse_kl(teacher, old, mask)

    def advantages(self, batch: StepBatch, metrics: dict) -> None:
        """Per-token advantages (and critic targets) by the recipe's estimator; with T-PPO
        windows, how they weigh stopping against continuing (``window_metrics``)."""
        values = batch.gather(batch.values) if batch.values is not None else None
        advantages, returns = estimate_advantages(self.recipe, batch.rows, batch.max_response_len, values)
        if self.recipe.generation_window is not None and values is not None:
            metrics.update(window_metrics(batch.rows, advantages, values))
        batch.advantages = batch.scatter(advantages)
        batch.returns = batch.scatter(returns) if returns is not None else None

    def has_learning_signal(self, batch: StepBatch) -> bool:
        """False when the step's update has no gradient to follow: every policy-loss token's
        advantage is 0 (every group's rewards equal, under a group-relative estimator) and no
        critic, KL or NLL term trains. Adam would still move the weights by its momentum, away
        from any evidence; the step is skipped and counted as an empty one instead."""
        recipe = self.recipe
        if self.critic is not None or recipe.kl is not None or recipe.positive_nll_coef > 0:
            return True
        return bool((batch.advantages[batch.loss_mask] != 0).any())

    def save_rollouts(self, step: int, batch: StepBatch) -> None:
        """trainer.save_rollouts: the rows the update trains on, with everything its loss reads
        (old logprobs, advantages, the policy-loss tokens), to RUN_DIR/rollouts (rank 0)."""
        if self.cfg.trainer.save_rollouts and self.rank == 0:
            write_rollouts(self.run_dir, step, batch)

    def update(self, step: int, batch: StepBatch, metrics: dict) -> int:
        """PPO epochs over mini-batches: the critic on its tokens, then the actor on the policy
        tokens (VAPO: the critic alone during value warm-up); returns the policy-loss tokens."""
        actor_batch, critic_batch = batch.for_actor(), batch.for_critic()
        if self.recipe.generation_window is not None:
            metrics["critic/rows"] = int(batch.critic_mask.any(dim=1).sum())
            metrics["critic/tokens"] = int(batch.critic_mask.sum())
        metrics["actor/loss_tokens"] = int(batch.loss_mask.sum())
        warming_up = step <= self.recipe.value_warmup_steps
        if self.critic is not None and warming_up and self.probe is None:
            self.probe = critic_batch
            metrics["critic/warmup_probe_loss"] = self._value_mse(self.probe)
        self.actor.set_lr(self._lr(step))
        self.packing_metrics(actor_batch, metrics)
        actor_out, critic_out = self._epochs(step, actor_batch, critic_batch, train_actor=not warming_up)
        for key in ACTOR_METRICS:
            if actor_out and key in actor_out[0]:
                metrics[key] = sum(float(x[key]) for x in actor_out) / len(actor_out)
        if critic_out:
            metrics["critic/value_loss"] = sum(float(x["critic/value_loss"]) for x in critic_out) / len(critic_out)
            metrics["critic/explained_var"] = float(explained_variance(batch.values, batch.returns, batch.critic_mask))
        metrics["actor/updated"] = bool(actor_out)
        if self.probe is not None and step == self.recipe.value_warmup_steps:
            metrics["critic/warmup_probe_loss"] = self._value_mse(self.probe)
        return int(batch.loss_mask.sum())

    def packing_metrics(self, actor_batch: TrainBatch, metrics: dict) -> None:
        """train/packing_efficiency (real tokens / tokens computed, padding included),
        train/micro_batches per DP rank and train/tokens_per_micro_batch_max of one pass of
        the actor over the step's mini-batches (what the schedules will run)."""
        layout, minis = self.cfg.parallel, self.cfg.algorithm.mini_batches_per_step
        rows = actor_batch.num_rows // minis
        micro = self.micro.for_layout(layout.tp if layout.sequence_parallel_enabled else 1, layout.vpp > 1, layout.cp)
        costs = [micro.cost(actor_batch.rows(m * rows, (m + 1) * rows), layout.dp(self.world)) for m in range(minis)]
        metrics["train/packing_efficiency"] = sum(c["real_tokens"] for c in costs) / sum(
            c["computed_tokens"] for c in costs
        )
        metrics["train/micro_batches"] = sum(c["micro_batches"] for c in costs)
        metrics["train/tokens_per_micro_batch_max"] = max(c["tokens_per_micro_batch_max"] for c in costs)

    def _epochs(self, step: int, actor_batch: TrainBatch, critic_batch: TrainBatch, train_actor: bool):
        """algorithm.ppo_epochs passes, each algorithm.mini_batches_per_step optimizer steps
        (over the rows in rollout order, or shuffled: algorithm.shuffle_mini_batches)."""
        micro, minis = self.micro, self.cfg.algorithm.mini_batches_per_step
        rows = actor_batch.num_rows // minis
        actor_out, critic_out = [], []
        for epoch in range(self.cfg.algorithm.ppo_epochs):
            actor_rows, critic_rows = actor_batch, critic_batch
            if self.cfg.algorithm.shuffle_mini_batches:
                order = epoch_order(actor_batch.num_rows, self.cfg.trainer.seed, step, epoch)
                actor_rows, critic_rows = actor_batch.select(order), critic_batch.select(order)
            for m in range(minis):
                part, critic_part = (b.rows(m * rows, (m + 1) * rows) for b in (actor_rows, critic_rows))
                # Every rank holds the whole batch, so all skip a mini-batch without finished rows alike.
                if self.critic is not None and bool(critic_part.loss_mask.any()):
                    with self.critic.active():
                        critic_out.append(
                            train_step(
                                self.critic.chunks,
                                self.critic.optimizer,
                                local_batch(self.critic.chunks, critic_part, micro),
                                self.critic_loss,
                                micro,
                            )
                        )
                if train_actor:
                    if self.route_replay is not None:
                        self.route_replay.begin(replay=True)  # fresh recompute queues
                    actor_out.append(
                        train_step(
                            self.actor.chunks,
                            self.actor.optimizer,
                            local_batch(self.actor.chunks, part, micro),
                            self.actor_loss,
                            micro,
                        )
                    )
        return actor_out, critic_out

    def sync_weights(self, step: int, rows: TrainRows, metrics: dict) -> None:
        """vLLM gets the updated weights in place; every rollout.parity_every steps the parity
        guard reads them back from vLLM and checks its logprobs of a few sequences against
        Megatron's (limits per dtype: rollout/parity.py)."""
        from megatron_rl.rollout.parity import parity_limits
        from megatron_rl.rollout.sync import check_parity

        every = self.cfg.rollout.parity_every
        guard = bool(every and step % every == 0 and len(rows))
        if metrics.get("actor/updated"):
            stats = self.weight_sync.sync(check_weights=guard)
            metrics["timing/weight_sync_s"] = stats.seconds
            # 1: gloo broadcasts (ranks on several hosts), 0: this host's shared arena or one rank
            metrics["rollout/weight_sync_broadcast"] = float(stats.transport == "broadcast")
            if stats.weight_check is not None:
                metrics["rollout/weight_check_elements"] = stats.weight_check.compared_elements
        else:
            metrics["timing/weight_sync_s"] = 0.0
        if guard:
            first_of_group = [row for row, g in enumerate(rows.group_index) if g not in rows.group_index[:row]]
            sequences = [rows.samples[row].prompt_ids + rows.samples[row].token_ids for row in first_of_group[:4]]
            limits = parity_limits(self.engine.config.dtype, self.cfg.rollout.parity_threshold)
            report = check_parity(
                self.actor.chunks,
                self.engine,
                sequences,
                self.arch.vocab_size,
                self.cfg.trainer.seq_length,
                limits=limits,
            )
            metrics["rollout/parity_max_abs_diff"] = report.max_abs_diff
            metrics["rollout/parity_mean_abs_diff"] = report.mean_abs_diff
            metrics["rollout/parity_median_abs_diff"] = report.median_abs_diff

    def step_metrics(self, metrics: dict, started: float, snapshot_waited: float, tokens: float) -> None:
        """Step time and throughput, and the stall of the checkpoint saved after the previous
        step: the save call itself, and this step's updates waiting for its deferred host copy.
        With rollout ranks of their own, timing/overlap_fraction: the share of the step in which
        the generation of what it trained on ran beside training (generation time the training
        ranks did not wait for, summed batch by batch)."""
        metrics["timing/step_s"] = time.perf_counter() - started
        metrics["timing/checkpoint_s"], self.last_save_s = self.last_save_s, 0.0
        metrics["timing/checkpoint_wait_s"] = self.checkpointer.snapshot_wait_seconds() - snapshot_waited
        metrics["throughput/tokens_per_s"] = tokens / metrics["timing/step_s"]
        if "timing/generation_hidden_s" in metrics:  # rollout ranks of their own
            hidden = metrics["timing/generation_hidden_s"]
            metrics["timing/overlap_fraction"] = min(hidden / metrics["timing/step_s"], 1.0)

    def agree_to_stop(self, metrics: dict) -> bool:
        """Whether the monitor declared a machine faulty (stop_on_alert); and any stop signal
        (Slurm preemption, scancel). Every rank, every step: all stop after the same step."""
        faulty = False
        if self.monitor is not None:
            self.monitor.on_step(
                metrics["timing/step_s"],
                sections={  # this rank's straggler signal
                    "rollout_time": metrics.get("timing/rollout_s"),
                    "train_time": metrics["timing/train_s"],
                    "sync_time": metrics["timing/weight_sync_s"],
                },
            )  # collective every detect_every_steps
            metrics["monitor/declared_machines"] = len(self.monitor.declared)
            faulty = _agree(self.cfg.monitor.stop_on_alert and self.monitor.stop_requested)
        metrics["slurm/restart_count"] = self.slurm.restart_count
        self.stop_signal = self.stop_signals.agree()
        return faulty

    def checkpoint(self, step: int, stopping: bool) -> None:
        """Save when due, and before stopping early (async: only the save call blocks)."""
        if not (stopping or self.run_checkpoint.due(step, self.cfg.trainer.max_steps)):
            return
        started = time.perf_counter()
        extra = self.source.state_dict()
        if self.entropy_stats is not None:
            extra["hapo_entropy_stats"] = dataclasses.asdict(self.entropy_stats)
        self.run_checkpoint.save(step, self.actor, self.critic, extra)
        self.last_save_s = time.perf_counter() - started

    def announce_stop(self, step: int, faulty: bool) -> None:
        if self.rank != 0:
            return
        if faulty:
            print(
                f"stopping after step {step}: the monitor declared {sorted(self.monitor.declared)} faulty "
                f"(listed in {self.monitor.exclude_file})",
                flush=True,
            )
        if self.stop_signal is not None:
            print(stop_line(self.stop_signal, step, self.run_checkpoint.root), flush=True)

    # ---- helpers and the end of the run -------------------------------------------------

    def _values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's values on ``batch``, every row, on every rank."""
        with self.critic.active():
            return gathered_values(self.critic.chunks, batch, self.micro)

    def _value_mse(self, batch: TrainBatch) -> float:
        """Mean squared error of the critic's values against ``batch.returns`` over its loss tokens."""
        mask = batch.loss_mask.float()
        return float(((self._values(batch) - batch.returns) ** 2 * mask).sum() / mask.sum())

    def _lr(self, step: int) -> float:
        """Linear warm-up over trainer.lr_warmup_steps, then constant."""
        warm = self.cfg.trainer.lr_warmup_steps
        return self.cfg.trainer.lr * (min(1.0, step / warm) if warm else 1.0)

    def close(self, step: int) -> dict:
        """Wait for the saves in flight, write the run's status; the summary of this run."""
        self.run_checkpoint.close()  # an async save still writing must commit before we exit
        if self.monitor is not None:
            self.monitor.stop()
        code = exit_code(step, self.cfg.trainer.max_steps, self.error, self.rollout_error)
        if self.rank == 0:
            write_status(
                self.run_dir, code, step, None if self.stop_signal is None else self.stop_signal.name, self.slurm
            )
        self.log.close()
        self.reward.close()
        self.verifier.close()
        for verifier in self.eval_verifiers.values():
            verifier.close()
        self.source.close()
        if self.roles is not None and self.rollout_error is None:
            self.engine.close()  # releases the rollout ranks
        return summary(self.run_dir, self.history, self.eval_history, step, code, self.rollout_error or self.error)


def _agree(flag: bool) -> bool:
    """Rank 0's decision, on every rank (only the detector rank knows)."""
    value = torch.tensor([1 if flag else 0], device=platform.current().device)
    dist.broadcast(value, src=0)
    return bool(value.item())
