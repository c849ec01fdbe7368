"""`megatron-rl convert`: bad paths fail in one line (exit 2) before any model is built and
without touching the output; megatron-to-hf carries the source model's tokenizer and
generation config over, or says in one line that the output has none."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_rl.bridge import convert
from megatron_rl.bridge.cli import BAD_INPUT, main
from megatron_rl.bridge.parity import make_tiny_hf
from megatron_rl.checkpoint import format as fmt

REPO = Path(__file__).resolve().parents[3]
TOOLS = REPO / "tools"
# the child imports this checkout's package, whatever the environment has installed
ENV = dict(
    os.environ,
    HF_HUB_OFFLINE="1",
    OMP_NUM_THREADS="1",
    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
)


def _one_line_error(capsys, *argv) -> str:
    """Run the converter CLI expecting exit 2, one stderr line, and no model built."""
    assert main([str(a) for a in argv]) == BAD_INPUT
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("megatron-rl convert: error: "), captured
    assert not dist.is_initialized()  # the check came before the conversion set anything up
    return captured.err


def _each_input_refused(capsys, command, flag, parent, cases, out):
    """Each ``parent/name`` given as ``flag`` fails naming itself and ``cases[name]``; no output appears."""
    for name, expected in cases.items():
        err = _one_line_error(capsys, command, flag, parent / name, "--out", out)
        assert f"{flag} {parent / name}" in err and expected in err, (name, err)
    assert not out.exists()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny qwen3 HF directory with a real tokenizer and a generation config."""
    from megatron_rl.tasks.tokenizer import train_tokenizer

    out = make_tiny_hf("qwen3", tmp_path_factory.mktemp("hf") / "qwen3", seed=1)
    train_tokenizer([f"max of {a} {b} Answer: {max(a, b)}" for a in range(10) for b in range(10)]).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """``hf_dir`` converted by the real CLI in its own process (it sets up torch.distributed)."""
    out = tmp_path_factory.mktemp("ckpt") / "ckpt"
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "convert_hf_to_megatron.py"), "--hf", str(hf_dir), "--out", str(out)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_hf_to_megatron_refuses_a_bad_hf_directory(tmp_path, capsys, hf_dir):
    out = tmp_path / "out"
    (tmp_path / "file").write_text("x")
    (tmp_path / "no_config").mkdir()
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text((hf_dir / "config.json").read_text())
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{model_type:")
    cases = {
        "missing": "missing does not exist (an HF model directory holds config.json",
        "file": "file is not a directory",
        "no_config": "no_config is not an HF model directory: no config.json",
        "no_weights": "no_weights has no *.safetensors weights",
        "unknown": "model_type='not_a_model' is not supported; supported: ['llama', 'mixtral', 'qwen2'",
        "broken": "config.json is not readable JSON",
    }
    _each_input_refused(capsys, "hf-to-megatron", "--hf", tmp_path, cases, out)


def test_hf_to_megatron_refuses_an_output_that_holds_something(tmp_path, capsys, hf_dir, converted):
    before = sorted(p.name for p in converted.iterdir())
    err = _one_line_error(capsys, "hf-to-megatron", "--hf", hf_dir, "--out", converted)
    assert f"--out {converted} already holds committed step(s) [0]" in err
    assert sorted(p.name for p in converted.iterdir()) == before
    (tmp_path / "notes.txt").write_text("mine")
    err = _one_line_error(capsys, "hf-to-megatron", "--hf", hf_dir, "--out", tmp_path)
    assert "is not empty (holds notes.txt)" in err and (tmp_path / "notes.txt").read_text() == "mine"
    err = _one_line_error(capsys, "hf-to-megatron", "--hf", hf_dir, "--out", tmp_path / "notes.txt")
    assert "notes.txt is a file" in err


def test_megatron_to_hf_refuses_what_is_not_a_checkpoint(tmp_path, capsys, converted):
    (tmp_path / "empty").mkdir()
    (tmp_path / "died" / ".tmp_step_0").mkdir(parents=True)
    out = tmp_path / "out"
    cases = {
        "missing": "missing does not exist (a checkpoint root holds step_<N>/ directories with a COMMIT marker)",
        "empty": "empty is not a checkpoint: no committed step in it",
        "died": "no committed step in it; unfinished saves: .tmp_step_0",
    }
    _each_input_refused(capsys, "megatron-to-hf", "--ckpt", tmp_path, cases, out)
    err = _one_line_error(capsys, "megatron-to-hf", "--ckpt", converted, "--step", 3, "--out", out)
    assert "step 3 is not a committed checkpoint" in err and "committed steps: [0]" in err
    assert not out.exists()


def test_megatron_to_hf_refuses_a_non_empty_output(tmp_path, capsys, converted):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model.safetensors").write_bytes(b"previous export")
    err = _one_line_error(capsys, "megatron-to-hf", "--ckpt", converted, "--out", tmp_path / "old")
    assert f"--out {tmp_path / 'old'} is not empty (holds model.safetensors)" in err
    assert (tmp_path / "old" / "model.safetensors").read_bytes() == b"previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no temporary left behind either


def test_megatron_to_hf_copies_tokenizer_and_generation_config(tmp_path, capsys, hf_dir, converted):
    from transformers import AutoTokenizer

    assert main(["megatron-to-hf", "--ckpt", str(converted), "--out", str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    assert "tokenizer.json" in captured.out and captured.err.count("no tokenizer") == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (hf_dir / name).read_bytes(), name
    text = "max of 3 7 Answer: 7"
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"]
        == AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]
    )


def test_megatron_to_hf_says_in_one_line_when_the_output_has_no_tokenizer(tmp_path, capsys, hf_dir, converted):
    moved = hf_dir.with_name("moved_away")
    hf_dir.rename(moved)
    try:
        assert main(["megatron-to-hf", "--ckpt", str(converted), "--out", str(tmp_path / "hf")]) == 0
    finally:
        moved.rename(hf_dir)
    err = capsys.readouterr().err.splitlines()
    notes = [line for line in err if "note:" in line]
    assert len(notes) == 1 and "has no tokenizer" in notes[0] and f"{hf_dir}, no longer exists" in notes[0]
    assert (tmp_path / "hf" / "config.json").is_file() and not (tmp_path / "hf" / "tokenizer.json").exists()
    assert convert._source_side_files(None) == ([], "the checkpoint does not record the HF directory it came from")


def test_converted_checkpoint_records_its_source(converted, hf_dir):
    extra = fmt.read_metadata(converted, 0).extra
    assert extra["hf_source_dir"] == str(hf_dir.resolve())
