"""A reasoning-gym dataset's tiny base: built like the digit task's (tokenizer on the
dataset's text, format warm-up), reported against chance, cached by its settings."""

import json

from megatron_rl.data.reasoning_gym import GymSpec
from megatron_rl.tasks.base_model import BaseModelSettings, make_tiny_base
from megatron_rl.tasks.gym_base import GymBaseSettings, GymExample, chance_accuracy

SPEC = GymSpec("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, seed=0, size=64)
# The smallest build that still goes through every part: 2 warm-up steps, 8 report prompts.
MODEL = BaseModelSettings(num_layers=1, num_experts=2, warmup_steps=2, warmup_batch_size=4, num_eval_prompts=8)


def test_chance_is_the_accuracy_of_answers_drawn_from_the_training_set():
    train = [GymExample("q", a, "") for a in "1123"]
    held_out = [GymExample("q", a, "") for a in "13"]
    assert chance_accuracy(train, held_out) == (2 / 4 + 1 / 4) / 2


def test_build_report_and_cache(tmp_path):
    settings = GymBaseSettings(model=MODEL, spec=SPEC)
    report = make_tiny_base(tmp_path / "base", settings, verbose=False)
    assert report["eval_set"] == "held_out" and not report["cached"]
    assert 0.0 < report["chance_accuracy"] < 1.0 and report["max_prompt_tokens"] < MODEL.max_position_embeddings
    rows = [json.loads(line) for line in (tmp_path / "base" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == SPEC.size and rows[0]["prompt"].endswith("</answer> tags.")
    assert make_tiny_base(tmp_path / "base", settings, verbose=False)["cached"]
    other = GymBaseSettings(model=MODEL, spec=GymSpec(SPEC.dataset, SPEC.options, seed=1, size=SPEC.size))
    assert other.content_hash() != settings.content_hash()
