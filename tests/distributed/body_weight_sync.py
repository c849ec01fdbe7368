"""torchrun body: weight sync from Megatron layouts into colocated vLLM engines.

Arguments: WORKDIR VLLM_TP KIND. One vLLM engine per process (its groups are global);
Megatron layouts are built and destroyed case by case on the same ranks. Each case loads
the HF model into the layout, perturbs the weights the same way in every layout (noise
keyed by canonical tensor name), syncs them into vLLM through small buckets, and checks
vLLM's fp32 logprobs against Megatron's. A sync that skips one tensor must be caught by
the parity guard.
"""

import os
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.bridge import PER_EXPERT, ExportPlans, iter_hf_buckets, load_hf
from megatron_rl.bridge.host_arena import TRANSPORT_ENV
from megatron_rl.models import build_model
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl.parallel.shards import local_shards
from megatron_rl.rollout import EngineConfig, RolloutEngine
from megatron_rl.rollout.sync import ParityError, WeightSync, check_parity
from megatron_rl.testing.hf_models import save_tiny_model
from megatron_rl.testing.tiny import TINY_DENSE, TINY_QWEN3_MOE
from megatron_rl.testing.torchrun import run_cases

WORK, VLLM_TP, KIND = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
SEQ = 24
BUCKET = 64 << 10  # small: many buckets, each ending between layers
STATE = {}


def setup():
    if not STATE:
        path = WORK / KIND
        if dist.get_rank() == 0:
            save_tiny_model(TINY_DENSE if KIND == "dense" else TINY_QWEN3_MOE, path, seed=5)
        dist.barrier()
        STATE["dir"] = path
        STATE["arch"] = arch_from_hf(path)
        STATE["engine"] = RolloutEngine(
            path, EngineConfig(tensor_parallel_size=VLLM_TP, max_model_len=64, load_tokenizer=False,
                               cache_dir=str(WORK / "cache")))
    return STATE["dir"], STATE["arch"], STATE["engine"]


def sequences(count=6):
    g = torch.Generator().manual_seed(99)
    return [torch.randint(3, 96, (int(torch.randint(8, SEQ, (1,), generator=g)),), generator=g).tolist() for _ in range(count)]


def perturb(chunks, salt):
    with torch.no_grad():
        for shard in local_shards(chunks):
            g = torch.Generator().manual_seed(zlib.crc32(f"{salt}:{shard.name}".encode()))
            noise = 0.05 * torch.randn(shard.global_shape, generator=g)
            shard.data.add_(noise[shard.index].to(shard.data.dtype))


def perturbed_actor(layout, salt):
    """The HF model loaded into a fresh Megatron ``layout``, its weights perturbed by ``salt``."""
    path, arch, _ = setup()
    initialize(ParallelConfig(**layout), seed=1, model=arch.shape())
    chunks = build_model("actor", arch, ParallelConfig(**layout))
    load_hf(chunks, path, arch)
    perturb(chunks, salt)
    return chunks


def sync_case(layout, skip_one=False):
    _, arch, engine = setup()
    try:
        chunks = perturbed_actor(layout, "a")
        weight_sync = WeightSync(chunks, arch, engine, bucket_bytes=BUCKET)
        stats = weight_sync.sync()
        report = check_parity(chunks, engine, sequences(), arch.vocab_size, SEQ, threshold=1e-4)
        out = {"mean_abs_diff": report.mean_abs_diff, "max_abs_diff": report.max_abs_diff,
               "buckets": stats.buckets, "tensors": stats.tensors, "bytes": stats.bytes,
               "sync_s": round(stats.seconds, 3)}
        if not skip_one:  # the next step's weights, through the buffers and views kept from the first sync
            perturb(chunks, "b")
            weight_sync.sync()
            again = check_parity(chunks, engine, sequences(), arch.vocab_size, SEQ, threshold=1e-4)
            out["max_abs_diff"] = max(report.max_abs_diff, again.max_abs_diff)
        else:
            perturb(chunks, "b")  # a new step's weights; one tensor is "forgotten"
            skipped = ("model.layers.1.mlp.experts.2.down_proj.weight" if arch.is_moe
                       else "model.layers.1.mlp.down_proj.weight")
            weight_sync.sync(skip=[skipped])
            try:
                check_parity(chunks, engine, sequences(), arch.vocab_size, SEQ, threshold=1e-4)
            except ParityError as err:
                out["guard"] = str(err)
            else:
                raise AssertionError(f"parity guard missed the skipped tensor {skipped}")
        return out
    finally:
        destroy()


def transports_case(layout):
    """The same-host shared arena and gloo broadcasts gather bitwise the same buckets."""
    _, arch, _ = setup()
    try:
        chunks = perturbed_actor(layout, "c")
        gathered, plans = {}, ExportPlans()
        for transport in ("auto", "broadcast"):
            os.environ[TRANSPORT_ENV] = transport
            gathered[transport] = [[(n, t.clone()) for n, t in bucket]
                                   for bucket in iter_hf_buckets(chunks, arch, BUCKET, plans=plans)]
        os.environ.pop(TRANSPORT_ENV)
        shared, broadcast = gathered["auto"], gathered["broadcast"]
        assert [[n for n, _ in b] for b in shared] == [[n for n, _ in b] for b in broadcast]
        unequal = [n for bs, bb in zip(shared, broadcast) for (n, a), (_, b) in zip(bs, bb) if not torch.equal(a, b)]
        assert not unequal, unequal[:5]
        return {"buckets": len(shared), "same_host": plans.gather_plan(chunks, arch, by_layer=True).same_host,
                "shared_arena": "shared_arena" in plans.buffers(chunks, arch, PER_EXPERT)}
    finally:
        destroy()


LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
    "tp2_ep2_etp1": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    "tp2_pp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
}


def cases():
    names = ["tp2", "pp2", "ep2", "tp2_ep2_etp1"] if KIND == "moe" else ["tp2", "pp2", "tp2_pp2"]
    out = {name: (lambda layout: lambda: sync_case(layout))(LAYOUTS[name]) for name in names}
    out["skipped_tensor_caught"] = lambda: sync_case(LAYOUTS[names[-1]], skip_one=True)
    out["transports_agree"] = lambda: transports_case(LAYOUTS[names[-1]])
    return out


if __name__ == "__main__":
    platform.init_distributed()
    run_cases(cases())
