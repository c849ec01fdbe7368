"""The weight sync: a sharded Megatron actor (any TP/PP/VPP/EP/ETP) into vLLM, in place.

The bridge's export stream (:func:`megatron_rl.bridge.iter_hf_tensors`) gathers each
HF-named full tensor onto every rank with real collectives (TP all-gather per the
family's split rules, expert gathers, broadcast from the owning pipeline stage). Here we
group the stream into size-bounded buckets and load each bucket into the colocated engine
with vLLM's in-place reload. Buckets end only between decoder layers: vLLM re-processes a
layer once all of its weights arrived in one reload, so a bucket that split a layer would
leave half of it stale. Extra memory is about one bucket (plus one layer if a single layer
is bigger than the bucket).

The parity guard then compares vLLM's logprobs with Megatron's on a few sequences, since
a silently wrong weight (a skipped tensor, the CPU MoE packing defect) only shows there.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.models.hf_config import ModelArch
from megatron_rl.rollout.engine import RolloutEngine

_LAYER = re.compile(r"^(model\.layers\.\d+)\.")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ParityError(RuntimeError):
    """vLLM's logprobs differ from Megatron's beyond the threshold after a sync."""


@dataclasses.dataclass(frozen=True)
class SyncStats:
    seconds: float
    bytes: int
    tensors: int
    buckets: int
    largest_bucket_bytes: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def layer_key(hf_name: str) -> str:
    """Tensors with the same key must travel in the same bucket (one decoder layer)."""
    match = _LAYER.match(hf_name)
    return match.group(1) if match else hf_name


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a (name, tensor) stream into buckets of about ``bucket_bytes``, never splitting a layer."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size, key = 0, None
    for name, tensor in named_tensors:
        k = layer_key(name)
        if bucket and k != key and size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        key = k
    if bucket:
        yield bucket


def sync_weights(
    chunks: Sequence[torch.nn.Module],
    arch: ModelArch,
    engine: RolloutEngine,
    bucket_bytes: int = 512 << 20,
    skip: Sequence[str] = (),
) -> SyncStats:
    """Push the actor's current weights into ``engine`` (collective over the world group).

    ``skip`` names HF tensors to leave out: only for tests of the parity guard.
    """
    from megatron_rl.bridge import iter_hf_tensors

    dtype = _TORCH_DTYPES[engine.config.dtype]
    start = time.perf_counter()
    moved = count = n_buckets = largest = 0
    stream = ((n, t) for n, t in iter_hf_tensors(chunks, arch, dtype=dtype) if n not in skip)
    for bucket in buckets(stream, bucket_bytes):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        engine.load_weights(bucket)
        moved += size
        count += len(bucket)
        n_buckets += 1
        largest = max(largest, size)
        del bucket
    engine.finish_weight_update()
    return SyncStats(time.perf_counter() - start, moved, count, n_buckets, largest)


@dataclasses.dataclass(frozen=True)
class ParityReport:
    mean_abs_diff: float
    max_abs_diff: float
    tokens: int


def check_parity(
    chunks: Sequence[torch.nn.Module],
    engine: RolloutEngine,
    sequences: Sequence[Sequence[int]],
    vocab_size: int,
    seq_length: int,
    threshold: Optional[float] = 1e-3,
    micro_batch_size: int = 1,
) -> ParityReport:
    """Compare vLLM's and Megatron's logprobs of ``sequences`` (the same list on every rank).

    Collective over the world group. Raises :class:`ParityError` when the largest
    difference exceeds ``threshold`` (None: only report).
    """
    from megatron_rl.schedules import TrainBatch, compute_logprobs, gather_data_parallel, local_batch, model_groups
    from megatron_rl.schedules.batch import pack_sequences

    dp = model_groups(list(chunks)).dp.size()
    rows = [list(s) for s in sequences]
    padded = rows + [rows[-1]] * (-len(rows) % (dp * micro_batch_size))  # rows divisible by DP x mbs
    tokens, mask = pack_sequences([r[:1] for r in padded], [r[1:] for r in padded], seq_length)
    batch = TrainBatch(tokens=tokens, loss_mask=mask)
    logp, _ = compute_logprobs(list(chunks), local_batch(list(chunks), batch), micro_batch_size, vocab_size)
    megatron = gather_data_parallel(list(chunks), logp)[: len(rows)].cpu()
    vllm = engine.prompt_logprobs(rows)
    diffs = []
    for n, row in enumerate(rows):
        ours = megatron[n, : len(row) - 1]
        diffs.append((ours - torch.tensor(vllm[n], dtype=ours.dtype)).abs())
    diff = torch.cat(diffs)
    stats = torch.tensor([float(diff.sum()), float(diff.numel()), float(diff.max())], dtype=torch.float64)
    if dist.is_initialized():
        total = stats[:2].clone()
        dist.all_reduce(total)
        worst = stats[2:].clone()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        stats = torch.cat([total, worst])
    report = ParityReport(float(stats[0] / stats[1]), float(stats[2]), int(stats[1]))
    if threshold is not None and report.max_abs_diff > threshold:
        raise ParityError(
            f"vLLM and Megatron logprobs differ by up to {report.max_abs_diff:.3g} (mean "
            f"{report.mean_abs_diff:.3g}) over {report.tokens} tokens after the weight sync; "
            f"threshold {threshold:g}: a weight is missing or wrongly mapped"
        )
    return report
