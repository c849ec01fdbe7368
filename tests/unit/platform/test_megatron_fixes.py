"""Each fix of a Megatron-Core 0.16.1 defect is needed: the release fails without it."""

import pytest
import torch

from megatron_rl.platform import megatron_fixes


@pytest.fixture
def shipped():
    """Megatron-Core as shipped during the test; the fixes back on after it."""
    megatron_fixes.uninstall()
    yield
    megatron_fixes.install()


def test_every_fix_states_its_target_reason_and_version():
    import megatron.core

    assert megatron.core.__version__ == megatron_fixes.MEGATRON_CORE_VERSION == "0.16.1"
    for patch in megatron_fixes.PATCHES:
        assert patch.module.startswith("megatron.core") and patch.covers and patch.why, patch.name


def _router_gemm() -> torch.Tensor:
    from megatron.core.transformer.moe.moe_utils import RouterGatingLinearFunction

    inp, weight = torch.randn(3, 8), torch.randn(4, 8)
    return RouterGatingLinearFunction.apply(inp, weight, None, torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, Transformer Engine may define the name")
def test_te_general_gemm_is_needed_without_transformer_engine(shipped):
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        pytest.skip("Transformer Engine is installed: the release defines the name")
    with pytest.raises(NameError, match="te_general_gemm"):
        _router_gemm()
    megatron_fixes.TE_GENERAL_GEMM.apply()
    assert _router_gemm().shape == (3, 4)
