"""torchrun body (world 2): a LoRA actor in TP2 synced into a vLLM TP2 engine with a LoRA
slot, the adapters alone (rollout.adapter_sync).

Arguments: WORKDIR. The tiny dense model is the base; the actor gets adapters on QKV, the
attention output, FC1 and FC2 with seeded non-zero B. Cases: the whole base sync into the
LoRA engine (read back exactly through vLLM's LoRA-wrapped layers); the adapters synced
alone, then again with other B (reloaded in place): vLLM's logprobs against Megatron's; the
greedy tokens of vLLM with the adapter against transformers + PEFT with the same adapter
(written by the live export); the bytes of each kind of sync.
"""

import json
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl import platform
from megatron_rl.bridge import load_hf, save_hf
from megatron_rl.bridge.lora_export import write_peft_adapter
from megatron_rl.models import build_model
from megatron_rl.models.adapter_names import is_adapter_name
from megatron_rl.models.builder import BuildOptions
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.models.lora import LoraSettings, add_adapters
from megatron_rl.parallel import ParallelConfig, initialize
from megatron_rl.parallel.shards import local_shards
from megatron_rl.rollout import EngineConfig, RolloutEngine
from megatron_rl.rollout.adapter_sync import AdapterSync, PolicySync
from megatron_rl.rollout.replicas import Replicas
from megatron_rl.rollout.sync import WeightSync, check_parity
from megatron_rl.rollout.types import Sampling
from megatron_rl_lab.testing.hf_models import save_tiny_model_on_rank0
from megatron_rl_lab.testing.tiny import TINY_DENSE
from megatron_rl_lab.testing.torchrun import run_cases

WORK = Path(sys.argv[1])
SEQ = 24
LORA = dict(rank=4, alpha=8.0, dropout=0.0)
TARGETS = ("qkv", "proj", "fc1", "fc2")
STATE = {}


def setup():
    if not STATE:
        path = save_tiny_model_on_rank0(TINY_DENSE, WORK / "dense", seed=5)
        arch = arch_from_hf(path)
        layout = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
        initialize(layout, seed=1, model=arch.shape())
        chunks = build_model("actor", arch, layout, BuildOptions(attention="sdpa"))
        load_hf(chunks, path, arch)
        adapters = add_adapters(chunks, LoraSettings(targets=TARGETS, **LORA))
        config = EngineConfig(
            tensor_parallel_size=2,
            max_model_len=64,
            load_tokenizer=False,
            cache_dir=str(WORK / "cache"),
            lora_rank=4,
            lora_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        )
        engine = Replicas(RolloutEngine(path, config))
        sync = PolicySync(
            WeightSync(chunks, arch, engine, bucket_bytes=64 << 10), AdapterSync(chunks, arch, engine, LORA)
        )
        STATE.update(dir=path, arch=arch, chunks=chunks, adapters=adapters, engine=engine, sync=sync)
    return STATE


def set_b(salt: str) -> None:
    """Every adapter's B from noise keyed by its name (the same full matrix on every rank, sliced)."""
    with torch.no_grad():
        for name, adapter in STATE["adapters"].items():
            g = torch.Generator().manual_seed(zlib.crc32(f"{salt}:{name}".encode()))
            adapter.b.copy_(0.2 * torch.randn(adapter.b.shape, generator=g))


def sequences(count=6):
    g = torch.Generator().manual_seed(99)
    return [
        torch.randint(3, 96, (int(torch.randint(8, SEQ, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


def max_logprob_diff() -> float:
    s = STATE
    return check_parity(s["chunks"], s["engine"], sequences(), s["arch"].vocab_size, SEQ, judge=False).max_abs_diff


def perturb_base(salt: str) -> None:
    """Every base weight moved by noise keyed by its canonical name (a base vLLM does not have)."""
    with torch.no_grad():
        for shard in local_shards(STATE["chunks"]):
            if not is_adapter_name(shard.name):
                g = torch.Generator().manual_seed(zlib.crc32(f"{salt}:{shard.name}".encode()))
                shard.data.add_((0.05 * torch.randn(shard.global_shape, generator=g))[shard.index])


def whole_base_case():
    s = setup()
    perturb_base("base")
    stats = s["sync"].weights.sync(check_weights=True)
    return {
        "bytes": stats.bytes,
        "checked_elements": stats.weight_check.compared_elements,
        "unreadable": list(stats.weight_check.unsupported)[:6],
        "base_diff": max_logprob_diff(),  # B = 0: the base's logprobs, no adapter loaded yet
    }


def adapter_case():
    s = setup()
    set_b("first")
    unsynced = max_logprob_diff()  # Megatron with the adapters, vLLM still the base
    first = s["sync"].sync()
    first_diff = max_logprob_diff()
    set_b("second")
    second = s["sync"].sync()
    return {
        "unsynced_diff": unsynced,
        "first_diff": first_diff,
        "second_diff": max_logprob_diff(),
        "bytes": first.bytes,
        "tensors": first.tensors,
        "again_bytes": second.bytes,
    }


def greedy_case():
    """Greedy tokens of vLLM with the synced adapter, and the PEFT adapter of the same
    factors for transformers (rank 0 writes it from the same gathered tensors)."""
    from megatron_rl.bridge.families import canonical
    from megatron_rl.bridge.lora_export import adapter_config, adapter_pairs, peft_tensors
    from megatron_rl.parallel.full_tensors import gather_full

    s = setup()
    prompts = sequences(4)
    groups = s["engine"].engine.generate(prompts, Sampling(n=1, max_tokens=12, temperature=0.0))
    full = {canonical(k): v for k, v in gather_full(s["chunks"], only=is_adapter_name).items()}
    tmap = s["sync"].adapters.tmap
    tensors = peft_tensors(adapter_pairs(full), tmap, full.__getitem__)
    out, base = WORK / "peft", WORK / "served_base"  # the perturbed base vLLM serves
    save_hf(s["chunks"], s["arch"], base, json.loads((s["dir"] / "config.json").read_text()))
    if dist.get_rank() == 0:
        write_peft_adapter(out, tensors, adapter_config(LORA, tensors, str(base)))
    dist.barrier()
    return {"prompts": prompts, "vllm": [g[0].token_ids for g in groups], "peft_dir": str(out), "base": str(base)}


if __name__ == "__main__":
    platform.init_distributed()
    run_cases({"whole_base": whole_base_case, "adapters": adapter_case, "greedy": greedy_case})
