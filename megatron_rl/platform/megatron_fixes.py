"""Fixes for defects of Megatron-Core 0.16.1 itself, applied on every platform.

Kept apart from the CPU layer (:mod:`.cpu_compat`) because they are bugs of the release,
not CUDA assumptions. Each is a :class:`~megatron_rl.platform.patch.Patch` entry, tested in
tests/unit/platform/test_megatron_fixes.py:

* ``te_general_gemm``: ``moe_utils.RouterGatingLinearFunction`` tests
  ``te_general_gemm is not None``, but the name is defined only when Transformer Engine
  imports, so without TE the MoE router's forward raises ``NameError``.
"""

from __future__ import annotations

from megatron_rl.platform.patch import Patch

MEGATRON_CORE_VERSION = "0.16.1"
"""The Megatron-Core release these fixes are written and tested for."""


def _none_unless_defined(original):
    """Transformer Engine's GEMM where TE defined it, else None (the torch matmul branch)."""
    return original


TE_GENERAL_GEMM = Patch(
    "te_general_gemm",
    "megatron.core.transformer.moe.moe_utils",
    "te_general_gemm",
    "moe_utils.RouterGatingLinearFunction.forward/backward (the MoE router's gating GEMM)",
    _none_unless_defined,
    why="the name is bound only when Transformer Engine imports; without TE the router's "
    "`te_general_gemm is not None` test raises NameError",
)

PATCHES: list[Patch] = [TE_GENERAL_GEMM]
"""Every fix, in the order applied."""


def install() -> None:
    """Apply every fix (idempotent)."""
    for patch in PATCHES:
        patch.apply()


def uninstall() -> None:
    """Revert every fix (used by tests that show a fix is needed)."""
    for patch in reversed(PATCHES):
        patch.revert()
