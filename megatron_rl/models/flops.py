"""Model FLOPs of a GPT actor or critic, counted the way Megatron-LM counts them for MFU.

Model FLOPs (not hardware FLOPs): only the matrix multiplications the model needs, each
multiply-add counted as 2 FLOPs; norms, softmax, RoPE and the optimizer are left out, and
activation recomputation adds nothing (so MFU compares runs with and without it fairly).
A training step runs every GEMM three times (forward, data gradient, weight gradient):
6 FLOPs per weight per token. A forward-only pass (rollout scoring, old/ref logprobs) is 2.

Per token and layer, with h = hidden, q = heads * head_dim, kv = query groups * head_dim:
  attention projections  h*q (Q) + 2*h*kv (K, V) + q*h (output)
  core attention         q*L: QK^T and (QK^T)V over a causal mask, L = the token's sequence
                         length (half of L*L per product), so a sequence costs q*L^2 and a
                         packed batch q*sum(L_i^2), never q*(sum L_i)^2
  MLP (SwiGLU)           3*h*ffn (gate, up, down)
  MoE                    top-k routed experts 3*h*moe_ffn each, the shared expert
                         3*h*shared, its sigmoid gate h*1, the router h*experts
plus the head: h*vocab (LM head; the padded vocabulary when TP pads it) or h*1 (critic).
Megatron-LM's ``num_floating_point_operations`` is the same sum without the router and
the shared-expert gate (:meth:`ModelFlops.megatron_lm_total` gives that number).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Sequence

from megatron_rl.models.hf_config import ModelArch

Role = Literal["actor", "critic"]
ROLES = ("actor", "critic")
TRAIN_FLOPS_PER_MAC = 6  # forward 2 + data gradient 2 + weight gradient 2
FORWARD_FLOPS_PER_MAC = 2


@dataclasses.dataclass(frozen=True)
class ModelFlops:
    """FLOPs of one pass over a batch, by component (exact integers)."""

    tokens: int
    """Real tokens in the batch (padding excluded)."""
    attention_projections: int
    core_attention: int
    mlp: int
    """Dense SwiGLU MLP, or routed experts plus the shared expert."""
    router: int
    """MoE router and shared-expert gate (0 for dense models)."""
    head: int
    """LM head (actor) or value head (critic)."""

    @property
    def total(self) -> int:
        return self.attention_projections + self.core_attention + self.mlp + self.router + self.head

    @property
    def megatron_lm_total(self) -> int:
        """What Megatron-LM's training.py reports: everything but the router and gate."""
        return self.total - self.router

    @property
    def per_token(self) -> float:
        return self.total / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total, "per_token": self.per_token}


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """Weights one token multiplies with in one layer and in the head (MACs per token)."""

    attention_projections: int
    mlp: int
    router: int
    head: int
    query_size: int
    """heads * head_dim: the width of the core-attention products."""


def gemm_shape(arch: ModelArch, role: Role = "actor", vocab_size: Optional[int] = None) -> GemmShape:
    """Per-token multiply-adds by component; ``vocab_size`` defaults to ``arch.vocab_size``."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not supported; supported: {list(ROLES)}")
    h = arch.hidden_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    attention = h * q + 2 * h * kv + q * h
    router = 0
    if arch.is_moe:
        moe_ffn = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
        shared = arch.moe_shared_expert_intermediate_size or 0
        mlp = 3 * h * moe_ffn * arch.moe_router_topk + 3 * h * shared
        router = h * arch.num_moe_experts + (h if shared and arch.moe_shared_expert_gate else 0)
    else:
        mlp = 3 * h * arch.ffn_hidden_size
    vocab = arch.vocab_size if vocab_size is None else vocab_size
    head = h * vocab if role == "actor" else h
    return GemmShape(attention_projections=attention, mlp=mlp, router=router, head=head, query_size=q)


def model_flops(
    arch: ModelArch,
    seq_lengths: Sequence[int],
    *,
    role: Role = "actor",
    forward_only: bool = False,
    vocab_size: Optional[int] = None,
) -> ModelFlops:
    """FLOPs of one training step (or forward pass) over sequences of these real lengths.

    ``seq_lengths`` lists each sequence's real tokens (each packed segment on its own);
    padding is not a token and must be left out of the lengths.
    """
    lengths = [int(n) for n in seq_lengths]
    if not lengths or any(n < 0 for n in lengths):
        raise ValueError(f"seq_lengths must be a non-empty list of non-negative lengths, got {list(seq_lengths)[:8]}")
    per_mac = FORWARD_FLOPS_PER_MAC if forward_only else TRAIN_FLOPS_PER_MAC
    shape = gemm_shape(arch, role, vocab_size)
    tokens = sum(lengths)
    layers = arch.num_layers
    return ModelFlops(
        tokens=tokens,
        attention_projections=per_mac * layers * shape.attention_projections * tokens,
        core_attention=per_mac * layers * shape.query_size * sum(n * n for n in lengths),
        mlp=per_mac * layers * shape.mlp * tokens,
        router=per_mac * layers * shape.router * tokens,
        head=per_mac * shape.head * tokens,
    )


def training_flops(arch: ModelArch, seq_lengths: Sequence[int], **kwargs) -> ModelFlops:
    """Forward + backward FLOPs (6 per weight per token)."""
    return model_flops(arch, seq_lengths, forward_only=False, **kwargs)


def forward_flops(arch: ModelArch, seq_lengths: Sequence[int], **kwargs) -> ModelFlops:
    """Forward-only FLOPs (2 per weight per token): rollouts' scoring and logprob passes."""
    return model_flops(arch, seq_lengths, forward_only=True, **kwargs)


def training_flops_per_token(arch: ModelArch, seq_length: int, **kwargs) -> float:
    """Training FLOPs per token for full (unpacked, unpadded) sequences of ``seq_length``."""
    return training_flops(arch, [seq_length], **kwargs).per_token
