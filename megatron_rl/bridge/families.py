"""One declarative HF <-> Megatron table per model family.

Megatron names are the canonical, parallelism-free names of
:func:`megatron_rl.parallel.shards.local_shards`. HF names are those the installed
transformers writes with ``save_pretrained`` (per-expert MoE weights) and reads with
``from_pretrained``; vLLM reads the same. MoE checkpoints may instead hold the
transformers-5 in-memory layout (all experts of a layer stacked in ``mlp.experts.gate_up_proj``
/ ``down_proj``); that is the ``"fused"`` expert style, accepted on load and reproduced on
export when asked.
"""

from __future__ import annotations

from megatron_rl.bridge.mapping import BridgeError, Concat, Copy, GroupedQKV, PadRows, Rule

PER_EXPERT, FUSED = "per_expert", "fused"
EXPERT_STYLES = (PER_EXPERT, FUSED)

L = "decoder.layers.{layer}."
H = "model.layers.{layer}."

#: Megatron spells some layer norms differently by layer spec (local vs Transformer
#: Engine, dense vs MoE); names on the left are read as the ones on the right.
MEGATRON_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}

EMBEDDINGS = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), PadRows(), ("hidden",)),
    Rule("output_layer.weight", ("lm_head.weight",), PadRows(), ("hidden",), when="untied"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), Copy("hidden")),
)

ATTENTION = (
    Rule(L + "self_attention.linear_qkv.layer_norm_weight", (H + "input_layernorm.weight",), Copy("hidden")),
    Rule(
        L + "self_attention.linear_qkv.weight",
        tuple(H + f"self_attn.{p}_proj.weight" for p in "qkv"),
        GroupedQKV(),
        ("hidden",),
    ),
    Rule(
        L + "self_attention.linear_qkv.bias",
        tuple(H + f"self_attn.{p}_proj.bias" for p in "qkv"),
        GroupedQKV(),
        when="qkv_bias",
    ),
    Rule(
        L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",), Copy("head_dim"), when="qk_layernorm"
    ),
    Rule(
        L + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",), Copy("head_dim"), when="qk_layernorm"
    ),
    Rule(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",), Copy("hidden"), ("q_rows",)),
    Rule(L + "mlp.linear_fc1.layer_norm_weight", (H + "post_attention_layernorm.weight",), Copy("hidden")),
)

DENSE_MLP = (
    Rule(
        L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), Concat("ffn"), ("hidden",)
    ),
    Rule(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), Copy("hidden"), ("ffn",)),
)

SHARED_EXPERT = (
    Rule(
        L + "mlp.shared_experts.linear_fc1.weight",
        (H + "mlp.shared_expert.gate_proj.weight", H + "mlp.shared_expert.up_proj.weight"),
        Concat("shared_ffn"),
        ("hidden",),
        when="shared_expert",
    ),
    Rule(
        L + "mlp.shared_experts.linear_fc2.weight",
        (H + "mlp.shared_expert.down_proj.weight",),
        Copy("hidden"),
        ("shared_ffn",),
        when="shared_expert",
    ),
    Rule(
        L + "mlp.shared_experts.gate_weight",
        (H + "mlp.shared_expert_gate.weight",),
        Copy("one"),
        ("hidden",),
        when="shared_expert",
    ),
)


def per_expert_moe(block: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Router + experts, one HF tensor per expert and projection (``save_pretrained`` style)."""
    e = H + block + ".experts.{expert}."
    return (
        Rule(L + "mlp.router.weight", (H + block + ".gate.weight",), Copy("experts"), ("hidden",)),
        Rule(
            L + "mlp.experts.{expert}.linear_fc1.weight",
            (e + gate + ".weight", e + up + ".weight"),
            Concat("moe_ffn"),
            ("hidden",),
        ),
        Rule(L + "mlp.experts.{expert}.linear_fc2.weight", (e + down + ".weight",), Copy("hidden"), ("moe_ffn",)),
    )


#: transformers-5 in-memory MoE layout: experts stacked, gate_up_proj[e] = [gate_e; up_e].
FUSED_MOE = (
    Rule(L + "mlp.router.weight", (H + "mlp.gate.weight",), Copy("experts"), ("hidden",)),
    Rule(L + "mlp.experts.{expert}.linear_fc1.weight", (H + "mlp.experts.gate_up_proj",), Copy("moe_fc1"), ("hidden",)),
    Rule(L + "mlp.experts.{expert}.linear_fc2.weight", (H + "mlp.experts.down_proj",), Copy("hidden"), ("moe_ffn",)),
)

_DENSE = EMBEDDINGS + ATTENTION + DENSE_MLP
_QWEN_MOE = per_expert_moe("mlp", "gate_proj", "up_proj", "down_proj")

#: family -> expert style -> rules. Dense families have only the per-expert style (no experts).
FAMILY_RULES: dict[str, dict[str, tuple[Rule, ...]]] = {
    "llama": {PER_EXPERT: _DENSE},
    "qwen2": {PER_EXPERT: _DENSE},
    "qwen3": {PER_EXPERT: _DENSE},
    "qwen2_moe": {
        PER_EXPERT: EMBEDDINGS + ATTENTION + _QWEN_MOE + SHARED_EXPERT,
        FUSED: EMBEDDINGS + ATTENTION + FUSED_MOE + SHARED_EXPERT,
    },
    "qwen3_moe": {
        PER_EXPERT: EMBEDDINGS + ATTENTION + _QWEN_MOE,
        FUSED: EMBEDDINGS + ATTENTION + FUSED_MOE,
    },
    "mixtral": {
        PER_EXPERT: EMBEDDINGS + ATTENTION + per_expert_moe("block_sparse_moe", "w1", "w3", "w2"),
        FUSED: EMBEDDINGS + ATTENTION + FUSED_MOE,
    },
}

SUPPORTED_FAMILIES = tuple(sorted(FAMILY_RULES))

#: The reward model's scalar head (models.value_head: weight [1, hidden]) as transformers'
#: ``*ForSequenceClassification`` with one label names it; HF's score layer has no bias
#: (bridge.sequence_classification says why the stored one may be dropped).
SCORE_HEAD = Rule("output_layer.weight", ("score.weight",), Copy("one"), ("hidden",))


def rules_for(family: str, style: str = PER_EXPERT) -> tuple[Rule, ...]:
    """The table of ``family`` in expert ``style``; unsupported names list the supported ones."""
    if family not in FAMILY_RULES:
        raise BridgeError(f"model family {family!r} is not supported; supported: {list(SUPPORTED_FAMILIES)}")
    styles = FAMILY_RULES[family]
    if style not in EXPERT_STYLES:
        raise BridgeError(f"expert style {style!r} is unknown; allowed: {list(EXPERT_STYLES)}")
    if style not in styles:  # a dense model has no experts: both styles are the same names
        return styles[PER_EXPERT]
    return styles[style]


def with_score_head(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """A family's causal-LM table with the LM head replaced by :data:`SCORE_HEAD`: the
    backbone keeps its names (``model.``), the head becomes ``score.weight``."""
    return tuple(r for r in rules if r.megatron != SCORE_HEAD.megatron) + (SCORE_HEAD,)


def canonical(name: str) -> str:
    """A Megatron name as the tables spell it (layer-norm aliases resolved)."""
    for alias, target in MEGATRON_ALIASES.items():
        if name.endswith("." + alias):
            return name[: -len(alias)] + target
    return name


def detect_style(hf_names) -> str:
    """FUSED when the checkpoint stacks experts (``...mlp.experts.gate_up_proj``)."""
    return FUSED if any(n.endswith(".mlp.experts.gate_up_proj") for n in hf_names) else PER_EXPERT
