"""The reference replay of `megatron-rl bench grpo-reference`: the rows' layout and mini-batch
split by hand, the optimizer settings against Megatron's, and one step on a tiny HF MoE
whose recorded old logprobs are its own (so the comparison reads 0 and the loss is known)."""

import dataclasses
import inspect
import math

import pytest
import torch

from megatron_rl_lab.bench import grpo_replay
from megatron_rl_lab.bench.grpo_replay import (
    Controls,
    Learner,
    ReplayError,
    ReplaySettings,
    check_supported,
    compare_step,
    load_reference,
    mini_batch_orders,
    step_rows,
    token_logprobs,
)

SETTINGS = ReplaySettings(
    clip_low=0.2,
    clip_high=0.2,
    loss_agg="seq-mean-token-mean",
    norm_by_std=True,
    kl_kind=None,
    kl_coef=0.0,
    temperature=1.0,
    mini_batches=1,
    ppo_epochs=1,
    shuffle=False,
    seed=1,
    lr=1e-3,
    lr_warmup_steps=0,
)


def _record(prompt, response, **fields):
    n = len(response)
    record = {
        "prompt_ids": prompt,
        "token_ids": response,
        "loss_start": 0,
        "loss_mask": [1] * n,
        "old_logprobs": [0.0] * n,
        "advantages": [0.0] * n,
        "reward": 0.0,
        "group_index": 0,
    }
    return {**record, **fields}


def test_rows_are_prediction_aligned_and_the_mask_starts_at_loss_start():
    rows = step_rows(
        [
            _record([5, 6], [1, 2, 3], loss_start=1, loss_mask=[0, 1, 1], old_logprobs=[-1.0, -2.0, -3.0]),
            _record([7], [4, 8], advantages=[0.5, 0.5]),
        ],
        pad_id=0,
    )
    assert rows.tokens.tolist() == [[5, 6, 1, 2, 3], [7, 4, 8, 0, 0]]
    # Position t predicts token t + 1: row 0's response is predicted at 1, 2, 3, its first token not trained.
    assert rows.loss_mask.tolist() == [[False, False, True, True, False], [True, True, False, False, False]]
    assert torch.equal(rows.loss_mask, rows.recorded_mask)
    assert rows.old_logprobs[0].tolist() == [0.0, -1.0, -2.0, -3.0, 0.0]
    assert rows.spread([2.0, -1.0]).tolist() == [[0, 2, 2, 2, 0], [-1, -1, 0, 0, 0]]


def test_mini_batches_are_consecutive_slices_epoch_by_epoch():
    settings = dataclasses.replace(SETTINGS, mini_batches=2, ppo_epochs=2)
    assert mini_batch_orders(settings, rows=4, step=3) == [[0, 1], [2, 3], [0, 1], [2, 3]]
    shuffled = mini_batch_orders(dataclasses.replace(settings, shuffle=True), rows=4, step=3)
    from megatron_rl.schedules.batch import epoch_order

    assert shuffled[0] + shuffled[1] == epoch_order(4, 1, 3, 0).tolist()
    assert shuffled[2] + shuffled[3] == epoch_order(4, 1, 3, 1).tolist()


def test_the_learning_rate_warms_up_as_the_trainers():
    settings = dataclasses.replace(SETTINGS, lr_warmup_steps=4)
    assert [settings.lr_at(s) for s in (1, 2, 4, 9)] == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3])
    assert SETTINGS.lr_at(1) == 1e-3


def test_the_optimizer_settings_are_the_ones_megatron_gets():
    from megatron.core.optimizer import OptimizerConfig

    from megatron_rl.from_config import setup
    from megatron_rl.models import builder

    defaults = OptimizerConfig()
    assert (defaults.adam_beta1, defaults.adam_beta2) == grpo_replay.ADAM_BETAS
    assert defaults.adam_eps == grpo_replay.ADAM_EPS and defaults.decoupled_weight_decay
    assert inspect.signature(builder.wrap_for_training).parameters["weight_decay"].default == grpo_replay.WEIGHT_DECAY
    assert inspect.signature(setup.build_trainable).parameters["clip_grad"].default == grpo_replay.CLIP_GRAD


def test_recipes_with_pieces_the_reference_does_not_write_are_refused():
    from megatron_rl.config import load_config

    check_supported(load_config("examples/grpo.yaml"))
    check_supported(load_config("examples/dapo.yaml"))  # token-mean, Clip-Higher, shaped rewards
    with pytest.raises(ReplayError, match="use_critic"):
        check_supported(load_config("examples/ppo.yaml"))
    with pytest.raises(ReplayError, match="moe_aux_loss_coeff"):
        check_supported(load_config("examples/grpo.yaml", ["model.moe_aux_loss_coeff=0.01"]))


def test_one_step_on_a_tiny_moe_whose_old_logprobs_are_its_own(tmp_path):
    from megatron_rl.bridge.parity import make_tiny_hf

    base = make_tiny_hf("qwen3_moe", tmp_path / "hf", seed=3)
    main = Learner.load(base, SETTINGS)
    controls = Controls(
        Learner.load(base, SETTINGS, torch.float64),
        Learner.load(base, SETTINGS, reverse_rows=True),
        load_reference(base),
    )
    prompts, responses = [[5, 6, 7], [5, 6, 7], [9, 2]], [[11, 12], [13, 14, 15], [16]]
    tokens = torch.tensor([p + r + [0] * (6 - len(p + r)) for p, r in zip(prompts, responses)])
    with torch.no_grad():
        own = token_logprobs(main.model, tokens, 1.0)
    # Group 0: rewards 1, 0 -> A = ±1/sqrt(2) (std sqrt(1/2)); group 1 is one sample: A = 1 / (1 + eps).
    advantages = [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6), 1 / (1 + 1e-6)]
    records = [
        _record(
            p,
            r,
            old_logprobs=own[row, len(p) - 1 : len(p) - 1 + len(r)].tolist(),
            advantages=[advantages[row]] * len(r),
            reward=[1.0, 0.0, 1.0][row],
            group_index=[0, 0, 1][row],
        )
        for row, (p, r) in enumerate(zip(prompts, responses))
    ]
    before = [p.detach().clone() for p in main.model.parameters()]
    ours = {"actor/pg_loss": -1 / 3, "actor/grad_norm": 0.5}
    result = compare_step(1, step_rows(records), main, controls, SETTINGS, ours)
    assert result["logp_abs_diff_max"] == 0.0 and result["loss_mask_mismatch"] == 0
    assert result["advantage_max_abs_diff"] < 1e-7 and result["fp64_vs_ours_max"] < 1e-5
    # The twin's forward before its first update is the reference's own.
    assert result["twin_vs_ref_max"] == 0.0 and result["moved_max"] == 0.0
    # One mini-batch at ratio 1: the loss is minus the mean over rows of A.
    assert result["ref_pg_loss"] == pytest.approx(-sum(advantages) / 3, abs=1e-5)
    assert result["ours_pg_loss"] == -1 / 3 and result["ref_clipfrac"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, main.model.parameters()))


def test_the_kl_penalty_is_k3_against_the_frozen_start(tmp_path):
    from megatron_rl.bridge.parity import make_tiny_hf
    from megatron_rl.config import load_config

    with pytest.raises(ReplayError, match="kl.kind='k1'"):
        check_supported(load_config("examples/grpo.yaml", ["algorithm.overrides={kl: {kind: k1, coef: 0.04}}"]))
    settings = dataclasses.replace(SETTINGS, kl_kind="k3", kl_coef=0.5)
    learner = Learner.load(make_tiny_hf("qwen3_moe", tmp_path / "hf", seed=4), settings)
    rows = step_rows([_record([5, 6], [7, 8], advantages=[1.0, 1.0])])
    with torch.no_grad():
        start = token_logprobs(learner.base, rows.tokens, 1.0)
        moved = start + torch.log(torch.tensor(2.0)) * rows.loss_mask  # ref − logp = log 2 on the loss tokens
        _, pg, _ = grpo_replay.mini_batch_loss(
            learner, rows, torch.tensor([0]), start, rows.spread([1.0]), settings, start
        )
        total, _, _ = grpo_replay.mini_batch_loss(
            learner, rows, torch.tensor([0]), start, rows.spread([1.0]), settings, moved
        )
    assert pg == pytest.approx(-1.0, abs=1e-6)  # ratio 1 against its own start
    assert float(total) == pytest.approx(-1.0 + 0.5 * (2 - math.log(2.0) - 1), abs=1e-5)
