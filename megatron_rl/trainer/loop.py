"""The RL loop (DESIGN.md "How data flows through one step").

prompts -> vLLM groups -> rewards -> shaping / dynamic sampling -> [critic values] ->
advantages -> Megatron old logprobs (also the train/inference mismatch metric) -> PPO
epochs over mini-batches for the actor [and the critic] -> weight sync into vLLM ->
metrics and checkpoints.

One code path for every recipe: the recipe object says which pieces are on (ppo, grpo,
dapo, vapo with value pre-training). Generation windows (tppo), HAPO's adaptive sampling
temperature and the KL reference model are rejected with a clear message until they land.
The critic shares the actor's layout (Megatron's parallel state is per process).
"""

from __future__ import annotations

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
from megatron_rl.parallel import initialize
from megatron_rl.trainer import setup
from megatron_rl.trainer.metrics import MetricsLog
from megatron_rl.trainer.rollouts import Group, collect_rollouts


def _advantages(recipe, groups: list[Group], max_len: int, values: Optional[list[torch.Tensor]] = None):
    """Per-response-token (advantages, returns or None), [rows, max_len] (rows = groups, then samples)."""
    from megatron_rl.algorithms import compute_advantages

    lengths = [len(s.token_ids) for g in groups for s in g.samples]
    mask = torch.zeros(len(lengths), max_len, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    extra = {}
    if values is not None:
        padded = torch.zeros(len(lengths), max_len)
        for row, v in enumerate(values):
            padded[row, : v.numel()] = v
        extra["values"] = padded
    inputs = recipe.advantage_inputs(mask, seq_rewards=rewards, group_index=group_index,
                                     lengths=torch.tensor(lengths), **extra)
    out = compute_advantages(recipe.advantage_estimator, inputs)
    return out.advantages, out.returns


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
    from megatron_rl.rollout.sync import check_parity, sync_weights
    from megatron_rl.algorithms import explained_variance
    from megatron_rl.schedules import (ActorLoss, CriticLoss, TrainBatch, compute_logprobs, compute_values,
                                       gather_data_parallel, local_batch, train_step)
    from megatron_rl.schedules.batch import gather_response, pack_sequences, scatter_response

    platform.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    validate(cfg, world)
    recipe = cfg.algorithm.build()
    if recipe.generation_window or recipe.token_aware or recipe.kl is not None:
        raise ConfigError(
            f"algorithm.recipe={cfg.algorithm.recipe!r} needs a reference model (kl), generation "
            "windows (tppo) or HAPO temperatures, which this trainer does not run yet; supported now: "
            "ppo, grpo, dapo, vapo (overrides without kl, generation_window, HAPO pieces)"
        )
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
    options = BuildOptions(dtype=cfg.model.dtype, moe_token_dispatcher_type=cfg.model.moe_token_dispatcher_type,
                           moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
                           recompute_activations=cfg.model.recompute_activations)
    actor = setup.build_trainable("actor", arch, cfg.parallel, options, cfg.trainer.lr, base_dir)
    critic = (setup.build_trainable("critic", arch, cfg.parallel, options,
                                    cfg.trainer.lr * recipe.critic_lr_multiplier, base_dir)
              if recipe.use_critic else None)

    # Data and rewards: the same seeded prompt order on every rank.
    dataset = PromptDataset(setup.prompt_files(cfg, base_dir), tokenizer,
                            fields=PromptFields(prompt=cfg.data.prompt_key, answer=cfg.data.answer_key))
    loader = PromptLoader(dataset, batch_size=cfg.rollout.prompts_per_step, seed=cfg.trainer.seed)
    verifier = build_verifier(setup.verifier_name(cfg))

    # The colocated engine starts from the same HF weights as the actor.
    engine = RolloutEngine(base_dir, EngineConfig(
        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
        dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[cfg.model.dtype],
        max_model_len=min(arch.max_position_embeddings, cfg.trainer.seq_length),
        seed=cfg.trainer.seed, cpu_kv_cache_gib=cfg.rollout.kv_cache_gib,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        cache_dir=str(run_dir / "cache"),
    ))
    sampling = Sampling(n=cfg.rollout.n_samples, max_tokens=cfg.rollout.max_new_tokens,
                        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                        stop_token_ids=(tokenizer.eos_token_id,))
    seq_length = cfg.trainer.seq_length
    dp = cfg.parallel.dp(world)
    mbs = cfg.trainer.micro_batch_size
    row_multiple = dp * mbs * cfg.algorithm.mini_batches_per_step
    actor_loss = ActorLoss(recipe, arch.vocab_size)
    critic_loss = CriticLoss.from_recipe(recipe) if critic is not None else None
    ckpt_root = run_dir / "checkpoints"
    first_step = 1 + _resume(ckpt_root, actor, loader, engine, arch, cfg)
    log = MetricsLog(run_dir, enabled=rank == 0, total_steps=cfg.trainer.max_steps, resume_after=first_step - 1)
    monitor = _start_monitor(cfg, run_dir)
    slurm = SlurmEnv.from_environ()
    probe = None
    history = []
    step, stop_signal = first_step - 1, None
    for step in range(first_step, cfg.trainer.max_steps + 1):
        step_start = time.perf_counter()
        rollout = collect_rollouts(
            engine, loader.next_batch, sampling, recipe, verifier.score_batch,
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True), cfg.rollout.prompts_per_step,
        )
        groups = rollout.groups[: _rows_usable(len(rollout.groups), cfg.rollout.n_samples, row_multiple)]
        record = {
            "step": step,
            "reward/mean": rollout.mean_correct_all,
            "response_length/mean": rollout.mean_length_all,
            "rollout/kept_groups": len(groups),
            "rollout/generated_groups": rollout.generated_groups,
            "rollout/generation_batches": rollout.generation_batches,
            "timing/rollout_s": rollout.seconds,
        }
        train_start = time.perf_counter()
        tokens_trained = 0
        if groups:
            samples = [s for g in groups for s in g.samples]
            prompts = [s.prompt_ids for s in samples]
            responses = [s.token_ids for s in samples]
            tokens, loss_mask = pack_sequences(prompts, responses, seq_length, tokenizer.pad_token_id or 0)
            max_len = max(len(r) for r in responses)
            prompt_lens, response_lens = [len(p) for p in prompts], [len(r) for r in responses]
            temperature = torch.full(tokens.shape, cfg.rollout.temperature)
            values = None
            if critic is not None:
                plain = TrainBatch(tokens=tokens, loss_mask=loss_mask)
                values = gather_data_parallel(critic.chunks, compute_values(critic.chunks, local_batch(critic.chunks, plain), mbs))
            adv, ret = _advantages(recipe, groups, max_len,
                                   gather_response(values, prompt_lens, response_lens) if values is not None else None)
            advantages = scatter_response([a[:r] for a, r in zip(adv, response_lens)], prompt_lens, seq_length)
            returns = (scatter_response([x[:r] for x, r in zip(ret, response_lens)], prompt_lens, seq_length)
                       if ret is not None else None)
            vllm_logp = scatter_response([torch.tensor(s.logprobs) for s in samples], prompt_lens, seq_length)
            is_positive = torch.tensor([c > 0 for g in groups for c in g.correct])
            plain = TrainBatch(tokens=tokens, loss_mask=loss_mask, temperature=temperature)
            old_logp, _ = compute_logprobs(actor.chunks, local_batch(actor.chunks, plain), mbs, arch.vocab_size)
            old_logp = gather_data_parallel(actor.chunks, old_logp)
            mask = loss_mask.float()
            record["rollout/logprob_abs_diff"] = float(((old_logp - vllm_logp).abs() * mask).sum() / mask.sum())
            full = TrainBatch(tokens=tokens, loss_mask=loss_mask, advantages=advantages, temperature=temperature,
                              old_logprobs=old_logp, returns=returns, old_values=values, is_positive=is_positive)
            warming_up = step <= recipe.value_warmup_steps  # VAPO: critic only, policy frozen
            if critic is not None and warming_up and probe is None:
                probe = full  # the first warm-up batch: the critic's loss on it before and after warm-up
                record["critic/warmup_probe_loss"] = _value_mse(critic, probe, mbs)
            actor.set_lr(_lr(cfg, step))
            actor_metrics, critic_metrics = [], []
            minis = cfg.algorithm.mini_batches_per_step
            rows = full.num_rows // minis
            for _ in range(cfg.algorithm.ppo_epochs):
                for m in range(minis):
                    part = full.rows(m * rows, (m + 1) * rows)
                    if critic is not None:
                        critic_metrics.append(train_step(critic.chunks, critic.optimizer,
                                                         local_batch(critic.chunks, part), critic_loss, mbs))
                    if not warming_up:
                        actor_metrics.append(train_step(actor.chunks, actor.optimizer,
                                                        local_batch(actor.chunks, part), actor_loss, mbs))
            for key in ("actor/pg_loss", "actor/clipfrac", "actor/entropy", "actor/grad_norm"):
                if actor_metrics:
                    record[key] = sum(float(x[key]) for x in actor_metrics) / len(actor_metrics)
            if critic_metrics:
                record["critic/value_loss"] = sum(float(x["critic/value_loss"]) for x in critic_metrics) / len(critic_metrics)
                record["critic/explained_var"] = float(explained_variance(values, returns, loss_mask))
            record["actor/updated"] = bool(actor_metrics)
            if probe is not None and step == recipe.value_warmup_steps:
                record["critic/warmup_probe_loss"] = _value_mse(critic, probe, mbs)
            tokens_trained = int(loss_mask.sum())
        record["timing/train_s"] = time.perf_counter() - train_start
        record["timing/weight_sync_s"] = 0.0
        if record.get("actor/updated"):
            sync = sync_weights(actor.chunks, arch, engine, bucket_bytes=int(cfg.rollout.bucket_mb * (1 << 20)))
            record["timing/weight_sync_s"] = sync.seconds
        if cfg.rollout.parity_every and step % cfg.rollout.parity_every == 0 and groups:
            seqs = [g.samples[0].prompt_ids + g.samples[0].token_ids for g in groups[:4]]
            report = check_parity(actor.chunks, engine, seqs, arch.vocab_size, seq_length,
                                  threshold=cfg.rollout.parity_threshold)
            record["rollout/parity_max_abs_diff"] = report.max_abs_diff
        record["timing/step_s"] = time.perf_counter() - step_start
        generated_tokens = rollout.mean_length_all * rollout.generated_groups * cfg.rollout.n_samples
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
            _save(ckpt_root, step, actor, loader, base_dir, cfg)
        if faulty and rank == 0:
            print(f"stopping after step {step}: the monitor declared {sorted(monitor.declared)} faulty "
                  f"(listed in {monitor.exclude_file})", flush=True)
        if stop_signal is not None and rank == 0:
            print(f"stopped on {stop_signal.name} after step {step}; checkpoint saved in {ckpt_root}", flush=True)
        if faulty or stop_signal is not None:
            break
    checkpoint.wait_pending()  # an async save still writing must commit before we exit
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
        first = [r["reward/mean"] for r in history[:5]]
        last = [r["reward/mean"] for r in history[-5:]]
        summary.update(first_reward=sum(first) / len(first), last_reward=sum(last) / len(last))
    return summary


def _save(root: Path, step: int, actor, loader, base_dir: Path, cfg: Config) -> None:
    """Actor, optimizer, RNG, data position; plus what an HF export needs."""
    hf_config = json.loads((base_dir / "config.json").read_text())
    extra = {"step": step, "data": loader.state_dict(), "hf_config": hf_config, "hf_expert_style": "per_expert"}
    checkpoint.save(root, step, model=actor.chunks, optimizer=actor.optimizer, extra=extra,
                    async_save=cfg.checkpoint.async_save, keep_last=cfg.checkpoint.keep_last)


def _resume(root: Path, actor, loader, engine, arch, cfg: Config) -> int:
    """Load the newest committed step (any layout), push its weights into vLLM; return it (0: fresh)."""
    from megatron_rl.rollout.sync import sync_weights

    if checkpoint.latest_step(root) is None:
        return 0
    extra = checkpoint.load(root, model=actor.chunks, optimizer=actor.optimizer)
    loader.load_state_dict(extra["data"])
    sync_weights(actor.chunks, arch, engine, bucket_bytes=int(cfg.rollout.bucket_mb * (1 << 20)))
    if dist.get_rank() == 0:
        print(f"resumed from {root} step {extra['step']}", flush=True)
    return int(extra["step"])


def _value_mse(critic, batch, micro_batch_size: int) -> float:
    """Mean squared error of the critic's values against ``batch.returns`` over response tokens."""
    from megatron_rl.schedules import compute_values, gather_data_parallel, local_batch

    values = gather_data_parallel(critic.chunks, compute_values(critic.chunks, local_batch(critic.chunks, batch),
                                                                micro_batch_size))
    mask = batch.loss_mask.float()
    return float(((values - batch.returns) ** 2 * mask).sum() / mask.sum())


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
