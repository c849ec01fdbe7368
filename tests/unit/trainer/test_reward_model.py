"""The reward model's trainer pieces that need no model: the step's pairs (every pair once
per epoch, a function of the step alone, so a resumed run trains what the uninterrupted
one would have) and the one-line refusal of a conversation longer than seq_length."""

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.data.pairs import PreferencePair
from megatron_rl.trainer.reward_model import encode_pairs
from megatron_rl.trainer.supervised import step_indices


def test_every_pair_once_per_epoch_in_a_fresh_order_each_epoch():
    steps = [step_indices(step, 4, 10, seed=1) for step in range(1, 6)]  # 20 positions = 2 epochs of 10
    flat = [i for s in steps for i in s]
    assert sorted(flat[:10]) == sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]
    assert step_indices(3, 4, 10, seed=1) == steps[2]  # the step alone decides (resume)
    assert step_indices(3, 4, 10, seed=2) != steps[2]


def test_a_conversation_longer_than_seq_length_is_one_line(tokenizer):
    short = ({"role": "user", "content": "max of 3"}, {"role": "assistant", "content": "Answer: 3"})
    long = ({"role": "user", "content": "max of " + " ".join("7" * 40)}, short[1])
    pairs = [PreferencePair(short, short, "f:1"), PreferencePair(short, long, "f:2")]
    assert len(encode_pairs(pairs[:1], tokenizer, 32, "data.source")) == 1
    with pytest.raises(ConfigError) as err:
        encode_pairs(pairs, tokenizer, 32, "data.source")
    assert str(err.value).startswith("data.source: 1 of 2 pairs are longer than trainer.seq_length=32 tokens")
    assert "at f:2); raise trainer.seq_length" in str(err.value) and "\n" not in str(err.value)
