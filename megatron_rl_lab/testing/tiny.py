"""The tests' tiny architectures by role, from the runtime's preset table."""

from megatron_rl.models.presets import TINY_ARCHS, TINY_DENSE, TINY_MOE, TINY_QWEN3_MOE

__all__ = ["TINY_ARCHS", "TINY_DENSE", "TINY_MOE", "TINY_QWEN3_MOE"]
