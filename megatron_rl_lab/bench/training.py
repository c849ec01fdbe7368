"""A model as training holds it: Megatron DDP chunks, the distributed optimizer, one step.

The MFU bench times the step; the checkpoint bench saves and loads the state a step leaves
(parameters and Adam's moments). Both build it here, so both measure the same thing the
trainer holds. Tokens are synthetic: full rows, no padding, no packing.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from megatron_rl import platform
from megatron_rl.models.builder import BuildOptions
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.config import ParallelConfig


def synthetic_microbatches(count: int, micro_batch_size: int, seq_length: int, vocab: int, seed: int) -> list:
    """``count`` microbatches of (tokens, labels, value targets), each [micro_batch_size, seq_length]."""
    device = platform.current().device
    g = torch.Generator().manual_seed(seed)
    micro = []
    for _ in range(count):
        seq = torch.randint(0, vocab, (micro_batch_size, seq_length + 1), generator=g)
        targets = torch.randn(micro_batch_size, seq_length, generator=g)
        micro.append(tuple(t.to(device) for t in (seq[:, :-1].contiguous(), seq[:, 1:].contiguous(), targets)))
    return micro


def _forward_step(role: str, data_iterator, model):
    tokens, labels, targets = next(data_iterator)
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    if role == "actor":
        output = model(tokens, positions, None, labels=labels)  # per-token cross-entropy [b, s]
    else:
        output = model(tokens, positions, None)  # values [b, s, 1]

    def loss_func(out):
        if role == "actor":
            loss = out.float().mean()
        else:
            loss = (out.float().squeeze(-1) - targets).pow(2).mean()
        return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return output, loss_func


def build_trainable(role: str, arch: ModelArch, parallel: ParallelConfig, options: BuildOptions):
    """Model chunks in Megatron DDP and the distributed optimizer (Adam), as in training.

    The layout's process groups must be initialised (:func:`megatron_rl.parallel.initialize`).
    """
    from megatron_rl.models.builder import build_model, wrap_for_training

    chunks = build_model(role, arch, parallel, options)
    return wrap_for_training(chunks, dtype=options.dtype, lr=1e-5, clip_grad=1.0)


def train_step(chunks, optimizer, micro: list, role: str) -> Optional[float]:
    """One optimizer step over ``micro``; the mean loss on the last pipeline stage (None elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batch_size, seq_length = micro[0][0].shape
    with platform.megatron_scope():
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, role),
            data_iterator=[iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
        optimizer.step()
    return sum(float(m["loss"]) for m in losses) / len(losses) if losses else None
