"""Read a Hugging Face config into the architecture numbers Megatron-Core needs.

One table per family says how its HF fields map (names differ between families and
between transformers releases, e.g. ``num_experts`` vs ``num_local_experts``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from megatron_rl.parallel.config import ModelShape


@dataclasses.dataclass(frozen=True)
class FamilyTraits:
    """What distinguishes one model family from the others, as data."""

    moe: bool
    qkv_bias: bool = False
    qk_layernorm: bool = False
    shared_expert: bool = False
    # Megatron's router: softmax over all experts then top-k (no renormalisation) is
    # ``pre_softmax=True``; top-k then softmax equals softmax-then-renormalise.
    router_pre_softmax: Optional[bool] = None  # None: decided by HF ``norm_topk_prob``


FAMILIES: dict[str, FamilyTraits] = {
    "llama": FamilyTraits(moe=False),
    "qwen2": FamilyTraits(moe=False, qkv_bias=True),
    "qwen3": FamilyTraits(moe=False, qk_layernorm=True),
    "qwen2_moe": FamilyTraits(moe=True, qkv_bias=True, shared_expert=True),
    "qwen3_moe": FamilyTraits(moe=True, qk_layernorm=True),
    "mixtral": FamilyTraits(moe=True, router_pre_softmax=False),
}


#: ModelArch fields that are TransformerConfig fields of the same name (MoE models only).
MOE_FIELDS = (
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_pre_softmax",
)


class UnsupportedModelError(ValueError):
    pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelArch:
    """Architecture numbers of one model, family-independent."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    norm_epsilon: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    moe_router_pre_softmax: bool = False

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    def shape(self) -> ModelShape:
        """The numbers a parallel layout must divide."""
        return ModelShape(
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            num_moe_experts=self.num_moe_experts,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
        )


def _first(cfg: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    scaling = getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type", scaling.get("rope_type", "default"))
    if kind not in ("default", None):
        raise UnsupportedModelError(f"rope_type={kind!r} is not supported yet; supported: 'default'")
    return float(params.get("rope_theta", _first(cfg, "rope_theta", default=10000.0)))


def arch_from_dict(hf_config: dict) -> ModelArch:
    """:func:`arch_from_hf` of a config.json's contents (as a checkpoint's ``extra`` records them)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    return arch_from_hf(AutoConfig.for_model(hf_config.get("model_type"), **fields))


def arch_from_hf(cfg: Any) -> ModelArch:
    """Map a transformers ``PretrainedConfig`` (or a path to one) to :class:`ModelArch`."""
    if isinstance(cfg, (str, os.PathLike)):
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(cfg)
    family = getattr(cfg, "model_type", None)
    if family not in FAMILIES:
        raise UnsupportedModelError(f"model_type={family!r} is not supported; supported: {sorted(FAMILIES)}")
    traits = FAMILIES[family]
    heads = cfg.num_attention_heads
    head_dim = _first(cfg, "head_dim", default=cfg.hidden_size // heads)
    moe: dict[str, Any] = {}
    if traits.moe:
        experts = _first(cfg, "num_experts", "num_local_experts")
        if family == "qwen2_moe" and (
            getattr(cfg, "mlp_only_layers", None) or getattr(cfg, "decoder_sparse_step", 1) != 1
        ):
            raise UnsupportedModelError(
                "qwen2_moe with dense layers (mlp_only_layers/decoder_sparse_step) is not supported"
            )
        pre_softmax = traits.router_pre_softmax
        if pre_softmax is None:
            pre_softmax = not bool(getattr(cfg, "norm_topk_prob", False))
        shared = getattr(cfg, "shared_expert_intermediate_size", None) if traits.shared_expert else None
        moe = dict(
            num_moe_experts=experts,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=_first(cfg, "moe_intermediate_size", "intermediate_size"),
            moe_shared_expert_intermediate_size=shared or None,
            moe_shared_expert_gate=bool(shared),
            moe_router_pre_softmax=pre_softmax,
        )
    return ModelArch(
        family=family,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_attention_heads=heads,
        num_query_groups=_first(cfg, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        ffn_hidden_size=cfg.intermediate_size,
        norm_epsilon=float(cfg.rms_norm_eps),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(cfg, "qkv_bias", traits.qkv_bias) or getattr(cfg, "attention_bias", False)),
        qk_layernorm=traits.qk_layernorm,
        **moe,
    )
