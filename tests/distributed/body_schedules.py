"""torchrun body (world 4): RL losses through Megatron's schedules vs plain single-process torch.

Reference: the whole mini-batch through the unwrapped single-rank model, logprobs from
torch.log_softmax over the full (unpadded) vocabulary, the recipe's loss composed from
`megatron_rl.algorithms` on the whole batch, plain autograd. Each case loads the
reference weights into a layout, runs `megatron_rl.schedules` on its DP slice in
microbatches (DDP + finalize_model_grads), and compares logprobs / entropy / values
(every rank), mini-batch metrics and the full gradients.

The vocabulary (96) is padded to 100 (vocab_size_divisible_by=5) in every layout, so the
4 padded LM-head rows carry random weights that must be masked (under TP2 they all sit on
TP rank 1).
"""

import dataclasses
from functools import partial

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.algorithms import (
    aggregate,
    asymmetric_clip_bounds,
    entropy_from_logits,
    get_recipe,
    kl_penalty,
    policy_loss,
    positive_example_nll,
    redistribute_advantages,
    value_loss,
)
from megatron_rl.models import build_model
from megatron_rl.models.builder import BuildOptions
from megatron_rl.parallel import ParallelConfig, destroy, initialize, initialize_alongside
from megatron_rl.parallel.full_tensors import gather_full, load_full, main_grad, params_as
from megatron_rl.parallel.state import check_coordinates
from megatron_rl.schedules import (
    ActorLoss,
    CriticLoss,
    compute_logprobs,
    compute_values,
    forward_backward,
    gather_data_parallel,
    local_batch,
    train_step,
)
from megatron_rl.schedules.packing import Microbatching
from megatron_rl_lab.testing import batches
from megatron_rl_lab.testing.tiny import TINY_ARCHS
from megatron_rl_lab.testing.torchrun import run_cases

GLOBAL_BATCH, SEQ = 8, 16
PACK_BUDGET = 24  # tokens per packed micro-batch: a multiple of TP2, some rows pair up, some not
OPTIONS = BuildOptions(vocab_size_divisible_by=5)
RECIPES = {
    "dapo": get_recipe("dapo"),  # token-mean, clip 0.2 / 0.28
    "grpo": get_recipe("grpo"),  # seq-mean-token-mean
    # every actor-loss piece at once: HAPO bounds + redistribution + dual clip, KL, NLL
    "hapo_kl_nll": get_recipe("hapo", kl={"kind": "k3", "coef": 0.04}, positive_nll_coef=0.1),
}
CRITIC = CriticLoss(value_clip=0.2)


def rollout_batch(vocab):
    """The mini-batch every layout and the reference train on, and its generator for noise."""
    return batches.rollout_batch(vocab, GLOBAL_BATCH, SEQ, seed=2024)


def plain_logprobs(model, batch, vocab):
    positions = torch.arange(SEQ).expand_as(batch.tokens)
    with platform.megatron_scope():
        logits = model(batch.tokens, positions, None)  # [N, S, 100]
    z = logits[..., :vocab] / batch.temperature.unsqueeze(-1)
    logp = torch.log_softmax(z, -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    return logp, entropy_from_logits(z)


def plain_actor_loss(logp, b, r):
    mask, adv, low, high = b.loss_mask, b.advantages, r.clip_low, r.clip_high
    if r.entropy_clip_alpha:
        low, high = asymmetric_clip_bounds(b.h_hat, low, high, r.entropy_clip_alpha)
    if r.redistribution_beta:
        ratio = torch.exp(logp.detach() - b.old_logprobs)
        adv = redistribute_advantages(adv, ratio, b.h_hat, low, high, r.redistribution_beta)
    loss, stats = policy_loss(logp, b.old_logprobs, adv, mask, low, high, r.clip_c, r.loss_agg)
    pg_loss = loss.detach().clone()
    if r.kl:
        loss = loss + r.kl.coef * aggregate(kl_penalty(logp, b.ref_logprobs, r.kl.kind), mask, r.loss_agg)
    if r.positive_nll_coef:
        loss = loss + r.positive_nll_coef * positive_example_nll(logp, mask, b.is_positive)
    return loss, {"pg_loss": float(pg_loss), "clipfrac": float(stats["clipfrac"]), "loss": float(loss)}


REFERENCES = {}


def reference(kind, role):
    """(weights, batch, {recipe: (metrics, grads)}, logp, entropy) or values, single process."""
    if (kind, role) in REFERENCES:
        return REFERENCES[kind, role]
    arch = TINY_ARCHS[kind]
    initialize(ParallelConfig(), seed=42, model=arch.shape())
    chunks = build_model(role, arch, ParallelConfig(), OPTIONS)
    model, weights = chunks[0], gather_full(chunks)
    batch, g = rollout_batch(arch.vocab_size)
    out = {"weights": weights}
    if role == "actor":
        logp, entropy = plain_logprobs(model, batch, arch.vocab_size)
        logp, entropy = logp.detach(), entropy.detach()

        def noise(scale):
            return scale * torch.randn(GLOBAL_BATCH, SEQ, generator=g)

        batch = dataclasses.replace(batch, old_logprobs=logp + noise(0.2), ref_logprobs=logp + noise(0.1))
        runs = {}
        for name, recipe in RECIPES.items():
            model.zero_grad()
            loss, metrics = plain_actor_loss(plain_logprobs(model, batch, arch.vocab_size)[0], batch, recipe)
            loss.backward()
            metrics["entropy"] = float(entropy[batch.loss_mask].mean())
            with params_as(chunks, main_grad):
                runs[name] = (metrics, gather_full(chunks))
        out.update(batch=batch, logp=logp, entropy=entropy, runs=runs)
    else:
        positions = torch.arange(SEQ).expand_as(batch.tokens)
        with platform.megatron_scope():
            values = model(batch.tokens, positions, None).squeeze(-1)
        loss = value_loss(values, batch.old_values, batch.returns, batch.loss_mask, CRITIC.value_clip)
        loss.backward()
        with params_as(chunks, main_grad):
            out.update(batch=batch, values=values.detach(), loss=float(loss), grads=gather_full(chunks))
    destroy()
    REFERENCES[kind, role] = out
    return out


def setup(role, kind, layout, weights, optimizer=None):
    """Initialise ``layout`` (as the only one), then build ``role`` in it (see ``build``)."""
    initialize(ParallelConfig(**layout), seed=42, model=TINY_ARCHS[kind].shape())
    return build(role, kind, layout, weights, optimizer)


def build(role, kind, layout, weights, optimizer=None):
    """``role`` in the active layout with ``weights``, in DDP, with Megatron's Adam when
    ``optimizer`` is "distributed" (DDP reduce-scatters: whole gradients are no longer
    readable) or "plain" (gradients all-reduced)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    arch, parallel = TINY_ARCHS[kind], ParallelConfig(**layout)
    chunks = build_model(role, arch, parallel, OPTIONS)
    load_full(chunks, weights)
    config = chunks[0].config
    distributed = optimizer == "distributed"
    with platform.megatron_scope():
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
        chunks = [DistributedDataParallel(config, ddp, c) for c in chunks]
        if optimizer is not None:
            optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=1e-4, use_distributed_optimizer=distributed, clip_grad=1.0, weight_decay=0.0
                ),
                chunks,
            )
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, optimizer


def max_over_world(value):
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def grad_report(grads, ref_grads):
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    diff = {k: float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads}
    return {
        "max_grad_diff": max(diff.values()),
        "worst_key": max(diff, key=diff.get),
        "max_grad": max(float(g.abs().max()) for g in ref_grads.values()),
        "params_without_grad": sorted(k for k, g in ref_grads.items() if not g.abs().max() > 0),
    }


def predicted(batch):
    """[N, S] bool: positions that predict a token of their own row (t < length - 1); a
    packed row's last token predicts the next sequence's first, padding is not computed."""
    return torch.arange(SEQ)[None] < (batch.sequence_lengths() - 1)[:, None]


def real_positions(batch):
    """[N, S] bool: the row's own tokens (a value reads only its prefix, packed or not)."""
    return torch.arange(SEQ)[None] < batch.sequence_lengths()[:, None]


def max_diff_on(a, b, where):
    return max_over_world((a - b).abs()[where].max())


def actor_case(kind, layout, recipe_name, micro, whole_batch_per_rank=False):
    """`micro`: rows per micro-batch (padded rows) or a packing Microbatching."""
    ref = reference(kind, "actor")
    vocab = TINY_ARCHS[kind].vocab_size
    chunks, _ = setup("actor", kind, layout, ref["weights"])
    batch = ref["batch"] if whole_batch_per_rank else local_batch(chunks, ref["batch"], micro)
    logp, entropy = compute_logprobs(chunks, batch, micro, vocab)
    if not whole_batch_per_rank:
        order = micro.gather_order(ref["batch"], ref_dp(chunks)) if isinstance(micro, Microbatching) else None
        logp, entropy = gather_data_parallel(chunks, logp, order), gather_data_parallel(chunks, entropy, order)
    metrics = forward_backward(chunks, batch, ActorLoss(RECIPES[recipe_name], vocab), micro)
    with params_as(chunks, main_grad):
        grads = gather_full(chunks)
    destroy()
    ref_metrics, ref_grads = ref["runs"][recipe_name]
    real = predicted(ref["batch"])
    return {
        **packing_report(micro, batch),
        "logprob_diff": max_diff_on(logp, ref["logp"], real),
        "entropy_diff": max_diff_on(entropy, ref["entropy"], real),
        "metric_diff": {k: abs(metrics[f"actor/{k}"] - v) for k, v in ref_metrics.items()},
        "metrics": metrics,
        **grad_report(grads, ref_grads),
    }


def packing_report(micro, local):
    """How many sequences the fullest packed micro-batch of any rank held (0: padded rows),
    and how many different row lengths one rank's packed micro-batches had (under PP each
    keeps its own: the stages exchange shapes)."""
    if not isinstance(micro, Microbatching):
        return {"max_sequences_per_micro_batch": 0, "row_lengths_per_rank": 0}
    bins = micro.bins(local)
    return {
        "max_sequences_per_micro_batch": max_over_world(max(len(b) for b in bins)),
        "row_lengths_per_rank": max_over_world(len(set(micro.row_lengths(local, bins)))),
    }


def ref_dp(chunks):
    from megatron_rl.schedules.runner import model_groups

    return model_groups(chunks).dp.size()


def critic_case(kind, layout, micro):
    ref = reference(kind, "critic")
    chunks, _ = setup("critic", kind, layout, ref["weights"])
    batch = local_batch(chunks, ref["batch"], micro)
    order = micro.gather_order(ref["batch"], ref_dp(chunks)) if isinstance(micro, Microbatching) else None
    values = gather_data_parallel(chunks, compute_values(chunks, batch, micro), order)
    metrics = forward_backward(chunks, batch, CRITIC, micro)
    with params_as(chunks, main_grad):
        grads = gather_full(chunks)
    destroy()
    return {
        **packing_report(micro, batch),
        "value_diff": max_diff_on(values, ref["values"], real_positions(ref["batch"])),
        "metric_diff": {"value_loss": abs(metrics["critic/value_loss"] - ref["loss"])},
        **grad_report(grads, ref["grads"]),
    }


def train_step_case(kind, layout, recipe_name, micro_batch_size):
    """train_step with the distributed optimizer: its grad norm is the reference's."""
    ref = reference(kind, "actor")
    vocab = TINY_ARCHS[kind].vocab_size
    chunks, optimizer = setup("actor", kind, layout, ref["weights"], optimizer="distributed")
    batch = local_batch(chunks, ref["batch"])
    metrics = train_step(chunks, optimizer, batch, ActorLoss(RECIPES[recipe_name], vocab), micro_batch_size)
    moved = max(float((w - ref["weights"][k]).abs().max()) for k, w in gather_full(chunks).items())
    destroy()
    ref_metrics, ref_grads = ref["runs"][recipe_name]
    ref_norm = float(torch.sqrt(sum(g.double().square().sum() for g in ref_grads.values())))
    return {
        "grad_norm": metrics["actor/grad_norm"],
        "ref_grad_norm": ref_norm,
        "pg_loss_diff": abs(metrics["actor/pg_loss"] - ref_metrics["pg_loss"]),
        "weights_moved": moved,
        "update_skipped": metrics["actor/update_skipped"],
    }


def two_layouts_case(actor_kind, actor_layout, actor_mbs, critic_kind, critic_layout, critic_mbs):
    """Actor and critic in different layouts in one process (the critic's groups built
    alongside the actor's), their work interleaved: each still equals its single-process
    reference, and the critic's own optimizer steps with the reference grad norm (a plain
    one: the distributed optimizer's reduce-scatter leaves no whole gradient to compare;
    the trainer's tests run it in a second layout)."""
    aref, cref = reference(actor_kind, "actor"), reference(critic_kind, "critic")
    vocab = TINY_ARCHS[actor_kind].vocab_size
    actor, _ = setup("actor", actor_kind, actor_layout, aref["weights"])
    critic_layout_ctx = initialize_alongside(
        ParallelConfig(**critic_layout), seed=42, model=TINY_ARCHS[critic_kind].shape()
    )
    try:  # outside its context the actor's groups are current: building the critic is refused
        build_model("critic", TINY_ARCHS[critic_kind], ParallelConfig(**critic_layout), OPTIONS)
        refused_outside = None
    except RuntimeError as err:
        refused_outside = str(err)
    with critic_layout_ctx.active():
        critic, critic_opt = build("critic", critic_kind, critic_layout, cref["weights"], optimizer="plain")
        critic_coords = check_coordinates(critic_layout_ctx)
    actor_batch = local_batch(actor, aref["batch"])
    logp, _ = compute_logprobs(actor, actor_batch, actor_mbs, vocab)
    with critic_layout_ctx.active():
        critic_batch = local_batch(critic, cref["batch"])
        values = gather_data_parallel(critic, compute_values(critic, critic_batch, critic_mbs))
    actor_metrics = forward_backward(actor, actor_batch, ActorLoss(RECIPES["dapo"], vocab), actor_mbs)
    with critic_layout_ctx.active():
        critic_metrics = forward_backward(critic, critic_batch, CRITIC, critic_mbs)
        with params_as(critic, main_grad):
            critic_grads = gather_full(critic)
    with params_as(actor, main_grad):
        actor_grads = gather_full(actor)
    with critic_layout_ctx.active():
        stepped = train_step(critic, critic_opt, critic_batch, CRITIC, critic_mbs)
        moved = max(float((w - cref["weights"][k]).abs().max()) for k, w in gather_full(critic).items())
        destroy()
    ref_norm = float(torch.sqrt(sum(g.double().square().sum() for g in cref["grads"].values())))
    ref_metrics, ref_grads = aref["runs"]["dapo"]
    out = {
        "logprob_diff": max_over_world((gather_data_parallel(actor, logp) - aref["logp"]).abs().max()),
        "value_diff": max_over_world((values - cref["values"]).abs().max()),
        "actor": {
            "metric_diff": {"pg_loss": abs(actor_metrics["actor/pg_loss"] - ref_metrics["pg_loss"])},
            **grad_report(actor_grads, ref_grads),
        },
        "critic": {
            "metric_diff": {"value_loss": abs(critic_metrics["critic/value_loss"] - cref["loss"])},
            **grad_report(critic_grads, cref["grads"]),
        },
        "critic_grad_norm": stepped["critic/grad_norm"],
        "critic_ref_grad_norm": ref_norm,
        "critic_weights_moved": moved,
        "coordinates": [critic_coords, check_coordinates_now(actor_layout)],
        "critic_refused_outside_its_layout": refused_outside,
    }
    destroy()
    return out


def check_coordinates_now(layout):
    """The active layout's live Megatron ranks against ``layout``'s rank map (None = agree)."""
    from megatron_rl.parallel.state import ParallelContext, rank_map

    parallel = ParallelConfig(**layout)
    world, rank = dist.get_world_size(), dist.get_rank()
    ctx = ParallelContext(parallel, world, rank, rank_map(parallel, world)[rank], None)
    return check_coordinates(ctx)


LAYOUTS = {
    "single": {},  # every size 1; each rank runs the whole mini-batch as one microbatch
    "dp4": {},
    "pp2": dict(pipeline_model_parallel_size=2),
    "pp2_vpp2": dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    "tp2": dict(tensor_model_parallel_size=2),
    "tp2_ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
    "ep4": dict(expert_model_parallel_size=4),
    "tp2_ep2_etp1": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    "cp2": dict(context_parallel_size=2),  # DP2 x CP2
    "cp4": dict(context_parallel_size=4),
    "cp2_tp2": dict(context_parallel_size=2, tensor_model_parallel_size=2),  # sequence parallel on
    "cp2_ep2": dict(context_parallel_size=2, expert_model_parallel_size=2),  # EP spans the CP ranks
    "cp2_pp2": dict(context_parallel_size=2, pipeline_model_parallel_size=2),
}


def cases(world_size: int = 4):
    assert world_size == 4, "these cases are written for world 4"
    out = {}
    for recipe in ("dapo", "grpo"):
        out[f"dense-actor-single-{recipe}"] = partial(
            actor_case, "dense", LAYOUTS["single"], recipe, GLOBAL_BATCH, True
        )
        out[f"dense-actor-dp4-{recipe}"] = partial(actor_case, "dense", LAYOUTS["dp4"], recipe, 1)
        out[f"dense-actor-pp2-{recipe}"] = partial(actor_case, "dense", LAYOUTS["pp2"], recipe, 1)
        out[f"moe-actor-tp2_ep2-{recipe}"] = partial(actor_case, "moe", LAYOUTS["tp2_ep2"], recipe, 2)
    out["dense-actor-pp2_vpp2-dapo"] = partial(actor_case, "dense", LAYOUTS["pp2_vpp2"], "dapo", 1)
    out["dense-actor-tp2-hapo_kl_nll"] = partial(actor_case, "dense", LAYOUTS["tp2"], "hapo_kl_nll", 1)
    out["moe-actor-pp2-hapo_kl_nll"] = partial(actor_case, "moe", LAYOUTS["pp2"], "hapo_kl_nll", 2)
    out["dense-critic-pp2"] = partial(critic_case, "dense", LAYOUTS["pp2"], 1)
    out["dense-critic-tp2"] = partial(critic_case, "dense", LAYOUTS["tp2"], 2)
    out["two-layouts-moe-actor-tp2_ep2+moe-critic-pp2"] = partial(
        two_layouts_case, "moe", LAYOUTS["tp2_ep2"], 2, "moe", LAYOUTS["pp2"], 1
    )
    out["two-layouts-dense-actor-pp2+dense-critic-tp2"] = partial(
        two_layouts_case, "dense", LAYOUTS["pp2"], 1, "dense", LAYOUTS["tp2"], 2
    )
    out["moe-train_step-tp2_ep2-dapo"] = partial(train_step_case, "moe", LAYOUTS["tp2_ep2"], "dapo", 2)
    out.update(packed_cases())
    out.update(context_parallel_cases())
    return out


def context_parallel_cases():
    """The same references with every sequence split over CP ranks (schedules.context_parallel):
    padded rows of 16 positions and packed rows whose sequences take slots of 2·CP(·TP)."""
    budget = Microbatching(max_tokens=32)
    return {
        "cp-dense-actor-cp2-dapo": partial(actor_case, "dense", LAYOUTS["cp2"], "dapo", 1),
        "cp-dense-actor-cp4-grpo": partial(actor_case, "dense", LAYOUTS["cp4"], "grpo", 2),
        "cp-dense-actor-cp2_tp2-hapo_kl_nll": partial(actor_case, "dense", LAYOUTS["cp2_tp2"], "hapo_kl_nll", 1),
        "cp-moe-actor-cp2_ep2-dapo": partial(actor_case, "moe", LAYOUTS["cp2_ep2"], "dapo", 2),
        "cp-dense-actor-cp2_pp2-grpo": partial(actor_case, "dense", LAYOUTS["cp2_pp2"], "grpo", 1),
        "cp-dense-critic-cp2": partial(critic_case, "dense", LAYOUTS["cp2"], 2),
        "packed-cp-dense-actor-cp2-grpo": partial(actor_case, "dense", LAYOUTS["cp2"], "grpo", budget),
        "packed-cp-moe-actor-cp2_ep2-dapo": partial(actor_case, "moe", LAYOUTS["cp2_ep2"], "dapo", budget),
        "packed-cp-dense-actor-cp2_tp2-grpo": partial(actor_case, "dense", LAYOUTS["cp2_tp2"], "grpo", budget),
        "packed-cp-dense-critic-cp2_pp2": partial(critic_case, "dense", LAYOUTS["cp2_pp2"], budget),
        "cp-moe-train_step-cp2_ep2-dapo": partial(train_step_case, "moe", LAYOUTS["cp2_ep2"], "dapo", 2),
    }


def packed_cases():
    """The same references, through packed token-budget micro-batches (schedules.packing)."""
    budget = Microbatching(max_tokens=PACK_BUDGET)
    return {
        "packed-dense-actor-single-grpo": partial(actor_case, "dense", LAYOUTS["single"], "grpo", budget, True),
        "packed-dense-actor-dp4-dapo": partial(actor_case, "dense", LAYOUTS["dp4"], "dapo", budget),
        "packed-dense-actor-pp2-grpo": partial(actor_case, "dense", LAYOUTS["pp2"], "grpo", budget),
        "packed-dense-actor-pp2_vpp2-dapo": partial(actor_case, "dense", LAYOUTS["pp2_vpp2"], "dapo", budget),
        "packed-dense-actor-tp2-hapo_kl_nll": partial(actor_case, "dense", LAYOUTS["tp2"], "hapo_kl_nll", budget),
        "packed-moe-actor-tp2_ep2-dapo": partial(actor_case, "moe", LAYOUTS["tp2_ep2"], "dapo", budget),
        "packed-moe-actor-pp2-hapo_kl_nll": partial(actor_case, "moe", LAYOUTS["pp2"], "hapo_kl_nll", budget),
        "packed-moe-actor-ep4-grpo": partial(actor_case, "moe", LAYOUTS["ep4"], "grpo", budget),
        "packed-moe-critic-tp2_ep2_etp1": partial(critic_case, "moe", LAYOUTS["tp2_ep2_etp1"], budget),
        "packed-dense-critic-pp2": partial(critic_case, "dense", LAYOUTS["pp2"], budget),
        "packed-dense-critic-tp2": partial(critic_case, "dense", LAYOUTS["tp2"], budget),
    }


if __name__ == "__main__":
    run_cases(cases())
