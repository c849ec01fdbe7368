"""The reward model's Bradley-Terry loss through Megatron's schedules (the shared world-4
launch, body_reward_model.py): in DP4 (TP1), TP2, PP2 and CP2, padded and packed, the loss,
the pair accuracy and every gradient equal plain single-process autograd on the whole
batch; under TP2 with the distributed optimizer a few steps lower the loss."""

import pytest

TOL = 1e-6  # fp32

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(shared_launch4):
    return shared_launch4.results("body_reward_model")


def _result(results, case):
    outcome = results[case]
    assert outcome["ok"], outcome["error"]
    return outcome["result"]


@pytest.mark.parametrize("case", ["dp4", "tp2", "packed-tp2", "packed-pp2", "cp2"])
def test_the_pair_loss_and_its_gradient_equal_the_single_process_reference(results, case):
    r = _result(results, case)
    # the head's bias adds to both rewards of a pair and cancels in their difference
    assert r["params_without_grad"] == ["output_layer.bias"], "some parameter got no gradient"
    assert r["max_grad"] > 1e-3, "reference gradients too small to compare meaningfully"
    assert r["max_grad_diff"] < TOL, f"{r['worst_key']}: {r['max_grad_diff']}"
    assert r["loss_diff"] < TOL and r["accuracy_diff"] < TOL, r


def test_a_few_steps_lower_the_loss_from_the_references(results):
    r = _result(results, "train-packed-tp2")
    losses = r["losses"]
    assert abs(losses[0] - r["reference_loss"]) < TOL  # the first step's loss is the reference's, before any update
    assert losses[-1] < 0.5 * losses[0], losses
    assert r["accuracies"][-1] == 1.0, r["accuracies"]
