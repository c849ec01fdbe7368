"""Actor and critic, dense and MoE, forward+backward through get_forward_backward_func in
many layouts (world 4 and 8): loss and full gradients equal the single-rank model's."""

from pathlib import Path

import pytest

from megatron_rl.testing.torchrun import launch

BODY = Path(__file__).with_name("body_model_layouts.py")
TOL = 1e-5

pytestmark = pytest.mark.distributed

WORLD4 = [
    f"{kind}-{role}-{layout}"
    for layout in ("tp2", "pp2", "pp2_vpp2", "ep2", "ep4", "tp2_ep2_etp1", "tp2_ep2_etp2")
    for kind in ("dense", "moe")
    for role in ("actor", "critic")
    if not (kind == "dense" and "ep" in layout)
]
WORLD8 = [
    f"{kind}-{role}-{layout}"
    for layout in ("tp2_pp2_ep2", "tp2_pp2_ep4", "tp2_pp2")
    for kind in ("dense", "moe")
    for role in ("actor", "critic")
    if not (kind == "dense" and "ep" in layout)
]


@pytest.fixture(scope="module")
def world4():
    return launch(BODY, 4, args=["4"])


@pytest.fixture(scope="module")
def world8():
    return launch(BODY, 8, args=["8"])


def _check(results, case):
    outcome = results[case]
    assert outcome["ok"], outcome["error"]
    r = outcome["result"]
    assert r["weight_diff"] == 0.0, "reference weights did not load exactly"
    assert abs(r["loss"] - r["ref_loss"]) < TOL, (r["loss"], r["ref_loss"])
    assert r["max_grad_diff"] < TOL, f"{r['worst_key']}: {r['max_grad_diff']}"
    assert r["min_grad_scale"] > 0, "some parameter got no gradient"


@pytest.mark.parametrize("case", WORLD4)
def test_layout_world4(world4, case):
    _check(world4, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", WORLD8)
def test_layout_world8(world8, case):
    _check(world8, case)
