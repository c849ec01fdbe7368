"""On-policy distillation end to end (world 2, dense TP2): the student samples with vLLM, a
teacher (the student's base with its weights perturbed: another model of the same tokenizer)
scores every sampled token in the actor's layout, and the per-token reverse KL is the
advantage. Checked against transformers on the teacher's own directory: the teacher's saved
logprobs of the sampled tokens, the advantages (teacher minus the student's old logprobs on
the policy-loss tokens, 0 elsewhere) and ``distill/reverse_kl`` (their mean, negated)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.distributed.trainer_runs import check_steps, train

TOL = 1e-5  # fp32: Megatron's teacher forward against transformers'

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _perturbed_teacher(base, out):
    """A copy of ``base`` whose every weight is moved by seeded noise of 5 % of its scale."""
    shutil.copytree(base, out)
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    for name, w in weights.items():
        weights[name] = w + 0.05 * w.float().std() * torch.randn(w.shape, generator=g).to(w.dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _transformers_logprobs(hf_dir, prompt_ids, token_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt_ids) + list(token_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)[len(prompt_ids) - 1 :]


def test_the_teachers_reverse_kl_is_the_advantage(tmp_path, bases):
    teacher = _perturbed_teacher(bases["qwen3"], tmp_path / "teacher")
    rows, _ = train(
        tmp_path,
        2,
        bases["qwen3"],
        "opd",
        f"algorithm.teacher.path={teacher}",
        "parallel.tensor_model_parallel_size=2",
        "trainer.save_rollouts=true",
        steps=2,
    )
    check_steps(rows, steps=2)
    for r in rows:
        assert r["distill/reverse_kl"] > 0.0, r  # the student is not the teacher
    records = [json.loads(line) for line in (tmp_path / "run-opd" / "rollouts" / "step_000001.jsonl").open()]
    learned, reverse_kl = 0, 0.0
    for rec in records[:6]:
        expected = _transformers_logprobs(teacher, rec["prompt_ids"], rec["token_ids"])
        assert torch.allclose(torch.tensor(rec["teacher_logprobs"]), expected, atol=TOL), rec["row"]
    for rec in records:
        for t, o, a, m in zip(rec["teacher_logprobs"], rec["old_logprobs"], rec["advantages"], rec["loss_mask"]):
            assert a == pytest.approx(t - o if m else 0.0, abs=1e-6)
            learned += m
            reverse_kl += (o - t) * m
    assert rows[0]["distill/reverse_kl"] == pytest.approx(reverse_kl / learned, abs=1e-5)
