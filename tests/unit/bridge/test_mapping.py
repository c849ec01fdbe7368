"""The family tables: row layouts against hand-written orders, HF names against what
transformers itself writes and holds."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron_rl.bridge import FUSED, PER_EXPERT, BridgeError, detect_style, rules_for, tensor_map
from megatron_rl.bridge.mapping import Concat, Copy, GroupedQKV, PadRows, Rule, expand
from megatron_rl.bridge.parity import TINY_FAMILIES, tiny_hf_config
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl_lab.testing.tiny import TINY_DENSE


def assemble(pieces, hf: dict, rows: int) -> list:
    """Megatron rows as labels, built from HF row labels through the pieces."""
    out = [None] * rows
    for p in pieces:
        for i in range(p.rows[1] - p.rows[0]):
            source = hf[p.hf]
            for lead in p.hf_lead:
                source = source[lead]
            out[p.rows[0] + i] = source[p.hf_rows[0] + i]
    return out


def test_qkv_rows_are_grouped_per_query_group():
    # 4 query heads in 2 groups, head_dim 1: Megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1]
    dims = dict(head_dim=1, heads=4, groups=2, q_rows=4, kv_rows=2)
    rows, pieces = GroupedQKV().pieces("qkv", ("q", "k", "v"), dims)
    hf = {"q": ["q0", "q1", "q2", "q3"], "k": ["k0", "k1"], "v": ["v0", "v1"]}
    assert assemble(pieces, hf, rows) == ["q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1"]


def test_qkv_with_head_dim_keeps_head_rows_together():
    dims = dict(head_dim=2, heads=2, groups=1, q_rows=4, kv_rows=2)
    rows, pieces = GroupedQKV().pieces("qkv", ("q", "k", "v"), dims)
    hf = {"q": ["a0", "a1", "b0", "b1"], "k": ["k0", "k1"], "v": ["v0", "v1"]}
    assert assemble(pieces, hf, rows) == ["a0", "a1", "b0", "b1", "k0", "k1", "v0", "v1"]


def test_gated_fc1_is_gate_then_up():
    rows, pieces = Concat("ffn").pieces("fc1", ("gate", "up"), dict(ffn=2))
    assert assemble(pieces, {"gate": ["g0", "g1"], "up": ["u0", "u1"]}, rows) == ["g0", "g1", "u0", "u1"]


def test_vocab_padding_rows_have_no_source():
    rows, pieces = PadRows().pieces("emb", ("e",), dict(vocab=3, padded_vocab=4))
    assert rows == 4
    assert assemble(pieces, {"e": ["r0", "r1", "r2"]}, rows) == ["r0", "r1", "r2", None]


def test_stacked_experts_index_the_leading_axis():
    rule = Rule("layers.{layer}.experts.{expert}.fc1", ("layers.{layer}.gate_up",), Copy("moe_fc1"), ("hidden",))
    arch = arch_from_hf(tiny_hf_config("qwen3_moe", num_hidden_layers=1))
    tmap = expand([rule], arch, padded_vocab=arch.vocab_size)
    assert tmap.hf_shapes == {"layers.0.gate_up": (4, 64, 64)}
    assert [p.hf_lead for p in tmap.pieces_of_hf["layers.0.gate_up"]] == [(0,), (1,), (2,), (3,)]
    assert tmap.megatron_shapes["layers.0.experts.3.fc1"] == (64, 64)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
@pytest.mark.parametrize("tied", [False, True])
def test_hf_names_and_shapes_match_save_pretrained(tmp_path, family, tied):
    """The table's HF side == the names and shapes transformers.save_pretrained writes."""
    import transformers
    from safetensors import safe_open

    cfg = tiny_hf_config(family, tie_word_embeddings=tied)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    written = {}
    for file in tmp_path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            written.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    arch = arch_from_hf(tmp_path)
    assert detect_style(written) == PER_EXPERT
    assert tensor_map(arch, PER_EXPERT, arch.vocab_size).hf_shapes == written


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_fused_names_and_shapes_match_the_transformers_model(family):
    """The fused style == the parameter names transformers 5 holds in memory."""
    import transformers

    cfg = tiny_hf_config(family)
    state = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    held = {k: tuple(v.shape) for k, v in state.items()}
    assert detect_style(held) == FUSED
    arch = arch_from_hf(cfg)
    assert tensor_map(arch, FUSED, arch.vocab_size).hf_shapes == held


def test_megatron_shapes_pad_the_vocabulary():
    tmap = tensor_map(TINY_DENSE, PER_EXPERT, padded_vocab=TINY_DENSE.vocab_size + 2)
    assert tmap.megatron_shapes["embedding.word_embeddings.weight"] == (98, 64)
    assert tmap.hf_shapes["model.embed_tokens.weight"] == (96, 64)
    qkv = tmap.megatron_shapes["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv == ((4 + 2 * 2) * 32, 64)


def test_unsupported_family_lists_the_supported_ones():
    with pytest.raises(BridgeError, match=r"'gpt2' is not supported; supported: \['llama', 'mixtral'"):
        rules_for("gpt2")


def test_unknown_expert_style_is_rejected():
    with pytest.raises(BridgeError, match="expert style 'stacked' is unknown"):
        rules_for("mixtral", "stacked")
