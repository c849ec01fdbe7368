"""Token log-probabilities and entropy from vocabulary-parallel logits.

Under tensor parallelism the LM head is column-parallel: TP rank r holds the logits of
vocabulary rows [r·V/tp, (r+1)·V/tp). Gathering the full [tokens, V] logits on one rank
would cost tp× the memory of the largest activation of the step, so the softmax
statistics are reduced over the TP group instead (max, Σexp, the label's logit and
Σ p·z in one all-reduce). Rows past the real vocabulary (Megatron pads it to a multiple
of TP) are masked to −inf so they carry no probability and get no gradient.

Per-token temperature: logprobs are those of softmax(logits / T_t), the distribution the
token was sampled from (HAPO samples every token at its own temperature).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

Tensor = torch.Tensor

__all__ = ["vocab_parallel_logprobs"]


def _all_reduce(x: Tensor, op, group: Optional[dist.ProcessGroup]) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelLogprobs(torch.autograd.Function):
    """(logits shard [..., Vl], labels [...]) -> (logprob [...], entropy [...]), fp32.

    Saves only p = softmax(z) for this rank's rows (one [..., Vl] fp32 tensor, like
    Megatron's vocab-parallel cross entropy). With z = logits / T:
    d logp / dz_j = 1[j = label] − p_j and dH / dz_j = −p_j (log p_j + H).
    The gradient of a TP rank's shard needs no communication: every TP rank holds the
    same (replicated) loss, and the column-parallel LM head sums the input gradients.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_start, vocab_size, group):
        local_vocab = logits.shape[-1]
        z = logits.to(torch.float32, copy=True)
        if temperature is not None:
            z.div_(temperature.unsqueeze(-1))
        columns = torch.arange(vocab_start, vocab_start + local_vocab, device=z.device)
        padded = columns >= vocab_size
        if bool(padded.any()):
            z.masked_fill_(padded, float("-inf"))
        # The max is only a shift for stability: it cancels in every output.
        shift = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
        z.sub_(shift.unsqueeze(-1))
        owned = (labels >= vocab_start) & (labels < vocab_start + local_vocab)
        index = (labels - vocab_start).clamp(0, local_vocab - 1).unsqueeze(-1)
        label_z = torch.where(owned, z.gather(-1, index).squeeze(-1), 0.0)
        exp_z = z.exp()  # padded rows: exp(−inf) = 0
        z.masked_fill_(padded, 0.0)  # so that 0·(−inf) does not make Σ p·z nan
        sums = torch.stack([label_z, exp_z.sum(-1), (exp_z * z).sum(-1)], dim=-1)
        label_z, sum_exp, sum_exp_z = _all_reduce(sums, dist.ReduceOp.SUM, group).unbind(-1)
        log_sum_exp = sum_exp.log()
        logprob = label_z - log_sum_exp
        entropy = log_sum_exp - sum_exp_z / sum_exp
        probs = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(probs, entropy, owned, index, temperature)
        ctx.logits_dtype = logits.dtype
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        probs, entropy, owned, index, temperature = ctx.saved_tensors
        grad_z = torch.zeros_like(probs)
        if grad_logprob is not None:
            grad_z.sub_(probs * grad_logprob.unsqueeze(-1))
            picked = torch.where(owned, grad_logprob, 0.0).unsqueeze(-1)
            grad_z.scatter_add_(-1, index, picked)
        if grad_entropy is not None:
            g = grad_entropy.unsqueeze(-1)
            grad_z.sub_(g * (torch.special.xlogy(probs, probs) + probs * entropy.unsqueeze(-1)))
        if temperature is not None:
            grad_z.div_(temperature.unsqueeze(-1))
        return grad_z.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_logprobs(
    logits: Tensor,
    labels: Tensor,
    vocab_size: int,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: Union[Tensor, float, None] = None,
) -> tuple[Tensor, Tensor]:
    """log softmax(logits / T)[label] and the entropy of softmax(logits / T), per token.

    logits: [..., V/tp] this TP rank's contiguous vocabulary shard (rank r holds rows
    r·V/tp ...; V the padded vocabulary); labels: [...] global token ids (< vocab_size);
    vocab_size: the REAL vocabulary size (rows at and past it are padding, masked);
    tp_group: None or a group of one = the full vocabulary is local; temperature: None
    (1), a float, or [...] per-token temperatures (> 0). Returns float32 (logprob,
    entropy), both differentiable w.r.t. logits.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match logits without the vocabulary dim {tuple(logits.shape[:-1])}"
        )
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    local_vocab = logits.shape[-1]
    if vocab_size > local_vocab * tp_size:
        raise ValueError(
            f"vocab_size={vocab_size} exceeds the model's vocabulary {local_vocab}×{tp_size} (per-rank rows × TP)"
        )
    if temperature is not None:
        temperature = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
        temperature = temperature.expand(labels.shape).contiguous()
        if not bool((temperature > 0).all()):
            raise ValueError("temperature must be > 0 at every token")
    return _VocabParallelLogprobs.apply(logits, labels, temperature, tp_rank * local_vocab, vocab_size, tp_group)
