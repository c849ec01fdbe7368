"""A checkpoint saved on CUDA (world 1) with the deferred device-to-host snapshot: the
optimizer update started right after ``save()`` returned waits for the copy into pinned host
buffers, and the files hold the state at save time, bit for bit, whether loaded back on CUDA
in the same layout or by a CPU launch at world 2 (TP2, PP2, EP2, DP2; gloo). EP2 loads a checkpoint
saved at EP1, which has no expert param group of its own."""

from pathlib import Path

import pytest

from megatron_rl_lab.testing.torchrun import launch
from tests.gpu.conftest import CPU_ENV, case_result, expected_device, launch_on

BODY = Path(__file__).with_name("body_cuda_checkpoint.py")
TIMEOUT_S = 300  # each launch took 20-35 s on an H200; a hang must not eat its time
WORLD2_LAYOUTS = ("tp2", "pp2", "ep2", "dp2")

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cuda-checkpoint")


@pytest.fixture(scope="module")
def on_cuda(out_dir) -> dict:
    """Save on CUDA, then load back there (one launch)."""
    return launch_on(BODY, "cuda", out_dir, TIMEOUT_S)


@pytest.fixture(scope="module")
def world2_cpu(on_cuda, out_dir) -> dict:
    """Two CPU ranks load what the CUDA launch saved."""
    return launch(BODY, 2, args=[str(out_dir / "cuda")], timeout_s=TIMEOUT_S, env=CPU_ENV)


def test_update_waits_for_the_deferred_device_to_host_copy(on_cuda, record_testsuite_property):
    r = case_result(on_cuda, "save")
    record_testsuite_property("save_returned_s", r["save_returned_s"])  # measurements travel in the kit's junit XML
    record_testsuite_property("update_waited_s", r["update_waited_s"])
    device = expected_device("cuda")
    assert r["device"] == device and r["param_devices"] == [device]
    # The writer was held until the update was asked for (plus 0.2 s), so the copy could only
    # start then, and the update waited for it.
    assert r["update_waited_s"] > 0.15, r
    assert r["host_buffers_pinned"] == [device == "cuda"], "CUDA tensors are copied into pinned host memory"
    assert r["num_changed_by_update"] == r["num_params"], "the update after save() must change every tensor"


def _check_bitwise(r: dict) -> None:
    assert r["param_mismatch"] == [], "parameters differ from the state at save time"
    assert r["optim_mismatch"] == [], "optimizer state (fp32 main params, exp_avg, exp_avg_sq) differs"
    assert r["num_optim"] == 3 * r["num_params"] > 0
    assert r["optim_steps"] == [2.0], r["optim_steps"]
    assert r["extra"] == {"data_position": 2}


def test_load_back_on_cuda_is_bitwise_the_saved_state(on_cuda):
    r = case_result(on_cuda, "load-same-layout")
    assert r["device"] == expected_device("cuda")
    _check_bitwise(r)
    assert r["rng_restored"] and all(r["rng_restored"].values()), r["rng_restored"]
    assert ("torch_cuda" in r["rng_restored"]) == (expected_device("cuda") == "cuda")


@pytest.mark.parametrize("layout", WORLD2_LAYOUTS)
def test_resharded_load_on_cpu_is_bitwise_the_saved_state(world2_cpu, layout):
    r = case_result(world2_cpu, f"load-{layout}")
    assert r["device"] == "cpu"
    _check_bitwise(r)
