"""torchrun body: actor and critic, dense and MoE, in many layouts vs the single-rank model.

The reference is the model with every parallel size 1 (each rank holds the whole model and
runs the whole batch). Each layout loads the reference weights through their
parallelism-free keys, runs forward+backward on its data-parallel slice through
Megatron's get_forward_backward_func with DDP and finalize_model_grads, and gathers its
gradients back into full tensors to compare.
"""

import sys
from functools import partial

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.models import build_model
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl.parallel.full_tensors import gather_full, load_full, main_grad, params_as
from megatron_rl.parallel.state import check_coordinates
from megatron_rl_lab.testing.tiny import TINY_ARCHS
from megatron_rl_lab.testing.torchrun import run_cases

GLOBAL_BATCH, SEQ = 8, 16


def batch(vocab):
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    targets = torch.randn(GLOBAL_BATCH, SEQ, generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), targets


def forward_step(role, data_iterator, model):
    tokens, labels, targets = next(data_iterator)
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    if role == "actor":
        out = model(tokens, positions, None, labels=labels)  # per-token CE, vocab-parallel
    else:
        out = model(tokens, positions, None)  # values [b, s, 1]

    def loss_func(output):
        if role == "actor":
            loss = output.float().mean()
        else:
            loss = (output.float().squeeze(-1) - targets).pow(2).mean()
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


def run(role, arch, parallel, weights=None, micro_batch_size=1):
    """Build, optionally load weights, one forward/backward; return (loss, weights, grads)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ctx = initialize(parallel, seed=42, model=arch.shape())
    mismatch = check_coordinates(ctx)  # computed rank map == Megatron's live groups
    assert mismatch is None, mismatch
    chunks = build_model(role, arch, parallel)
    if weights is not None:
        load_full(chunks, weights)
    config = chunks[0].config
    with platform.megatron_scope():
        chunks = [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    dp, dp_rank = parallel.dp(ctx.world_size), ctx.coords.dp
    tokens, labels, targets = batch(arch.vocab_size)
    per_rank = GLOBAL_BATCH // dp
    sl = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    micro = [
        (
            tokens[sl][i : i + micro_batch_size],
            labels[sl][i : i + micro_batch_size],
            targets[sl][i : i + micro_batch_size],
        )
        for i in range(0, per_rank, micro_batch_size)
    ]
    with platform.megatron_scope():
        losses = get_forward_backward_func()(
            forward_step_func=partial(forward_step, role),
            data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro),
            seq_length=SEQ,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
    local = sum(float(m["loss"]) for m in losses) / len(micro) if losses else None
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, local)
    stage_losses = [loss for loss in everyone if loss is not None]
    loss = sum(stage_losses) / len(stage_losses)
    full_weights = gather_full(chunks)
    with params_as(chunks, main_grad):
        full_grads = gather_full(chunks)
    destroy()
    return loss, full_weights, full_grads


REFERENCES = {}


def reference(role, kind):
    if (role, kind) not in REFERENCES:
        REFERENCES[role, kind] = run(role, TINY_ARCHS[kind], ParallelConfig(), micro_batch_size=4)
    return REFERENCES[role, kind]


def compare(role, kind, layout):
    ref_loss, ref_weights, ref_grads = reference(role, kind)
    loss, weights, grads = run(role, TINY_ARCHS[kind], ParallelConfig(**layout), weights=ref_weights)
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    grad_diff = {k: float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads}
    weight_diff = max(float((weights[k] - ref_weights[k]).abs().max()) for k in ref_weights)
    grad_scale = {k: float(ref_grads[k].abs().max()) for k in ref_grads}
    return {
        "loss": loss,
        "ref_loss": ref_loss,
        "max_grad_diff": max(grad_diff.values()),
        "worst_key": max(grad_diff, key=grad_diff.get),
        "weight_diff": weight_diff,
        "min_grad_scale": min(grad_scale.values()),
        "num_tensors": len(grad_diff),
    }


def layouts_for(world_size):
    if world_size == 4:
        return {
            "tp2": dict(tensor_model_parallel_size=2),
            "pp2": dict(pipeline_model_parallel_size=2),
            "pp2_vpp2": dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            "ep2": dict(expert_model_parallel_size=2),
            "ep4": dict(expert_model_parallel_size=4),
            "tp2_ep2_etp2": dict(
                tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=2
            ),
            "tp2_ep2_etp1": dict(
                tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
            ),
        }
    return {
        "tp2_pp2_ep2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2),
        "tp2_pp2_ep4": dict(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=4,
            expert_tensor_parallel_size=1,
        ),
        "tp2_pp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    }


def cases(world_size):
    out = {}
    for name, layout in layouts_for(world_size).items():
        for kind in ("dense", "moe"):
            if kind == "dense" and "ep" in name:
                continue
            for role in ("actor", "critic"):
                out[f"{kind}-{role}-{name}"] = partial(compare, role, kind, layout)
    layout = layouts_for(world_size)["tp2_pp2" if world_size == 8 else "tp2"]
    out["destroy-frees-the-groups"] = partial(destroy_case, layout)
    return {**out, **packed_schedule_cases(world_size)}


def destroy_case(layout):
    """Process groups registered with torch before a layout, with it, and after destroy()."""
    from torch.distributed.distributed_c10d import _world

    before = len(_world.pg_map)
    initialize(ParallelConfig(**layout))
    built = len(_world.pg_map)
    destroy()
    return {"before": before, "built": built, "after": len(_world.pg_map)}


def packed_schedule_cases(world_size):
    """World 8 only: the RL schedules on packed micro-batches (body_schedules' cases and
    references) in the layouts only this launch reaches, without a launch of their own."""
    if world_size != 8:
        return {}
    import body_schedules as sched

    layouts, budget = layouts_for(8), sched.Microbatching(max_tokens=sched.PACK_BUDGET)
    return {
        "packed-moe-actor-tp2_pp2_ep2-dapo": partial(sched.actor_case, "moe", layouts["tp2_pp2_ep2"], "dapo", budget),
        "packed-moe-actor-tp2_pp2_ep4-grpo": partial(sched.actor_case, "moe", layouts["tp2_pp2_ep4"], "grpo", budget),
        "packed-dense-critic-tp2_pp2": partial(sched.critic_case, "dense", layouts["tp2_pp2"], budget),
        # context parallelism with the experts folded over the CP ranks: EP4 spans CP2 x DP2
        # (ETP = TP2), and EP2 x EDP4 under CP4
        "cp-moe-actor-cp2_tp2_ep4-dapo": partial(
            sched.actor_case,
            "moe",
            dict(context_parallel_size=2, tensor_model_parallel_size=2, expert_model_parallel_size=4),
            "dapo",
            1,
        ),
        "packed-cp-moe-actor-cp4_ep2-grpo": partial(
            sched.actor_case,
            "moe",
            dict(context_parallel_size=4, expert_model_parallel_size=2),
            "grpo",
            sched.Microbatching(max_tokens=32),
        ),
    }


if __name__ == "__main__":
    run_cases(cases(int(sys.argv[1])))
