"""The colocated vLLM engine under torchrun (external_launcher): sampled logprobs equal
transformers', windowed continuation reproduces one-shot greedy decoding, and weights
reloaded in place (layer-aligned buckets) serve the new model exactly; per-prompt seeds
give the same samples on every replica and in any batch.

One engine per process (vLLM's parallel groups are global), so one launch per engine
setup: MoE with vLLM TP1 (two independent replicas) and dense with vLLM TP2.
"""

from pathlib import Path

import pytest

from megatron_rl_lab.testing.torchrun import launch

BODY = Path(__file__).with_name("body_rollout_engine.py")
CASES = ("sampled_logprobs", "windows", "reload", "seeded")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module", params=[("moe", 1), ("dense", 2)], ids=["moe-vllm_tp1", "dense-vllm_tp2"])
def results(request, tmp_path_factory):
    kind, tp = request.param
    work = tmp_path_factory.mktemp(f"engine-{kind}-tp{tp}")
    return launch(BODY, 2, args=[str(work), str(tp), kind], timeout_s=900)


@pytest.mark.parametrize("case", CASES)
def test_engine(results, case):
    outcome = results[case]
    assert outcome["ok"], outcome["error"]
