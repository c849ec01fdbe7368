"""The context-parallel benchmark: arguments refused in one line before torch is touched, and
the activation counter against tensors whose bytes are known."""

import argparse

import pytest
import torch

from megatron_rl_lab.bench import context_parallel
from megatron_rl_lab.bench.args import BenchArgumentError
from megatron_rl_lab.bench.cli import main


def _args(*argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    return context_parallel.add_parser(sub).parse_args(list(argv))


def test_bad_arguments_are_refused():
    with pytest.raises(BenchArgumentError, match="--cp 4 does not divide WORLD_SIZE=2"):
        context_parallel.make_plan(_args("--cp", "1,4"), world=2)
    with pytest.raises(
        BenchArgumentError, match=r"--seq-length 1000 must be a multiple of 2·CP·pack = 16 \(CP=2, pack=4\)"
    ):
        context_parallel.make_plan(_args("--cp", "1,2", "--seq-length", "1000"), world=2)
    plan = context_parallel.make_plan(_args("--model", "tiny-dense-4l", "--seq-length", "8192"), world=4)
    assert plan.cp_sizes == (1, 2, 4) and plan.arch.max_position_embeddings == 8192  # raised for the sequence


def test_bad_arguments_exit_2(capsys):
    assert main(["cp", "--model", "no-such-model"]) == 2
    assert "megatron-rl bench cp: error: --model: model 'no-such-model' is neither a preset" in capsys.readouterr().err


def test_saved_activations_count_each_storage_once_and_no_parameter():
    """x @ W saves x (and W, a parameter: not counted); tanh saves its output; a view of x
    saved again adds nothing. Counting stops once the backward unpacks."""
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    class Chunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = weight

    with context_parallel.SavedActivations([Chunk()]) as saved:
        y = torch.tanh(x @ weight)  # saves x (128 B) and the tanh output (128 B)
        z = (x[:2] * 2.0).sum() + y.sum()  # a view of x: the same storage
        z.backward()
        torch.tanh(torch.randn(100, requires_grad=True)).sum()  # after the backward started: not counted
    assert saved.bytes == 2 * 4 * 8 * 4
