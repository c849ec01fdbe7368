"""Per-rank random state: torch (CPU and CUDA), Megatron's model-parallel tracker, python, numpy.

Exact resume needs every generator a training step draws from (dropout under the tracker's
fork, data shuffles in python/numpy). The states are layout-specific (the tracker seeds
differ by TP rank), so they are restored only into the layout that saved them.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from megatron_rl import platform
from megatron_rl.checkpoint.format import decode, encode


def _tracker():
    from megatron.core import tensor_parallel

    with platform.megatron_scope():
        tracker = tensor_parallel.get_cuda_rng_tracker()
    return tracker if getattr(tracker, "is_initialized", lambda: False)() else None


def capture() -> dict:
    """This rank's RNG states as JSON."""
    state = {
        "torch_cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available() and platform.current().is_cuda:
        state["torch_cuda"] = torch.cuda.get_rng_state()
    tracker = _tracker()
    if tracker is not None:
        state["megatron_tracker"] = tracker.get_states()
    return encode(state)


def restore(saved: dict) -> None:
    state = decode(saved)
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "torch_cuda" in state and platform.current().is_cuda:
        torch.cuda.set_rng_state(state["torch_cuda"])
    tracker = _tracker()
    if "megatron_tracker" in state and tracker is not None:
        tracker.set_states(state["megatron_tracker"])
