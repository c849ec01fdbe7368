"""Per-prompt sampling seeds: a function of (run seed, epoch, dataset index) alone, spaced
so that the n consecutive seeds vLLM gives a prompt's samples never reach another prompt's."""

import pytest

from megatron_rl.rollout.seeds import MAX_SAMPLES, episode_seeds, prompt_seed, prompt_seeds


def test_a_prompt_seed_depends_on_run_seed_epoch_and_index_only():
    seeds = {prompt_seed(run, epoch, index) for run in (1, 2) for epoch in (0, 1) for index in range(50)}
    assert len(seeds) == 2 * 2 * 50  # every (run, epoch, index) its own seed
    assert prompt_seed(1234, 3, 17) == prompt_seed(1234, 3, 17)
    assert all(s % MAX_SAMPLES == 0 and 0 <= s < 2**63 for s in seeds)  # room for seed + i, i < MAX_SAMPLES


def test_seeds_follow_the_prompts_not_their_batch():
    batch = prompt_seeds(7, [0, 0, 1], [4, 9, 4], n=8)
    assert batch == [prompt_seed(7, 0, 4), prompt_seed(7, 0, 9), prompt_seed(7, 1, 4)]
    assert prompt_seeds(7, [1, 0], [4, 4], n=8) == [batch[2], batch[0]]


@pytest.mark.parametrize(
    "args,match",
    [
        ((7, [0], [1], MAX_SAMPLES + 1), "exceed the 4096"),
        ((7, [0, 0], [1], 4), "2 epochs for 1 prompts"),
    ],
)
def test_bad_requests_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        prompt_seeds(*args)


def test_prefill_waves_are_consecutive_and_fit_the_budget():
    from megatron_rl.rollout.engine import prefill_waves

    tokens = [3, 4, 3, 5, 20, 1, 1]
    waves = prefill_waves(tokens, 10)
    assert [list(w) for w in waves] == [[0, 1, 2], [3], [4], [5, 6]]  # 20 alone: over the budget
    assert [i for w in waves for i in w] == list(range(len(tokens)))
    assert prefill_waves([2, 2], 10) == [range(0, 2)] and prefill_waves([], 10) == [range(0, 0)]


def test_episode_seeds_leave_every_turn_of_every_episode_a_seed_of_its_own():
    seeds = episode_seeds(7, [0, 1], [4, 4], n=3, max_turns=5)
    first, second = prompt_seed(7, 0, 4), prompt_seed(7, 1, 4)
    assert seeds == [first, first + 5, first + 10, second, second + 5, second + 10]
    turns = {s + t for s in seeds for t in range(5)}  # the driver samples turn t with seed + t
    assert len(turns) == 2 * 3 * 5
    with pytest.raises(ValueError, match="exceed the 4096 seeds per prompt"):
        episode_seeds(7, [0], [4], n=8, max_turns=MAX_SAMPLES // 8 + 1)
