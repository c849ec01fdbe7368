"""The step's rows in the training layout: masks by hand, scatter and gather."""

import torch

from megatron_rl.rollout import Sample
from megatron_rl.trainer.assembly import assemble
from megatron_rl.trainer.rollouts import TrainRows


def _rows():
    # Row 0: prompt (5, 6), response (1, 2, 3) finished and correct, its first token trained earlier.
    # Row 1: prompt (7,), response (4, 8) cut off by the window, sampled before this step up to token 1.
    samples = [
        Sample(prompt_ids=[5, 6], token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3], finish_reason="stop"),
        Sample(prompt_ids=[7], token_ids=[4, 8], logprobs=[-0.4, -0.5], finish_reason="window"),
    ]
    return TrainRows(
        samples,
        rewards=[1.0, 0.0],
        correct=[1.0, 0.0],
        group_index=[0, 1],
        loss_start=[1, 0],
        fresh_start=[0, 1],
        truncated=[False, True],
    )


def test_masks_follow_the_prediction_aligned_layout():
    batch = assemble(_rows(), seq_length=6, pad_token_id=0, temperature=0.7)
    assert batch.tokens.tolist() == [[5, 6, 1, 2, 3, 0], [7, 4, 8, 0, 0, 0]]
    # Position t predicts token t + 1: row 0's response tokens are predicted at 1, 2, 3.
    assert batch.response_mask.tolist() == [
        [False, True, True, True, False, False],
        [True, True, False, False, False, False],
    ]
    assert batch.loss_mask.tolist() == [
        [False, False, True, True, False, False],
        [True, True, False, False, False, False],
    ]
    assert batch.fresh_mask.tolist() == [
        [False, True, True, True, False, False],
        [False, True, False, False, False, False],
    ]
    # The cut-off row has no outcome yet: no critic tokens.
    assert batch.critic_mask.tolist() == [[False, True, True, True, False, False], [False] * 6]
    assert torch.equal(batch.temperature, torch.full((2, 6), 0.7))


def test_scatter_and_gather_are_inverse_and_the_batches_carry_the_fields():
    batch = assemble(_rows(), seq_length=6, pad_token_id=0, temperature=1.0)
    logprobs = batch.scatter([s.logprobs for s in batch.rows.samples])
    assert torch.allclose(logprobs, torch.tensor([[0, -0.1, -0.2, -0.3, 0, 0], [-0.4, -0.5, 0, 0, 0, 0]]))
    assert [len(x) for x in batch.gather(logprobs)] == [3, 2]
    assert torch.allclose(torch.cat(batch.gather(logprobs)), torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5]))
    batch.advantages = logprobs
    actor, critic = batch.for_actor(), batch.for_critic()
    assert actor.is_positive.tolist() == [True, False]
    assert torch.equal(actor.loss_mask, batch.loss_mask) and torch.equal(critic.loss_mask, batch.critic_mask)
    assert torch.equal(critic.advantages, actor.advantages)


def test_overlong_filtering_takes_a_budget_hit_out_of_the_policy_loss_alone():
    rows = _rows()
    rows.samples[0].finish_reason = "length"  # row 0 used up the budget; row 1 is a window cut
    kept = assemble(rows, seq_length=6, pad_token_id=0, temperature=1.0)
    filtered = assemble(rows, seq_length=6, pad_token_id=0, temperature=1.0, filter_overlong=True)
    assert filtered.loss_mask.tolist() == [[False] * 6, kept.loss_mask[1].tolist()]
    assert torch.equal(filtered.fresh_mask, kept.fresh_mask)  # the mismatch still sees every sampled token
    assert torch.equal(filtered.critic_mask, kept.critic_mask)  # and the critic still learns its outcome
