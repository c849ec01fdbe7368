"""`megatron-rl convert megatron-to-hf` of a reward model: an HF one-label
*ForSequenceClassification whose scores are Megatron's last-token rewards.

A tiny qwen2 critic (untied LM head in the base, QKV bias, head size 32 as vLLM's CPU
attention needs, vocabulary padded for TP) with its backbone loaded from an HF base and a
unit-scale random head is saved as the reward-model trainer saves it
(``extra[MODEL_ROLE] == REWARD_MODEL``), exported, and scored by transformers in fp32 on
conversations of different lengths batched with right padding, against Megatron's rewards
through the trainer's path (pair_batch, gathered_values, last_token_rewards). Scores are
O(1) and both sides compute the same fp32 sums in another order (measured: 1e-6 apart), so
1e-5 absolute leaves a wrong tensor (a score moved by O(1)) nowhere to hide. vLLM (slow:
an engine start) must give transformers' scores too. Training keeps the head bias at 0,
which the export needs: a few steps with the reward model's frozen bias.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.bridge.cli import main
from megatron_rl.bridge.parity import make_tiny_hf
from megatron_rl.config.schema import MODEL_ROLE, REWARD_MODEL

TOL = 1e-5  # fp32
LENGTHS = (1, 5, 12, 23, 31, 8)
SEQ = 32
PROBE = Path(__file__).with_name("vllm_reward_probe.py")


def conversations(vocab: int, pad: int) -> list[list[int]]:
    """Random token ids of the lengths above, never the pad id (HF pools at the last non-pad token)."""
    g = torch.Generator().manual_seed(7)
    ids = [i for i in range(vocab) if i != pad]
    return [[ids[int(j)] for j in torch.randint(len(ids), (n,), generator=g)] for n in LENGTHS]


@pytest.fixture(scope="module")
def rm(world_of_one, tmp_path_factory, tokenizer):
    """The base, the reward model's checkpoints (zero and nonzero bias, and the same
    weights saved as a plain critic), the conversations and Megatron's rewards of them."""
    from megatron_rl import checkpoint
    from megatron_rl.bridge.load import load_hf
    from megatron_rl.models.builder import BuildOptions, build_model
    from megatron_rl.models.hf_config import arch_from_hf
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.schedules import gathered_values
    from megatron_rl.schedules.preference import last_token_rewards, pair_batch, pair_microbatching

    work = tmp_path_factory.mktemp("rm")
    base = make_tiny_hf("qwen2", work / "base", seed=3, vocab_size=len(tokenizer), hidden_size=128)
    tokenizer.save_pretrained(base)
    arch = arch_from_hf(base)
    (critic,) = build_model("critic", arch, ParallelConfig(), BuildOptions(vocab_size_divisible_by=7))
    load_hf([critic], base, arch, backbone_only=True)
    head = critic.output_layer
    with torch.no_grad():
        noise = torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(5))
        head.weight.copy_(noise / arch.hidden_size**0.5)
    convs = conversations(len(tokenizer), tokenizer.pad_token_id)
    batch = pair_batch(list(zip(convs[0::2], convs[1::2])), SEQ, tokenizer.pad_token_id)
    rewards = last_token_rewards(gathered_values([critic], batch, pair_microbatching(1, None)), batch)
    extra = {"hf_config": json.loads((base / "config.json").read_text()), "hf_source_dir": str(base)}
    roots = {}
    with checkpoint.Checkpointer() as ckpt:
        for name, role, bias in (
            ("rm", {MODEL_ROLE: REWARD_MODEL}, 0.0),
            ("critic", {}, 0.0),
            ("biased", {MODEL_ROLE: REWARD_MODEL}, 0.25),
        ):
            with torch.no_grad():
                head.bias.fill_(bias)
            roots[name] = work / name
            ckpt.save(roots[name], 1, model=[critic], extra={**extra, **role}).wait()
    return dict(
        roots=roots,
        out=work / "hf",
        convs=convs,
        rewards=rewards.tolist(),
        weight=head.weight.detach().clone(),
        pad=tokenizer.pad_token_id,
        pairs=batch,
        arch=arch,
    )


@pytest.fixture(scope="module")
def exported(rm):
    assert main(["megatron-to-hf", "--ckpt", str(rm["roots"]["rm"]), "--out", str(rm["out"])]) == 0
    return rm["out"]


def hf_scores(hf_dir: Path, convs: list[list[int]], pad: int) -> list[float]:
    """transformers' fp32 scores of ``convs`` in one right-padded batch."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    width = max(map(len, convs))
    ids = torch.tensor([c + [pad] * (width - len(c)) for c in convs])
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in convs])
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()


def test_the_export_is_a_one_label_sequence_classifier(rm, exported):
    from safetensors import safe_open

    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert config["num_labels"] == 1 and config["problem_type"] == "regression"
    assert config["pad_token_id"] == rm["pad"]
    names = {}
    for file in exported.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            names.update({n: f.get_tensor(n) for n in f.keys()})
    assert "lm_head.weight" not in names and "score.bias" not in names
    assert all(n.startswith("model.") for n in names if n != "score.weight")
    assert torch.equal(names["score.weight"], rm["weight"])
    assert names["model.embed_tokens.weight"].shape[0] == config["vocab_size"]  # TP padding dropped
    assert (exported / "tokenizer.json").is_file()


def test_transformers_scores_equal_megatron_rewards(rm, exported):
    scores = hf_scores(exported, rm["convs"], rm["pad"])
    diff = max(abs(a - b) for a, b in zip(scores, rm["rewards"]))
    assert diff < TOL, (diff, scores, rm["rewards"])
    assert max(map(abs, rm["rewards"])) > 0.1  # the scores move: the comparison means something


def test_a_nonzero_head_bias_is_refused_in_one_line(rm, tmp_path, capsys):
    code = main(["megatron-to-hf", "--ckpt", str(rm["roots"]["biased"]), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and "head bias is [0.25], not 0" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "hf").exists()


def test_a_value_head_that_is_not_a_reward_model_is_refused(rm, tmp_path, capsys):
    code = main(["megatron-to-hf", "--ckpt", str(rm["roots"]["critic"]), "--out", str(tmp_path / "hf")])
    assert code == 2 and "output_layer.bias" in capsys.readouterr().err


@pytest.mark.slow
def test_vllm_scores_equal_transformers(rm, exported):
    """VllmRewardModel (vLLM's pooling runner, in its own process: vLLM keeps process-wide state)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(exported), json.dumps(rm["convs"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = json.loads(proc.stdout.strip().splitlines()[-1])
    reference = hf_scores(exported, rm["convs"], rm["pad"])
    diff = max(abs(a - b) for a, b in zip(scores, reference))
    assert len(scores) == len(reference) and diff < TOL, (diff, scores, reference)


def test_training_with_the_frozen_bias_keeps_it_at_zero(rm):
    """The Bradley-Terry gradient wrt the bias is a fp32 residue (about 6e-8) that Adam would
    turn into steps of about the learning rate (a trained run's bias was 4e-4 after 20
    steps); the reward-model trainer freezes it (setup.build_trainable(freeze_head_bias))."""
    from megatron_rl.models.builder import BuildOptions, build_model, wrap_for_training
    from megatron_rl.models.value_head import freeze_bias
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.schedules import local_batch, train_step
    from megatron_rl.schedules.preference import PreferenceLoss, pair_batch, pair_microbatching

    chunks = build_model("critic", rm["arch"], ParallelConfig(), BuildOptions())
    freeze_bias(chunks)
    chunks, optimizer = wrap_for_training(chunks, dtype="fp32", lr=1e-2, clip_grad=1.0)
    head = chunks[0].module.output_layer
    before = head.weight.detach().clone()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, SEQ, (16,), generator=g)]
    batch = pair_batch(list(zip(rows[0::2], rows[1::2])), SEQ, 0)
    micro = pair_microbatching(8, 8 * SEQ)  # packed, as the example recipe: unfrozen, the bias moved by 4e-4
    for _ in range(3):
        train_step(chunks, optimizer, local_batch(chunks, batch, micro), PreferenceLoss(), micro)
    assert not torch.equal(head.weight, before)
    assert torch.count_nonzero(head.bias) == 0
