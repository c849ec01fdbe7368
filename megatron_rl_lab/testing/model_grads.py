"""One forward and backward of a single-rank actor model, for tests that compare two builds
of the same model (grouped against sequential experts, fused against unfused elementwise
kernels, one dispatcher against another) parameter by parameter."""

from __future__ import annotations

from typing import Callable

import torch

from megatron_rl import platform


def logits_and_grads(model, tokens: torch.Tensor, loss: str = "sum"):
    """(logits, {name: gradient}) of ``model`` on ``tokens`` [batch, seq]. ``loss`` sum
    backpropagates an expanded (stride 0) gradient, which torch's grouped GEMM refuses unless
    the caller copes; square (the mean of the squared logits) gives every logit its own."""
    model.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with platform.megatron_scope():
        logits = model(tokens, positions, attention_mask=None)
        value = logits.float().sum() if loss == "sum" else (logits.float() ** 2).mean()
        value.backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert torch.equal(got, want), f"{what}: differs by up to {(got - want).abs().max().item():.3g}"


def assert_builds_agree(
    got_model, want_model, tokens: torch.Tensor, compare: Callable = assert_equal, loss: str = "sum"
) -> None:
    """Two builds of one model (the same weights) give the logits and every parameter's
    gradient that ``compare(got, want, what)`` accepts on ``tokens``."""
    want_logits, want_grads = logits_and_grads(want_model, tokens, loss)
    got_logits, got_grads = logits_and_grads(got_model, tokens, loss)
    compare(got_logits, want_logits, "logits")
    assert got_grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        compare(got_grads[name], want, name)
