"""The recipe's actor/critic losses as microbatch shares: summed over any split with the
whole batch's denominators they equal the whole-batch loss (value and gradient), for
every aggregation mode and every actor-loss piece; plus hand-computed values."""

import dataclasses

import pytest
import torch

from megatron_rl.algorithms import get_recipe
from megatron_rl.schedules import ActorLoss, CriticLoss, TrainBatch

N, S = 8, 7
RECIPES = {
    "dapo": get_recipe("dapo"),
    "grpo": get_recipe("grpo"),
    "seq-mean-token-sum": get_recipe("grpo", loss_agg="seq-mean-token-sum"),
    "seq-mean-token-sum-norm": get_recipe("grpo", loss_agg="seq-mean-token-sum-norm"),
    "hapo_kl_nll": get_recipe("hapo", kl={"kind": "k3", "coef": 0.04}, positive_nll_coef=0.1),
    "dapo_seq_mis": get_recipe("dapo", rollout_correction={"kind": "seq_mis"}),
}


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([0, 1, 2, 5, 3, 0, 5, 4])  # empty rows too (a filtered window)
    positions = torch.arange(S)
    mask = (positions >= 1) & (positions < 1 + lengths.unsqueeze(1))
    old = -torch.rand(N, S, generator=g) * 3
    return (
        TrainBatch(
            tokens=torch.randint(0, 10, (N, S), generator=g),
            loss_mask=mask,
            old_logprobs=old,
            ref_logprobs=old + 0.1 * torch.randn(N, S, generator=g),
            advantages=torch.randn(N, 1, generator=g) * (1 + 0.2 * torch.randn(N, S, generator=g)),
            returns=torch.randn(N, S, generator=g),
            old_values=torch.randn(N, S, generator=g),
            h_hat=2 * torch.rand(N, S, generator=g) - 1,
            is_positive=torch.rand(N, generator=g) > 0.5,
            is_weights=torch.rand(N, S, generator=g) * 2,
        ),
        old + 0.3 * torch.randn(N, S, generator=g),
        torch.rand(N, S, generator=g) * 4,
    )


def _split_sum(loss, batch, per_part, fn):
    """Σ over parts of `fn(part, rows, norms)` with the whole batch's summed norms."""
    parts = [(batch.rows(i, i + per_part), slice(i, i + per_part)) for i in range(0, N, per_part)]
    names = loss.local_norms(batch).keys()
    norms = {n: sum(loss.local_norms(p)[n] for p, _ in parts).clamp_min(1) for n in names}
    outs = [fn(part, rows, norms) for part, rows in parts]
    total = sum(o.loss for o in outs)
    sums = {k: sum(o.sums[k] for o in outs) for k in outs[0].sums}
    maxes = {k: max(o.maxes[k] for o in outs) for k in outs[0].maxes}
    return total, sums, maxes


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("per_part", [1, 2, 4])
def test_actor_microbatch_shares_add_up_to_the_whole_batch_loss(recipe, per_part):
    batch, logp_value, entropy = _batch()
    loss = ActorLoss(RECIPES[recipe], vocab_size=10)
    whole_logp = logp_value.clone().requires_grad_()
    whole = loss.objective(whole_logp, entropy, batch, norms=None)
    whole.loss.backward()
    split_logp = logp_value.clone().requires_grad_()
    total, sums, maxes = _split_sum(
        loss, batch, per_part, lambda part, rows, norms: loss.objective(split_logp[rows], entropy[rows], part, norms)
    )
    total.backward()
    torch.testing.assert_close(total, whole.loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(split_logp.grad, whole_logp.grad, atol=1e-7, rtol=0)
    for name in sums:
        torch.testing.assert_close(sums[name], whole.sums[name], atol=1e-6, rtol=0)
    torch.testing.assert_close(maxes["ratio_max"], whole.maxes["ratio_max"])
    assert set(whole.sums) == set(loss.metric_names()[0])


def test_actor_loss_hand_computed_at_ratio_one():
    batch, _, entropy = _batch()
    mask = batch.loss_mask
    result = ActorLoss(RECIPES["dapo"], vocab_size=10).objective(batch.old_logprobs, entropy, batch, None)
    # r = 1 everywhere: nothing clipped, ℓ = −A, token-mean over the response tokens
    expected = -(batch.advantages * mask).sum() / mask.sum()
    torch.testing.assert_close(result.loss, expected)
    assert float(result.sums["clipfrac"]) == 0.0
    torch.testing.assert_close(result.sums["entropy"], (entropy * mask).sum() / mask.sum())


def test_actor_loss_reads_vocab_parallel_logits():
    batch, _, _ = _batch()
    logits = torch.randn(N, S, 12, generator=torch.Generator().manual_seed(3))
    temperature = torch.full((N, S), 0.8)
    batch = dataclasses.replace(batch, temperature=temperature)
    result = ActorLoss(RECIPES["dapo"], vocab_size=10)(logits, batch, norms=None)
    z = logits[..., :10] / 0.8
    logp = torch.log_softmax(z, -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    expected = ActorLoss(RECIPES["dapo"], vocab_size=10).objective(logp, torch.zeros(N, S), batch, None)
    torch.testing.assert_close(result.loss, expected.loss, atol=1e-6, rtol=0)


def test_actor_required_fields_follow_the_recipe():
    assert ActorLoss(RECIPES["dapo"], 10).required_fields() == ("old_logprobs", "advantages")
    assert set(ActorLoss(RECIPES["hapo_kl_nll"], 10).required_fields()) == {
        "old_logprobs",
        "advantages",
        "ref_logprobs",
        "is_positive",
        "h_hat",
    }


@pytest.mark.parametrize("value_clip", [None, 0.2])
@pytest.mark.parametrize("per_part", [1, 4])
def test_critic_microbatch_shares_add_up(value_clip, per_part):
    batch, values, _ = _batch()
    loss = CriticLoss(value_clip=value_clip)
    whole_values = values.clone().requires_grad_()
    whole = loss.objective(whole_values, batch, None)
    whole.loss.backward()
    split_values = values.clone().requires_grad_()
    total, sums, _ = _split_sum(
        loss, batch, per_part, lambda part, rows, norms: loss.objective(split_values[rows], part, norms)
    )
    total.backward()
    torch.testing.assert_close(total, whole.loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(split_values.grad, whole_values.grad, atol=1e-7, rtol=0)
    for name in sums:
        torch.testing.assert_close(sums[name], whole.sums[name], atol=1e-6, rtol=0)


def test_critic_loss_hand_computed():
    batch, _, _ = _batch()
    mask = batch.loss_mask
    values = batch.returns + 2.0  # error 2 everywhere: 0.5·4 = 2
    result = CriticLoss().objective(values, batch, None)
    torch.testing.assert_close(result.loss, torch.tensor(2.0))
    # clipped at old ± 0.2 the error can only grow: max(...) picks the larger one
    clipped = CriticLoss(value_clip=0.2)(values.unsqueeze(-1), batch, None)
    assert float(clipped.loss) >= 2.0
    assert 0 <= float(clipped.sums["value_clipfrac"]) <= 1
    torch.testing.assert_close(result.sums["values_mean"], (values * mask).sum() / mask.sum())
