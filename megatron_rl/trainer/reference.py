"""A frozen policy's token logprobs: the KL penalty's reference, on-policy distillation's teacher.

The reference is the actor's starting point (GRPO's k3 against the initial model): the same
weights (the HF directory's, then ``model.ckpt``'s when set), loaded into a second set of
chunks in the actor's layout, never wrapped for training (no gradient buffers, no optimizer
state: it costs one copy of the weights). It is always rebuilt from the base model, so a
resumed run penalises against the same policy as the fresh one. A teacher is the same thing
built from its own HF directory and shape.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.bridge import load_hf
from megatron_rl.from_config.setup import load_start_weights
from megatron_rl.models.builder import BuildOptions, build_model
from megatron_rl.models.hf_config import ModelArch
from megatron_rl.parallel.config import ParallelConfig


class ReferencePolicy:
    """π_ref's token logprobs on a packed batch, on every rank (like the old logprobs)."""

    def __init__(self, arch: ModelArch, parallel: ParallelConfig, options: BuildOptions, hf_dir: Path, start=None):
        """``start`` (model.ckpt's step): its weights after the HF directory's, as the actor's."""
        self.vocab_size = arch.vocab_size
        self.chunks = build_model("actor", arch, parallel, options)
        load_hf(self.chunks, hf_dir, arch)
        if start is not None:
            load_start_weights(self.chunks, start)
        for chunk in self.chunks:
            chunk.eval()
            chunk.requires_grad_(False)

    @torch.no_grad()
    def logprobs(self, batch, micro) -> torch.Tensor:
        """[N, S] log π_ref(token t + 1) at each token's sampling temperature (batch: every row;
        micro: rows per micro-batch or a schedules.Microbatching)."""
        from megatron_rl.schedules import gathered_logprobs

        return gathered_logprobs(self.chunks, batch, micro, self.vocab_size)[0]
