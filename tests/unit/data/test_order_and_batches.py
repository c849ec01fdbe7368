"""Seeded epoch order, exact resumption, batching and group expansion."""

import json

import pytest
import torch

from megatron_rl.data import EpochSampler, PromptDataset, PromptFields, PromptLoader


def test_each_epoch_is_a_seeded_permutation():
    s = EpochSampler(10, seed=1)
    first, second = s.take(10), s.take(10)
    assert sorted(i for _, i in first) == list(range(10)) == sorted(i for _, i in second)
    assert {e for e, _ in first} == {0} and {e for e, _ in second} == {1}
    assert [i for _, i in first] != [i for _, i in second]  # reshuffled per epoch
    assert EpochSampler(10, seed=1).take(20) == first + second  # same seed, same order
    assert EpochSampler(10, seed=2).take(10) != first
    assert EpochSampler(4, seed=1, shuffle=False).take(6) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]


def test_resume_continues_exactly():
    reference = EpochSampler(7, seed=5).take(25)
    s = EpochSampler(7, seed=5)
    head = s.take(9)
    state = json.loads(json.dumps(s.state_dict()))  # survives a checkpoint round trip
    assert (state["epoch"], state["index"]) == (1, 2)
    resumed = EpochSampler(7, seed=5)
    resumed.load_state_dict(state)
    assert resumed.drawn == s.drawn == 9  # the count of items handed out continues too
    assert head + resumed.take(16) == reference
    assert resumed.drawn == 25


def test_resume_refuses_a_different_order():
    state = EpochSampler(7, seed=5).state_dict()
    with pytest.raises(ValueError, match="saved with seed=5 but this loader has seed=6"):
        EpochSampler(7, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="num_items=7 but this loader has num_items=8"):
        EpochSampler(8, seed=5).load_state_dict(state)


@pytest.fixture
def dataset(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"max of {'1 ' * (i + 1)}{i}", "answer": str(i)}) + "\n" for i in range(5))
    )
    return PromptDataset(path, tokenizer, fields=PromptFields(answer="answer"))


def test_loader_batches_resume_and_cross_epochs(dataset):
    loader = PromptLoader(dataset, batch_size=3, seed=0)
    batches = [loader.next_batch() for _ in range(4)]  # 12 prompts: epochs 0, 0..1, 1, 2
    assert batches[1].epochs == [0, 0, 1]
    assert sorted(batches[0].dataset_indices + batches[1].dataset_indices[:2]) == list(range(5))
    for b in batches:
        assert b.answers == [str(i) for i in b.dataset_indices]
        assert b.prompt_ids == [list(dataset[i].prompt_ids) for i in b.dataset_indices]
    again = PromptLoader(dataset, batch_size=3, seed=0)
    again.next_batch()
    state = again.state_dict()
    resumed = PromptLoader(dataset, batch_size=3, seed=0)
    resumed.load_state_dict(state)
    assert resumed.prompts_drawn == 3
    assert [resumed.next_batch().dataset_indices for _ in range(3)] == [b.dataset_indices for b in batches[1:]]


def test_group_expansion_and_padding(dataset):
    batch = PromptLoader(dataset, batch_size=2, seed=0, shuffle=False).next_batch()
    grouped = batch.expand_groups(3)
    assert grouped.group_ids == [0, 0, 0, 1, 1, 1] and grouped.group_size == 3
    assert grouped.answers == ["0", "0", "0", "1", "1", "1"]
    assert grouped.prompt_ids[2] == batch.prompt_ids[0] and grouped.prompt_ids[3] == batch.prompt_ids[1]
    short, long = batch.prompt_ids  # the second prompt has one more "1"
    assert len(long) == len(short) + 1
    ids, mask = batch.padded(pad_id=0)
    assert ids[0].tolist() == [0] + short and mask[0].tolist() == [0] + [1] * len(short)
    ids, mask = batch.padded(pad_id=0, side="right")
    assert ids[0].tolist() == short + [0] and mask.sum(1).tolist() == [len(short), len(long)]
    assert ids.dtype == torch.long
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        batch.expand_groups(0)
