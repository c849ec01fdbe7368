"""`megatron-rl convert`: HF -> megatron_rl checkpoint -> HF reproduces the input bitwise,
and bad input gets one clear error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.bridge.cli import main
from megatron_rl.bridge.parity import make_tiny_hf

ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
TOOLS = Path(__file__).resolve().parents[3] / "tools"


def tensors(path: Path) -> dict:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def hf_to_megatron(*args):
    return subprocess.run(
        [sys.executable, str(TOOLS / "convert_hf_to_megatron.py"), *map(str, args)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    return make_tiny_hf("qwen2_moe", tmp_path_factory.mktemp("hf") / "qwen2_moe", seed=3)


@pytest.mark.slow
def test_round_trip_is_bitwise_and_pads_the_vocabulary_for_tp(moe_hf, tmp_path):
    proc = hf_to_megatron("--hf", moe_hf, "--out", tmp_path / "ckpt", "--tp", 2, "--ep", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hf -> megatron" in proc.stderr  # the progress bar

    from megatron_rl.checkpoint import iter_model_tensors

    stored = dict(iter_model_tensors(tmp_path / "ckpt"))
    assert stored["embedding.word_embeddings.weight"].shape == (98, 64)  # vocab 97 padded for TP2
    assert torch.count_nonzero(stored["embedding.word_embeddings.weight"][97:]) == 0

    assert main(["megatron-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    source, back = tensors(moe_hf), tensors(tmp_path / "back")
    assert set(back) == set(source)
    assert all(torch.equal(back[n], source[n]) for n in source)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe" and config["dtype"] == "float32"


def test_expert_parallel_size_must_divide_the_experts(moe_hf, tmp_path, capsys):
    code = main(["hf-to-megatron", "--hf", str(moe_hf), "--out", str(tmp_path / "c"), "--ep", "3"])
    assert code == 2
    assert "expert_model_parallel_size=3 does not divide num_moe_experts=4" in capsys.readouterr().err


def test_unsupported_architecture_lists_the_supported_ones(tmp_path, capsys):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code = main(["hf-to-megatron", "--hf", str(tmp_path / "gpt2"), "--out", str(tmp_path / "c")])
    assert code == 2
    err = capsys.readouterr().err
    assert "'gpt2' is not supported" in err and "qwen3_moe" in err


def test_a_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    code = main(["megatron-to-hf", "--ckpt", str(tmp_path / "none"), "--out", str(tmp_path / "o")])
    assert code == 2
    assert "none does not exist" in capsys.readouterr().err
