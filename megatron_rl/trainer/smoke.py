"""The model smoke job: supervised next-token training of the tiny actor on a synthetic task.

It exercises the whole foundation end to end (platform layer, layout, actor, Megatron DDP,
the distributed optimizer, get_forward_backward_func) without vLLM or rewards; `train`
runs it for ``trainer.job=smoke`` (examples/smoke.yaml). Task: counting, token t+1 =
token t + 1 (mod vocab) from a random start, so the loss must fall from ln(vocab) towards
0 once the model has learned it.

It is also the stand-in trainer for the Slurm launch (scripts/slurm, megatron_rl.launch):
it saves to ``<run_dir>/checkpoints`` every ``checkpoint.save_interval`` steps, at the end
and when a stop signal (SIGUSR1 / SIGTERM) is agreed on, and resumes from the newest
committed step. Each step's data is a function of the step alone, so a resumed run
reproduces the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl import checkpoint, platform
from megatron_rl.config import Config, dump_yaml
from megatron_rl.from_config import model_arch, validate
from megatron_rl.launch import exit_codes
from megatron_rl.launch.exclude import ExcludeWatch
from megatron_rl.launch.resume import continue_metrics
from megatron_rl.launch.signals import StopSignals, stop_line
from megatron_rl.launch.slurm_env import SlurmEnv
from megatron_rl.launch.status import write_status
from megatron_rl.models.builder import BuildOptions, build_model, wrap_for_training
from megatron_rl.parallel import initialize


def _batch(step: int, rank_slice: slice, cfg: Config, vocab: int):
    g = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + step)
    n, s = cfg.trainer.global_batch_size, cfg.trainer.seq_length
    start = torch.randint(0, vocab, (n, 1), generator=g)
    seq = (start + torch.arange(s + 1)) % vocab
    return seq[rank_slice, :-1], seq[rank_slice, 1:]


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    loss_tokens = model(tokens, positions, None, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm_loss": loss.detach().clone()}

    return loss_tokens, loss_func


def run(cfg: Config) -> dict:
    """Train up to ``trainer.max_steps`` (resuming from the newest checkpoint); return first/last
    loss, the step reached and the exit code (launch.exit_codes: DONE, or STOPPED on a signal).

    The stop handlers go in first, so that a signal during start-up is not fatal either."""
    with StopSignals(exclude=ExcludeWatch.in_job(cfg.trainer.run_dir)) as stop:
        return _train(cfg, stop)


def _train(cfg: Config, stop: StopSignals) -> dict:
    platform.init_distributed(cfg.trainer.dist_timeout_s)
    world = dist.get_world_size()
    validate(cfg, world)
    arch = model_arch(cfg)
    ctx = initialize(cfg.parallel, seed=cfg.trainer.seed, model=arch.shape(), timeout_s=cfg.trainer.dist_timeout_s)
    options = BuildOptions(dtype=cfg.model.dtype, moe_token_dispatcher_type=cfg.model.moe_token_dispatcher_type)
    chunks = build_model("actor", arch, cfg.parallel, options)
    chunks, optimizer = wrap_for_training(chunks, dtype=cfg.model.dtype, lr=cfg.trainer.lr, clip_grad=1.0)
    dp = cfg.parallel.dp(world)
    per_rank = cfg.trainer.global_batch_size // dp
    rank_slice = slice(ctx.coords.dp * per_rank, (ctx.coords.dp + 1) * per_rank)
    mbs = cfg.trainer.micro_batch_size
    run_dir = Path(cfg.trainer.run_dir)
    ckpt_root = run_dir / "checkpoints"
    slurm = SlurmEnv.from_environ()
    ckpt = checkpoint.Checkpointer()
    start_step, extra = _resume(ckpt, ckpt_root, chunks, optimizer)
    if ctx.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
        metrics = continue_metrics(run_dir / "metrics.jsonl", start_step)
        if start_step:
            print(f"resumed from {ckpt_root} at step {start_step} (restart {slurm.restart_count})", flush=True)
    history = []
    stop_signal = None
    step = start_step
    while step < cfg.trainer.max_steps and stop_signal is None:
        step += 1
        start = time.time()
        tokens, labels = _batch(step, rank_slice, cfg, arch.vocab_size)
        micro = [(tokens[i : i + mbs], labels[i : i + mbs]) for i in range(0, per_rank, mbs)]
        losses, grad_norm = _optimizer_step(chunks, optimizer, micro, cfg)
        loss = _mean_over_last_stage(losses, world)
        record = {
            "step": step,
            "lm_loss": loss,
            "grad_norm": float(grad_norm),
            "timing/step_s": time.time() - start,
            "slurm/restart_count": slurm.restart_count,
        }
        history.append(record)
        if ctx.rank == 0:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            print(
                f"step {step:3d}  lm_loss {loss:.4f}  grad_norm {float(grad_norm):.3f}  {record['timing/step_s']:.2f}s",
                flush=True,
            )
        stop_signal = stop.agree()  # every rank, every step: all stop at the same step
        interval = cfg.checkpoint.save_interval
        if stop_signal is not None or step == cfg.trainer.max_steps or (interval and step % interval == 0):
            extra = {"step": step, "first_loss": extra.get("first_loss", history[0]["lm_loss"]), "last_loss": loss}
            ckpt.save(
                ckpt_root,
                step,
                model=chunks,
                optimizer=optimizer,
                extra=extra,
                async_save=cfg.checkpoint.async_save,
                keep_last=cfg.checkpoint.keep_last,
            )
    ckpt.close()  # committed on every rank before anyone reports
    done = step >= cfg.trainer.max_steps
    code = exit_codes.DONE if done else exit_codes.STOPPED
    if ctx.rank == 0:
        metrics.close()
        write_status(run_dir, code, step, None if stop_signal is None else stop_signal.name, slurm)
        if not done:
            print(stop_line(stop_signal, step, ckpt_root), flush=True)
    return {
        "first_loss": extra.get("first_loss", history[0]["lm_loss"] if history else math.nan),
        "last_loss": extra.get("last_loss", math.nan),
        "chance_loss": math.log(arch.vocab_size),
        "run_dir": str(run_dir),
        "step": step,
        "exit_code": code,
    }


def _optimizer_step(chunks, optimizer, micro: list, cfg: Config):
    """One forward/backward over the microbatches and an optimizer step: (losses, grad_norm)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with platform.megatron_scope():
        for c in chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro),
            seq_length=cfg.trainer.seq_length,
            micro_batch_size=cfg.trainer.micro_batch_size,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
    return losses, grad_norm


def _resume(ckpt: checkpoint.Checkpointer, root: Path, chunks, optimizer) -> tuple[int, dict]:
    """(step, extra) of the newest committed checkpoint, loaded into chunks + optimizer;
    (0, {}) when there is none. Rank 0 looks, so every rank resumes from the same step."""
    found = [checkpoint.latest_step(root) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return 0, {}
    extra = ckpt.load(root, model=chunks, optimizer=optimizer, step=found[0])
    return found[0], extra


def _mean_over_last_stage(losses, world: int) -> float:
    local = sum(float(m["lm_loss"]) for m in losses) / len(losses) if losses else None
    everyone = [None] * world
    dist.all_gather_object(everyone, local)
    values = [v for v in everyone if v is not None]
    return sum(values) / len(values)
