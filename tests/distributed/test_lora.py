"""LoRA adapters under tensor parallelism (with and without sequence parallelism), PP2 on
packed rows, PP2 with two virtual stages each, CP2, and on MoE experts under TP2·EP2 and
TP2·EP2·ETP1 (the shared world-4 launch, body_lora.py): every adapter's gradient equals
plain single-process autograd's, and no base parameter gets one."""

import pytest

from megatron_rl_lab.testing.tiny import TINY_ARCHS

TOL = 1e-6  # fp32, the bound for adapter gradients against a single-rank reference

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(shared_launch4):
    return shared_launch4.results("body_lora")


@pytest.mark.parametrize("case", ["tp2-sp", "tp2", "packed-pp2", "pp2-vpp2", "cp2", "moe-tp2_ep2", "moe-tp2_ep2_etp1"])
def test_adapter_gradients_equal_the_single_process_reference(results, case):
    outcome = results[case]
    assert outcome["ok"], outcome["error"]
    r = outcome["result"]
    assert r["base_with_grad"] == [], r
    arch = TINY_ARCHS["moe" if case.startswith("moe") else "dense"]
    # a and b of four linears per dense layer; of QKV, the output and each expert's two per MoE layer
    per_layer = 2 * (2 + 2 * arch.num_moe_experts) if arch.is_moe else 2 * 4
    assert r["adapters"] == per_layer * arch.num_layers, r["adapters"]
    assert r["params_without_grad"] == [], r
    assert r["max_grad"] > 1e-3, "reference gradients too small to compare meaningfully"
    assert r["max_grad_diff"] < TOL, f"{r['worst_key']}: {r['max_grad_diff']}"
    assert r["loss_diff"] < TOL, r
