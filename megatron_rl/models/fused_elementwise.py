"""The layers' elementwise work fused by torch.compile, for builds without Transformer Engine.

Measured on one H200 (docs/benchmarks.md, the GPU kit): without TE, 40 % of the dense
training step's device time and 46 % of the MoE step's went to unfused elementwise kernels
and copies: RMSNorm, RoPE, the gated SiLU and their backward passes, each a chain of small
kernels that reads and writes the whole activation. TE fuses them into hand-written kernels;
here inductor fuses the same formulas into one kernel per direction:

* RMSNorm: :class:`CompiledRMSNorm`, torch's ``rms_norm`` compiled;
* RoPE: Megatron's own formula, compiled, in the slot of TE's fused RoPE
  (:mod:`megatron_rl.platform.megatron_fusions`, reached by ``config.apply_rope_fusion``);
* the gated SiLU of dense MLPs and SequentialMLP experts: Megatron's ``bias_swiglu_impl``,
  which Megatron already compiles (``config.bias_activation_fusion``); of the grouped
  experts: :func:`scaled_gated_silu`, compiled when that flag is on.

``BuildOptions(fusion="compiled")`` turns all of these on together; ``"none"`` builds the
layers as before. Both compute the same formulas; inductor may reorder a reduction, so
fp32 results agree to rounding (tests/unit/models/test_fused_elementwise.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FUSIONS = ("none", "compiled")
"""none: Megatron's local layers as shipped; compiled: their elementwise work compiled."""


def transformer_config_fields(fusion: str) -> dict:
    """The TransformerConfig flags that route Megatron's layers through the fused paths
    (``fusion`` one of FUSIONS, as BuildOptions checks)."""
    if fusion == "none":
        return {}
    from megatron_rl.platform import megatron_fusions

    megatron_fusions.install()  # TransformerConfig refuses apply_rope_fusion while the slots are empty
    return dict(bias_activation_fusion=True, apply_rope_fusion=True)


@functools.lru_cache(maxsize=1)
def _compiled_rms_norm():
    return torch.compile(F.rms_norm)


class CompiledRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with its forward and backward each compiled into one kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled_rms_norm()(x, self.normalized_shape, self.weight, self.eps)


def scaled_gated_silu(fc1_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """MLP's gated SiLU of a grouped-experts FC1 output, scaled by each token's routing
    probability and rounded back to the activation dtype as Megatron's MLP does."""
    gate, linear = torch.chunk(fc1_out, 2, dim=-1)
    hidden = F.silu(gate) * linear
    return (hidden * probs.unsqueeze(-1)).to(hidden.dtype)


@functools.lru_cache(maxsize=1)
def compiled_scaled_gated_silu():
    return torch.compile(scaled_gated_silu)
