"""The RL loop (DESIGN.md "How data flows through one step").

prompts -> vLLM groups -> rewards -> shaping / dynamic sampling -> [critic values] ->
advantages -> Megatron old logprobs (also the train/inference mismatch metric) -> PPO
epochs over mini-batches for the actor [and the critic] -> weight sync into vLLM ->
metrics and checkpoints.

One code path for every recipe: the recipe object says which pieces are on (ppo, grpo,
dapo, vapo with value pre-training, tppo). T-PPO's generation window only changes where
the step's rows come from (trainer.windows: responses carried across steps) and which
tokens each loss sees (policy: the tokens no earlier step trained on; critic: finished
responses only). HAPO samples each token at its own temperature inside vLLM (from the
previous step's entropy statistics); the trainer recomputes those temperatures and ĥ from
Megatron's entropy (trainer.hapo). A KL penalty adds a frozen reference policy
(trainer.reference). The critic trains in its own layout (``critic_parallel``; the actor's
by default) with its own process groups: everything done with it runs inside
``critic.active()``, which switches Megatron's groups to the critic's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl import checkpoint, platform
from megatron_rl.config import Config, ConfigError, dump_yaml, validate
from megatron_rl.launch import exit_codes
from megatron_rl.launch.slurm_env import SlurmEnv
from megatron_rl.launch.status import write_status
from megatron_rl.models.builder import BuildOptions, padded_vocab_size
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.parallel import initialize, initialize_alongside
from megatron_rl.trainer import setup
from megatron_rl.trainer.hapo import hapo_token_fields
from megatron_rl.trainer.metrics import MetricsLog
from megatron_rl.trainer.reference import ReferencePolicy
from megatron_rl.trainer.rollouts import TrainRows, collect_rollouts, windowed_rollouts
from megatron_rl.trainer.windows import WindowPool


def _response_span(lengths: list[int], starts: list[int], max_len: int) -> torch.Tensor:
    """[rows, max_len] bool: response tokens starts[row] .. lengths[row] - 1."""
    positions = torch.arange(max_len)
    return (positions >= torch.tensor(starts)[:, None]) & (positions < torch.tensor(lengths)[:, None])


def _aligned_span(prompt_lens: list[int], response_lens: list[int], starts: list[int], seq_length: int):
    """[rows, seq_length] bool in the training layout (schedules.batch): response tokens starts[row] onwards."""
    from megatron_rl.schedules.batch import scatter_response

    spans = _response_span(response_lens, starts, max(response_lens))
    return scatter_response([m[:r] for m, r in zip(spans, response_lens)], prompt_lens, seq_length).bool()


def _advantages(recipe, rows: TrainRows, max_len: int, values: Optional[list[torch.Tensor]] = None):
    """Per-response-token (advantages, returns or None), [rows, max_len].

    Estimated over whole responses (a window's advantages need the values after it);
    whitening uses only the tokens of the policy loss (all of them without windows)."""
    from megatron_rl.algorithms import compute_advantages, masked_whiten

    lengths = [len(s.token_ids) for s in rows.samples]
    mask = _response_span(lengths, [0] * len(lengths), max_len)
    extra = {}
    if values is not None:
        padded = torch.zeros(len(lengths), max_len)
        for row, v in enumerate(values):
            padded[row, : v.numel()] = v
        extra["values"] = padded
    if any(rows.truncated):
        extra["truncated"] = torch.tensor(rows.truncated)
    inputs = recipe.advantage_inputs(mask, seq_rewards=torch.tensor(rows.rewards, dtype=torch.float32),
                                     group_index=torch.tensor(rows.group_index),
                                     lengths=torch.tensor(lengths), **extra)
    out = compute_advantages(recipe.advantage_estimator, dataclasses.replace(inputs, whiten=False))
    advantages = out.advantages
    if recipe.whiten_advantages:
        advantages = masked_whiten(advantages, _response_span(lengths, rows.loss_start, max_len))
    return advantages, out.returns


def _take_prompts(loader, count: int):
    """``count`` prompts from a loader of batch size 1 (its position stays exact for resume)."""
    from megatron_rl.data import PromptBatch

    batches = [loader.next_batch() for _ in range(count)]
    return PromptBatch(prompt_ids=[b.prompt_ids[0] for b in batches], answers=[b.answers[0] for b in batches],
                       dataset_indices=[b.dataset_indices[0] for b in batches],
                       epochs=[b.epochs[0] for b in batches], group_ids=list(range(count)))


def _window_record(step: int, rollout, pool: WindowPool, rows) -> dict:
    """A T-PPO step's rollout metrics (reward/mean: responses that finished this step)."""
    return {
        "step": step,
        "reward/mean": rollout.mean_correct_finished,
        "response_length/mean": rollout.mean_length_finished,
        "rollout/kept_groups": len({r.prompt_key for r in rows}),
        "rollout/generated_groups": rollout.counts.new_prompts,
        "rollout/generation_batches": rollout.generation_batches,
        "rollout/new_prompts": rollout.counts.new_prompts,
        "rollout/carried_samples": rollout.counts.carried,
        "rollout/finished_samples": rollout.counts.finished,
        "rollout/trained_rows": len(rows),
        "rollout/truncated_rows": sum(not r.finished for r in rows),
        "rollout/held_rows": len(pool.samples) - len(rows),
        "rollout/context_response_tokens": sum(r.trained for r in rows),
        "rollout/max_windows": max((r.windows for r in rows), default=0),
        "timing/rollout_s": rollout.seconds,
    }


def _rows_usable(num_groups: int, group_size: int, multiple: int) -> int:
    """Most groups whose rows split evenly over DP x micro-batches x mini-batches."""
    while num_groups and (num_groups * group_size) % multiple:
        num_groups -= 1
    return num_groups


def train(cfg: Config) -> dict:
    """Run ``trainer.max_steps`` RL steps; returns a summary (rank 0 writes the run dir).

    SIGUSR1 / SIGTERM (Slurm preemption, scancel) stop the run after the current step with
    a committed checkpoint; the summary's ``exit_code`` then says "requeue me" (launch.exit_codes).
    The handlers go in first, so that a signal during start-up is not fatal either."""
    from megatron_rl.launch.signals import StopSignals

    with StopSignals() as stop:
        return _train(cfg, stop)


def _train(cfg: Config, stop) -> dict:
    from transformers import AutoTokenizer

    from megatron_rl.data import PromptDataset, PromptFields, PromptLoader
    from megatron_rl.rewards import build_verifier
    from megatron_rl.rollout import EngineConfig, RolloutEngine, Sampling
    from megatron_rl.rollout.sync import WeightSync, check_parity
    from megatron_rl.algorithms import explained_variance
    from megatron_rl.schedules import (ActorLoss, CriticLoss, TrainBatch, compute_logprobs, compute_values,
                                       gather_data_parallel, local_batch, train_step)
    from megatron_rl.schedules.batch import gather_response, pack_sequences, scatter_response

    platform.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    validate(cfg, world)
    recipe = cfg.algorithm.build()
    windowed = recipe.generation_window is not None
    if windowed and recipe.token_aware:
        raise ConfigError("algorithm: generation_window (tppo) cannot be combined with the HAPO pieces "
                          "(temperature_tau, entropy_clip_alpha, redistribution_beta): a response's windows "
                          "would be sampled under different entropy statistics")
    if windowed and recipe.dynamic_sampling:
        raise ConfigError("algorithm: generation_window (tppo) cannot be combined with dynamic_sampling: "
                          "responses finish at different steps, so there are no whole groups to filter")
    run_dir = Path(cfg.trainer.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    torch.manual_seed(cfg.trainer.seed)

    # The actor's weights come from an HF directory (for task data: the task's tiny base).
    base_dir = setup.base_model_dir(cfg, rank)
    arch = arch_from_hf(base_dir)
    try:
        cfg.parallel.validate(world, arch.shape())
    except ValueError as err:
        raise ConfigError(f"parallel: {err} (model {base_dir})") from None
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    ctx = initialize(cfg.parallel, seed=cfg.trainer.seed, model=arch.shape())
    critic_ctx = _critic_layout(cfg, ctx, arch, world) if recipe.use_critic else None
    if cfg.critic_parallel is not None and critic_ctx is None and rank == 0:
        print(f"critic_parallel is ignored: algorithm.recipe={cfg.algorithm.recipe} trains no critic", flush=True)
    options = BuildOptions(dtype=cfg.model.dtype, moe_token_dispatcher_type=cfg.model.moe_token_dispatcher_type,
                           moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
                           recompute_activations=cfg.model.recompute_activations)
    actor = setup.build_trainable("actor", arch, ctx, options, cfg.trainer.lr, base_dir)
    critic = (setup.build_trainable("critic", arch, critic_ctx, options,
                                    cfg.trainer.lr * recipe.critic_lr_multiplier, base_dir)
              if recipe.use_critic else None)
    reference = ReferencePolicy(arch, cfg.parallel, options, base_dir) if recipe.kl is not None else None

    # Data and rewards: the same seeded prompt order on every rank.
    dataset = PromptDataset(setup.prompt_files(cfg, base_dir), tokenizer,
                            fields=PromptFields(prompt=cfg.data.prompt_key, answer=cfg.data.answer_key))
    # T-PPO refills single rows of the pool: the loader hands out one prompt at a time.
    loader = PromptLoader(dataset, batch_size=1 if windowed else cfg.rollout.prompts_per_step,
                          seed=cfg.trainer.seed)
    verifier = build_verifier(setup.verifier_name(cfg))

    # The colocated engine starts from the same HF weights as the actor.
    engine = RolloutEngine(base_dir, EngineConfig(
        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
        dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[cfg.model.dtype],
        max_model_len=min(arch.max_position_embeddings, cfg.trainer.seq_length),
        seed=cfg.trainer.seed, cpu_kv_cache_gib=cfg.rollout.kv_cache_gib,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        cpu_linear=cfg.rollout.cpu_linear, cache_dir=str(run_dir / "cache"),
    ))
    sampling = Sampling(n=cfg.rollout.n_samples, max_tokens=cfg.rollout.max_new_tokens,
                        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                        stop_token_ids=(tokenizer.eos_token_id,), window=recipe.generation_window)
    seq_length = cfg.trainer.seq_length
    mbs = cfg.trainer.micro_batch_size
    # Every mini-batch splits evenly over the DP ranks (and micro-batches) of actor and critic.
    dp = math.lcm(cfg.parallel.dp(world), critic_ctx.config.dp(world) if critic_ctx else 1)
    row_multiple = dp * mbs * cfg.algorithm.mini_batches_per_step
    actor_loss = ActorLoss(recipe, arch.vocab_size)
    critic_loss = CriticLoss.from_recipe(recipe) if critic is not None else None
    pool = None
    if windowed:
        try:
            pool = WindowPool(cfg.rollout.prompts_per_step * cfg.rollout.n_samples, cfg.rollout.n_samples,
                              row_multiple)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    ckpt_root = run_dir / "checkpoints"
    ckpt = checkpoint.Checkpointer()
    weight_sync = WeightSync(actor.chunks, arch, engine, bucket_bytes=int(cfg.rollout.bucket_mb * (1 << 20)))
    # HAPO: the previous step's entropy statistics (None: the first step samples at plain T).
    first_step, hapo_stats = _resume(ckpt_root, ckpt, actor, critic, loader, weight_sync, pool)
    first_step += 1
    log = MetricsLog(run_dir, enabled=rank == 0, total_steps=cfg.trainer.max_steps, resume_after=first_step - 1)
    monitor = _start_monitor(cfg, run_dir)
    slurm = SlurmEnv.from_environ()
    probe = None
    history = []
    step, stop_signal = first_step - 1, None
    last_save_s = 0.0
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for step in range(first_step, cfg.trainer.max_steps + 1):
        step_start = time.perf_counter()
        snapshot_waited = ckpt.snapshot_wait_seconds()
        step_sampling = sampling
        if recipe.temperature_tau > 0 and hapo_stats is not None:
            step_sampling = dataclasses.replace(sampling, temperature_tau=recipe.temperature_tau,
                                                entropy_stats=hapo_stats)
        if pool is None:
            rollout = collect_rollouts(engine, loader.next_batch, step_sampling, recipe, verifier.score_batch,
                                       decode, cfg.rollout.prompts_per_step)
            groups = rollout.groups[: _rows_usable(len(rollout.groups), cfg.rollout.n_samples, row_multiple)]
            rows = TrainRows.from_groups(groups)
            record = {
                "step": step,
                "reward/mean": rollout.mean_correct_all,
                "response_length/mean": rollout.mean_length_all,
                "rollout/kept_groups": len(groups),
                "rollout/generated_groups": rollout.generated_groups,
                "rollout/generation_batches": rollout.generation_batches,
                "timing/rollout_s": rollout.seconds,
            }
            generated_tokens = rollout.mean_length_all * rollout.generated_groups * cfg.rollout.n_samples
        else:
            rollout = windowed_rollouts(engine, pool, lambda count: _take_prompts(loader, count), sampling, recipe,
                                        verifier.score_batch, decode)
            window_rows = pool.training_rows()
            rows = TrainRows.from_window_rows(window_rows)
            record = _window_record(step, rollout, pool, window_rows)
            generated_tokens = rollout.new_tokens
        train_start = time.perf_counter()
        tokens_trained = 0
        if len(rows):
            samples = rows.samples
            prompts = [s.prompt_ids for s in samples]
            responses = [s.token_ids for s in samples]
            tokens, response_mask = pack_sequences(prompts, responses, seq_length, tokenizer.pad_token_id or 0)
            max_len = max(len(r) for r in responses)
            prompt_lens, response_lens = [len(p) for p in prompts], [len(r) for r in responses]
            # Policy loss: tokens no earlier step trained on; mismatch: tokens vLLM sampled with the
            # current weights; critic: finished responses (the window's cut-offs have no outcome yet).
            loss_mask = _aligned_span(prompt_lens, response_lens, rows.loss_start, seq_length)
            fresh_mask = _aligned_span(prompt_lens, response_lens, rows.fresh_start, seq_length)
            critic_mask = response_mask & ~torch.tensor(rows.truncated)[:, None]
            temperature = torch.full(tokens.shape, cfg.rollout.temperature)
            h_hat = None
            if recipe.token_aware:  # per-token sampling temperatures and ĥ from Megatron's entropy at T
                fields = hapo_token_fields(actor.chunks, TrainBatch(tokens=tokens, loss_mask=response_mask), mbs,
                                           arch.vocab_size, temperature=cfg.rollout.temperature,
                                           tau=recipe.temperature_tau, prev_stats=hapo_stats,
                                           pivot_quantile=recipe.entropy_pivot_quantile)
                temperature, h_hat, hapo_stats = fields.temperature, fields.h_hat, fields.stats
                record["rollout/temperature_std"] = float(temperature[response_mask].std()) \
                    if int(response_mask.sum()) > 1 else 0.0
            values = None
            if critic is not None:
                plain = TrainBatch(tokens=tokens, loss_mask=response_mask)
                with critic.active():
                    values = gather_data_parallel(critic.chunks, compute_values(critic.chunks,
                                                                                local_batch(critic.chunks, plain), mbs))
            adv, ret = _advantages(recipe, rows, max_len,
                                   gather_response(values, prompt_lens, response_lens) if values is not None else None)
            advantages = scatter_response([a[:r] for a, r in zip(adv, response_lens)], prompt_lens, seq_length)
            returns = (scatter_response([x[:r] for x, r in zip(ret, response_lens)], prompt_lens, seq_length)
                       if ret is not None else None)
            vllm_logp = scatter_response([torch.tensor(s.logprobs) for s in samples], prompt_lens, seq_length)
            is_positive = torch.tensor([c > 0 for c in rows.correct])
            plain = TrainBatch(tokens=tokens, loss_mask=loss_mask, temperature=temperature)
            old_logp, _ = compute_logprobs(actor.chunks, local_batch(actor.chunks, plain), mbs, arch.vocab_size)
            old_logp = gather_data_parallel(actor.chunks, old_logp)
            mask = fresh_mask.float()
            if mask.sum() > 0:
                record["rollout/logprob_abs_diff"] = float(((old_logp - vllm_logp).abs() * mask).sum() / mask.sum())
            ref_logp = reference.logprobs(plain, mbs) if reference is not None else None
            full = TrainBatch(tokens=tokens, loss_mask=loss_mask, advantages=advantages, temperature=temperature,
                              old_logprobs=old_logp, ref_logprobs=ref_logp, h_hat=h_hat, returns=returns,
                              old_values=values, is_positive=is_positive)
            critic_batch = dataclasses.replace(full, loss_mask=critic_mask)
            if pool is not None:
                record["critic/rows"] = int(critic_mask.any(dim=1).sum())
                record["critic/tokens"] = int(critic_mask.sum())
                record["actor/loss_tokens"] = int(loss_mask.sum())
            warming_up = step <= recipe.value_warmup_steps  # VAPO: critic only, policy frozen
            if critic is not None and warming_up and probe is None:
                probe = critic_batch  # the first warm-up batch: the critic's loss on it before and after warm-up
                record["critic/warmup_probe_loss"] = _value_mse(critic, probe, mbs)
            actor.set_lr(_lr(cfg, step))
            actor_metrics, critic_metrics = [], []
            minis = cfg.algorithm.mini_batches_per_step
            rows_per_mini = full.num_rows // minis
            for _ in range(cfg.algorithm.ppo_epochs):
                for m in range(minis):
                    part = full.rows(m * rows_per_mini, (m + 1) * rows_per_mini)
                    critic_part = critic_batch.rows(m * rows_per_mini, (m + 1) * rows_per_mini)
                    # Every rank holds the whole batch, so all skip a mini-batch without finished rows alike.
                    if critic is not None and bool(critic_part.loss_mask.any()):
                        with critic.active():
                            critic_metrics.append(train_step(critic.chunks, critic.optimizer,
                                                             local_batch(critic.chunks, critic_part), critic_loss, mbs))
                    if not warming_up:
                        actor_metrics.append(train_step(actor.chunks, actor.optimizer,
                                                        local_batch(actor.chunks, part), actor_loss, mbs))
            for key in ("actor/pg_loss", "actor/clipfrac", "actor/entropy", "actor/grad_norm", "actor/kl_loss"):
                if actor_metrics and key in actor_metrics[0]:
                    record[key] = sum(float(x[key]) for x in actor_metrics) / len(actor_metrics)
            if critic_metrics:
                record["critic/value_loss"] = sum(float(x["critic/value_loss"]) for x in critic_metrics) / len(critic_metrics)
                record["critic/explained_var"] = float(explained_variance(values, returns, critic_mask))
            record["actor/updated"] = bool(actor_metrics)
            if probe is not None and step == recipe.value_warmup_steps:
                record["critic/warmup_probe_loss"] = _value_mse(critic, probe, mbs)
            tokens_trained = int(loss_mask.sum())
        if pool is not None:
            pool.trained(window_rows)  # finished rows leave; unfinished ones keep their tokens as context
        record["timing/train_s"] = time.perf_counter() - train_start
        record["timing/weight_sync_s"] = 0.0
        if record.get("actor/updated"):
            sync = weight_sync.sync()
            record["timing/weight_sync_s"] = sync.seconds
        if cfg.rollout.parity_every and step % cfg.rollout.parity_every == 0 and len(rows):
            first_of_group = [row for row, g in enumerate(rows.group_index) if g not in rows.group_index[:row]]
            seqs = [rows.samples[row].prompt_ids + rows.samples[row].token_ids for row in first_of_group[:4]]
            report = check_parity(actor.chunks, engine, seqs, arch.vocab_size, seq_length,
                                  threshold=cfg.rollout.parity_threshold)
            record["rollout/parity_max_abs_diff"] = report.max_abs_diff
        record["timing/step_s"] = time.perf_counter() - step_start
        # The stall of the checkpoint saved after the previous step: the save call itself, and
        # this step's updates waiting for its deferred host copy (0 once the rollout covered it).
        record["timing/checkpoint_s"], last_save_s = last_save_s, 0.0
        record["timing/checkpoint_wait_s"] = ckpt.snapshot_wait_seconds() - snapshot_waited
        record["throughput/tokens_per_s"] = (generated_tokens + tokens_trained) / record["timing/step_s"]
        faulty = False
        if monitor is not None:
            monitor.on_step(record["timing/step_s"])  # collective every detect_every_steps
            record["monitor/declared_machines"] = len(monitor.declared)
            faulty = _agree(cfg.monitor.stop_on_alert and monitor.stop_requested)
        record["slurm/restart_count"] = slurm.restart_count
        history.append(record)
        log.write(record)
        stop_signal = stop.agree()  # every rank, every step: all stop at the same step
        interval = cfg.checkpoint.save_interval
        if faulty or stop_signal or step == cfg.trainer.max_steps or (interval and step % interval == 0):
            save_start = time.perf_counter()
            _save(ckpt_root, ckpt, step, actor, critic, loader, base_dir, cfg, pool, hapo_stats)
            last_save_s = time.perf_counter() - save_start
        if faulty and rank == 0:
            print(f"stopping after step {step}: the monitor declared {sorted(monitor.declared)} faulty "
                  f"(listed in {monitor.exclude_file})", flush=True)
        if stop_signal is not None and rank == 0:
            print(f"stopped on {stop_signal.name} after step {step}; checkpoint saved in {ckpt_root}", flush=True)
        if faulty or stop_signal is not None:
            break
    ckpt.close()  # an async save still writing must commit before we exit
    if monitor is not None:
        monitor.stop()
    done = step >= cfg.trainer.max_steps
    code = exit_codes.DONE if done else exit_codes.STOPPED
    if rank == 0:
        write_status(run_dir, code, step, None if stop_signal is None else stop_signal.name, slurm)
    log.close()
    verifier.close()
    summary = {"run_dir": str(run_dir), "steps": len(history), "last_step": step, "exit_code": code}
    if history:
        # T-PPO steps in which no response finished have no reward (nan).
        rewards = [r["reward/mean"] for r in history if math.isfinite(r["reward/mean"])]
        if rewards:
            first, last = rewards[:5], rewards[-5:]
            summary.update(first_reward=sum(first) / len(first), last_reward=sum(last) / len(last))
    return summary


def _save(root: Path, ckpt: checkpoint.Checkpointer, step: int, actor, critic, loader, base_dir: Path,
          cfg: Config, pool: Optional[WindowPool], hapo_stats=None) -> None:
    """Actor, optimizer, RNG, data position, T-PPO's in-flight responses, HAPO's entropy statistics;
    plus what an HF export needs. The critic (and its optimizer) goes first into root/critic:
    saves commit in the order they were made, so once the actor's step is committed the critic's is too."""
    snapshot = cfg.checkpoint.snapshot if cfg.checkpoint.async_save else "at_save"
    if critic is not None:
        with critic.active():
            ckpt.save(root / CRITIC_DIR, step, model=critic.chunks, optimizer=critic.optimizer,
                      extra={"step": step}, async_save=cfg.checkpoint.async_save,
                      keep_last=cfg.checkpoint.keep_last, snapshot=snapshot)
    hf_config = json.loads((base_dir / "config.json").read_text())
    extra = {"step": step, "data": loader.state_dict(), "hf_config": hf_config, "hf_expert_style": "per_expert"}
    if pool is not None:
        extra["windows"] = pool.state_dict()
    if hapo_stats is not None:
        extra["hapo_entropy_stats"] = dataclasses.asdict(hapo_stats)
    ckpt.save(root, step, model=actor.chunks, optimizer=actor.optimizer, extra=extra,
              async_save=cfg.checkpoint.async_save, keep_last=cfg.checkpoint.keep_last, snapshot=snapshot)


def _resume(root: Path, ckpt: checkpoint.Checkpointer, actor, critic, loader, weight_sync,
            pool: Optional[WindowPool]):
    """Load the newest committed step (any layout), push its weights into vLLM; return
    (step, HAPO entropy stats or None); (0, None) for a fresh run.

    A T-PPO run also gets its in-flight responses back, so it continues them where it stopped;
    a HAPO run its sampling statistics, so the next rollout samples as it would have."""
    from megatron_rl.algorithms.hapo import EntropyStats

    step = checkpoint.latest_step(root)
    if step is None:
        return 0, None
    if critic is not None:  # first, so that the actor's RNG state is the one restored
        if step not in checkpoint.committed_steps(root / CRITIC_DIR):
            raise ConfigError(f"{root} step {step} has no critic checkpoint in {root / CRITIC_DIR}: it was saved "
                              f"by a recipe without a critic; resume it with that recipe or use a new trainer.run_dir")
        with critic.active():  # any saved layout loads into the critic's current one
            ckpt.load(root / CRITIC_DIR, model=critic.chunks, optimizer=critic.optimizer, step=step)
    extra = ckpt.load(root, model=actor.chunks, optimizer=actor.optimizer, step=step)
    loader.load_state_dict(extra["data"])
    note = ""
    if pool is not None:
        if "windows" in extra:
            try:
                pool.load_state_dict(extra["windows"])
            except ValueError as err:
                raise ConfigError(str(err)) from None
            note = f" with {len(pool.samples)} in-flight responses of the window pool"
        else:
            note = " (the checkpoint has no window pool: T-PPO starts with new prompts only)"
    weight_sync.sync()
    if dist.get_rank() == 0:
        print(f"resumed from {root} step {extra['step']}{note}", flush=True)
    stats = extra.get("hapo_entropy_stats")
    return int(extra["step"]), (EntropyStats(**stats) if stats else None)


CRITIC_DIR = "critic"
"""The critic's checkpoints, under the actor's root (step directories only match there)."""


def _value_mse(critic, batch, micro_batch_size: int) -> float:
    """Mean squared error of the critic's values against ``batch.returns`` over response tokens."""
    from megatron_rl.schedules import compute_values, gather_data_parallel, local_batch

    with critic.active():
        values = gather_data_parallel(critic.chunks, compute_values(critic.chunks, local_batch(critic.chunks, batch),
                                                                    micro_batch_size))
    mask = batch.loss_mask.float()
    return float(((values - batch.returns) ** 2 * mask).sum() / mask.sum())


def _critic_layout(cfg: Config, actor_ctx, arch, world: int):
    """The critic's process groups: the actor's, or its own when critic_parallel is set."""
    if cfg.critic_layout == cfg.parallel:
        return actor_ctx
    try:
        cfg.critic_parallel.validate(world, arch.shape())
    except ValueError as err:
        raise ConfigError(f"critic_parallel: {err}") from None
    critic_ctx = initialize_alongside(cfg.critic_parallel, seed=cfg.trainer.seed, model=arch.shape())
    if dist.get_rank() == 0:
        print(f"actor layout: {cfg.parallel.describe(world)}\ncritic layout: {cfg.critic_parallel.describe(world)}",
              flush=True)
    return critic_ctx


def _start_monitor(cfg: Config, run_dir: Path):
    """Minder beside training: every machine samples, rank 0 detects (monitor.enabled)."""
    if not cfg.monitor.enabled:
        return None
    import os

    from megatron_rl.monitor.online import OnlineMonitor, torch_gather

    return OnlineMonitor(cfg.monitor, run_dir, is_detector=dist.get_rank() == 0,
                         sample_here=int(os.environ.get("LOCAL_RANK", "0")) == 0,
                         gather=torch_gather()).start()


def _agree(flag: bool) -> bool:
    """Rank 0's decision, on every rank (only the detector rank knows)."""
    value = torch.tensor([1 if flag else 0], device=platform.current().device)
    dist.broadcast(value, src=0)
    return bool(value.item())


def _lr(cfg: Config, step: int) -> float:
    """Linear warm-up over trainer.lr_warmup_steps, then constant."""
    warm = getattr(cfg.trainer, "lr_warmup_steps", 0)
    return cfg.trainer.lr * (min(1.0, step / warm) if warm else 1.0)
