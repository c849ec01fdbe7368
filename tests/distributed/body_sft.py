"""torchrun body (world 4, in the shared launch): SFT's token loss through Megatron's
schedules against plain single-process torch.

Reference: the whole batch of conversations through the unwrapped single-rank actor,
log_softmax over the real vocabulary at each learned token (the loss mask, prediction-
aligned), the mean over every learned token of the batch of -log p, plain autograd. Each
case loads the reference weights into a layout (DP4 = TP1, TP2 with the vocabulary split,
PP2 on packed rows, CP2) and runs `forward_backward` with `TokenNLLLoss` on its DP share:
the loss and every gradient must be the reference's (token-mean over the whole mini-batch,
whatever the split).
"""

from functools import partial

import body_schedules as sched
import torch

from megatron_rl import platform
from megatron_rl.models import build_model
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl.parallel.full_tensors import gather_full, main_grad, params_as
from megatron_rl.schedules import forward_backward, local_batch
from megatron_rl.schedules.packing import Microbatching
from megatron_rl.schedules.supervised import TokenNLLLoss, chat_batch
from megatron_rl_lab.testing.tiny import TINY_ARCHS
from megatron_rl_lab.testing.torchrun import run_cases

ROWS, SEQ = 8, 16
REFERENCE = {}


def conversations():
    """8 rows of random tokens, lengths 4..16, each with an assistant span (the mask) of
    1..4 tokens somewhere after its first token, and a second one in every other row."""
    g = torch.Generator().manual_seed(13)
    vocab = TINY_ARCHS["dense"].vocab_size
    rows = []
    for n in range(ROWS):
        length = int(torch.randint(4, SEQ + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        mask = [False] * length
        start = int(torch.randint(1, length, (1,), generator=g))
        for t in range(start, min(length, start + 1 + n % 4)):
            mask[t] = True
        if n % 2:
            mask[1] = True
        rows.append((ids, mask))
    return chat_batch(rows, SEQ, pad_token_id=0)


def reference():
    """Weights, batch, loss and gradients of the whole batch in one process."""
    if REFERENCE:
        return REFERENCE
    arch = TINY_ARCHS["dense"]
    initialize(ParallelConfig(), seed=42, model=arch.shape())
    chunks = build_model("actor", arch, ParallelConfig(), sched.OPTIONS)
    weights, batch = gather_full(chunks), conversations()
    positions = torch.arange(SEQ).expand_as(batch.tokens)
    with platform.megatron_scope():
        logits = chunks[0](batch.tokens, positions, None)[..., : arch.vocab_size]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    mask = batch.loss_mask
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    with params_as(chunks, main_grad):
        grads = gather_full(chunks)
    destroy()
    REFERENCE.update(weights=weights, batch=batch, loss=float(loss), tokens=int(mask.sum()), grads=grads)
    return REFERENCE


def sft_case(layout, micro):
    """forward_backward of the conversations in ``layout``: loss and gradients."""
    ref = reference()
    chunks, _ = sched.setup("actor", "dense", layout, ref["weights"])
    loss = TokenNLLLoss(TINY_ARCHS["dense"].vocab_size)
    metrics = forward_backward(chunks, local_batch(chunks, ref["batch"], micro), loss, micro)
    with params_as(chunks, main_grad):
        grads = gather_full(chunks)
    destroy()
    return {
        "loss_diff": abs(metrics["train/loss"] - ref["loss"]),
        "tokens": ref["tokens"],
        **sched.grad_report(grads, ref["grads"]),
    }


def cases(world_size: int = 4):
    assert world_size == 4, "these cases are written for world 4"
    padded, packed = Microbatching(micro_batch_size=1), Microbatching(micro_batch_size=1, max_tokens=2 * SEQ)
    layouts = sched.LAYOUTS
    return {
        "dp4": partial(sft_case, layouts["dp4"], padded),
        "tp2": partial(sft_case, layouts["tp2"], padded),
        "packed-pp2": partial(sft_case, layouts["pp2"], packed),
        "cp2": partial(sft_case, layouts["cp2"], padded),
    }


if __name__ == "__main__":
    run_cases(cases())
