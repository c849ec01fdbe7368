"""torchrun body (world 1): one RL update of a tiny actor and critic through megatron_rl.schedules
on this process's device: CUDA, or the CPU under ``MEGATRON_RL_FORCE_CPU=1`` (the reference).

test_cuda_schedules.py runs it on both and compares what each case saved. So that the two runs
differ only in where the arithmetic happens, every input is made on the CPU from seeded
generators: the weights (loaded with ``load_full``), the rollout batch (megatron_rl_lab.testing.batches)
and, for the bf16 MoE cases, the experts every token is routed to (router replay: a router whose
top-2 and top-3 scores lie within bf16 rounding would pick other experts on the other device).
No device RNG is read.

The losses' targets are the exception, on purpose: old logprobs, old values and returns are this
run's own logprobs and values plus seeded offsets. The offsets keep every PPO clip and the value
clip's max well away from their switching points (by 0.1 to 0.6 in log-ratio or value, against
rounding differences of ~1e-6 in fp32 and ~1e-2 in bf16), so no token's gradient switches on or
off between the devices; fixed targets would leave a few tokens of a bf16 batch within rounding
of a clip boundary, each flipping its share of the gradient.

Each case saves ``<case>.pt`` under argv[1] (per-token logprobs and entropy, values, the masks
of the positions they are defined on, full fp32 copies of the actor's and critic's gradients)
and returns the metrics of one DAPO actor update and one value-clipped critic update.
"""

import dataclasses
import functools
import sys
from pathlib import Path

import torch

from megatron_rl import platform
from megatron_rl.algorithms import get_recipe
from megatron_rl.models.builder import BuildOptions, build_model, wrap_for_training
from megatron_rl.models.route_replay import RouteReplay
from megatron_rl.parallel import ParallelConfig, initialize
from megatron_rl.parallel.full_tensors import gather_full, load_full, main_grad, params_as
from megatron_rl.schedules import ActorLoss, CriticLoss, Microbatching, compute_logprobs, compute_values, train_step
from megatron_rl_lab.testing.batches import rollout_batch
from megatron_rl_lab.testing.tiny import TINY_ARCHS
from megatron_rl_lab.testing.torchrun import run_cases

ROWS, SEQ = 8, 16
MICRO_BATCH = 2  # padded rows: four micro-batches, so the schedule accumulates over several
PACK_BUDGET = 24  # packed rows (THD): four micro-batches of two sequences each, 16-20 tokens
OPTIONS = BuildOptions(vocab_size_divisible_by=5)  # 96 -> 100: the padded LM-head rows are masked
DAPO = get_recipe("dapo")  # token-mean, clip 0.2 / 0.28
CRITIC = CriticLoss(value_clip=0.2)
LR = 1e-3
CLIP_GRAD = 1e6
"""Never clips, so train_step still reports the grad norm and the gradient buffers keep the raw
gradient (an fp32 model's optimizer would clip them in place; a bf16 one clips its fp32 copies)."""
CASES = {  # name: (tiny arch, packed, dtype)
    f"{kind}-{rows}-{dtype}": (kind, rows == "packed", dtype)
    for kind in ("dense", "moe")
    for rows in ("padded", "packed")
    for dtype in ("fp32", "bf16")
}


def seeded_weights(chunks, seed: int) -> dict[str, torch.Tensor]:
    """Full weights for ``chunks`` drawn on the CPU: matrices ~ N(0, 1/fan_in) (activations
    stay O(1) through the layers, logits are far from uniform), norm weights 1 + N(0, 0.1²),
    biases N(0, 0.1²); keys in sorted order, so the draw is the same on every device."""
    g = torch.Generator().manual_seed(seed)
    full = {}
    for name, like in sorted(gather_full(chunks).items()):
        noise = torch.randn(like.shape, generator=g)
        if name.endswith("bias"):
            full[name] = 0.1 * noise
        elif like.dim() == 1:
            full[name] = 1 + 0.1 * noise
        else:
            full[name] = noise * like.shape[-1] ** -0.5
    return full


def offsets(
    g: torch.Generator, like: torch.Tensor, near: float, far: tuple[float, float], p_near: float
) -> torch.Tensor:
    """Random-sign offsets whose size is in [0, near] with probability ``p_near``, else in
    ``far``: the gap between the two bands is where a clip switches (see the module docstring)."""
    u, coin, sign = (torch.rand(like.shape, generator=g) for _ in range(3))
    size = torch.where(coin < p_near, near * u, far[0] + (far[1] - far[0]) * u)
    return torch.where(sign < 0.5, -size, size)


def random_routes(g: torch.Generator, arch) -> torch.Tensor:
    """[N, S, layers, k] int16: k distinct random experts for every token of every layer."""
    scores = torch.rand(ROWS, SEQ, arch.num_layers, arch.num_moe_experts, generator=g)
    return scores.argsort(-1)[..., : arch.moe_router_topk].to(torch.int16)


def build(role: str, arch, dtype: str, replay: bool):
    """``role`` with seeded weights, in DDP with the trainer's optimizer (Adam, distributed,
    fp32 main params under bf16; no clipping), and a router replay when ``replay``."""
    options = dataclasses.replace(OPTIONS, dtype=dtype)
    chunks = build_model(role, arch, ParallelConfig(), options)
    load_full(chunks, seeded_weights(chunks, seed=7 if role == "actor" else 8))
    chunks, optimizer = wrap_for_training(chunks, dtype=dtype, lr=LR, clip_grad=CLIP_GRAD)
    if replay:
        RouteReplay(chunks)
    return chunks, optimizer


def update(chunks, optimizer, batch, loss, micro) -> tuple[dict, dict]:
    """train_step's metrics, the full gradients it stepped with (fp32 copies), and how far
    the largest weight moved (only a sign of life: Adam's first step is lr·sign(g))."""
    before = gather_full(chunks)
    metrics = train_step(chunks, optimizer, batch, loss, micro)
    with params_as(chunks, main_grad):
        grads = gather_full(chunks)
    metrics["weights_moved"] = max(float((w - before[k]).abs().max()) for k, w in gather_full(chunks).items())
    return metrics, grads


@functools.cache
def world_one_layout():
    """Megatron's groups at world 1, built once per launch and shared by every case (none needs
    another layout). Built per case, every case took 9-12 s on an H200 (< 1 s on the CPU): on
    CUDA each of Megatron's groups is an NCCL communicator."""
    return initialize(ParallelConfig(), seed=42)


def case(name: str, out_dir: Path) -> dict:
    kind, packed, dtype = CASES[name]
    arch = TINY_ARCHS[kind]
    micro = Microbatching(max_tokens=PACK_BUDGET) if packed else MICRO_BATCH
    batch, g = rollout_batch(arch.vocab_size, ROWS, SEQ, seed=2024)
    replay = arch.is_moe and dtype == "bf16"
    if replay:
        batch = dataclasses.replace(batch, routes=random_routes(g, arch))
    world_one_layout()
    actor, actor_opt = build("actor", arch, dtype, replay)
    logp, entropy = (t.cpu() for t in compute_logprobs(actor, batch, micro, arch.vocab_size))
    batch = dataclasses.replace(batch, old_logprobs=logp + offsets(g, logp, 0.1, (0.4, 0.6), 0.6))
    actor_metrics, actor_grads = update(actor, actor_opt, batch, ActorLoss(DAPO, arch.vocab_size), micro)
    critic, critic_opt = build("critic", arch, dtype, replay)
    values = compute_values(critic, batch, micro).cpu()
    batch = dataclasses.replace(
        batch,
        old_values=values + offsets(g, values, 0.0, (0.4, 0.6), 0.5),
        returns=values + offsets(g, values, 0.0, (0.8, 1.2), 0.0),
    )
    critic_metrics, critic_grads = update(critic, critic_opt, batch, CRITIC, micro)
    lengths = batch.sequence_lengths()[:, None]
    torch.save(
        {
            "logp": logp,
            "entropy": entropy,
            "values": values,
            "predicted": torch.arange(SEQ)[None] < lengths - 1,  # logp, entropy: a token of the row follows
            "real": torch.arange(SEQ)[None] < lengths,  # values: the row's own prefixes
            "actor_grads": actor_grads,
            "critic_grads": critic_grads,
        },
        out_dir / f"{name}.pt",
    )
    return {"device": str(platform.current().device), "actor": actor_metrics, "critic": critic_metrics}


def exact_float32_matmuls() -> None:
    """On CUDA, fp32 matmuls and convolutions in IEEE fp32, not TF32 (10-bit mantissa): the
    fp32 tolerances are those of fp32 rounding."""
    if platform.current().is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


if __name__ == "__main__":
    exact_float32_matmuls()
    run_cases({name: functools.partial(case, name, Path(sys.argv[1])) for name in CASES})
