"""models.fused_elementwise against the layers as shipped (single process, CPU, inductor's
C++ kernels): the same model built with ``fusion="none"`` and ``"compiled"``, same weights,
logits and every parameter's gradient; and the compiled RoPE of packed rows against
Megatron's unfused THD RoPE.

Both builds compute the same formulas; inductor fuses them and may reorder a reduction, so in
fp32 they agree to rounding. Measured here: logits within 4e-7 and gradients within 1.4e-6 of
their largest entry; the limit is 1e-5 of the scale. A missing RMSNorm weight, a RoPE on the
wrong half or an unscaled expert output moves the logits by more than their own size.
"""

import copy

import pytest
import torch

from megatron_rl.models.fused_elementwise import CompiledRMSNorm
from megatron_rl.parallel import ParallelConfig
from megatron_rl_lab.testing.model_grads import assert_builds_agree

RELATIVE_LIMIT = 1e-5


def build(arch, fusion: str, experts: str = "auto"):
    from megatron_rl.models.builder import BuildOptions, build_model

    torch.manual_seed(7)
    (model,) = build_model("actor", arch, ParallelConfig(), BuildOptions(fusion=fusion, experts=experts))
    return model


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str):
    scale = want.abs().max().item()
    error = (got - want).abs().max().item()
    assert error <= RELATIVE_LIMIT * scale, f"{what}: differs by {error:.3g} of a scale {scale:.3g}"


@pytest.mark.parametrize("arch_name, experts", [("dense", "auto"), ("moe", "grouped")])
def test_compiled_elementwise_equals_the_layers_as_shipped(world_of_one, arch_name, experts):
    from megatron_rl_lab.testing.tiny import TINY_DENSE, TINY_QWEN3_MOE

    arch = TINY_DENSE if arch_name == "dense" else TINY_QWEN3_MOE
    shipped = build(arch, "none", experts)
    fused = build(arch, "compiled", experts)
    fused.load_state_dict(copy.deepcopy(shipped.state_dict()))
    assert fused.config.apply_rope_fusion and fused.config.bias_activation_fusion
    assert not shipped.config.apply_rope_fusion and not shipped.config.bias_activation_fusion
    norms = [m for m in fused.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert norms and all(isinstance(m, CompiledRMSNorm) for m in norms)
    assert not any(isinstance(m, CompiledRMSNorm) for m in shipped.modules())
    tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    assert_builds_agree(fused, shipped, tokens, compare=assert_close, loss="square")


def test_compiled_rope_of_packed_rows_equals_megatrons_thd_rope(world_of_one):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models.fused_elementwise import transformer_config_fields

    fields = transformer_config_fields("compiled")
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, **fields)
    cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    seeded = torch.Generator().manual_seed(5)
    t = torch.randn(20, 4, 16, generator=seeded, requires_grad=True)
    freqs = torch.randn(16, 1, 1, 16, generator=seeded)
    fused = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens)
    config.apply_rope_fusion = False
    want = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens)
    assert_close(fused, want, "packed RoPE")
    (want_grad,) = torch.autograd.grad(want.square().sum(), t)
    (got_grad,) = torch.autograd.grad(fused.square().sum(), t)
    assert_close(got_grad, want_grad, "packed RoPE gradient")


def test_an_unknown_fusion_is_refused():
    from megatron_rl.models.builder import BuildOptions

    with pytest.raises(ValueError, match="BuildOptions.fusion 'te' is not one of none, compiled"):
        BuildOptions(fusion="te")
