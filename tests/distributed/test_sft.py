"""Supervised fine-tuning: the token loss through Megatron's schedules (the shared world-4
launch, body_sft.py) in DP4, TP2, packed PP2 and CP2 equals plain single-process autograd on
the whole batch, loss and every gradient; `train` runs the recipe on a file of multi-turn
and tool conversations, saves, resumes, and its val/<set>/loss is transformers' loss of the
exported checkpoint on the same conversations; GRPO then starts from its checkpoint
(model.ckpt) in DP2 with vLLM serving the checkpoint's weights."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.data.chat import ChatExample, encode_chat
from tests.distributed.trainer_runs import FP32_PARITY_MAX, train

TOL = 1e-6  # fp32
VAL_TOL = 1e-5  # fp32, Megatron's eval forward against transformers' on the exported weights

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(shared_launch4):
    return shared_launch4.results("body_sft")


@pytest.mark.parametrize("case", ["dp4", "tp2", "packed-pp2", "cp2"])
def test_the_token_loss_and_its_gradient_equal_the_single_process_reference(results, case):
    outcome = results[case]
    assert outcome["ok"], outcome["error"]
    r = outcome["result"]
    assert r["params_without_grad"] == [], r
    assert r["max_grad"] > 1e-3, "reference gradients too small to compare meaningfully"
    assert r["max_grad_diff"] < TOL, f"{r['worst_key']}: {r['max_grad_diff']}"
    assert r["loss_diff"] < TOL, r


def _conversations(n):
    """Multi-turn conversations, every third one with a tool call and its response."""
    rows = []
    for i in range(n):
        a, b = i % 10, (3 * i + 1) % 10
        messages = [
            {"role": "user", "content": f"max {a} {b}"},
            {"role": "assistant", "content": f"Answer: {max(a, b)}"},
            {"role": "user", "content": f"max {b} {a} {i % 7}"},
        ]
        if i % 3 == 0:
            call = {"name": "python", "arguments": {"code": f"print(max({a}, {b}, {i % 7}))"}}
            messages += [
                {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": call}]},
                {"role": "tool", "content": str(max(a, b, i % 7))},
            ]
        messages.append({"role": "assistant", "content": f"Answer: {max(a, b, i % 7)}"})
        rows.append({"messages": messages})
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(overrides):
    cmd = [sys.executable, "-m", "megatron_rl", "train", "--config", "examples/sft.yaml", *overrides]
    proc = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc


def _transformers_loss(hf_dir, rows):
    """Mean -log p per assistant token of ``rows`` under the exported model, in transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    for row in rows:
        encoded = encode_chat(tokenizer, ChatExample(tuple(row["messages"]), None, "x"))
        ids = torch.tensor([encoded.ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        token_logp = logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        learned = torch.tensor(encoded.mask[1:])
        total -= float(token_logp[learned].sum())
        count += int(learned.sum())
    return total / count


def test_train_runs_the_recipe_on_chat_files_resumes_and_evaluates_as_transformers(tmp_path, bases):
    train_file = _write(tmp_path / "train.jsonl", _conversations(48))
    held_out_rows = _conversations(61)[48:]
    held_out = _write(tmp_path / "held_out.jsonl", held_out_rows)
    run_dir = tmp_path / "run"
    overrides = [
        f"model.hf_path={bases['qwen3']}",
        "data.seed=null",
        f"data.source={train_file}",
        f"eval.sets.held_out.source={held_out}",
        f"trainer.run_dir={run_dir}",
        "trainer.seq_length=160",
        "trainer.max_tokens_per_micro_batch=640",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "eval.every=2",
        "checkpoint.save_interval=2",
        "trainer.loggers=[]",
    ]
    first = _train(overrides + ["trainer.max_steps=4"])
    assert "val/held_out/loss" in first.stdout
    again = _train(overrides + ["trainer.max_steps=5"])
    assert f"resumed from {run_dir / 'checkpoints'} step 4" in again.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert all({"train/loss", "train/grad_norm", "timing/step_s"} <= set(r) for r in rows[1:])
    evaluated = {r["step"]: r["val/held_out/loss"] for r in rows if "val/held_out/loss" in r}
    assert sorted(evaluated) == [0, 2, 4, 5] and evaluated[5] < evaluated[0], evaluated
    export = subprocess.run(
        [sys.executable, "-m", "megatron_rl", "convert", "megatron-to-hf", "--ckpt", str(run_dir / "checkpoints"),
         "--out", str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr[-3000:]
    assert abs(_transformers_loss(tmp_path / "hf", held_out_rows) - evaluated[5]) < VAL_TOL
    # RL from that checkpoint (model.ckpt), in another layout (DP2): vLLM, built from the HF base,
    # gets the checkpoint's weights before the first rollout, so its logprobs are Megatron's.
    rl_rows, out = train(tmp_path, 2, bases["qwen3"], "grpo", f"model.ckpt={run_dir / 'checkpoints'}", steps=1)
    assert f"started from model.ckpt={run_dir / 'checkpoints'} step 5" in out
    assert rl_rows[0]["rollout/logprob_abs_diff"] < 1e-3, rl_rows[0]
    assert rl_rows[0]["rollout/parity_max_abs_diff"] < FP32_PARITY_MAX, rl_rows[0]
