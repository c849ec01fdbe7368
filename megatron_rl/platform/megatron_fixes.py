"""Fixes for defects of Megatron-Core 0.16.1 itself, applied on every platform.

Kept apart from the CPU layer because they are bugs of the release, not CUDA assumptions.
"""

from __future__ import annotations

MEGATRON_CORE_VERSION = "0.16.1"


def install() -> None:
    """Apply every fix (idempotent)."""
    _define_te_general_gemm()


def _define_te_general_gemm() -> None:
    """moe_utils.RouterGatingLinearFunction tests ``te_general_gemm is not None`` but the
    name is only defined when Transformer Engine imports; without TE the router's forward
    raises NameError. Define it as None so the torch matmul branch is taken."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
