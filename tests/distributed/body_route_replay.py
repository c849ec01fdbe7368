"""torchrun body: MoE router replay in many layouts vs the single-rank model.

The reference layout is data parallel only (each rank holds the whole model and runs whole
sequences, so the router's token order is plainly [s, b]). There, with the routes the
model chose itself fed back, the logprobs are bitwise those without replay and every
(token, layer) agrees; with random routes (-1 on the first positions: the router's own)
the used experts are exactly the given ones, and the logprobs move. Every other layout
(TP with sequence parallelism, EP, ETP, PP and VPP, CP with the routes split like the
tokens) gets the same weights and the same random routes: its logprobs, and its loss and
gradients of a forward-backward with full activation recompute (through the RL schedules),
equal the reference's, and every recompute took its queued routes.

Usage: body_route_replay.py WORLD_SIZE
"""

from functools import partial

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.models import build_model
from megatron_rl.models.builder import BuildOptions
from megatron_rl.models.route_replay import RouteReplay
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl.parallel.full_tensors import gather_full, load_full, main_grad, params_as
from megatron_rl.schedules import TrainBatch, compute_logprobs, forward_backward, gather_data_parallel, local_batch
from megatron_rl_lab.testing.losses import MeanCrossEntropy, all_but_last
from megatron_rl_lab.testing.tiny import TINY_QWEN3_MOE
from megatron_rl_lab.testing.torchrun import run_cases

ARCH = TINY_QWEN3_MOE
ROWS, SEQ, MBS, FALLBACK_POSITIONS = 8, 16, 2, 3
LAYERS, TOPK, EXPERTS = ARCH.num_layers, ARCH.moe_router_topk, ARCH.num_moe_experts


def tokens():
    return torch.randint(3, ARCH.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(11))


def random_routes():
    """[N, S, L, k]: k distinct random experts per (token, layer); -1 on the first positions."""
    g = torch.Generator().manual_seed(5)
    routes = torch.rand(ROWS, SEQ, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOPK].to(torch.int16)
    routes[:, :FALLBACK_POSITIONS] = -1
    return routes


class Model:
    """One layout's actor with a replay on its routers (recompute on for the backward)."""

    def __init__(self, layout, weights=None):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        self.parallel = ParallelConfig(**layout)
        initialize(self.parallel, seed=42, model=ARCH.shape())
        chunks = build_model("actor", ARCH, self.parallel, BuildOptions(recompute_activations=True))
        if weights is not None:
            load_full(chunks, weights)
        config = chunks[0].config
        with platform.megatron_scope():
            self.chunks = [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]
        config.finalize_model_grads_func = finalize_model_grads
        self.replay = RouteReplay(self.chunks)

    def logprobs(self, routes=None, record_used=False):
        batch = TrainBatch(tokens=tokens(), loss_mask=all_but_last(ROWS, SEQ), routes=routes)
        self.replay.begin(record_used=record_used)
        logp, _ = compute_logprobs(self.chunks, local_batch(self.chunks, batch), MBS, ARCH.vocab_size)
        return gather_data_parallel(self.chunks, logp).cpu()

    def forward_backward(self, routes):
        """Mean CE over all rows through the RL schedules, forward and backward (recomputed
        layers; under CP the routes are split with the tokens)."""
        batch = TrainBatch(tokens=tokens(), loss_mask=all_but_last(ROWS, SEQ), routes=routes)
        self.replay.begin()
        metrics = forward_backward(self.chunks, local_batch(self.chunks, batch), MeanCrossEntropy(ARCH.vocab_size), MBS)
        with params_as(self.chunks, main_grad):
            grads = gather_full(self.chunks)
        left = sum(len(layer.pending) for layer in self.replay.layers)
        return metrics["ce/loss"], grads, left


def own_routes(used):
    """The reference's recorded experts ([s*b, k] per micro-batch, per layer, this rank's
    rows) as [N, S, L, k] of all rows (the reference is data parallel over the world)."""
    routes = torch.full((ROWS, SEQ, LAYERS, TOPK), -1, dtype=torch.int32)
    first = dist.get_rank() * ROWS // dist.get_world_size()
    for layer in used:
        for m, chosen in enumerate(layer.used):
            rows = slice(first + m * MBS, first + (m + 1) * MBS)
            routes[rows, :, layer.layer_index] = chosen.view(SEQ, MBS, TOPK).transpose(0, 1).to(torch.int32)
    dist.all_reduce(routes, op=dist.ReduceOp.MAX)
    return routes.to(torch.int16)


REFERENCE = {}


def reference():
    """Reference layout (DP only): weights, logprobs with and without replay, training."""
    if not REFERENCE:
        model = Model({})
        plain = model.logprobs(record_used=True)
        own = own_routes(model.replay.layers)
        model.replay.stats()
        replayed_own = model.logprobs(own)
        agreement_own = model.replay.stats()
        routes = random_routes()
        replayed = model.logprobs(routes, record_used=True)
        used = own_routes(model.replay.layers)
        fallback = routes < 0
        REFERENCE.update(
            weights=gather_full(model.chunks),
            plain=plain,
            replayed=replayed,
            own_replay_diff=float((replayed_own - plain).abs().max()),
            agreement_own=agreement_own,
            used_equals_given=bool((used[~fallback] == routes[~fallback]).all()),
            fallback_equals_own=bool((used[fallback] == own[fallback]).all()),
            random_moves=float((replayed - plain).abs().max()),
            training=model.forward_backward(routes),
        )
        destroy()
    return REFERENCE


def reference_case():
    ref = reference()
    return {
        k: ref[k]
        for k in ("own_replay_diff", "agreement_own", "used_equals_given", "fallback_equals_own", "random_moves")
    } | {"pending_after_backward": ref["training"][2]}


def layout_case(layout):
    ref = reference()
    model = Model(layout, weights=ref["weights"])
    plain, replayed = model.logprobs(), model.logprobs(random_routes())
    loss, grads, left = model.forward_backward(random_routes())
    ref_loss, ref_grads, _ = ref["training"]
    destroy()
    return {
        "plain_diff": float((plain - ref["plain"]).abs().max()),
        "replayed_diff": float((replayed - ref["replayed"]).abs().max()),
        "loss_diff": abs(loss - ref_loss),
        "grad_diff": max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads),
        "pending_after_backward": left,
    }


LAYOUTS = {
    "tp2_sp_ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
    "tp2_ep2_etp1": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    "ep4": dict(expert_model_parallel_size=4),
    "pp2_vpp2_ep2": dict(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, expert_model_parallel_size=2
    ),
    "cp2_ep2": dict(context_parallel_size=2, expert_model_parallel_size=2),  # routes split like the tokens
}


def cases(world_size: int = 4):
    assert world_size == 4, "these cases are written for world 4"
    out = {"reference": reference_case}
    out.update({name: partial(layout_case, layout) for name, layout in LAYOUTS.items()})
    return out


if __name__ == "__main__":
    platform.init_distributed()
    run_cases(cases())
