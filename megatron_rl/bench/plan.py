"""What an MFU benchmark run will do: its settings and its cases (layout x micro-batch size).

No torch here, so bad arguments are reported in well under a second.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.config import LayoutError, ParallelConfig

#: --dtype -> torch dtype name
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MfuSettings:
    """One benchmark run (every case shares these)."""

    model: str
    """Preset name or HF config path (recorded as given)."""
    role: str = "actor"
    """actor (LM head) | critic (value head)."""
    dtype: str = "fp32"
    """fp32 | bf16 parameters and compute."""
    seq_length: int = 256
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks."""
    steps: int = 5
    """Timed steps."""
    warmup: int = 2
    """Untimed steps first (allocator, thread pools, kernel selection)."""
    moe_token_dispatcher_type: str = "alltoall"
    recompute_activations: bool = False
    peak_tflops: Optional[float] = None
    """Per-device peak to use instead of the table / the measured CPU peak."""
    peak_matmul_size: int = 2048
    """Matrix size of the CPU matmul peak measurement."""
    seed: int = 1234


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout and micro-batch size."""

    parallel: ParallelConfig
    micro_batch_size: int

    def describe(self, world: int) -> str:
        p = self.parallel
        parts = [f"TP{p.tp}", f"PP{p.pp}"] + ([f"VPP{p.vpp}"] if p.vpp > 1 else [])
        parts += [f"EP{p.ep}", f"ETP{p.etp}", f"DP{p.dp(world)}"]
        return "·".join(parts) + f" mbs{self.micro_batch_size}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sweep_layouts(arch: ModelArch, world: int) -> list[ParallelConfig]:
    """Every TP x PP (x EP for MoE) layout that fits the world size and the model."""
    layouts = []
    for tp in _divisors(world):
        for pp in _divisors(world // tp):
            for ep in _divisors(world // pp) if arch.is_moe else [1]:
                layout = ParallelConfig(
                    tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
                )
                try:
                    layout.validate(world, arch.shape())
                except LayoutError:
                    continue
                layouts.append(layout)
    return layouts


def batch_problem(settings: MfuSettings, case: Case, world: int) -> Optional[str]:
    """Why this case cannot split the global batch (None when it can)."""
    dp = case.parallel.dp(world)
    if settings.global_batch_size % (case.micro_batch_size * dp):
        return (
            f"global batch {settings.global_batch_size} is not divisible by micro_batch_size x "
            f"data-parallel size = {case.micro_batch_size}x{dp}"
        )
    return None
