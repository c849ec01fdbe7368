"""Megatron-Core 0.16.1's RoPE fusion slots filled with torch.compile where Transformer Engine
is absent.

``rope_utils.apply_rotary_pos_emb`` calls ``fused_apply_rotary_pos_emb`` (padded rows) or
``fused_apply_rotary_pos_emb_thd`` (packed rows) when ``config.apply_rope_fusion`` is on. Both
names are Transformer Engine's kernels, bound to None without it, and ``TransformerConfig``
refuses the flag while both are None. Unfused, RoPE is seven elementwise kernels forward
(cos, sin, two casts, chunk/neg/cat, two multiplies and an add) on every query and key.

The two entries below fill the slots only where they are None, with Megatron's own unfused
formula compiled by inductor into one kernel per direction, so a model asks for the fusion
with the same flag a TE build uses (``BuildOptions(fusion="compiled")``), and a model built
without the flag runs Megatron's code as shipped. TE's kernels, where installed, are kept.
Tested in tests/unit/platform/test_megatron_fusions.py.
"""

from __future__ import annotations

import functools

import torch

from megatron_rl.platform.patch import Patch

MEGATRON_CORE_VERSION = "0.16.1"
ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"


@functools.lru_cache(maxsize=1)
def compiled_rope_bshd():
    """Megatron's ``_apply_rotary_pos_emb_bshd`` (0.16.1) compiled; built on first use."""
    from megatron.core.models.common.embeddings import rope_utils

    return torch.compile(rope_utils._apply_rotary_pos_emb_bshd)


def _rope_bshd(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False, interleaved: bool = False):
    """TE's ``fused_apply_rotary_pos_emb`` signature; Megatron reaches it only for mscale 1."""
    return compiled_rope_bshd()(t, freqs, rotary_interleaved=interleaved)


class _ContextParallelCoordinates:
    """What Megatron's THD RoPE reads of a context-parallel group: its size and this rank."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _rope_thd(t, cu_seqlens, freqs, cp_size: int = 1, cp_rank: int = 0):
    """TE's ``fused_apply_rotary_pos_emb_thd`` signature: Megatron's own THD RoPE (which slices
    each sequence's frequencies on the host, as shipped), its elementwise part compiled."""
    from megatron.core.models.common.embeddings import rope_utils

    with COMPILED_BSHD_INSIDE_THD.scope():
        return rope_utils._apply_rotary_pos_emb_thd(
            t, cu_seqlens, freqs, cp_group=_ContextParallelCoordinates(cp_size, cp_rank)
        )


def _unless_defined(replacement):
    def make(original):
        return original if original is not None else replacement

    return make


ROPE_BSHD = Patch(
    "rope_fused_bshd",
    ROPE_UTILS,
    "fused_apply_rotary_pos_emb",
    "rope_utils.apply_rotary_pos_emb with config.apply_rope_fusion, padded rows",
    _unless_defined(_rope_bshd),
    why="bound to None without Transformer Engine: no fused RoPE, and the config refuses the flag",
)
ROPE_THD = Patch(
    "rope_fused_thd",
    ROPE_UTILS,
    "fused_apply_rotary_pos_emb_thd",
    "rope_utils.apply_rotary_pos_emb with config.apply_rope_fusion, packed rows",
    _unless_defined(_rope_thd),
    why="bound to None without Transformer Engine; packed rows would fail the fused branch's assert",
)
COMPILED_BSHD_INSIDE_THD = Patch(
    "rope_thd_compiled_elementwise",
    ROPE_UTILS,
    "_apply_rotary_pos_emb_bshd",
    "rope_utils._apply_rotary_pos_emb_thd's elementwise step, only inside _rope_thd",
    lambda original: compiled_rope_bshd(),
    why="scoped: the THD path's per-token multiply-add compiled, Megatron's frequency slicing kept",
)

PATCHES: list[Patch] = [ROPE_BSHD, ROPE_THD]
"""The global entries (the scoped one holds only inside :func:`_rope_thd`)."""


def install() -> None:
    """Fill the empty RoPE fusion slots (idempotent; a no-op where TE filled them)."""
    for patch in PATCHES:
        patch.apply()


def uninstall() -> None:
    for patch in reversed(PATCHES):
        patch.revert()
