"""On-policy distillation's signal: the per-token reverse KL of the student to a teacher.

The student samples y ~ π_θ; the teacher scores each sampled token. The sampled estimate of
KL(π_θ || π_T) at token t is log π_θ(y_t) − log π_T(y_t), so its negative,
log π_T(y_t) − log π_θold(y_t), is a per-token advantage: the policy-gradient step that
follows it lowers the reverse KL (Agarwal et al., "On-Policy Distillation of Language
Models", 2024; Thinking Machines, "On-Policy Distillation", 2025). The student's logprobs
are the old policy's (the no-grad pass at the weights that sampled), so the advantage is
fixed over the step's PPO epochs, as any other.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms._common import Tensor


def reverse_kl_advantages(teacher_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[N, S] log π_T(y_t) − log π_old(y_t) on the masked tokens, 0 elsewhere."""
    return torch.where(mask.bool(), teacher_logprobs - old_logprobs, 0.0)


def mean_reverse_kl(teacher_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> float:
    """The mean over the masked tokens of log π_old(y_t) − log π_T(y_t) (0 when none is)."""
    mask = mask.bool()
    if not mask.any():
        return 0.0
    return float((old_logprobs - teacher_logprobs)[mask].mean())
