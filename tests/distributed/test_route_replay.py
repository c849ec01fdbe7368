"""MoE router replay (R3) on gloo, world 4: the routers use the given experts in every
layout (TP with sequence parallelism, EP, ETP, PP*VPP, CP), forward-only and in a
forward-backward with full activation recompute, matching the single-rank model."""

import pytest

LAYOUTS = ["tp2_sp_ep2", "tp2_ep2_etp1", "ep4", "pp2_vpp2_ep2", "cp2_ep2"]
LOGP_TOL, LOSS_TOL, GRAD_TOL = 1e-5, 1e-5, 1e-5
"""fp32 reductions in another order (the layout test's tolerances)."""

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def world4(shared_launch4):
    return shared_launch4.results("body_route_replay")


def _result(results, case):
    outcome = results[case]
    assert outcome["ok"], f"{case}: {outcome['error']}"
    return outcome["result"]


def test_replay_uses_the_given_experts(world4):
    r = _result(world4, "reference")
    assert r["own_replay_diff"] == 0.0  # its own routes fed back: bitwise the same logprobs
    agreement = r["agreement_own"]
    assert agreement["agreed"] == agreement["compared"] == agreement["routed"] > 0, agreement
    assert r["used_equals_given"] and r["fallback_equals_own"], r
    assert r["random_moves"] > 100 * LOGP_TOL, r  # random experts move the outputs far beyond the tolerance
    assert r["pending_after_backward"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_in_every_layout_matches_the_single_rank_model(world4, layout):
    r = _result(world4, layout)
    assert r["plain_diff"] < LOGP_TOL and r["replayed_diff"] < LOGP_TOL, r
    assert r["loss_diff"] < LOSS_TOL and r["grad_diff"] < GRAD_TOL, r
    assert r["pending_after_backward"] == 0, r  # every recompute took its queued routes
