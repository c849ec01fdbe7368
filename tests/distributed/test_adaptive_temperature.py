"""HAPO's adaptive sampling temperature inside the colocated vLLM engine (external_launcher):
every sampled token's logprob is transformers' log_softmax(logits / T_t) with T_t computed
by hand from transformers' entropy at T; plain requests in the same batch are untouched;
Megatron (trainer.hapo) recomputes the same T_t. One world-1 launch.
"""

from pathlib import Path

import pytest

from megatron_rl_lab.testing.torchrun import launch

BODY = Path(__file__).with_name("body_adaptive_temperature.py")
CASES = ("adaptive_tau_0.5", "adaptive_tau_0.05", "mixed_batch", "megatron_temperatures")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(BODY, 1, args=[str(tmp_path_factory.mktemp("adaptive-temperature"))], timeout_s=900)


@pytest.mark.parametrize("case", CASES)
def test_adaptive_temperature(results, case):
    assert "__launch__" not in results or results["__launch__"]["ok"], results["__launch__"]["error"]
    outcome = results[case]
    assert outcome["ok"], outcome["error"]
