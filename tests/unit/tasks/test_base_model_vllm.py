"""The tiny base end to end: a (shortened) build, the cache, and vLLM serving the saved
directory with the chat template, agreeing with transformers' greedy answers and logprobs."""

import json
import subprocess
import sys
import time

import pytest

from megatron_rl.tasks.base_model import BaseModelSettings, make_tiny_base

SMALL = BaseModelSettings(num_train_prompts=400, num_eval_prompts=32, warmup_steps=40, warmup_batch_size=16)


@pytest.mark.slow
def test_build_cache_and_vllm_agrees_with_transformers(tmp_path):
    out = tmp_path / "base"
    report = make_tiny_base(out, SMALL, verbose=False)
    assert not report["cached"]
    assert report["chance_accuracy"] == pytest.approx(0.1)
    assert report["warmup_final_loss"] < report["warmup_first_loss"] / 3
    assert report["sampled_format_rate_after_warmup"] >= 0.9  # the format is learned ...
    assert report["sampled_accuracy_after_warmup"] <= 0.35  # ... the task is not
    assert 0.5e6 < report["num_parameters"] < 5e6
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "train.jsonl",
        "eval.jsonl",
    ):
        assert (out / name).is_file(), name

    started = time.perf_counter()
    again = make_tiny_base(out, SMALL, verbose=False)
    assert again["cached"] and time.perf_counter() - started < 1.0
    assert again["accuracy_after_warmup"] == report["accuracy_after_warmup"]

    result = subprocess.run(
        [sys.executable, "-m", "megatron_rl.tasks.engine_check", str(out), "6"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    line = [out for out in result.stdout.splitlines() if out.startswith("ENGINE_CHECK ")]
    assert line, result.stderr[-3000:]
    check = json.loads(line[0].split(" ", 1)[1])
    assert check["vllm"] == check["transformers"], check
    assert all(text.startswith("Answer: ") for text in check["vllm"]), check
    assert check["max_logprob_abs_diff"] < 1e-3, check
