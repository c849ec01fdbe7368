"""models.sdpa_attention against Megatron's own DotProductAttention, the independent reference
(single process, CPU): padded causal rows with grouped-query heads, packed THD rows against each
sequence run on its own, forward outputs and the gradients of q, k and v, in fp32 and bf16.

Tolerances. fp32: 1e-5 absolute and relative. Both sides compute the same sums in another order
(a fused kernel against baddbmm, softmax and bmm); with values of order 1 (outputs and gradients
up to about 8), a 16-wide head and at most 24 keys, that moves results by a few fp32 ulps (1.2e-7
relative each): measured at most 2e-6, a tenth of the tolerance. A wrong mask, scale or grouped-
query head order moves the output by about 3 (measured), so nothing real hides under 1e-5.
bf16 (8 significant bits: neighbouring values 2^-7 = 7.8e-3 apart, relative): Megatron rounds the
scores (up to about 5 here), the probabilities and the output to bf16 each, and the gradients go
through as many roundings again; SDPA rounds only what it returns. 3e-2 relative is about four
bf16 spacings, 3e-2 absolute covers elements near 0 whose rounded sums cancel; the measured
differences reach at most half of that, and a real error (about 3) stays 100 times above it.
"""

import pytest
import torch

from megatron_rl import platform
from megatron_rl.models import layer_spec
from megatron_rl.models.sdpa_attention import SdpaAttention
from megatron_rl.parallel import ParallelConfig

FP32_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
BF16_TOLERANCE = dict(atol=3e-2, rtol=3e-2)
HEADS, GROUPS, HEAD_DIM = 8, 2, 16


def attention_config(dtype=torch.float32, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    with platform.megatron_scope():
        return TransformerConfig(**{**fields, **platform.transformer_config_overrides(), **overrides})


def both_attentions(config):
    """(SdpaAttention, DotProductAttention) built as Megatron's SelfAttention builds its core attention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    kwargs = dict(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type=None,
        softmax_scale=config.softmax_scale,
        pg_collection=None,
    )
    with platform.megatron_scope():
        return SdpaAttention(**kwargs), DotProductAttention(**kwargs)


def random_qkv(leading: tuple, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(*leading, HEADS, HEAD_DIM), (*leading, GROUPS, HEAD_DIM), (*leading, GROUPS, HEAD_DIM)]
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_() for shape in shapes]


def output_and_grads(attention_fn, qkv, seed: int):
    """The output and the gradients of q, k, v under a random linear loss."""
    qkv = [x.detach().clone().requires_grad_() for x in qkv]
    with platform.megatron_scope():
        out = attention_fn(*qkv)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
        (out.float() * weights.float()).sum().backward()
    return [out.detach()] + [x.grad for x in qkv]


def assert_all_close(actual, expected, tolerance):
    for name, a, e in zip(("output", "dq", "dk", "dv"), actual, expected):
        assert a.shape == e.shape, name
        torch.testing.assert_close(a.float(), e.float(), **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def packed_params(lengths):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )


def per_sequence(attention, lengths):
    """Megatron's attention run on each sequence of a packed row as a batch of one, outputs concatenated."""

    def run(q, k, v):
        bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
        rows = [
            attention(q[a:b, None], k[a:b, None], v[a:b, None], None)[:, 0] for a, b in zip(bounds, bounds[1:]) if b > a
        ]
        return torch.cat(rows)

    return run


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, FP32_TOLERANCE), (torch.bfloat16, BF16_TOLERANCE)])
def test_padded_causal_gqa_matches_megatron(world_of_one, dtype, tolerance):
    sdpa, megatron = both_attentions(attention_config(dtype))
    qkv = random_qkv((24, 3), dtype, seed=0)  # [s, b, heads or groups, dim]
    actual = output_and_grads(lambda q, k, v: sdpa(q, k, v, None), qkv, seed=1)
    expected = output_and_grads(lambda q, k, v: megatron(q, k, v, None), qkv, seed=1)
    assert actual[0].shape == (24, 3, HEADS * HEAD_DIM)
    assert_all_close(actual, expected, tolerance)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, FP32_TOLERANCE), (torch.bfloat16, BF16_TOLERANCE)])
def test_packed_rows_match_megatron_per_sequence(world_of_one, dtype, tolerance):
    lengths = [5, 1, 0, 11, 7]  # a sequence of one token, and an empty one as cu_seqlens padding leaves
    sdpa, megatron = both_attentions(attention_config(dtype))
    qkv = random_qkv((sum(lengths),), dtype, seed=2)  # [t, heads or groups, dim]
    params = packed_params(lengths)
    actual = output_and_grads(lambda q, k, v: sdpa(q, k, v, None, packed_seq_params=params), qkv, seed=3)
    expected = output_and_grads(per_sequence(megatron, lengths), qkv, seed=3)
    assert actual[0].shape == (sum(lengths), HEADS * HEAD_DIM)
    assert_all_close(actual, expected, tolerance)


def test_softmax_scale_and_query_key_layer_scaling_match_megatron(world_of_one):
    """An explicit softmax_scale, and apply_query_key_layer_scaling (Megatron divides the scale by
    the layer number, then multiplies the scores back in its fp32 softmax)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = attention_config(softmax_scale=0.7, apply_query_key_layer_scaling=True)
    kwargs = dict(
        config=config,
        layer_number=3,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        softmax_scale=config.softmax_scale,
    )
    with platform.megatron_scope():
        sdpa, megatron = SdpaAttention(**kwargs), DotProductAttention(**kwargs)
    qkv = random_qkv((9, 2), torch.float32, seed=4)
    actual = output_and_grads(lambda q, k, v: sdpa(q, k, v, None), qkv, seed=5)
    expected = output_and_grads(lambda q, k, v: megatron(q, k, v, None), qkv, seed=5)
    assert_all_close(actual, expected, FP32_TOLERANCE)


def test_attention_dropout_in_training_only(world_of_one):
    sdpa, megatron = both_attentions(attention_config(attention_dropout=0.5))
    q, k, v = (x.detach() for x in random_qkv((12, 2), torch.float32, seed=6))
    with platform.megatron_scope():
        sdpa.eval(), megatron.eval()
        torch.testing.assert_close(sdpa(q, k, v, None), megatron(q, k, v, None), **FP32_TOLERANCE)
        sdpa.train()
        assert not torch.allclose(sdpa(q, k, v, None), megatron(q, k, v, None))


def test_unsupported_inputs_are_refused(world_of_one):
    from megatron.core.transformer.enums import AttnMaskType

    sdpa, _ = both_attentions(attention_config())
    q, k, v = (x.detach() for x in random_qkv((4, 1), torch.float32, seed=7))
    with pytest.raises(ValueError, match="attention_bias"):
        sdpa(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="attention_mask=None"):
        sdpa(q, k, v, torch.zeros(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal"):
        sdpa(q, k, v, None, attn_mask_type=AttnMaskType.padding)
    with pytest.raises(ValueError, match="cu_seqlens_q must rise"):
        sdpa(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=packed_params([2, 1]))
    with pytest.raises(ValueError, match="without a CP process group of that size"):
        SdpaAttention(attention_config(context_parallel_size=2), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="mask type"):
        SdpaAttention(attention_config(), 1, AttnMaskType.no_mask, "self")


def test_local_layer_spec_uses_sdpa_attention(world_of_one, monkeypatch):
    from megatron_rl.models.builder import BuildOptions, build_model, transformer_config
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    monkeypatch.setattr(layer_spec, "has_transformer_engine", lambda: False)
    config = transformer_config(TINY_DENSE, ParallelConfig(), BuildOptions())
    spec = layer_spec.block_spec(config, TINY_DENSE, vp_stage=None, options=BuildOptions())
    assert all(layer.submodules.self_attention.submodules.core_attention is SdpaAttention for layer in spec.layer_specs)
    (model,) = build_model("actor", TINY_DENSE, ParallelConfig())
    built = [m for m in model.modules() if isinstance(m, SdpaAttention)]
    assert len(built) == TINY_DENSE.num_layers


def test_unfused_attention_stays_selectable_as_the_reference(world_of_one, monkeypatch):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_rl.models.builder import BuildOptions, build_model
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    monkeypatch.setattr(layer_spec, "has_transformer_engine", lambda: False)
    (model,) = build_model("actor", TINY_DENSE, ParallelConfig(), BuildOptions(attention="unfused"))
    kinds = {type(m) for m in model.modules() if isinstance(m, (DotProductAttention, SdpaAttention))}
    assert kinds == {DotProductAttention}
    assert layer_spec.describe_attention("unfused") == "megatron local, unfused attention"
    assert layer_spec.describe_attention("auto") == "megatron local, SDPA attention"
    with pytest.raises(ValueError, match="BuildOptions.attention 'flash' is not one of auto, sdpa, unfused"):
        BuildOptions(attention="flash")


def test_the_unfused_reference_refuses_context_parallelism():
    """Megatron's DotProductAttention has no CP; the spec says so before any layer is built."""
    import dataclasses

    from megatron_rl.models.builder import BuildOptions, transformer_config
    from megatron_rl_lab.testing.tiny import TINY_DENSE

    config = dataclasses.replace(
        transformer_config(TINY_DENSE, ParallelConfig(), BuildOptions()), context_parallel_size=2
    )
    with pytest.raises(ValueError, match="attention 'unfused' .* has no context parallelism .*; use auto or sdpa"):
        layer_spec.block_spec(config, TINY_DENSE, vp_stage=None, options=BuildOptions(attention="unfused"))
