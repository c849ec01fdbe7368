"""RL losses through Megatron's schedules (the shared world-4 launch): for DAPO (token-mean) and
GRPO (seq-mean-token-mean), and one recipe using every actor-loss piece, the gradient of
one mini-batch split over microbatches and DP4 / PP2 / PP2·VPP2 / TP2 / TP2·EP2 equals
plain single-process autograd on the whole batch; logprobs and entropy (padded vocabulary,
per-token temperature) equal torch.log_softmax on the full logits on every rank; the
critic's values and value-loss gradient likewise; train_step's grad norm is the reference's.
An actor and a critic in two different layouts in one process (the critic's groups built
alongside, switched in around its work) each still match their references. Packed
token-budget micro-batches (several sequences per row, THD) match the same padded
references in every layout above. With every sequence split over context-parallel ranks
(CP2, CP4, CP2·TP2 with sequence parallelism, CP2·EP2 with the experts folded over the CP
ranks, CP2·PP2), padded and packed, actor and critic, the same references hold.
"""

import pytest

GRAD_TOL = 1e-6  # fp32; observed ≤ 1.2e-7 with gradients up to 0.28
LOGPROB_TOL = 1e-6
ENTROPY_TOL = 1e-5  # entropies are ~4.5 nats: 1e-5 is a relative 2e-6
METRIC_TOL = 1e-6

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ACTOR_CASES = [
    *(
        f"{layout}-{recipe}"
        for recipe in ("dapo", "grpo")
        for layout in ("dense-actor-single", "dense-actor-dp4", "dense-actor-pp2", "moe-actor-tp2_ep2")
    ),
    "dense-actor-pp2_vpp2-dapo",
    "dense-actor-tp2-hapo_kl_nll",
    "moe-actor-pp2-hapo_kl_nll",
]
CRITIC_CASES = ["dense-critic-pp2", "dense-critic-tp2"]
# the same references through packed token-budget micro-batches (schedules.packing)
PACKED_ACTOR_CASES = [
    "packed-dense-actor-single-grpo",
    "packed-dense-actor-dp4-dapo",
    "packed-dense-actor-pp2-grpo",
    "packed-dense-actor-pp2_vpp2-dapo",
    "packed-dense-actor-tp2-hapo_kl_nll",
    "packed-moe-actor-tp2_ep2-dapo",
    "packed-moe-actor-pp2-hapo_kl_nll",
    "packed-moe-actor-ep4-grpo",
]
PACKED_CRITIC_CASES = ["packed-dense-critic-pp2", "packed-dense-critic-tp2", "packed-moe-critic-tp2_ep2_etp1"]
# every sequence split over CP ranks (schedules.context_parallel), padded and packed
CP_ACTOR_CASES = [
    "cp-dense-actor-cp2-dapo",
    "cp-dense-actor-cp4-grpo",
    "cp-dense-actor-cp2_tp2-hapo_kl_nll",
    "cp-moe-actor-cp2_ep2-dapo",
    "cp-dense-actor-cp2_pp2-grpo",
    "packed-cp-dense-actor-cp2-grpo",
    "packed-cp-moe-actor-cp2_ep2-dapo",
    "packed-cp-dense-actor-cp2_tp2-grpo",
]
CP_CRITIC_CASES = ["cp-dense-critic-cp2", "packed-cp-dense-critic-cp2_pp2"]


@pytest.fixture(scope="module")
def results(shared_launch4):
    return shared_launch4.results("body_schedules")


def _result(results, case):
    outcome = results[case]
    assert outcome["ok"], outcome["error"]
    return outcome["result"]


def _check_grads(r):
    assert r["params_without_grad"] == [], "some parameter got no gradient"
    assert r["max_grad"] > 1e-2, "reference gradients too small to compare meaningfully"
    assert r["max_grad_diff"] < GRAD_TOL, f"{r['worst_key']}: {r['max_grad_diff']}"
    for name, diff in r["metric_diff"].items():
        assert diff < METRIC_TOL, (name, diff)


def _check_packed(r, case):
    if case.startswith("packed-"):  # some micro-batch really holds several sequences
        assert r["max_sequences_per_micro_batch"] >= 2, r["max_sequences_per_micro_batch"]
    if case.startswith("packed-") and "-pp2-" in case:  # the stages exchanged rows of different lengths
        assert r["row_lengths_per_rank"] >= 2, r["row_lengths_per_rank"]


@pytest.mark.parametrize("case", ACTOR_CASES + PACKED_ACTOR_CASES + CP_ACTOR_CASES)
def test_actor_gradient_and_logprobs_match_single_process(results, case):
    r = _result(results, case)
    _check_packed(r, case)
    assert r["logprob_diff"] < LOGPROB_TOL
    assert r["entropy_diff"] < ENTROPY_TOL
    _check_grads(r)


@pytest.mark.parametrize("case", CRITIC_CASES + PACKED_CRITIC_CASES + CP_CRITIC_CASES)
def test_critic_values_and_gradient_match_single_process(results, case):
    r = _result(results, case)
    _check_packed(r, case)
    assert r["value_diff"] < 1e-6
    _check_grads(r)


@pytest.mark.parametrize("case", ["moe-train_step-tp2_ep2-dapo", "cp-moe-train_step-cp2_ep2-dapo"])
def test_train_step_grad_norm_and_update(results, case):
    r = _result(results, case)
    assert abs(r["grad_norm"] - r["ref_grad_norm"]) < 1e-6 * r["ref_grad_norm"]
    assert r["pg_loss_diff"] < METRIC_TOL
    assert r["update_skipped"] == 0.0 and r["weights_moved"] > 0


TWO_LAYOUT_CASES = ["two-layouts-moe-actor-tp2_ep2+moe-critic-pp2", "two-layouts-dense-actor-pp2+dense-critic-tp2"]


@pytest.mark.parametrize("case", TWO_LAYOUT_CASES)
def test_actor_and_critic_in_their_own_layouts_match_single_process(results, case):
    r = _result(results, case)
    assert r["coordinates"] == [None, None]  # Megatron's live ranks are each layout's own inside its scope
    refused = r["critic_refused_outside_its_layout"]  # built outside its active(): the actor's groups
    assert refused is not None and "ParallelContext.active()" in refused, refused
    assert r["logprob_diff"] < LOGPROB_TOL and r["value_diff"] < 1e-6
    _check_grads(r["actor"])
    _check_grads(r["critic"])
    assert abs(r["critic_grad_norm"] - r["critic_ref_grad_norm"]) < 1e-6 * r["critic_ref_grad_norm"]
    assert r["critic_weights_moved"] > 0
