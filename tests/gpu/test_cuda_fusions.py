"""The compiled elementwise kernels (models.fused_elementwise) and the local MoE dispatcher
(models.local_dispatch) on a GPU (world 1), against the layers and dispatcher as Megatron
ships them on the same device: inductor's Triton kernels there, its C++ kernels in the CPU
unit tests (tests/unit/models/test_fused_elementwise.py, test_local_dispatch.py)."""

from pathlib import Path

import pytest

from tests.gpu.conftest import case_result, expected_device, launch_on

BODY = Path(__file__).with_name("body_cuda_fusions.py")
TIMEOUT_S = 240
RELATIVE_LIMIT = 1e-5
"""fp32, TF32 off: both builds compute the same formulas and differ by the reduction order
inductor picks; the CPU unit test measured 4e-7 (logits) and 1.4e-6 (gradients) of the scale."""

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def on_cuda(tmp_path_factory) -> dict:
    return launch_on(BODY, "cuda", tmp_path_factory.mktemp("cuda-fusions"), TIMEOUT_S)


@pytest.mark.parametrize("case", ["dense", "moe"])
def test_fast_layers_equal_the_shipped_layers_on_the_device(on_cuda, case, record_testsuite_property):
    r = case_result(on_cuda, case)
    record_testsuite_property(f"fusion_logit_diff[{case}]", r["logit_diff"])
    record_testsuite_property(f"fusion_grad_diff[{case}]", r["grad_diff"])
    assert r["device"] == expected_device("cuda")
    assert r["same_grad_names"]
    assert r["logit_diff"] <= RELATIVE_LIMIT, r
    assert r["grad_diff"] <= RELATIVE_LIMIT, r
