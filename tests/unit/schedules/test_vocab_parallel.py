"""Vocab-parallel logprobs and entropy at world 1 against plain torch (log_softmax over the
real vocabulary, autograd): values, gradients, padded vocabulary rows, temperatures."""

import pytest
import torch

from megatron_rl.algorithms import entropy_from_logits
from megatron_rl.schedules import vocab_parallel_logprobs

VOCAB, PADDED = 11, 16


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 5, PADDED, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (3, 5), generator=g)
    temperature = 0.5 + torch.rand(3, 5, generator=g)
    return logits, labels, temperature


def _plain(logits, labels, temperature):
    z = logits.float()[..., :VOCAB] / temperature.unsqueeze(-1)
    logp = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return logp, entropy_from_logits(z)


def _grad(fn, logits, weights):
    logits.grad = None
    logp, entropy = fn()
    (weights[0] * logp + weights[1] * entropy).sum().backward()
    return logits.grad.clone()


def test_values_and_gradients_match_plain_torch_with_padding_and_temperature():
    logits, labels, temperature = _inputs()
    logp, entropy = vocab_parallel_logprobs(logits, labels, VOCAB, temperature=temperature)
    ref_logp, ref_entropy = _plain(logits, labels, temperature)
    torch.testing.assert_close(logp, ref_logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=2e-6, rtol=0)
    weights = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1))
    grad = _grad(lambda: vocab_parallel_logprobs(logits, labels, VOCAB, temperature=temperature), logits, weights)
    ref_grad = _grad(lambda: _plain(logits, labels, temperature), logits, weights)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
    assert grad[..., VOCAB:].abs().max() == 0  # padded rows: no probability, no gradient


def test_padded_rows_are_masked_even_when_they_dominate():
    logits, labels, _ = _inputs()
    with torch.no_grad():
        logits[..., VOCAB:] = 50.0  # would take all the probability if not masked
    logp, entropy = vocab_parallel_logprobs(logits, labels, VOCAB)
    ref_logp, ref_entropy = _plain(logits, labels, torch.ones(3, 5))
    torch.testing.assert_close(logp, ref_logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=2e-6, rtol=0)


def test_scalar_temperature_and_hand_computed_uniform_case():
    logits = torch.zeros(2, VOCAB)  # uniform: logp = −log V, H = log V, at any temperature
    labels = torch.tensor([0, VOCAB - 1])
    logp, entropy = vocab_parallel_logprobs(logits, labels, VOCAB, temperature=0.7)
    expected = torch.log(torch.tensor(float(VOCAB)))
    torch.testing.assert_close(logp, -expected.expand(2))
    torch.testing.assert_close(entropy, expected.expand(2))


def test_entropy_gradient_only_and_bf16_logits():
    logits, labels, temperature = _inputs(torch.bfloat16)
    logp, entropy = vocab_parallel_logprobs(logits, labels, VOCAB, temperature=temperature)
    assert logp.dtype == entropy.dtype == torch.float32
    entropy.sum().backward()  # logprob unused: its gradient arrives as None
    assert logits.grad.dtype == torch.bfloat16
    ref = logits.detach().float().requires_grad_()
    _plain(ref, labels, temperature)[1].sum().backward()
    torch.testing.assert_close(logits.grad.float(), ref.grad, atol=2e-2, rtol=2e-2)


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4] + [0.0] * (VOCAB - 2)])
    logp, entropy = vocab_parallel_logprobs(logits, torch.tensor([1]), VOCAB)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    assert float(logp) == pytest.approx(-2e4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(labels=torch.zeros(3, dtype=torch.long)), "labels"),
        (dict(vocab_size=PADDED + 1), "exceeds the model's vocabulary"),
        (dict(temperature=torch.zeros(3, 5)), "temperature must be > 0"),
    ],
)
def test_bad_input_raises_naming_it(kwargs, match):
    logits, labels, _ = _inputs()
    args = dict(logits=logits, labels=labels, vocab_size=VOCAB) | kwargs
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs(**args)
