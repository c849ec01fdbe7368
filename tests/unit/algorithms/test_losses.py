"""Losses and aggregation against hand-computed values and per-element references."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (
    LOSS_AGGREGATIONS,
    aggregate,
    entropy_from_logits,
    explained_variance,
    get_loss_aggregation,
    kl_penalty,
    policy_loss,
    positive_example_nll,
    value_loss,
)

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


# ----------------------------------------------------------------------------- aggregate

# rows: [1, 2, 3] all real; [4, 5, 6] only the first real; a row of nan fully masked
LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [math.nan] * 3])
MASK = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 2.5),  # (1 + 2 + 3 + 4)/4 tokens
        ("seq-mean-token-mean", 3.0),  # ((1 + 2 + 3)/3 + 4/1)/2 non-empty sequences
        ("seq-mean-token-sum", 5.0),  # (6 + 4)/2 non-empty sequences
        ("seq-mean-token-sum-norm", 10.0 / 3.0),  # (6 + 4)/L, L = T = 3
    ],
)
def test_aggregate_by_hand(mode, expected):
    torch.testing.assert_close(aggregate(LOSS, MASK, mode), t(expected))


@pytest.mark.parametrize(
    "mode,norm,expected",
    [
        ("token-mean", 10, 1.0),  # (1 + 2 + 3 + 4)/10
        ("seq-mean-token-mean", 4, 1.5),  # (2 + 4)/4
        ("seq-mean-token-sum", 5, 2.0),  # (6 + 4)/5
        ("seq-mean-token-sum-norm", 20, 0.5),  # (6 + 4)/20
    ],
)
def test_aggregate_with_norm_by_hand(mode, norm, expected):
    torch.testing.assert_close(aggregate(LOSS, MASK, mode, norm=norm), t(expected))
    as_tensor = torch.tensor(float(norm))
    torch.testing.assert_close(aggregate(LOSS, MASK, mode, norm=as_tensor), t(expected))


def test_aggregate_all_masked_is_zero_not_nan():
    for mode in MODES[:3]:
        assert aggregate(t([[math.nan, 1.0]]), t([[0, 0]]), mode).item() == 0.0


def test_aggregate_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-mean"):
        aggregate(LOSS, MASK, "sum")


def test_aggregate_rejects_non_positive_norm():
    with pytest.raises(ValueError, match="norm"):
        aggregate(LOSS, MASK, "token-mean", norm=0)


def reference_whole_batch(loss, mask, mode):
    """Per-element reference of the whole-batch aggregation, on Python lists."""
    rows = [[(v, m) for v, m in zip(lr, mr)] for lr, mr in zip(loss.tolist(), mask.tolist())]
    sums = [sum(v for v, m in row if m) for row in rows]
    counts = [sum(1 for _, m in row if m) for row in rows]
    nonempty = [i for i, c in enumerate(counts) if c > 0]
    if mode == "token-mean":
        return sum(sums) / sum(counts)
    if mode == "seq-mean-token-mean":
        return sum(sums[i] / counts[i] for i in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum":
        return sum(sums[i] for i in nonempty) / len(nonempty)
    return sum(sums) / loss.shape[-1]


def _whole_batch_norm(mask, mode):
    # computed here, independently: N_tok, N_seq (rows with a real token), or L = T
    if mode == "token-mean":
        return mask.sum()
    if mode == "seq-mean-token-sum-norm":
        return mask.shape[-1]
    return (mask.sum(-1) > 0).sum()


@pytest.mark.parametrize("mode", MODES)
def test_microbatch_split_with_whole_batch_norm_equals_whole_batch(mode):
    gen = torch.Generator().manual_seed(42)
    loss = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(6, 5, generator=gen) > 0.4).to(torch.float64)
    mask[2] = 0.0  # an empty row
    mask[4] = 1.0
    whole = aggregate(loss, mask, mode)
    torch.testing.assert_close(whole, t(reference_whole_batch(loss.detach(), mask, mode)))
    (grad_whole,) = torch.autograd.grad(whole, loss)

    norm = _whole_batch_norm(mask, mode)
    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]  # uneven microbatches
    split = sum(aggregate(loss[p], mask[p], mode, norm=norm) for p in parts)
    torch.testing.assert_close(split, whole)
    (grad_split,) = torch.autograd.grad(split, loss)
    torch.testing.assert_close(grad_split, grad_whole)

    # without norm the split is NOT the whole-batch loss (the reason `norm` exists)
    if mode != "seq-mean-token-sum-norm":  # L is a constant: split-invariant anyway
        local = sum(aggregate(loss[p], mask[p], mode) for p in parts)
        assert not torch.allclose(local, whole)


@pytest.mark.parametrize("mode", MODES)
def test_local_norm_matches_the_norm_definition(mode):
    mask = t([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]])
    entry = get_loss_aggregation(mode)
    expected = {"token-mean": 5, "seq-mean-token-mean": 2, "seq-mean-token-sum": 2, "seq-mean-token-sum-norm": 4}[mode]
    assert int(entry.local_norm(mask)) == expected
    assert entry.norm_is_additive == (mode != "seq-mean-token-sum-norm")
    assert set(LOSS_AGGREGATIONS) == set(MODES)


# ----------------------------------------------------------------------------- policy_loss


def _one_token(adv, ratio, **kwargs):
    logp = t([[math.log(ratio)]]).requires_grad_()
    loss, stats = policy_loss(logp, t([[0.0]]), t([[adv]]), t([[1]]), **kwargs)
    return loss, stats, logp


@pytest.mark.parametrize(
    "adv,ratio,clip_c,expected",
    [
        (1.0, 1.5, None, -1.28),  # max(−1.5, −1·clip(1.5, 0.8, 1.28) = −1.28)
        (1.0, 0.5, None, -0.5),  # max(−0.5, −0.8): A > 0 is not clipped from below
        (-1.0, 1.5, None, 1.5),  # max(1.5, 1.28): A < 0 is not clipped from above
        (-1.0, 0.5, None, 0.8),  # max(0.5, 0.8)
        (-1.0, 20.0, 10.0, 10.0),  # dual clip: min(max(20, 1.28), 1·10) = 10
        (-1.0, 5.0, 10.0, 5.0),  # dual clip inactive: min(5, 10) = 5
        (1.0, 20.0, 10.0, -1.28),  # dual clip never applies to A > 0
        (-2.0, 1.1, 3.0, 2.2),  # −A·r = 2.2 < −A·c = 6
    ],
)
def test_policy_loss_by_hand(adv, ratio, clip_c, expected):
    loss, _, _ = _one_token(adv, ratio, clip_low=0.2, clip_high=0.28, clip_c=clip_c)
    torch.testing.assert_close(loss, t(expected))


def test_policy_loss_gradient_is_zero_when_clipped():
    # clipped (A = 1, r = 1.5 > 1.28): constant → grad 0; unclipped (A = 1, r = 0.5):
    # d(−A·exp(logp − old))/dlogp = −A·r = −0.5
    loss, _, logp = _one_token(1.0, 1.5, clip_high=0.28)
    loss.backward()
    assert logp.grad.item() == 0.0
    loss, _, logp = _one_token(1.0, 0.5)
    loss.backward()
    assert logp.grad.item() == pytest.approx(-0.5)


def reference_policy_tokens(logp, old, adv, low, high, clip_c):
    out = []
    for lp, o, a, lo, hi in zip(logp, old, adv, low, high):
        r = math.exp(max(-20.0, min(20.0, lp - o)))
        clipped = min(max(r, 1 - lo), 1 + hi)
        loss = max(-a * r, -a * clipped)
        if clip_c is not None and a < 0:
            loss = min(loss, -a * clip_c)
        out.append(loss)
    return out


@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_policy_loss_per_token_bounds_match_reference(clip_c):
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    old = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    low = 0.1 + 0.3 * torch.rand(4, 6, generator=gen, dtype=torch.float64)
    high = 0.1 + 0.5 * torch.rand(4, 6, generator=gen, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, mask, low, high, clip_c, agg="token-mean")
    tokens = reference_policy_tokens(
        logp.flatten().tolist(),
        old.flatten().tolist(),
        adv.flatten().tolist(),
        low.flatten().tolist(),
        high.flatten().tolist(),
        clip_c,
    )
    torch.testing.assert_close(loss, t(sum(tokens) / len(tokens)))


def test_policy_loss_stats_by_hand():
    # tokens: (A, r) = (1, 1.5) clipped, (1, 0.5) not, (−1, 0.5) clipped, (−1, 1.5) not,
    # (−1, 30) dual-clipped at c = 10; the sixth token is masked (r = 100 must not count).
    ratios = [1.5, 0.5, 0.5, 1.5, 30.0, 100.0]
    logp = t([[math.log(r) for r in ratios]])
    adv = t([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
    mask = t([[1, 1, 1, 1, 1, 0]])
    _, stats = policy_loss(logp, torch.zeros_like(logp), adv, mask, 0.2, 0.28, clip_c=10.0)
    # clipfrac: the clipped term wins for token 1 (−1.28 > −1.5) and token 3 (0.8 > 0.5),
    # not for token 5 (1.28 < 30, the dual clip is counted separately) → 2/5
    assert stats["clipfrac"].item() == pytest.approx(2 / 5)
    assert stats["dual_clipfrac"].item() == pytest.approx(1 / 5)
    # approx KL = mean(old − new) = −mean(log r) over the 5 real tokens
    expected_kl = -sum(math.log(r) for r in ratios[:5]) / 5
    assert stats["approx_kl"].item() == pytest.approx(expected_kl)
    assert stats["ratio_mean"].item() == pytest.approx(sum(ratios[:5]) / 5)
    assert stats["ratio_max"].item() == pytest.approx(30.0)
    assert not any(v.requires_grad for v in stats.values())


def test_policy_loss_log_ratio_is_clamped():
    # logp − old = 30 is clamped to 20 → ratio e^20
    _, stats = policy_loss(t([[30.0]]), t([[0.0]]), t([[1.0]]), t([[1]]))
    assert stats["ratio_max"].item() == pytest.approx(math.exp(20.0))


def test_policy_loss_passes_agg_and_norm():
    # two rows of one and two tokens, A = 1, r = 1 → ℓ = −1 per real token
    logp = torch.zeros(2, 2, dtype=torch.float64)
    mask = t([[1, 0], [1, 1]])
    adv = torch.ones(2, 2, dtype=torch.float64)
    loss, _ = policy_loss(logp, logp, adv, mask, agg="seq-mean-token-sum")
    torch.testing.assert_close(loss, t(-1.5))  # (−1 − 2)/2 sequences
    loss, _ = policy_loss(logp, logp, adv, mask, agg="token-mean", norm=6)
    torch.testing.assert_close(loss, t(-0.5))  # −3/6


def test_policy_loss_rejects_dual_clip_below_one():
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1]]), clip_c=0.5)


# ----------------------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    values, old, returns = t([[1.0, 2.0, 1.6]]), t([[1.5, 1.5, 1.5]]), t([[0.0, 3.0, 0.0]])
    mask = t([[1, 1, 1]])
    # unclipped: 0.5·[1, 1, 2.56] → mean 4.56/6 = 0.76
    torch.testing.assert_close(value_loss(values, old, returns, mask), t(0.76))
    # c = 0.2: clip(V) = [1.3, 1.7, 1.6] → (V_c − R)² = [1.69, 1.69, 2.56];
    # max with [1, 1, 2.56] → 0.5·[1.69, 1.69, 2.56], mean = 5.94/6 = 0.99
    torch.testing.assert_close(value_loss(values, old, returns, mask, clip_range=0.2), t(0.99))
    # seq-mean-token-sum with norm 2: 0.5·(1 + 1 + 2.56)/2 = 1.14
    loss = value_loss(values, old, returns, mask, agg="seq-mean-token-sum", norm=2)
    torch.testing.assert_close(loss, t(1.14))


def test_value_loss_ignores_masked_tokens():
    loss = value_loss(t([[1.0, math.nan]]), t([[1.0, 0.0]]), t([[0.0, 5.0]]), t([[1, 0]]))
    torch.testing.assert_close(loss, t(0.5))  # 0.5·(1 − 0)²


def test_explained_variance():
    returns = t([[1.0, 2.0, 3.0, 99.0]])
    mask = t([[1, 1, 1, 0]])
    # perfect critic → 1; constant critic at the mean → Var[R − V] = Var[R] → 0
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(t([[2.0, 2.0, 2.0, 0.0]]), returns, mask).item() == pytest.approx(0.0)


# ----------------------------------------------------------------------------- NLL


def test_positive_example_nll_by_hand():
    logp = t([[-1.0, -2.0], [-3.0, -4.0]]).requires_grad_()
    mask = t([[1, 1], [1, 0]])
    nll = lambda pos, **kw: positive_example_nll(logp, mask, torch.tensor(pos), **kw)  # noqa: E731
    torch.testing.assert_close(nll([True, False]), t(1.5))  # −(−1 − 2)/2
    torch.testing.assert_close(nll([False, True]), t(3.0))  # −(−3)/1; −4 is masked
    torch.testing.assert_close(nll([True, True]), t(2.0))  # 6/3
    torch.testing.assert_close(nll([True, False], norm=6), t(0.5))  # 3/6
    none = nll([False, False])
    assert none.item() == 0.0 and none.requires_grad


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    logp, ref = t([[-1.0]]), t([[-1.5]])
    # k1 = −1 − (−1.5) = 0.5; k2 = ½·0.5² = 0.125; k3 = e^{−0.5} − (−0.5) − 1 = 0.1065307
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), t([[0.5]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), t([[0.125]]))
    torch.testing.assert_close(kl_penalty(logp, ref), t([[math.exp(-0.5) - 0.5]]))


def test_kl_k3_is_nonnegative_and_zero_at_equality():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 4, generator=gen)
    assert bool((kl_penalty(logp, logp + torch.randn(3, 4, generator=gen)) >= 0).all())
    assert torch.equal(kl_penalty(logp, logp), torch.zeros(3, 4))


def test_kl_unknown_kind_lists_valid():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(t([0.0]), t([0.0]), "k4")


# ----------------------------------------------------------------------------- entropy


def test_entropy_matches_manual_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 3, 7, generator=gen, dtype=torch.float64)
    expected = []
    for row in logits.reshape(-1, 7).tolist():
        top = max(row)
        exps = [math.exp(x - top) for x in row]
        total = sum(exps)
        expected.append(-sum((e / total) * math.log(e / total) for e in exps))
    torch.testing.assert_close(entropy_from_logits(logits), t(expected).reshape(2, 3))


def test_entropy_special_cases():
    # uniform over 4 → log 4; −inf logits are excluded: uniform over 2 → log 2; near one-hot → ~0
    inf = math.inf
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -inf, -inf], [100.0, 0, 0, 0]])
    entropy = entropy_from_logits(logits)
    torch.testing.assert_close(entropy, torch.tensor([math.log(4), math.log(2), 0.0]))
    assert entropy_from_logits(logits.to(torch.bfloat16)).dtype == torch.float32


def test_policy_loss_rejects_sequence_level_advantages():
    # a [B] advantage would broadcast along T (wrong axis when B == T): refuse it
    with pytest.raises(ValueError, match="adv\\[:, None\\]"):
        policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2), torch.ones(2, 2))
    zeros = torch.zeros(2, 2)
    loss, _ = policy_loss(zeros, zeros, torch.ones(2)[:, None], torch.ones(2, 2))
    assert loss.item() == -1.0  # −A·r with r = 1
