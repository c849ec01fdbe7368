"""torchrun body (world 4, in the shared launch): the reward model's Bradley-Terry loss through
Megatron's schedules against plain single-process torch, and a few training steps.

Reference: the whole batch of pairs through the unwrapped single-rank critic (the backbone
and the scalar value head), each row's reward read at its last real token, the mean over
pairs of -log sigmoid(r_chosen - r_rejected), plain autograd. Each case loads the
reference weights into a layout (DP4 = TP1, TP2, PP2, CP2; padded rows and packed rows of
whole pairs) and runs `forward_backward` with `PreferenceLoss` on its DP share: the loss,
the pair accuracy and every gradient must be the reference's. The training case runs
`train_step` with the distributed optimizer under TP2 on packed rows for a few steps.
"""

from functools import partial

import body_schedules as sched
import torch

from megatron_rl import platform
from megatron_rl.algorithms import bradley_terry_loss, pair_correct
from megatron_rl.models import build_model
from megatron_rl.models.builder import wrap_for_training
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl.parallel.full_tensors import gather_full, load_full, main_grad, params_as
from megatron_rl.schedules import forward_backward, local_batch, train_step
from megatron_rl.schedules.batch import TrainBatch
from megatron_rl.schedules.preference import PreferenceLoss, pair_microbatching
from megatron_rl_lab.testing.tiny import TINY_ARCHS
from megatron_rl_lab.testing.torchrun import run_cases

PAIRS, SEQ = 8, 16
TRAIN_STEPS = 6
REFERENCE = {}


def pair_rows():
    """8 pairs as 16 rows (chosen, rejected, ...) of random tokens and lengths 4..16."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, TINY_ARCHS["dense"].vocab_size, (2 * PAIRS, SEQ), generator=g)
    lengths = torch.randint(4, SEQ + 1, (2 * PAIRS,), generator=g)
    return TrainBatch(tokens=tokens, loss_mask=torch.zeros_like(tokens, dtype=torch.bool), lengths=lengths)


def reference():
    """Weights, batch, loss, pair accuracy and gradients of the whole batch in one process."""
    if REFERENCE:
        return REFERENCE
    arch = TINY_ARCHS["dense"]
    initialize(ParallelConfig(), seed=42, model=arch.shape())
    chunks = build_model("critic", arch, ParallelConfig(), sched.OPTIONS)
    weights, batch = gather_full(chunks), pair_rows()
    with platform.megatron_scope():
        values = chunks[0](batch.tokens, batch.position_ids, None).squeeze(-1)  # [2P, S]
    rewards = values[torch.arange(2 * PAIRS), batch.lengths - 1]
    chosen, rejected = rewards[0::2], rewards[1::2]
    loss = bradley_terry_loss(chosen, rejected).mean()
    loss.backward()
    with params_as(chunks, main_grad):
        grads = gather_full(chunks)
    destroy()
    REFERENCE.update(
        weights=weights,
        batch=batch,
        loss=float(loss),
        accuracy=float(pair_correct(chosen, rejected).mean()),
        grads=grads,
    )
    return REFERENCE


def pair_case(layout, micro):
    """forward_backward of the pairs in ``layout``: loss, accuracy and gradients."""
    ref = reference()
    chunks, _ = sched.setup("critic", "dense", layout, ref["weights"])
    metrics = forward_backward(chunks, local_batch(chunks, ref["batch"], micro), PreferenceLoss(), micro)
    with params_as(chunks, main_grad):
        grads = gather_full(chunks)
    destroy()
    return {
        "loss_diff": abs(metrics["train/loss"] - ref["loss"]),
        "accuracy_diff": abs(metrics["train/pair_accuracy"] - ref["accuracy"]),
        **sched.grad_report(grads, ref["grads"]),
    }


def training_case(layout, micro):
    """train_step with the trainer's DDP and distributed optimizer, the same pairs each step."""
    ref = reference()
    arch, parallel = TINY_ARCHS["dense"], ParallelConfig(**layout)
    initialize(parallel, seed=42, model=arch.shape())
    chunks = build_model("critic", arch, parallel, sched.OPTIONS)
    load_full(chunks, ref["weights"])
    chunks, optimizer = wrap_for_training(chunks, dtype="fp32", lr=3e-3, clip_grad=1.0)
    steps = [
        train_step(chunks, optimizer, local_batch(chunks, ref["batch"], micro), PreferenceLoss(), micro)
        for _ in range(TRAIN_STEPS)
    ]
    destroy()
    return {
        "losses": [s["train/loss"] for s in steps],
        "accuracies": [s["train/pair_accuracy"] for s in steps],
        "reference_loss": ref["loss"],
    }


def cases(world_size: int = 4):
    assert world_size == 4, "these cases are written for world 4"
    padded, packed = pair_microbatching(1, None), pair_microbatching(1, 2 * SEQ)
    layouts = sched.LAYOUTS
    return {
        "dp4": partial(pair_case, layouts["dp4"], padded),
        "tp2": partial(pair_case, layouts["tp2"], padded),
        "packed-tp2": partial(pair_case, layouts["tp2"], packed),
        "packed-pp2": partial(pair_case, layouts["pp2"], packed),
        "cp2": partial(pair_case, layouts["cp2"], padded),
        "train-packed-tp2": partial(training_case, layouts["tp2"], pair_microbatching(2, 4 * SEQ)),
    }


if __name__ == "__main__":
    run_cases(cases())
