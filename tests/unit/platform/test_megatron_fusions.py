"""The RoPE fusion slots of Megatron-Core 0.16.1 (platform.megatron_fusions): empty without
Transformer Engine, so the config refuses the fusion flag as shipped; filled, the flag is
accepted, and reverting restores the release's state. What the filled slots compute is
tested against Megatron's unfused RoPE in tests/unit/models/test_fused_elementwise.py."""

import pytest

from megatron_rl.platform import megatron_fusions


def _config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, **fields)


def test_every_entry_states_its_target_reason_and_version():
    import megatron.core

    assert megatron.core.__version__ == megatron_fusions.MEGATRON_CORE_VERSION == "0.16.1"
    for patch in [*megatron_fusions.PATCHES, megatron_fusions.COMPILED_BSHD_INSIDE_THD]:
        assert patch.module.startswith("megatron.core") and patch.covers and patch.why, patch.name


def test_the_slots_are_empty_without_transformer_engine_and_filled_by_install():
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.models.layer_spec import has_transformer_engine

    if has_transformer_engine():
        pytest.skip("Transformer Engine is installed: its kernels fill the slots")
    megatron_fusions.uninstall()
    try:
        assert rope_utils.fused_apply_rotary_pos_emb is None and rope_utils.fused_apply_rotary_pos_emb_thd is None
        with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
            _config(apply_rope_fusion=True)
        megatron_fusions.install()
        assert _config(apply_rope_fusion=True).apply_rope_fusion
        assert rope_utils.fused_apply_rotary_pos_emb is megatron_fusions._rope_bshd
        assert rope_utils.fused_apply_rotary_pos_emb_thd is megatron_fusions._rope_thd
    finally:
        megatron_fusions.install()
