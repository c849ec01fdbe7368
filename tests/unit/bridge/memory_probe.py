"""Peak memory of converting one model, phase by phase (run as a script by the test).

    python memory_probe.py make DIR      # write a ~270 MB random qwen2_moe HF checkpoint
    python memory_probe.py convert DIR   # load_hf + save_hf at world 1; prints JSON

The peak of each phase is the kernel's high-water mark (VmHWM), reset before the phase
through /proc/self/clear_refs, minus the resident memory when the phase starts (which
already holds the Megatron model itself).
"""

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BIG = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=16,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=1024,
)


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(fn):
    import gc

    gc.collect()
    start = status_kb("VmRSS")
    reset_peak()
    t = time.time()
    fn()
    return {"extra_peak_mb": (status_kb("VmHWM") - start) / 1024, "seconds": round(time.time() - t, 2)}


def make(path):
    from megatron_rl.bridge.parity import make_tiny_hf

    make_tiny_hf("qwen2_moe", path, **BIG)


def convert(path):
    from megatron_rl import platform
    from megatron_rl.bridge import load_hf, save_hf
    from megatron_rl.models import build_model
    from megatron_rl.models.hf_config import arch_from_hf
    from megatron_rl.parallel import ParallelConfig, initialize

    platform.init_distributed()
    arch = arch_from_hf(path)
    initialize(ParallelConfig(), model=arch.shape())
    chunks = build_model("actor", arch, ParallelConfig())
    model_mb = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()) / 2**20
    config = json.loads(open(os.path.join(path, "config.json")).read())
    out = {"model_mb": model_mb}
    out["load_hf"] = measure(lambda: load_hf(chunks, path, arch))
    out["save_hf"] = measure(lambda: save_hf(chunks, arch, path + "-out", config, max_file_bytes=64 * 2**20))
    out["largest_tensor_mb"] = max(p.numel() * p.element_size() for c in chunks for p in c.parameters()) / 2**20
    print(json.dumps(out))


if __name__ == "__main__":
    {"make": make, "convert": convert}[sys.argv[1]](sys.argv[2])
