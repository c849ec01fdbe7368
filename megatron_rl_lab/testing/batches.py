"""Seeded RL mini-batches for tests: the same rows on every rank, device and process."""

from __future__ import annotations

import torch

from megatron_rl.schedules.batch import TrainBatch, pack_sequences

FULL_ROW = 3
"""This row's response runs to the last position, so one sequence is as long as the batch
(the longest a packed token budget must hold)."""


def rollout_batch(vocab: int, rows: int, seq: int, seed: int) -> tuple[TrainBatch, torch.Generator]:
    """Realistic shapes: prompts of 2-5 tokens, responses of 1 to all remaining positions,
    with every per-token field a loss may read (advantages varying around a per-sequence
    value, returns, old values, per-token temperatures, HAPO's h_hat, correctness).

    Drawn from a CPU generator seeded with ``seed``; that generator is returned, advanced
    past the batch, for the caller's further draws (noise on logprobs, routes)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for n in range(rows):
        p = int(torch.randint(2, 6, (), generator=g))
        r = seq - p if n == FULL_ROW else int(torch.randint(1, seq - p + 1, (), generator=g))
        prompts.append(torch.randint(0, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(0, vocab, (r,), generator=g).tolist())
    tokens, mask = pack_sequences(prompts, responses, seq)
    seq_adv = torch.randn(rows, 1, generator=g)
    batch = TrainBatch(
        tokens=tokens,
        loss_mask=mask,
        lengths=torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)]),
        advantages=seq_adv * (1 + 0.3 * torch.randn(rows, seq, generator=g)),
        returns=torch.randn(rows, seq, generator=g),
        old_values=0.3 * torch.randn(rows, seq, generator=g),
        temperature=0.7 + 0.6 * torch.rand(rows, seq, generator=g),
        h_hat=2 * torch.rand(rows, seq, generator=g) - 1,
        is_positive=torch.rand(rows, generator=g) > 0.5,
    )
    return batch, g
