"""torchrun body (world 1): the compiled elementwise kernels and the local MoE dispatcher on
the device the platform picked, against the layers and dispatcher as Megatron ships them.

Per case, one tiny model built twice with the same weights: as shipped (``fusion="none"``,
Megatron's alltoall dispatcher) and fast (``fusion="compiled"``, and for MoE the grouped
experts with the local dispatcher); fp32 with TF32 off; the largest logit and gradient
differences relative to their scale.

Usage: body_cuda_fusions.py OUT_DIR
"""

import copy
import sys
from functools import partial
from pathlib import Path

import torch

from megatron_rl.models.builder import BuildOptions, build_model
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl_lab.testing.model_grads import logits_and_grads
from megatron_rl_lab.testing.tiny import TINY_DENSE, TINY_QWEN3_MOE
from megatron_rl_lab.testing.torchrun import run_cases

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/cuda-fusions")
torch.set_float32_matmul_precision("highest")
CASES = {
    "dense": (TINY_DENSE, dict(), dict(fusion="compiled")),
    "moe": (
        TINY_QWEN3_MOE,
        dict(experts="grouped"),
        dict(experts="grouped", fusion="compiled", moe_token_dispatcher_type="local"),
    ),
}


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def case(name: str) -> dict:
    arch, shipped_options, fast_options = CASES[name]
    initialize(ParallelConfig(), seed=1234)
    try:
        torch.manual_seed(7)
        (shipped,) = build_model("actor", arch, ParallelConfig(), BuildOptions(**shipped_options))
        (fast,) = build_model("actor", arch, ParallelConfig(), BuildOptions(**fast_options))
        fast.load_state_dict(copy.deepcopy(shipped.state_dict()))
        tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
        device = next(shipped.parameters()).device
        want_logits, want_grads = logits_and_grads(shipped, tokens.to(device), loss="square")
        got_logits, got_grads = logits_and_grads(fast, tokens.to(device), loss="square")
        return {
            "device": device.type,
            "logit_diff": relative(got_logits, want_logits),
            "grad_diff": max(relative(got_grads[n], want) for n, want in want_grads.items()),
            "same_grad_names": sorted(got_grads) == sorted(want_grads),
        }
    finally:
        destroy()


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    run_cases({name: partial(case, name) for name in CASES})
