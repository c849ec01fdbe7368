"""Where each tensor starts in a flat byte buffer that is cut back into typed views.

Two such buffers exist and need different alignments, so each value has its own name:
:data:`DTYPE_VIEW_ALIGN` for the buffer sent to the rollout ranks (a message: the least
padding that is correct), :data:`CACHE_LINE_ALIGN` for the weight sync's bucket buffer.
"""

DTYPE_VIEW_ALIGN = 8
"""The least alignment at which a byte buffer can be viewed as any torch dtype (none has
elements wider than 8 bytes): the bucket a training rank sends to the rollout ranks
(:mod:`megatron_rl.rollout.buckets`) pads no more than that, so it sends few extra bytes."""

CACHE_LINE_ALIGN = 64
"""A CPU cache line (and an AVX-512 vector): every HF tensor in the weight sync's bucket
buffer (:func:`megatron_rl.bridge.iter_hf_buckets`) starts on a line of its own, so the
copies into it and the engine's reads of it are line-aligned, and ranks filling
neighbouring tensors of the shared arena never write the same line."""


def align_up(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment
