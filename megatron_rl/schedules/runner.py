"""Drive Megatron's `get_forward_backward_func` for RL: logprobs, values, and one update.

Every function takes this data-parallel rank's slice of the mini-batch (`local_batch`)
and works unchanged under PP and VPP: the schedule owns microbatching and pipelining,
results that live on the last pipeline stage are broadcast over the PP group so every
rank of the model ends up with them.

Exact normalisation (why the loss is pre-scaled). Megatron 0.16.1 offers two contracts
for the loss function: (a) return (loss, metrics): the schedule multiplies the loss by the
CP size and divides it by num_microbatches, and DDP scales gradients by 1/(DP·CP) before
summing them; (b) return (loss, num_tokens, metrics) with `calculate_per_token_loss`:
nothing is divided and finalize_model_grads divides every gradient by the total token
count. (b) has a single denominator, but a recipe's loss can need several (VAPO: policy
tokens and positive-example tokens; seq-mean modes count sequences, not tokens). So we use
(a): the denominators of the WHOLE mini-batch are summed over DP before it starts and
each microbatch returns its exact share ℓ_mb of the mini-batch loss, times
num_microbatches·DP (the CP factor the schedule applies cancels with DDP's). The gradient
is then Σ_ranks Σ_mb ∇ℓ_mb = ∇(mini-batch loss) for any microbatch count, DP or PP split,
with the default DDP config (average_in_collective either way).

Context parallelism (`schedules.context_parallel`): the CP ranks of a DP rank hold the same
rows; the model reads each rank's share of every sequence, the losses read whole rows
gathered back, so denominators and metrics are summed over DP only (not DP×CP), and each CP
rank's gradient covers its own tokens: DDP's sum over DP×CP is the whole gradient.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, Optional, Protocol, Union

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.models import route_replay
from megatron_rl.parallel.sequence_split import sequence_multiple
from megatron_rl.schedules.batch import TrainBatch
from megatron_rl.schedules.context_parallel import ContextShard
from megatron_rl.schedules.objectives import ActorLoss, CriticLoss, LossOutput
from megatron_rl.schedules.packing import Microbatching, PackedMicroBatch
from megatron_rl.schedules.vocab_parallel import vocab_parallel_logprobs

Tensor = torch.Tensor

__all__ = [
    "model_groups",
    "local_batch",
    "gather_data_parallel",
    "gathered_logprobs",
    "gathered_values",
    "compute_logprobs",
    "compute_values",
    "forward_backward",
    "train_step",
]


class MicrobatchLoss(Protocol):
    prefix: str

    def required_fields(self) -> tuple[str, ...]: ...
    def metric_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]: ...
    def local_norms(self, batch: TrainBatch) -> dict[str, Tensor]: ...
    def __call__(self, output: Tensor, mb: TrainBatch, norms, tp_group) -> LossOutput: ...


def model_groups(model_chunks: list[torch.nn.Module]):
    """The ProcessGroupCollection the model was built with (tp, pp, dp, dp_cp, cp, ...)."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(model_chunks[0], "pg_collection")


Micro = Union[int, Microbatching]


def local_batch(model_chunks: list[torch.nn.Module], batch: TrainBatch, micro: Optional[Micro] = None) -> TrainBatch:
    """This rank's data-parallel share of a mini-batch every rank holds in full: the
    contiguous slice, or with packing the rows that balance the ranks' token load."""
    groups = model_groups(model_chunks)
    rows = _microbatching(micro).rank_rows(batch, groups.dp.rank(), groups.dp.size())
    return batch.select(rows)


def gather_data_parallel(model_chunks: list[torch.nn.Module], local: Tensor, order: Optional[Tensor] = None) -> Tensor:
    """Every DP rank's [n_local, ...] result -> [N, ...]: in rank order, or with `order`
    (Microbatching.gather_order) back in the mini-batch's row order."""
    group = model_groups(model_chunks).dp
    gathered = local
    if group.size() > 1:
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local.contiguous(), group=group)
        gathered = torch.cat(parts)
    if order is None:
        return gathered
    out = torch.empty_like(gathered)
    out[order.to(out.device)] = gathered
    return out


def gathered_logprobs(
    model_chunks: list[torch.nn.Module], batch: TrainBatch, micro: Micro, vocab_size: int
) -> tuple[Tensor, Tensor]:
    """compute_logprobs on this rank's share of the whole `batch`, gathered: [N, S] twice."""
    micro = _microbatching(micro)
    local, order = _share_and_order(model_chunks, batch, micro)
    logp, entropy = compute_logprobs(model_chunks, local, micro, vocab_size)
    return gather_data_parallel(model_chunks, logp, order), gather_data_parallel(model_chunks, entropy, order)


def gathered_values(critic_chunks: list[torch.nn.Module], batch: TrainBatch, micro: Micro) -> Tensor:
    """compute_values on this rank's share of the whole `batch`, gathered: [N, S]."""
    micro = _microbatching(micro)
    local, order = _share_and_order(critic_chunks, batch, micro)
    return gather_data_parallel(critic_chunks, compute_values(critic_chunks, local, micro), order)


def _share_and_order(model_chunks, batch: TrainBatch, micro: Microbatching) -> tuple[TrainBatch, Tensor]:
    """This rank's rows of `batch` and the gather order, from one DP split."""
    dp = model_groups(model_chunks).dp
    split = micro.dp_split(batch, dp.size())
    return batch.select(split[dp.rank()]), torch.cat(split)


def compute_logprobs(
    model_chunks: list[torch.nn.Module],
    batch: TrainBatch,
    micro: Micro,
    vocab_size: int,
) -> tuple[Tensor, Tensor]:
    """Forward only: (logprobs [n, S], entropy [n, S]) of `batch`'s labels under the model,
    at each token's temperature, on every rank of the model (n = this DP rank's rows).
    vocab_size is the real vocabulary; padded rows of the LM head are masked."""
    _check_tokens(batch, vocab_size)
    groups = model_groups(model_chunks)

    def collect(mb, logits: Tensor):
        logp, entropy = vocab_parallel_logprobs(logits, mb.labels, vocab_size, groups.tp, mb.temperature)
        return logits.new_zeros(()), {"out": mb.as_rows(torch.stack([logp, entropy], dim=-1))}

    out = _forward_only(model_chunks, batch, micro, collect, channels=2)
    return out[..., 0], out[..., 1]


def compute_values(critic_chunks: list[torch.nn.Module], batch: TrainBatch, micro: Micro) -> Tensor:
    """Forward only: the critic's values [n, S] (prediction-aligned) on every rank."""

    def collect(mb, values: Tensor):
        return values.new_zeros(()), {"out": mb.as_rows(values.float())}

    return _forward_only(critic_chunks, batch, micro, collect, channels=1)[..., 0]


def forward_backward(
    model_chunks: list[torch.nn.Module],
    batch: TrainBatch,
    loss: Union[ActorLoss, CriticLoss, MicrobatchLoss],
    micro: Micro,
) -> dict[str, float]:
    """Accumulate the gradient of `loss` over the whole mini-batch (no zeroing, no step).

    Returns the mini-batch metrics "<prefix>/<name>", identical on every rank.
    """
    from megatron.core.utils import get_model_config

    groups = model_groups(model_chunks)
    config = get_model_config(model_chunks[0])
    _check_layout(groups, config, training=True)
    batch.require(*loss.required_fields())
    if isinstance(loss, ActorLoss):
        _check_tokens(batch, loss.vocab_size)
    norms = _global_norms(loss.local_norms(batch), groups)
    microbatches, _ = _microbatches(batch, micro, groups, config)
    scale = len(microbatches) * groups.dp_cp.size() / groups.cp.size()
    sum_names, max_names = loss.metric_names()

    def loss_func(mb, output: Tensor):
        result = (
            loss(output, mb, norms, groups.tp) if mb.row_batch.num_rows else _empty_loss(output, sum_names, max_names)
        )
        metrics = {
            "sums": torch.stack([result.sums[n].double() for n in sum_names]),
            "maxes": torch.stack([result.maxes[n].double() for n in max_names])
            if max_names
            else torch.zeros(0, dtype=torch.float64),
        }
        return result.loss * scale, metrics  # the schedule divides by len(microbatches)

    store = _run(model_chunks, microbatches, loss_func, forward_only=False)
    metrics = _reduce_metrics(store, len(sum_names), len(max_names), groups)
    names = [*sum_names, *max_names]
    return {f"{loss.prefix}/{name}": float(v) for name, v in zip(names, metrics)}


def train_step(
    model_chunks: list[torch.nn.Module],
    optimizer,
    batch: TrainBatch,
    loss: Union[ActorLoss, CriticLoss, MicrobatchLoss],
    micro: Micro,
) -> dict[str, float]:
    """One optimizer update on one mini-batch: zero, forward/backward, step.

    Returns forward_backward's metrics plus "<prefix>/grad_norm" (before clipping) and
    "<prefix>/update_skipped" (1 when a mixed-precision overflow skipped the step).
    """
    with platform.megatron_scope():
        for chunk in model_chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    metrics = forward_backward(model_chunks, batch, loss, micro)
    with platform.megatron_scope():
        updated, grad_norm, _ = optimizer.step()
    metrics[f"{loss.prefix}/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics[f"{loss.prefix}/update_skipped"] = float(not updated)
    return metrics


def model_inputs(model_chunks: list[torch.nn.Module], local: TrainBatch, micro: Micro) -> list[tuple]:
    """(tokens, position_ids, packed_seq_params) of each micro-batch the schedules run on this
    rank for its rows ``local``, on the platform's device: the arguments of one forward of the
    model, for a caller that runs it without the schedules (``megatron-rl bench step``'s floors)."""
    from megatron.core.utils import get_model_config

    groups = model_groups(model_chunks)
    microbatches, _ = _microbatches(local, micro, groups, get_model_config(model_chunks[0]))
    device = platform.current().device
    return [
        (mb.tokens, mb.position_ids, _packed_seq_params(mb, model_chunks[0]))
        for mb in (m.to(device) for m in microbatches)
    ]


# ---------------------------------------------------------------- internals


def _check_layout(groups, config, training: bool) -> None:
    if training and config.calculate_per_token_loss:
        raise ValueError(
            "TransformerConfig.calculate_per_token_loss must be False: the "
            "schedules pass exact mini-batch denominators themselves"
        )
    if training and config.finalize_model_grads_func is None:
        raise ValueError(
            "config.finalize_model_grads_func is None: set it to Megatron's "
            "finalize_model_grads after wrapping the chunks in DDP, or DP/PP "
            "gradients are never reduced"
        )


def _check_tokens(batch: TrainBatch, vocab_size: int) -> None:
    low, high = int(batch.tokens.min()), int(batch.tokens.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}); got [{low}, {high}]")


def _global_norms(local: dict[str, Tensor], groups) -> dict[str, Tensor]:
    """Sum each additive denominator over DP (CP ranks hold the same rows); an empty
    mini-batch gives 1 (loss 0)."""
    names = sorted(local)
    device = platform.current().device
    counts = torch.stack([local[n].to(torch.long) for n in names]).to(device)
    if groups.dp.size() > 1:
        dist.all_reduce(counts, group=groups.dp)
    return {n: c.clamp_min(1) for n, c in zip(names, counts)}


def _microbatching(micro: Optional[Micro]) -> Microbatching:
    if micro is None:
        return Microbatching()
    return micro if isinstance(micro, Microbatching) else Microbatching(micro_batch_size=micro)


def _microbatches(local: TrainBatch, micro: Optional[Micro], groups, config) -> tuple[list, list]:
    """This rank's micro-batches and each one's local rows. Packed: as many on every DP
    rank (empty ones appended); rows a multiple of TP under sequence parallelism; under the
    interleaved pipeline schedule one row length per call (see schedules.packing). Under CP
    each one is this rank's `ContextShard` of it."""
    micro = _microbatching(micro)
    tp = groups.tp.size() if config is not None and config.sequence_parallel else 1
    cp = groups.cp.size()
    if not micro.packed:
        multiple = sequence_multiple(cp, tp)
        if local.seq_length % multiple:
            raise ValueError(
                f"seq_length={local.seq_length} must be a multiple of {multiple} "
                f"(2·CP·TP with sequence parallelism; CP={cp}, TP={tp})"
            )
        bins = micro.bins(local)
        return _context_shards(micro.micro_batches(local, bins, len(bins)), groups), bins
    interleaved = config is not None and (config.virtual_pipeline_model_parallel_size or 1) > 1
    micro = micro.for_layout(tp, interleaved, cp)
    bins = micro.bins(local)
    agreed = torch.tensor(
        [len(bins), max(micro.row_lengths(local, bins) + [micro.multiple])], device=platform.current().device
    )
    if groups.dp.size() > 1:
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=groups.dp)
    count, length = int(agreed[0]), (int(agreed[1]) if interleaved else None)
    microbatches = _context_shards(micro.micro_batches(local, bins, count, length), groups)
    return microbatches, bins + [[] for _ in range(count - len(bins))]


def _context_shards(microbatches: list, groups) -> list:
    """Each micro-batch as this CP rank runs it (unchanged without CP)."""
    if groups.cp.size() == 1:
        return microbatches
    return [ContextShard(mb, groups.cp) for mb in microbatches]


def _empty_loss(output: Tensor, sum_names, max_names) -> LossOutput:
    """An empty packed micro-batch (DP agreement padding): loss 0, still part of the graph."""
    zero = output.sum() * 0.0
    return LossOutput(
        zero,
        {n: zero.detach() for n in sum_names},
        {n: torch.full_like(zero.detach(), float("-inf")) for n in max_names},
    )


def _packed_seq_params(mb, model):
    """Megatron's THD description of a packed micro-batch (None for padded rows). Under CP the
    offsets are the whole row's: Megatron's rotary embedding and the attention split each
    sequence themselves."""
    if isinstance(mb, ContextShard):
        mb = mb.packed
    if not isinstance(mb, PackedMicroBatch):
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens, longest = mb.cu_seqlens, mb.max_seqlen
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cp_group=model_groups([model]).cp,
    )


def _forward_step(loss_func, data_iterator, model):
    mb = next(data_iterator).to(platform.current().device)
    route_replay.set_targets(model, mb.routes)  # MoE router replay: this micro-batch's routes
    output = model(
        mb.tokens,
        mb.position_ids,
        None,  # last stage: [b, s, V/tp] or [b, s, 1]
        packed_seq_params=_packed_seq_params(mb, model),
    )
    return output, partial(loss_func, mb)


def _run(model_chunks, microbatches: list, loss_func: Callable, forward_only: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = list(model_chunks)
    first = microbatches[0]
    with platform.megatron_scope(), _shapes_per_micro_batch(chunks, microbatches):
        return get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_func),
            data_iterator=[iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(microbatches),
            seq_length=first.tokens.shape[1] * model_groups(chunks).cp.size(),  # Megatron divides by CP
            micro_batch_size=first.tokens.shape[0],
            forward_only=forward_only,
        )


@contextlib.contextmanager
def _shapes_per_micro_batch(chunks, microbatches: list):
    """Packed micro-batches differ in length. Megatron-Core's pipeline schedules send
    activations of the one shape given per call unless the model config's
    `variable_seq_lengths` is on, which exchanges each tensor's shape first (three int64
    per send). Turned on for this call only when the lengths really differ, so padded
    batches, PP=1 and the interleaved schedule (one length per call) keep the plain exchange."""
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    varying = len({mb.tokens.shape[1] for mb in microbatches}) > 1
    before = config.variable_seq_lengths
    config.variable_seq_lengths = before or varying
    try:
        yield
    finally:
        config.variable_seq_lengths = before


def _forward_only(model_chunks, batch: TrainBatch, micro: Micro, collect: Callable, channels: int) -> Tensor:
    """Run `collect` on every microbatch's last-stage output; [n, S, channels] everywhere."""
    from megatron.core.utils import get_model_config

    groups = model_groups(model_chunks)
    _check_layout(groups, None, training=False)
    microbatches, bins = _microbatches(batch, micro, groups, get_model_config(model_chunks[0]))
    with torch.no_grad():
        store = _run(model_chunks, microbatches, collect, forward_only=True)
    device = platform.current().device
    out = torch.zeros(batch.num_rows, batch.seq_length, channels, device=device)
    if _is_last_stage(groups):
        for rows, record in zip(bins, store):
            out[rows, : record["out"].shape[1]] = record["out"].float()
    _broadcast_from_last_stage(out, groups)
    return out


def _is_last_stage(groups) -> bool:
    return groups.pp.rank() == groups.pp.size() - 1


def _broadcast_from_last_stage(x: Tensor, groups) -> None:
    if groups.pp.size() > 1:
        last = dist.get_process_group_ranks(groups.pp)[-1]
        dist.broadcast(x, src=last, group=groups.pp)


def _reduce_metrics(store: list[dict], num_sums: int, num_maxes: int, groups) -> Tensor:
    """Sum/max over microbatches, then over DP (last stage), then broadcast over PP."""
    device = platform.current().device
    sums = torch.zeros(num_sums, dtype=torch.float64, device=device)
    maxes = torch.full((num_maxes,), float("-inf"), dtype=torch.float64, device=device)
    if _is_last_stage(groups):
        for record in store:
            sums += record["sums"].to(device)
            maxes = torch.maximum(maxes, record["maxes"].to(device))
        if groups.dp.size() > 1:  # CP ranks computed the same whole-row metrics
            dist.all_reduce(sums, group=groups.dp)
            if num_maxes:
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=groups.dp)
    packed = torch.cat([sums, maxes])
    _broadcast_from_last_stage(packed, groups)
    return packed
