"""torchrun body: weight sync from Megatron layouts into colocated vLLM engines.

Arguments: WORKDIR VLLM_TP KIND [DTYPE]. One vLLM engine per process (its groups are
global); Megatron layouts are built and destroyed case by case on the same ranks. Each
case loads the HF model into the layout (in DTYPE, float32 by default), perturbs the
weights the same way in every layout (noise keyed by canonical tensor name), syncs them
into vLLM through small buckets with the weight check on, and reports vLLM's logprobs
against Megatron's. A sync that skips one tensor must be caught by the weight check; an
export that scrambles one tensor (vLLM then serves exactly what it was sent) by the
logprob limits of the dtype.

In fp32 the launch first runs the engine's own cases (body_rollout_engine.py) on that engine,
against transformers, while it still serves the saved model: one vLLM engine per process,
and a vLLM start per launch, serves both.
"""

import functools
import os
import sys
import zlib
from pathlib import Path

import body_rollout_engine
import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.bridge import PER_EXPERT, ExportPlans, iter_hf_buckets, load_hf
from megatron_rl.bridge.host_arena import TRANSPORT_ENV
from megatron_rl.models import build_model
from megatron_rl.models.builder import BuildOptions
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl.parallel.shards import local_shards
from megatron_rl.rollout import EngineConfig, RolloutEngine
from megatron_rl.rollout.parity import ParityError
from megatron_rl.rollout.replicas import Replicas
from megatron_rl.rollout.sync import WeightSync, check_parity
from megatron_rl.utils import dtypes
from megatron_rl_lab.testing.hf_models import load_reference, save_tiny_model_on_rank0
from megatron_rl_lab.testing.tiny import TINY_DENSE, TINY_QWEN3_MOE
from megatron_rl_lab.testing.torchrun import run_cases

WORK, VLLM_TP, KIND = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
DTYPE = sys.argv[4] if len(sys.argv) > 4 else "float32"
SEQ = 24
BUCKET = 64 << 10  # small: many buckets, each ending between layers
STATE = {}


def setup():
    if not STATE:
        path = save_tiny_model_on_rank0(TINY_DENSE if KIND == "dense" else TINY_QWEN3_MOE, WORK / KIND, seed=5)
        STATE["dir"] = path
        STATE["arch"] = arch_from_hf(path)
        STATE["engine"] = RolloutEngine(
            path,
            EngineConfig(
                tensor_parallel_size=VLLM_TP,
                max_model_len=body_rollout_engine.MAX_MODEL_LEN,
                load_tokenizer=False,
                dtype=DTYPE,
                cache_dir=str(WORK / "cache"),
            ),
        )
    return STATE["dir"], STATE["arch"], STATE["engine"]


def sequences(count=6):
    g = torch.Generator().manual_seed(99)
    return [
        torch.randint(3, 96, (int(torch.randint(8, SEQ, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


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
    chunks = build_model("actor", arch, ParallelConfig(**layout), BuildOptions(dtype=dtypes.short_name(DTYPE)))
    load_hf(chunks, path, arch)
    perturb(chunks, salt)
    return chunks


def report_of(chunks, engine, arch):
    """The logprob comparison's statistics, not judged (the test judges them)."""
    report = check_parity(chunks, Replicas(engine), sequences(), arch.vocab_size, SEQ, judge=False)
    return {
        "mean_abs_diff": report.mean_abs_diff,
        "max_abs_diff": report.max_abs_diff,
        "median_abs_diff": report.median_abs_diff,
    }


def sync_case(layout):
    _, arch, engine = setup()
    try:
        chunks = perturbed_actor(layout, "a")
        weight_sync = WeightSync(chunks, arch, Replicas(engine), bucket_bytes=BUCKET)
        stats = weight_sync.sync(check_weights=True)
        out = {
            **report_of(chunks, engine, arch),
            "buckets": stats.buckets,
            "tensors": stats.tensors,
            "bytes": stats.bytes,
            "sync_s": round(stats.seconds, 3),
            "checked_elements": stats.weight_check.compared_elements,
            "unreadable": list(stats.weight_check.unsupported),
        }
        # The next step's weights, through the buffers and views kept from the first sync.
        perturb(chunks, "b")
        weight_sync.sync(check_weights=True)
        again = report_of(chunks, engine, arch)
        return {**out, **{k: max(out[k], again[k]) for k in again}}
    finally:
        destroy()


def skipped_tensor_case(layout):
    """A new step's weights with one tensor "forgotten": vLLM keeps serving the old one."""
    _, arch, engine = setup()
    try:
        chunks = perturbed_actor(layout, "a")
        weight_sync = WeightSync(chunks, arch, Replicas(engine), bucket_bytes=BUCKET)
        weight_sync.sync()
        perturb(chunks, "b")
        skipped = (
            "model.layers.1.mlp.experts.2.down_proj.weight" if arch.is_moe else "model.layers.1.mlp.down_proj.weight"
        )
        try:
            weight_sync.sync(check_weights=True, skip=[skipped])
        except ParityError as err:
            return {"guard": str(err), **report_of(chunks, engine, arch)}
        raise AssertionError(f"the weight check missed the skipped tensor {skipped}")
    finally:
        destroy()


def scrambled_export_case(layout):
    """An export that maps one tensor wrongly (layer 1's o_proj rows rolled by one): vLLM
    serves exactly what it was sent, so the weight check passes and the logprob limits of
    the dtype must catch it."""
    _, arch, engine = setup()
    try:
        chunks = perturbed_actor(layout, "a")
        scrambled = "model.layers.1.self_attn.o_proj.weight"
        checked = 0
        for bucket in iter_hf_buckets(chunks, arch, BUCKET, dtype=dtypes.to_torch(DTYPE), plans=ExportPlans()):
            bucket = [(n, t.roll(1, 0) if n == scrambled else t) for n, t in bucket]
            engine.load_weights(bucket)
            result = engine.check_weights(bucket)
            assert not result.mismatches, result.describe()
            checked += result.compared_elements
        engine.finish_weight_update()
        try:
            check_parity(chunks, Replicas(engine), sequences(), arch.vocab_size, SEQ)
        except ParityError as err:
            return {"guard": str(err), "checked_elements": checked, **report_of(chunks, engine, arch)}
        raise AssertionError(f"the logprob limits missed the scrambled {scrambled}")
    finally:
        destroy()


def transports_case(layout):
    """The same-host shared arena and gloo broadcasts gather bitwise the same buckets."""
    _, arch, _ = setup()
    try:
        chunks = perturbed_actor(layout, "c")
        gathered, used, plans = {}, {}, ExportPlans()
        for transport in ("auto", "broadcast"):
            os.environ[TRANSPORT_ENV] = transport
            gathered[transport] = [
                [(n, t.clone()) for n, t in bucket] for bucket in iter_hf_buckets(chunks, arch, BUCKET, plans=plans)
            ]
            used[transport] = plans.transport
        os.environ.pop(TRANSPORT_ENV)
        shared, broadcast = gathered["auto"], gathered["broadcast"]
        assert [[n for n, _ in b] for b in shared] == [[n for n, _ in b] for b in broadcast]
        unequal = [n for bs, bb in zip(shared, broadcast) for (n, a), (_, b) in zip(bs, bb) if not torch.equal(a, b)]
        assert not unequal, unequal[:5]
        return {
            "buckets": len(shared),
            "same_host": plans.gather_plan(chunks, arch, by_layer=True).same_host,
            "shared_arena": plans.buffers(chunks, arch, PER_EXPERT).shared_arena is not None,
            "used": used,
        }
    finally:
        destroy()


LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
    "ep2": dict(expert_model_parallel_size=2),
    "tp2_ep2_etp1": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    "tp2_pp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
}


def engine_case(case):
    path, _, engine = setup()
    return case(engine, load_reference(path))


def cases():
    out = {}
    if DTYPE == "float32":
        for name, case in body_rollout_engine.CASES.items():
            out[f"engine:{name}"] = functools.partial(engine_case, case)
    if dist.get_world_size() == 2:
        names = ["ep2"] if KIND == "moe" else ["tp2"]
    else:
        names = ["tp2", "pp2", "ep2", "tp2_ep2_etp1"] if KIND == "moe" else ["tp2", "pp2", "tp2_pp2"]
    out.update({name: (lambda layout: lambda: sync_case(layout))(LAYOUTS[name]) for name in names})
    out["skipped_tensor_caught"] = lambda: skipped_tensor_case(LAYOUTS[names[-1]])
    out["scrambled_export_caught"] = lambda: scrambled_export_case(LAYOUTS[names[-1]])
    if dist.get_world_size() == 4:
        out["transports_agree"] = lambda: transports_case(LAYOUTS[names[-1]])
    return out


if __name__ == "__main__":
    platform.init_distributed()
    run_cases(cases())
