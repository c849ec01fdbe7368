"""CPU patches reached only with several ranks: the layout fails without each one."""

from pathlib import Path

import pytest
import torch

from megatron_rl_lab.testing.torchrun import launch

BODY = Path(__file__).with_name("body_model_layouts.py")

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU layer only"),
]


@pytest.mark.parametrize(
    "patch, case, error",
    [
        ("a2a_host_splits", "moe-actor-ep2", "all_to_all"),
        ("uneven_all_gather", "moe-actor-tp2_ep2_etp2", "invalid tensor size"),
    ],
)
def test_patch_is_needed(monkeypatch, patch, case, error):
    monkeypatch.setenv("MEGATRON_RL_CPU_PATCHES_EXCLUDE", patch)
    results = launch(BODY, 4, args=["4"], cases=[case], timeout_s=300)
    assert not results[case]["ok"]
    assert error in results[case]["error"], results[case]["error"][-1500:]
