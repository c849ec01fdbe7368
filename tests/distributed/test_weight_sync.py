"""Weight sync Megatron -> colocated vLLM (world 4): after perturbing the weights in each
training layout, vLLM's fp32 logprobs equal Megatron's within 1e-4, and a sync that skips
one tensor is caught by the parity guard.

Launches: MoE with four vLLM TP1 replicas (layouts TP2, PP2, EP2, TP2*EP2*ETP1) and dense
with two vLLM TP2 replicas (TP2, PP2, TP2*PP2).
"""

from pathlib import Path

import pytest

from megatron_rl.testing.torchrun import launch

BODY = Path(__file__).with_name("body_weight_sync.py")
SETUPS = {
    "moe-vllm_tp1": ("moe", 1, ("tp2", "pp2", "ep2", "tp2_ep2_etp1")),
    "dense-vllm_tp2": ("dense", 2, ("tp2", "pp2", "tp2_pp2")),
}

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request, tmp_path_factory):
    kind, tp, layouts = SETUPS[request.param]
    work = tmp_path_factory.mktemp(request.param)
    return layouts, launch(BODY, 4, args=[str(work), str(tp), kind], timeout_s=1200)


def test_sync_gives_megatron_logprobs(setup):
    layouts, results = setup
    for layout in layouts:
        outcome = results[layout]
        assert outcome["ok"], f"{layout}: {outcome['error']}"
        r = outcome["result"]
        assert r["max_abs_diff"] < 1e-4, (layout, r)
        assert r["buckets"] > 1, "the test should exercise several buckets"


def test_parity_guard_catches_a_skipped_tensor(setup):
    _, results = setup
    outcome = results["skipped_tensor_caught"]
    assert outcome["ok"], outcome["error"]
    assert "a weight is missing or wrongly mapped" in outcome["result"]["guard"]


def test_shared_arena_and_broadcasts_gather_the_same_buckets(setup):
    _, results = setup
    outcome = results["transports_agree"]
    assert outcome["ok"], outcome["error"]
    r = outcome["result"]
    assert r["same_host"] and r["shared_arena"] and r["buckets"] > 1, r
