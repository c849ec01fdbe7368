"""reasoning-gym as prompt data: spec checks in one line, prompts that carry a reference
rebuilding their entry, and held-out sets that never repeat a training question."""

import json

import pytest

from megatron_rl.data import PromptLoader
from megatron_rl.data.reasoning_gym import (
    ANSWER_INSTRUCTION,
    GymPrompts,
    GymSpec,
    build_dataset,
    check_spec,
    held_out_indices,
    held_out_prompts,
    resolve,
)

SUMS = GymSpec("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, seed=3, size=40)


def test_a_valid_spec_passes():
    check_spec(SUMS)
    check_spec(GymSpec("count_bits", {"max_n": 15}, seed=0, size=5))


@pytest.mark.parametrize(
    "spec, message",
    [
        (GymSpec("count_bitz"), r"no dataset 'count_bitz'; did you mean count_bits.*lists them$"),
        (GymSpec("count_bits", {"max_m": 3}), r"count_bits has no option 'max_m'; allowed: \['max_n', 'min_n'\]"),
        (GymSpec("count_bits", {"seed": 3}), r"option 'seed' is set by data.seed, not data.options"),
        (GymSpec("count_bits", {"max_n": -3}), r"reasoning-gym rejects count_bits options \{'max_n': -3\}: min_n must"),
        (GymSpec("chain_sum", {"min_terms": "two"}), r"reasoning-gym rejects chain_sum options"),
        (GymSpec("count_bits", size=0), r"size=0 must be >= 1"),
    ],
)
def test_bad_specs_are_refused_in_one_line(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        check_spec(spec)
    assert "\n" not in str(err.value)


def test_prompts_ask_the_question_and_carry_a_reference_to_their_entry(tokenizer):
    prompts = GymPrompts(SUMS, tokenizer)
    dataset = build_dataset(SUMS)
    assert len(prompts) == SUMS.size
    for i in (0, 17):
        record, entry = prompts[i], dataset[i]
        text = tokenizer.decode(record.prompt_ids)
        assert text == f"<|user|>{entry['question']}\n{ANSWER_INSTRUCTION}<|end|><|assistant|>"
        ref = json.loads(record.answer)  # plain JSON: it travels to the reward workers
        assert (ref["dataset"], ref["index"], ref["answer"]) == ("chain_sum", i, entry["answer"])
        _, rebuilt = resolve(record.answer)
        assert rebuilt == entry
    batch = PromptLoader(prompts, batch_size=4, seed=0).next_batch()  # the trainer's loader takes them
    assert len(batch.prompt_ids) == 4 and all(json.loads(a)["dataset"] == "chain_sum" for a in batch.answers)


def test_the_same_spec_gives_the_same_prompts_and_another_seed_others(tokenizer):
    again = GymPrompts(GymSpec(SUMS.dataset, dict(SUMS.options), SUMS.seed, SUMS.size), tokenizer)
    assert [r.prompt_ids for r in again.records] == [r.prompt_ids for r in GymPrompts(SUMS, tokenizer).records]
    other = build_dataset(GymSpec(SUMS.dataset, SUMS.options, SUMS.seed + 1, SUMS.size))
    assert [e["question"] for e in other] != [e["question"] for e in build_dataset(SUMS)]


def test_held_out_questions_never_occur_in_the_training_set(tokenizer):
    spec, indices = held_out_indices(SUMS, seed=4, size=30)
    train = {e["question"] for e in build_dataset(SUMS)}
    held_out = [build_dataset(spec)[i]["question"] for i in indices]
    assert len(held_out) == len(set(held_out)) == 30 and not train & set(held_out)
    # Another seed alone would not do: entry i of seed 4 is entry i + 1 of seed 3.
    seed_4 = build_dataset(GymSpec(SUMS.dataset, SUMS.options, 4, 30))
    assert [seed_4[i]["question"] for i in range(5)] == [build_dataset(SUMS)[i + 1]["question"] for i in range(5)]
    prompts = held_out_prompts(SUMS, 4, 30, tokenizer)
    assert [json.loads(r.answer)["seed"] for r in prompts.records] == [4] * 30


def test_held_out_sets_refuse_the_training_seed_and_a_dataset_too_small():
    with pytest.raises(ValueError, match="held-out seed 3 is the training seed"):
        held_out_indices(SUMS, seed=3, size=5)
    tiny = GymSpec("count_bits", {"max_n": 15}, seed=0, size=200)  # all 15 questions are in training
    with pytest.raises(ValueError, match="gave only 0 questions outside the 200-entry training set"):
        held_out_indices(tiny, seed=1, size=5)
