"""The weight sync: a sharded Megatron actor (any TP/PP/VPP/EP/ETP) into vLLM, in place.

The bridge's bucketed export (:func:`megatron_rl.bridge.iter_hf_buckets`) gathers the
HF-named full tensors onto every rank, one broadcast per decoder layer and owning rank,
into one bucket buffer reused from bucket to bucket (and from sync to sync on CPU). Each
bucket is loaded in place into the engines, colocated or on rollout ranks of their own
(:meth:`~megatron_rl.rollout.backend.RolloutBackend.load_weights`: on CPU the fast
per-layer path of :mod:`megatron_rl.rollout.inplace_load`, else vLLM's reload). Buckets
end only between decoder layers: packed kernel weights are rebuilt from all of a module's
weights at once (fused qkv, all experts of a layer), and vLLM's reload processes a layer
only once all of it arrived. Extra memory is about one bucket
plus one layer. A :class:`WeightSync` keeps the export plan and those buffers (its own
``ExportPlans``) for all syncs of one actor into one engine.

The parity guard then checks that vLLM serves what was sent: its loaded weights read back
(:mod:`.weight_check`) and its logprobs of a few sequences against Megatron's, judged per
dtype (:mod:`.parity`), since a silently wrong weight (a skipped tensor, the CPU MoE
packing defect) shows nowhere else.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from megatron_rl.models.hf_config import ModelArch
from megatron_rl.rollout import parity
from megatron_rl.rollout.backend import RolloutBackend
from megatron_rl.rollout.parity import ParityError, ParityLimits, ParityReport, parity_limits, parity_report
from megatron_rl.utils import dtypes

if TYPE_CHECKING:
    from megatron_rl.rollout.weight_check import WeightCheckResult


@dataclasses.dataclass(frozen=True)
class SyncStats:
    seconds: float
    bytes: int
    tensors: int
    buckets: int
    largest_bucket_bytes: int
    weight_check: Optional["WeightCheckResult"] = None
    """What reading the weights back found (only when the sync was asked to check)."""
    transport: str = "local"
    """How the gather moved the pieces between ranks (:data:`megatron_rl.bridge.export.TRANSPORTS`)."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


class WeightSync:
    """Pushes the actor's current weights into ``engine`` (collective over the training
    world group), keeping the export plan and the gather buffers from one sync to the next.

    ``bucket_bytes``: the largest bucket (a decoder layer larger than that goes alone).
    ``keep_buffers``: keep the gather's bucket and receive buffers for the next sync (None:
    on CPU, where mapping fresh pages costs as much as a copy; freed on GPU, where training
    wants the memory back).
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        arch: ModelArch,
        engine: RolloutBackend,
        bucket_bytes: int = 512 << 20,
        keep_buffers: Optional[bool] = None,
    ):
        from megatron_rl.bridge import ExportPlans

        self.chunks, self.arch, self.engine, self.bucket_bytes = chunks, arch, engine, bucket_bytes
        self.keep_buffers = not torch.cuda.is_available() if keep_buffers is None else keep_buffers
        self.plans = ExportPlans()
        """The export plan, gather plans and buffers of ``chunks`` (built at the first sync)."""

    def sync(self, check_weights: bool = False, skip: Sequence[str] = ()) -> SyncStats:
        """One sync, bucket by bucket. ``check_weights``: read every bucket back from vLLM
        after loading it (:mod:`.weight_check`; its time is not counted in ``seconds``) and
        raise :class:`ParityError`, on every rank, when a served weight differs. ``skip``
        names HF tensors to leave out: only for tests of the parity guard."""
        from megatron_rl.bridge import iter_hf_buckets
        from megatron_rl.rollout.weight_check import WeightCheckResult

        dtype = dtypes.to_torch(self.engine.config.dtype)
        start = time.perf_counter()
        moved = count = n_buckets = largest = 0
        checked, check_seconds = WeightCheckResult(), 0.0
        for bucket in iter_hf_buckets(
            self.chunks, self.arch, self.bucket_bytes, dtype=dtype, keep_buffers=self.keep_buffers, plans=self.plans
        ):
            sent = [(n, t) for n, t in bucket if n not in skip]
            size = sum(t.numel() * t.element_size() for _, t in sent)
            self.engine.load_weights(sent)  # the views are reused for the next bucket: load them now
            if check_weights:  # against the whole export: a tensor lost on the way is a mismatch
                check_start = time.perf_counter()
                checked = checked.merged(self.engine.check_weights(bucket))
                check_seconds += time.perf_counter() - check_start
            moved += size
            count += len(sent)
            n_buckets += 1
            largest = max(largest, size)
            del bucket, sent
        self.engine.finish_weight_update()
        seconds = time.perf_counter() - start - check_seconds
        if check_weights:
            require_weights_match(checked)
        return SyncStats(
            seconds, moved, count, n_buckets, largest, checked if check_weights else None, self.plans.transport
        )


def require_weights_match(result: "WeightCheckResult") -> None:
    """Raise :class:`ParityError` on every rank when any rank's engine serves a weight that
    differs from the exported one (collective). Weights the check cannot read (another
    backend than vLLM's CPU one) are not an error: ``result.unsupported`` names them."""
    import torch.distributed as dist

    bad = torch.tensor([float(bool(result.mismatches))])
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bad.item():
        return
    if result.mismatches:
        raise ParityError(
            f"vLLM serves weights that differ from the synced ones: {result.describe()}: "
            "a weight is missing or wrongly mapped"
        )
    raise ParityError("vLLM serves weights that differ from the synced ones on another rank (see its log)")


def check_parity(
    chunks: Sequence[torch.nn.Module],
    engine: RolloutBackend,
    sequences: Sequence[Sequence[int]],
    vocab_size: int,
    seq_length: int,
    limits: Optional[ParityLimits] = None,
    micro_batch_size: int = 1,
    judge: bool = True,
) -> ParityReport:
    """Compare vLLM's and Megatron's logprobs of ``sequences`` (the same list on every rank).

    Collective over the world group. Raises :class:`ParityError` when a statistic exceeds
    ``limits`` (None: the engine dtype's, :data:`megatron_rl.rollout.parity.PARITY_LIMITS`);
    ``judge=False`` only reports.
    """
    from megatron_rl.schedules import TrainBatch, compute_logprobs, gather_data_parallel, local_batch, model_groups
    from megatron_rl.schedules.batch import pack_sequences

    dp = model_groups(list(chunks)).dp.size()
    rows = [list(s) for s in sequences]
    padded = rows + [rows[-1]] * (-len(rows) % (dp * micro_batch_size))  # rows divisible by DP x mbs
    tokens, mask = pack_sequences([r[:1] for r in padded], [r[1:] for r in padded], seq_length)
    batch = TrainBatch(tokens=tokens, loss_mask=mask)
    logp, _ = compute_logprobs(list(chunks), local_batch(list(chunks), batch), micro_batch_size, vocab_size)
    megatron = gather_data_parallel(list(chunks), logp)[: len(rows)].cpu().to(torch.float64)
    vllm = engine.prompt_logprobs(rows)
    diffs = [
        (megatron[n, : len(row) - 1] - torch.tensor(vllm[n], dtype=torch.float64)).abs() for n, row in enumerate(rows)
    ]
    report = parity_report(torch.cat(diffs))
    dtype = engine.config.dtype
    return parity.judge(report, limits or parity_limits(dtype), dtype) if judge else report
