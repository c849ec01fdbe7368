"""A tiny model trained with Megatron's DDP and distributed optimizer, for checkpoint tests.

The saved state (parameters and Adam state) and its full, layout-free tensors gathered
without the checkpoint code, so a test's expectations never come from the store it tests.
Works on whatever device the platform picked (CUDA + NCCL or CPU + gloo).
"""

from __future__ import annotations

import random
import threading
import time

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.models import build_model
from megatron_rl.models.builder import BuildOptions, wrap_for_training
from megatron_rl.parallel import ParallelConfig, initialize
from megatron_rl.parallel.full_tensors import gather_full, params_as
from megatron_rl.schedules import TrainBatch, local_batch, train_step
from megatron_rl_lab.testing.losses import MeanCrossEntropy, all_but_last
from megatron_rl_lab.testing.tiny import TINY_ARCHS

GLOBAL_BATCH, SEQ, MBS = 8, 16, 2


class TrainingRun:
    """One model + Megatron DDP + distributed optimizer in one layout, trained on fixed data.

    ``data="step"``: each step's batch is fixed by the step number (the same in any layout);
    ``"python_rng"``: drawn from python's RNG, so only a resume that restores it sees the
    same data."""

    def __init__(self, kind: str, layout: dict, seed: int = 7, data: str = "step", dtype: str = "fp32"):
        self.arch, self.parallel, self.data = TINY_ARCHS[kind], ParallelConfig(**layout), data
        self.ctx = initialize(self.parallel, seed=seed, model=self.arch.shape())
        rows_per_rank = GLOBAL_BATCH // self.parallel.dp(self.ctx.world_size)
        # interleaving needs M >= PP micro-batches; at DP8 a rank has one row
        self.mbs = 1 if self.parallel.virtual_pipeline_model_parallel_size else min(MBS, rows_per_rank)
        chunks = build_model("actor", self.arch, self.parallel, BuildOptions(dtype=dtype))
        self.chunks, self.optimizer = wrap_for_training(chunks, dtype=dtype, lr=1e-2, clip_grad=1.0, weight_decay=0.01)

    def batch(self, step: int) -> TrainBatch:
        """``step``'s whole mini-batch (every rank draws the same), on the platform's device."""
        seed = step if self.data == "step" else random.getrandbits(62)
        g = torch.Generator().manual_seed(1000 + seed)
        tokens = torch.randint(0, self.arch.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)
        batch = TrainBatch(tokens=tokens, loss_mask=all_but_last(GLOBAL_BATCH, SEQ))
        return batch.to(platform.current().device)

    def train(self, steps) -> list[float]:
        """One optimizer step per entry of ``steps`` through the RL schedules (any layout, CP
        included); the mini-batch's mean loss of each (every rank)."""
        loss = MeanCrossEntropy(self.arch.vocab_size)
        losses = []
        for step in steps:
            local = local_batch(self.chunks, self.batch(step))
            losses.append(train_step(self.chunks, self.optimizer, local, loss, self.mbs)["ce/loss"])
        return losses

    def full_params(self) -> dict[str, torch.Tensor]:
        """{canonical name: full fp32 tensor on the CPU} of every parameter (every rank)."""
        return gather_full(self.chunks)

    def full_optimizer_state(self) -> dict[str, torch.Tensor]:
        """{'<state>.<name>': full tensor}, assembled without the checkpoint code: each DP
        rank writes its flat slice of a parameter's state into zeros, an all-reduce over the
        sub-optimizer's DP group completes it, gather_full assembles TP/PP/EP pieces."""
        from megatron_rl.checkpoint.optimizer_state import sub_optimizers
        from megatron_rl.platform.megatron_internals import main_param_and_optimizer_states

        device = platform.current().device
        per_key = {key: {} for key in ("param", "exp_avg", "exp_avg_sq")}
        for sub in sub_optimizers(self.optimizer):
            mine = _flat_ranges(sub)
            for buffer in sub.buffers:
                for param in buffer.params:  # same order on every DP rank
                    states = main_param_and_optimizer_states(sub, param) if param in mine else None
                    for key, full in per_key.items():
                        flat = torch.zeros(param.numel(), device=device)
                        if states is not None:
                            flat[mine[param].start : mine[param].end] = states[key].detach().view(-1)
                        dist.all_reduce(flat, group=sub.data_parallel_group)
                        full[param] = flat
        out = {}
        for key, full in per_key.items():
            with params_as(self.chunks, lambda p, full=full: full[p].view_as(p.data)):
                for name, tensor in gather_full(self.chunks).items():
                    out[f"{key}.{name}"] = tensor
        return out

    def step_count(self) -> list[float]:
        """The distinct Adam step counts of the optimizer's parameter groups."""
        from megatron_rl.checkpoint.optimizer_state import sub_optimizers

        groups = (g for s in sub_optimizers(self.optimizer) for g in s.state_dict()["optimizer"]["param_groups"])
        return sorted({g["step"] for g in groups})


def _flat_ranges(sub) -> dict:
    """param -> the range of its flat shard this DP rank's sub-optimizer owns."""
    mine = {}
    for gbuf in sub.gbuf_ranges:
        for per_bucket in gbuf.values():
            for bucket in per_bucket:
                for param, ranges in bucket["param_map"].items():
                    mine[param] = ranges["param"]
    return mine


def hold_writer_until_update(ckpt, optimizer, after_s: float) -> list:
    """Occupy ``ckpt``'s background writer until ``optimizer``'s next step() is called, then
    ``after_s`` more: a deferred snapshot queued now provably starts copying after the update
    was asked for, so the update must wait for it. Returns the hooks (remove them after)."""
    from megatron_rl.checkpoint.optimizer_state import sub_optimizers

    called = threading.Event()
    hooks = [sub.optimizer.register_step_pre_hook(lambda *_: called.set()) for sub in sub_optimizers(optimizer)]
    ckpt._background().submit(lambda: (called.wait(120), time.sleep(after_s)))
    return hooks
