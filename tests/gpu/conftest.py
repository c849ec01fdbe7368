"""The GPU suite: each test runs one body on CUDA at world 1 and the same body on CPU
(``MEGATRON_RL_FORCE_CPU=1``, gloo) as its reference, and compares what they computed.

A body is a torchrun script (see :mod:`megatron_rl_lab.testing.torchrun`) whose cases save
their tensors with ``torch.save`` under the directory given as its first argument and
return small JSON-able summaries. Both runs of a module share one launch per device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import pytest
import torch

from megatron_rl_lab.testing.torchrun import launch

CPU_ENV = {"MEGATRON_RL_FORCE_CPU": "1", "CUDA_VISIBLE_DEVICES": ""}
"""The CPU reference sees no GPU, so it runs as on a CPU machine. With one visible, Megatron's
torch.compile'd functions (``jit_fuser``: the MoE router's ``_apply_expert_bias``) had dynamo
ask the CUDA device interface for the current device, which the CPU layer's
``torch.cuda.current_device`` answers with a CPU device: the MoE cases crashed on an H200."""


def launch_on(body: Path, device: str, out_dir: Path, timeout_s: float = 900, args: Sequence[str] = ()) -> dict:
    """``body``'s case results at world 1 on ``device`` ("cuda" or "cpu"); tensors under
    ``out_dir/<device>``, the body's first argument (``args`` follow it).

    In a dry run (no CUDA) both devices are the CPU, so one launch serves both: the first
    call runs the CPU reference, later calls read its results back, and ``out_dir/cuda`` is
    a link to ``out_dir/cpu``. The bodies and comparisons still run once each; the second,
    identical launch would prove nothing more."""
    dry_run = not torch.cuda.is_available()
    if dry_run:
        device = "cpu"
    directory = out_dir / device
    saved = directory / "launch-results.json"
    if dry_run and saved.exists():
        return json.loads(saved.read_text())
    directory.mkdir(parents=True, exist_ok=True)
    env = CPU_ENV if device == "cpu" else None
    results = launch(body, 1, args=[str(directory), *args], timeout_s=timeout_s, env=env)
    if dry_run:
        saved.write_text(json.dumps(results))
        (out_dir / "cuda").symlink_to(directory.name)
    return results


def expected_device(device: str) -> str:
    """The device a launch on ``device`` really ran on: the "cuda" launches of a dry run
    (``MEGATRON_RL_GPU_DRY_RUN=1`` on a machine without CUDA, see tests/conftest.py) run on
    the CPU, which proves the bodies and comparisons work but nothing about CUDA."""
    return device if torch.cuda.is_available() else "cpu"


def case_result(results: dict, case: str):
    """One case's result, or the test fails with the body's traceback."""
    if "__launch__" in results and case not in results:
        pytest.fail(results["__launch__"]["error"])
    r = results.get(case)
    if r is None:
        pytest.fail(f"case {case!r} did not run: {sorted(results)}")
    if not r["ok"]:
        pytest.fail(r["error"])
    return r["result"]
