"""torchrun body (world 4, in the shared launch): LoRA adapters' gradients in every layout
against plain single-process autograd.

Reference: the single-rank actor with adapters on every target it has (dense: QKV, the
attention output, FC1 and FC2; MoE: QKV, the output and every expert's FC1 and FC2), B set
to seeded non-zero values so that every A and B gets a gradient, SFT's token loss (body_sft's
conversations) by plain autograd. Each case loads the same base and adapter weights into a
layout (dense: TP2 with and without sequence parallelism, PP2 on packed rows, CP2; MoE: TP2
with EP2, and EP2 with ETP1 beside TP2), runs `forward_backward` in Megatron DDP, and gathers
the adapters' gradients: each must be the reference's, and the base must have none.
"""

import zlib
from functools import partial

import body_schedules as sched
import body_sft
import torch

from megatron_rl import platform
from megatron_rl.models import build_model
from megatron_rl.models.lora import LoraSettings, add_adapters
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl.parallel.full_tensors import gather_full, load_full, main_grad, params_as
from megatron_rl.schedules import forward_backward, local_batch
from megatron_rl.schedules.packing import Microbatching
from megatron_rl.schedules.supervised import TokenNLLLoss
from megatron_rl_lab.testing.tiny import TINY_ARCHS
from megatron_rl_lab.testing.torchrun import run_cases

SETTINGS = LoraSettings(rank=4, alpha=8.0, seed=3)
REFERENCE = {}
"""kind -> the reference's weights, batch, loss and adapter gradients."""


def set_b(chunks) -> None:
    """Every B to seeded values from its full shape (the same in every layout: loaded after)."""
    with torch.no_grad():
        for name, param in chunks[0].named_parameters():
            if name.endswith("_lora.b"):
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)


def reference(kind):
    if kind in REFERENCE:
        return REFERENCE[kind]
    arch = TINY_ARCHS[kind]
    initialize(ParallelConfig(), seed=42, model=arch.shape())
    chunks = build_model("actor", arch, ParallelConfig(), sched.OPTIONS)
    add_adapters(chunks, SETTINGS)
    set_b(chunks)
    weights, batch = gather_full(chunks), body_sft.conversations()
    positions = torch.arange(body_sft.SEQ).expand_as(batch.tokens)
    with platform.megatron_scope():
        logits = chunks[0](batch.tokens, positions, None)[..., : arch.vocab_size]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    with params_as(chunks, main_grad):
        grads = gather_full(chunks)
    destroy()
    adapter_grads = {k: g for k, g in grads.items() if "_lora." in k}
    REFERENCE[kind] = dict(weights=weights, batch=batch, loss=float(loss), grads=adapter_grads)
    return REFERENCE[kind]


def adapted(kind, layout, weights):
    """The ``kind`` actor in ``layout`` with the reference's base and adapter weights, in DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    arch, parallel = TINY_ARCHS[kind], ParallelConfig(**layout)
    initialize(parallel, seed=42, model=arch.shape())
    chunks = build_model("actor", arch, parallel, sched.OPTIONS)
    add_adapters(chunks, SETTINGS)
    load_full(chunks, weights)
    config = chunks[0].config
    with platform.megatron_scope():
        chunks = [DistributedDataParallel(config, DistributedDataParallelConfig(), c) for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    return chunks


def lora_case(kind, layout, micro):
    ref = reference(kind)
    chunks = adapted(kind, layout, ref["weights"])
    loss = TokenNLLLoss(TINY_ARCHS[kind].vocab_size)
    metrics = forward_backward(chunks, local_batch(chunks, ref["batch"], micro), loss, micro)
    with params_as(chunks, main_grad):
        grads = gather_full(chunks)
    base_with_grad = sorted(k for k, g in grads.items() if "_lora." not in k and g.abs().max() > 0)
    destroy()
    return {
        "loss_diff": abs(metrics["train/loss"] - ref["loss"]),
        "base_with_grad": base_with_grad,
        "adapters": len(ref["grads"]),
        **sched.grad_report({k: grads[k] for k in ref["grads"]}, ref["grads"]),
    }


def cases(world_size: int = 4):
    assert world_size == 4, "these cases are written for world 4"
    padded, packed = Microbatching(micro_batch_size=1), Microbatching(micro_batch_size=1, max_tokens=2 * body_sft.SEQ)
    layouts = sched.LAYOUTS
    return {
        "tp2-sp": partial(lora_case, "dense", layouts["tp2"], padded),
        "tp2": partial(lora_case, "dense", dict(tensor_model_parallel_size=2, sequence_parallel=False), padded),
        "packed-pp2": partial(lora_case, "dense", layouts["pp2"], packed),
        "pp2-vpp2": partial(lora_case, "dense", layouts["pp2_vpp2"], padded),
        "cp2": partial(lora_case, "dense", layouts["cp2"], padded),
        "moe-tp2_ep2": partial(lora_case, "moe", layouts["tp2_ep2"], padded),
        "moe-tp2_ep2_etp1": partial(lora_case, "moe", layouts["tp2_ep2_etp1"], padded),
    }


if __name__ == "__main__":
    run_cases(cases())
