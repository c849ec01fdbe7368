"""HAPO's adaptive sampling temperature as a vLLM V1 logits processor (vllm 0.32).

Every generated token is sampled from softmax(logits / T_t) with
T_t = T·(1 + τ·ĥ_t) (docs/algorithms.md, "HAPO token-aware pieces"). ĥ_t is the
normalised entropy of the current step's distribution under the previous training
step's `EntropyStats`. Choice: the entropy is that of the base-temperature distribution
softmax(logits / T), which is what Megatron's `compute_logprobs` returns as entropy when
run at temperature T, so the trainer recomputes the same T_t from its own forward pass
(`megatron_rl.trainer.hapo`).

Where it runs: vLLM's sampler first divides the logits by the request's T, then calls
the argmax-invariant processors, then top-k/top-p, samples, and takes the "processed"
logprobs from those final logits. Dividing by a positive per-row factor keeps the
argmax, so this processor is argmax-invariant and receives exactly logits / T: it
computes ĥ on them and divides by (1 + τ·ĥ). Sampling and the returned logprobs
(logprobs_mode="processed_logprobs") are then those of softmax(logits / T_t). Greedy
requests never reach it (and are refused with the setting: a greedy T_t is meaningless).
With top_p < 1 the nucleus is cut from softmax(logits / T_t).

Per request, the setting travels in `SamplingParams.extra_args[EXTRA_ARGS_KEY]`
(`extra_args(tau, stats)` builds it); requests without it are untouched. Register the
class with `LLM(logits_processors=[AdaptiveTemperatureProcessor])`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from megatron_rl.algorithms.hapo import EntropyStats, _h_hat
from megatron_rl.algorithms.losses import entropy_from_logits

__all__ = ["EXTRA_ARGS_KEY", "AdaptiveTemperatureProcessor", "extra_args"]

EXTRA_ARGS_KEY = "hapo_adaptive_temperature"
_FIELDS = ("tau", "pivot", "scale", "pos_max", "neg_max")
_GREEDY_EPS = 1e-5  # vLLM's sampler treats temperature below this as greedy


def extra_args(tau: float, stats: EntropyStats) -> dict:
    """`SamplingParams.extra_args` that switch the processor on for a request."""
    floats = stats.as_floats()
    setting = {
        "tau": float(tau),
        "pivot": floats.pivot,
        "scale": floats.scale,
        "pos_max": floats.pos_max,
        "neg_max": floats.neg_max,
    }
    _check(setting)
    return {EXTRA_ARGS_KEY: setting}


def _check(setting) -> tuple[float, ...]:
    """The setting as a (tau, pivot, scale, pos_max, neg_max) tuple, or one clear error."""
    if not isinstance(setting, dict) or set(setting) != set(_FIELDS):
        raise ValueError(f"extra_args[{EXTRA_ARGS_KEY!r}] must be a dict with keys {list(_FIELDS)}, got {setting!r}")
    values = tuple(float(setting[name]) for name in _FIELDS)
    tau, pivot, scale, pos_max, neg_max = values
    if not 0.0 <= tau < 1.0:
        raise ValueError(f"adaptive temperature tau={tau} must be in [0, 1) so that T_t > 0")
    if not math.isfinite(pivot) or not all(math.isfinite(v) and v > 0 for v in (scale, pos_max, neg_max)):
        raise ValueError(f"entropy stats must be finite with scale, pos_max, neg_max > 0, got {setting!r}")
    return values


def _setting_of(params: SamplingParams, _prompt_ids, _output_ids) -> Optional[tuple[float, ...]]:
    setting = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
    if setting is None:
        return None
    values = _check(setting)
    return values if values[0] > 0 else None  # τ = 0 is plain T: nothing to do


class AdaptiveTemperatureProcessor(LogitsProcessor):
    """Divides each opted-in row of logits / T by (1 + τ·ĥ) (see the module docstring)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        setting = (sampling_params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if setting is None:
            return
        _check(setting)
        if sampling_params.temperature < _GREEDY_EPS:
            raise ValueError(
                f"adaptive temperature needs random sampling (temperature >= {_GREEDY_EPS}), "
                f"got temperature={sampling_params.temperature}"
            )

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.device = device
        self.settings: dict[int, tuple[float, ...]] = {}
        """Batch row -> (tau, pivot, scale, pos_max, neg_max) of the requests that opted in."""
        self._packed: Optional[tuple[torch.Tensor, torch.Tensor, EntropyStats]] = None

    def is_argmax_invariant(self) -> bool:
        return True  # a positive per-row scale keeps every row's argmax

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if process_dict_updates(self.settings, batch_update, _setting_of):
            self._packed = None

    def _pack(self) -> tuple[torch.Tensor, torch.Tensor, EntropyStats]:
        """Row indices, τ and stats as device tensors, rebuilt only when the batch changes."""
        if self._packed is None:
            rows = sorted(self.settings)
            columns = torch.tensor([self.settings[r] for r in rows], dtype=torch.float32).T.to(self.device)
            tau, pivot, scale, pos_max, neg_max = columns
            index = torch.tensor(rows, dtype=torch.long).to(self.device)
            self._packed = (index, tau, EntropyStats(pivot, scale, pos_max, neg_max))
        return self._packed

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.settings:
            return logits
        index, tau, stats = self._pack()
        scaled = logits[index]  # logits / T of the opted-in rows (a copy)
        factor = 1.0 + tau * _h_hat(entropy_from_logits(scaled), stats)  # T_t / T
        logits[index] = scaled / factor.unsqueeze(-1).to(scaled.dtype)
        return logits
