"""torchrun body (world 1): the HF <-> Megatron bridge on the device the platform picked.

Per family: load the tiny HF checkpoint into the Megatron actor, export it back from the
shards on that device (iter_hf_tensors, the weight sync's bucketed iter_hf_buckets, and
save_hf), and run transformers from save_hf's directory on the same device, in fp32 with
TF32 off. Each case saves its logits for the cross-device comparison.

Usage: body_cuda_bridge.py OUT_DIR MODELS_DIR (MODELS_DIR/<family>: tiny HF checkpoints)
"""

import os
import sys
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from megatron_rl import platform
from megatron_rl.bridge import iter_hf_buckets, iter_hf_tensors, load_hf, save_hf
from megatron_rl.bridge.parity import hf_logits, megatron_logits, read_config
from megatron_rl.models import build_model
from megatron_rl.models.hf_config import arch_from_hf
from megatron_rl.parallel import ParallelConfig, destroy, initialize
from megatron_rl_lab.testing.torchrun import run_cases

FAMILIES = ("qwen3", "qwen3_moe")
TOKENS = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(7))
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/cuda-bridge")
MODELS = Path(sys.argv[2]) if len(sys.argv) > 2 else OUT / "models"

# fp32 matmuls in full precision on both sides (TF32 would cost ~1e-3 relative).
torch.set_float32_matmul_precision("highest")


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def mismatches(pairs, source: dict[str, torch.Tensor]) -> list[str]:
    """Names among ``pairs`` whose tensor is not bitwise the source's (or not in it)."""
    return [n for n, t in pairs if n not in source or not torch.equal(t.cpu(), source[n])]


def bucket_mismatches(chunks, arch, style: str, source: dict[str, torch.Tensor]) -> list[str]:
    """The weight sync's stream, one decoder layer per bucket; each bucket is views into a
    reused buffer, so it is checked before the next one is asked for."""
    wrong, seen = [], set()
    for bucket in iter_hf_buckets(chunks, arch, 1, style=style):
        wrong += mismatches(bucket, source)
        seen.update(n for n, _ in bucket)
    return wrong + [f"missing or extra: {n}" for n in sorted(set(source) ^ seen)]


def devices_of(tensors) -> list[str]:
    return sorted({t.device.type for t in tensors})


def case(family: str) -> dict:
    path = MODELS / family
    source = read_safetensors(path)
    arch = arch_from_hf(path)
    ctx = initialize(ParallelConfig(), seed=1, model=arch.shape())
    chunks = build_model("actor", arch, ParallelConfig())
    style = load_hf(chunks, path, arch)
    device = platform.current().device
    logits = megatron_logits(chunks, TOKENS, ctx.pg_collection.tp)[..., : arch.vocab_size]
    exported = dict(iter_hf_tensors(chunks, arch, style=style))
    wrong = mismatches(exported.items(), source) + [f"missing: {n}" for n in sorted(set(source) - set(exported))]
    bucket_wrong = bucket_mismatches(chunks, arch, style, source)
    saved = OUT / f"exported-{family}"
    save_hf(chunks, arch, saved, read_config(path), style=style)
    saved_tensors = read_safetensors(saved)
    saved_wrong = mismatches(saved_tensors.items(), source) + sorted(set(source) - set(saved_tensors))
    reference = hf_logits(saved, TOKENS, device)  # transformers from the exported checkpoint
    torch.save({"megatron": logits.cpu(), "hf": reference.cpu()}, OUT / f"logits-{family}.pt")
    result = {
        "device": device.type,
        "param_devices": devices_of([*chunks[0].parameters(), *chunks[0].buffers()]),
        "export_devices": devices_of(exported.values()),
        "logits_devices": devices_of([logits, reference]),
        "matmul_precision": torch.get_float32_matmul_precision(),
        "style": style,
        "num_tensors": len(exported),
        "export_mismatch": wrong[:5],
        "num_export_mismatch": len(wrong),
        "bucket_mismatch": bucket_wrong[:5],
        "num_bucket_mismatch": len(bucket_wrong),
        "saved_mismatch": saved_wrong[:5],
        "num_saved_mismatch": len(saved_wrong),
        "logit_diff": float((logits - reference).abs().max()),
        "logit_scale": float(reference.abs().max()),
    }
    destroy()
    return result


if __name__ == "__main__":
    run_cases({family: partial(case, family) for family in FAMILIES})
