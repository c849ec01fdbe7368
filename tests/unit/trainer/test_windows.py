"""T-PPO's window pool bookkeeping (carried responses, refills, held rows, checkpoint state)
and the trainer's masks and EGAE advantages on windowed rows, against hand-worked values."""

import json

import pytest
import torch

from megatron_rl.from_config.rows import check_window_pool
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.rollouts import TrainRows
from megatron_rl.trainer.windows import WindowPool

PROMPT = [7, 8]


def _sample(tokens, reason, prompt=PROMPT):
    return Sample(prompt_ids=list(prompt), token_ids=list(tokens), logprobs=[-0.5] * len(tokens), finish_reason=reason)


def _extend(sample, more, reason):
    return _sample(sample.token_ids + more, reason, sample.prompt_ids)


def test_first_step_fills_the_pool_and_finished_rows_leave_after_training():
    pool = WindowPool(capacity=4, group_size=2, row_multiple=2)
    assert pool.begin_step() == []
    assert pool.new_prompt_count() == 2
    pool.add_group("1", [_sample([1, 2], "stop"), _sample([1, 2, 3], "window")])
    pool.add_group("2", [_sample([4, 5, 6], "window"), _sample([4], "stop")])
    assert [s.prompt_key for s in pool.samples] == [0, 0, 1, 1]
    assert [s.length for s in pool.to_score()] == [2, 1]
    pool.set_scores(pool.to_score(), [1.0, 0.0], [1.0, -0.5])
    rows = pool.training_rows()
    assert len(rows) == 4
    train = TrainRows.from_window_rows(rows)
    assert train.truncated == [False, True, True, False]
    assert train.rewards == [1.0, 0.0, 0.0, -0.5]  # in-flight rows have no outcome yet
    assert train.correct == [1.0, 0.0, 0.0, 0.0]
    assert train.group_index == [0, 0, 1, 1]
    assert train.loss_start == [0, 0, 0, 0] and train.fresh_start == [0, 0, 0, 0]
    pool.trained(rows)
    # The two cut-off responses stay, with their 3 tokens as context for the next loss.
    assert [(s.sample.token_ids, s.trained) for s in pool.samples] == [([1, 2, 3], 3), ([4, 5, 6], 3)]


def test_carried_rows_continue_and_their_loss_starts_after_the_trained_tokens():
    pool = WindowPool(capacity=4, group_size=2, row_multiple=2)
    pool.begin_step()
    pool.add_group("1", [_sample([1, 2, 3], "window"), _sample([1, 9, 9], "window")])
    pool.add_group("2", [_sample([4], "stop"), _sample([5], "stop")])
    pool.set_scores(pool.to_score(), [1.0, 1.0], [1.0, 1.0])
    pool.trained(pool.training_rows())
    # Step 2: the two carried responses are continued (one finishes); 2 free rows -> 1 new prompt.
    todo = pool.begin_step()
    assert [s.token_ids for s in todo] == [[1, 2, 3], [1, 9, 9]]
    pool.continued([_extend(todo[0], [10], "stop"), _extend(todo[1], [11, 12, 13], "window")])
    assert pool.new_prompt_count() == 1
    pool.add_group("3", [_sample([6, 6, 6], "window"), _sample([6], "stop")])
    assert [e.sample.token_ids for e in pool.to_score()] == [[1, 2, 3, 10], [6]]
    pool.set_scores(pool.to_score(), [0.0, 1.0], [0.0, 1.0])
    rows = pool.training_rows()
    train = TrainRows.from_window_rows(rows)
    assert train.loss_start == [3, 3, 0, 0]
    assert train.fresh_start == [3, 3, 0, 0]
    assert train.truncated == [False, True, True, False]
    assert [r.windows for r in rows] == [2, 2, 1, 1]
    pool.trained(rows)
    assert [(s.sample.token_ids, s.trained) for s in pool.samples] == [([1, 9, 9, 11, 12, 13], 6), ([6, 6, 6], 3)]


def test_rows_that_do_not_split_evenly_wait_untrained_and_are_not_lost():
    pool = WindowPool(capacity=6, group_size=3, row_multiple=4)
    pool.begin_step()
    pool.add_group("1", [_sample([1], "stop"), _sample([2, 2], "window"), _sample([3], "stop")])
    pool.add_group("2", [_sample([4, 4], "window"), _sample([5], "stop"), _sample([6, 6], "window")])
    pool.set_scores(pool.to_score(), [1, 1, 1], [1, 1, 1])
    rows = pool.training_rows()
    assert len(rows) == 4  # 6 rows, batches of 4: the last 2 wait
    pool.trained(rows)
    waiting = pool.samples[-2:]
    assert [(s.sample.token_ids, s.trained) for s in waiting] == [([5], 0), ([6, 6], 0)]
    # Next step: the waiting cut-off row is continued; its loss covers both of its windows,
    # the mismatch metric only the newly sampled one.
    todo = pool.begin_step()
    assert [s.token_ids for s in todo] == [[2, 2], [4, 4], [6, 6]]
    pool.continued([_extend(todo[0], [1], "stop"), _extend(todo[1], [1], "stop"), _extend(todo[2], [7], "stop")])
    train = TrainRows.from_window_rows(pool.samples)
    assert train.loss_start == [2, 2, 0, 0]
    assert train.fresh_start == [2, 2, 1, 2]


def test_refill_overfills_by_less_than_one_group_so_training_never_stalls():
    pool = WindowPool(capacity=4, group_size=3, row_multiple=4)
    pool.begin_step()
    assert pool.new_prompt_count() == 2  # 6 rows >= capacity: one batch of 4 is always there
    for key in range(2):
        pool.add_group(str(key), [_sample([1], "stop")] + [_sample([2, 2], "window")] * 2)
    assert len(pool.training_rows()) == 4
    pool.trained(pool.training_rows())
    assert len(pool.samples) == 4  # 2 untrained + 2 carried, nothing free
    pool.begin_step()
    assert pool.new_prompt_count() == 0


def test_state_round_trips_through_json():
    pool = WindowPool(capacity=4, group_size=2, row_multiple=2)
    pool.begin_step()
    pool.add_group("12", [_sample([1, 2, 3], "window"), _sample([1], "stop")])
    pool.set_scores(pool.to_score(), [1.0], [0.75])
    pool.trained(pool.training_rows()[:0])
    state = json.loads(json.dumps(pool.state_dict()))
    again = WindowPool(capacity=4, group_size=2, row_multiple=2)
    again.load_state_dict(state)
    assert again.state_dict() == pool.state_dict()
    assert again.samples[0].sample == pool.samples[0].sample and again.samples[1].reward == 0.75
    assert again.next_prompt_key == 1
    with pytest.raises(ValueError, match="group_size=2 but this run has group_size=4"):
        WindowPool(capacity=4, group_size=4, row_multiple=2).load_state_dict(state)


def test_bad_pools_and_continuations_are_refused():
    with pytest.raises(ValueError, match="cannot fill one training batch"):
        WindowPool(capacity=4, group_size=2, row_multiple=8)
    pool = WindowPool(capacity=2, group_size=2, row_multiple=2)
    pool.begin_step()
    pool.add_group("1", [_sample([1, 2], "window"), _sample([3], "stop")])
    todo = pool.begin_step()
    with pytest.raises(ValueError, match="does not extend"):
        pool.continued([_sample([9, 9, 9], "stop")])
    with pytest.raises(ValueError, match="1 unfinished"):
        pool.continued(todo + todo)


def _finished_and_cut_rows() -> TrainRows:
    """Row 0 finished (reward 1, 3 tokens, the first 2 trained earlier); row 1 cut off (2 tokens)."""
    return TrainRows(
        [_sample([1, 2, 3], "stop"), _sample([4, 5], "window", prompt=[7, 8, 9])],
        rewards=[1.0, 0.0],
        correct=[1.0, 0.0],
        group_index=[0, 1],
        loss_start=[2, 0],
        fresh_start=[2, 0],
        truncated=[False, True],
    )


def test_window_masks_and_egae_advantages_by_hand():
    from megatron_rl.algorithms import get_recipe
    from megatron_rl.trainer.advantages import estimate_advantages
    from megatron_rl.trainer.assembly import aligned_span

    rows = _finished_and_cut_rows()
    mask = aligned_span([2, 3], [3, 2], rows.loss_start, seq_length=7)
    # Prediction-aligned: response token i of a row with prompt p is predicted at position p - 1 + i.
    assert mask.tolist() == [
        [False, False, False, True, False, False, False],
        [False, False, True, True, False, False, False],
    ]
    values = [torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.2, 0.4])]
    adv, ret = estimate_advantages(get_recipe("tppo", generation_window=4), rows, 3, values)
    # Finished, λ = 0.95: δ = (0, 0, 0.5) -> A = (0.95² · 0.5, 0.95 · 0.5, 0.5); λ_critic = 1: returns = R = 1.
    # Cut off: bootstrap V(s_2) ≈ V(s_1) = 0.4, so δ = (0.2, 0) -> A = (0.2, 0); returns = 0.4.
    assert torch.allclose(adv, torch.tensor([[0.45125, 0.475, 0.5], [0.2, 0.0, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0], [0.4, 0.4, 0.0]]))
    # Whitening sees only the loss tokens (0.5, 0.2, 0.0): mean 0.2333, unbiased std 0.2517.
    adv_w, _ = estimate_advantages(get_recipe("tppo", generation_window=4, whiten_advantages=True), rows, 3, values)
    loss_tokens = torch.tensor([0.5, 0.2, 0.0])
    expected = (loss_tokens - loss_tokens.mean()) / loss_tokens.std()
    assert torch.allclose(adv_w[[0, 1, 1], [2, 0, 1]], expected, atol=1e-6)
    assert float(adv_w[0, 0]) == 0.0 and float(adv_w[0, 1]) == 0.0


def test_pool_size_check_is_the_one_config_validation_runs():
    # capacity 4 < one training batch of 8 rows: the pool and the check refuse alike.
    with pytest.raises(ValueError) as built:
        WindowPool(capacity=4, group_size=2, row_multiple=8)
    with pytest.raises(ValueError) as checked:
        check_window_pool(4, 2, 8)
    assert str(built.value) == str(checked.value)
    check_window_pool(8, 2, 8)
    with pytest.raises(ValueError, match="must hold at least one group"):
        check_window_pool(2, 3, 1)


def test_a_critic_offset_moves_finished_windows_and_not_in_flight_ones():
    """The asymmetry behind T-PPO's drift to the budget: an in-flight window's EGAE advantages
    are differences of values, a finished window's hold R − V. A critic too high by c makes
    every stop cost about c against continuing; critic/terminal_error measures c."""
    from megatron_rl.algorithms import get_recipe
    from megatron_rl.trainer.advantages import estimate_advantages, window_metrics

    rows = _finished_and_cut_rows()
    recipe = get_recipe("tppo", generation_window=4)
    values = [torch.tensor([0.5, 0.5, 0.5]), torch.tensor([0.2, 0.4])]
    adv, _ = estimate_advantages(recipe, rows, 3, values)
    # Loss tokens: the finished row's last (A = 1 − 0.5), the cut-off row's two (0.2, 0).
    assert window_metrics(rows, adv, values) == pytest.approx(
        {"advantage/inflight_mean": 0.1, "advantage/finished_mean": 0.5, "critic/terminal_error": -0.5}
    )
    shifted = [v + 0.3 for v in values]
    adv_shifted, _ = estimate_advantages(recipe, rows, 3, shifted)
    assert torch.allclose(adv_shifted[1], adv[1])  # in flight: unchanged
    assert torch.allclose(adv_shifted[0], adv[0] - 0.3 * torch.tensor([0.95**2, 0.95, 1.0]))
    assert window_metrics(rows, adv_shifted, shifted) == pytest.approx(
        {"advantage/inflight_mean": 0.1, "advantage/finished_mean": 0.2, "critic/terminal_error": -0.2}
    )


def test_without_training_in_flight_a_response_waits_for_its_end_and_trains_whole():
    pool = WindowPool(capacity=4, group_size=2, row_multiple=2, train_in_flight=False)
    pool.begin_step()
    pool.add_group("1", [_sample([1, 2], "stop"), _sample([1, 2, 3], "window")])
    pool.add_group("2", [_sample([4, 5, 6], "window"), _sample([4], "stop")])
    pool.set_scores(pool.to_score(), [1.0, 0.0], [1.0, 0.0])
    rows = pool.training_rows()
    assert [r.sample.token_ids for r in rows] == [[1, 2], [4]]  # the finished rows alone
    pool.trained(rows)
    assert [(s.sample.token_ids, s.trained) for s in pool.samples] == [([1, 2, 3], 0), ([4, 5, 6], 0)]
    todo = pool.begin_step()
    pool.continued([_extend(todo[0], [10], "stop"), _extend(todo[1], [11], "stop")])
    pool.add_group("3", [_sample([6, 6], "window"), _sample([6, 7], "window")])
    pool.set_scores(pool.to_score(), [1.0, 0.0], [1.0, 0.0])
    train = TrainRows.from_window_rows(pool.training_rows())
    # Both carried responses train from their first token, with their outcome (no bootstrap).
    assert train.loss_start == [0, 0] and train.truncated == [False, False] and train.rewards == [1.0, 0.0]
    assert train.fresh_start == [3, 3]  # their first window came from older weights
