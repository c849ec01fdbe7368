"""The adaptive-temperature logits processor on its own: vLLM's real BatchUpdate bookkeeping
(add, swap, move, remove) and hand-computed scaled rows; validation of the per-request setting.
The sampler end to end (logprobs vs transformers) is tests/distributed/test_adaptive_temperature.py."""

import math

import pytest
import torch

from megatron_rl.algorithms.hapo import EntropyStats

vllm = pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality  # noqa: E402

from megatron_rl.rollout.adaptive_temperature import (  # noqa: E402
    EXTRA_ARGS_KEY,
    AdaptiveTemperatureProcessor,
    extra_args,
)

INF = float("inf")
# ĥ = clamp(log H) with these stats (pivot 0, scale 1, maxima 1).
UNIT = EntropyStats(0.0, 1.0, 1.0, 1.0)


def uniform_row(k, width=6):
    """logits / T uniform over the first k tokens: entropy log k (−inf elsewhere)."""
    row = torch.full((width,), -INF)
    row[:k] = 0.5
    return row


def params(tau=None, stats=UNIT, temperature=0.8):
    return SamplingParams(temperature=temperature, extra_args=extra_args(tau, stats) if tau is not None else None)


def update(size, added=(), removed=(), moved=()):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def expected(row, k, tau):
    factor = 1.0 + tau * max(-1.0, min(1.0, math.log(math.log(k))))
    return row / factor


def test_scales_opted_in_rows_and_leaves_the_others_untouched():
    proc = AdaptiveTemperatureProcessor(None, torch.device("cpu"), False)
    assert proc.is_argmax_invariant()
    proc.update_state(update(3, added=[(0, params(0.5), [1], []), (1, params(), [1], []), (2, params(0.2), [1], [])]))
    logits = torch.stack([uniform_row(4), uniform_row(3), uniform_row(2)])
    original = logits.clone()
    out = proc.apply(logits)
    torch.testing.assert_close(out[0], expected(original[0], 4, 0.5))  # ĥ = ln ln 4 = 0.327
    assert torch.equal(out[1], original[1])
    torch.testing.assert_close(out[2], expected(original[2], 2, 0.2))  # ĥ = ln ln 2 = −0.367
    assert torch.isinf(out[0, 4:]).all() and torch.isfinite(out[0, :4]).all()


def test_follows_requests_when_the_batch_is_reordered():
    proc = AdaptiveTemperatureProcessor(None, torch.device("cpu"), False)
    proc.update_state(update(3, added=[(0, params(0.5), None, []), (1, params(), None, []), (2, params(), None, [])]))
    proc.update_state(update(3, moved=[(0, 2, MoveDirectionality.SWAP)]))  # now at row 2
    rows = torch.stack([uniform_row(4)] * 3)
    out = proc.apply(rows.clone())
    assert torch.equal(out[0], rows[0]) and torch.equal(out[1], rows[1])
    torch.testing.assert_close(out[2], expected(rows[2], 4, 0.5))
    proc.update_state(update(3, moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))  # row 2 -> row 1
    out = proc.apply(rows.clone())
    torch.testing.assert_close(out[1], expected(rows[1], 4, 0.5))
    assert torch.equal(out[2], rows[2])
    proc.update_state(update(2, removed=[1]))
    assert torch.equal(proc.apply(rows[:2].clone()), rows[:2])
    assert not proc.settings


def test_tau_zero_is_plain_temperature():
    proc = AdaptiveTemperatureProcessor(None, torch.device("cpu"), False)
    proc.update_state(update(1, added=[(0, params(0.0), None, [])]))
    row = uniform_row(4)[None]
    assert torch.equal(proc.apply(row.clone()), row)


def test_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="random sampling"):
        AdaptiveTemperatureProcessor.validate_params(params(0.05, temperature=0.0))
    with pytest.raises(ValueError, match=r"tau=1.0 must be in \[0, 1\)"):
        extra_args(1.0, UNIT)
    with pytest.raises(ValueError, match="scale, pos_max, neg_max > 0"):
        extra_args(0.05, EntropyStats(0.0, 0.0, 1.0, 1.0))
    bad = SamplingParams(temperature=1.0, extra_args={EXTRA_ARGS_KEY: {"tau": 0.05}})
    with pytest.raises(ValueError, match="must be a dict with keys"):
        AdaptiveTemperatureProcessor.validate_params(bad)
    AdaptiveTemperatureProcessor.validate_params(SamplingParams(temperature=0.0))  # not opted in: fine


def test_extra_args_carry_tensor_stats_as_floats():
    stats = EntropyStats(torch.tensor(0.25), torch.tensor(2.0), torch.tensor(1.5), torch.tensor(3.0))
    setting = extra_args(0.05, stats)[EXTRA_ARGS_KEY]
    assert setting == {"tau": 0.05, "pivot": 0.25, "scale": 2.0, "pos_max": 1.5, "neg_max": 3.0}
    assert all(type(v) is float for v in setting.values())
