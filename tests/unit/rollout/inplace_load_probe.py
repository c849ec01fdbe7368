"""Subprocess body of test_inplace_load.py (vLLM keeps process-wide state).

Arguments: WORKDIR [CPU_LINEAR [DTYPE]]. Prints one JSON line: for a tiny MoE model
(linear, fused-MoE and LM head kinds), the logprob differences between the fast in-place
load and vLLM's own reload_weights of the same new weights, also with buckets split inside
decoder layers; with the engine's linear weights packed (vLLM's default) or plain; and what
the weight check (rollout/weight_check.py) reads back after each path and after a bucket
whose tensors differ from the loaded ones.
"""

import json
import os
import sys
from pathlib import Path

import torch

from megatron_rl.rollout import EngineConfig, RolloutEngine
from megatron_rl.rollout.inplace_load import MODE_ENV
from megatron_rl_lab.testing.hf_models import save_tiny_model
from megatron_rl_lab.testing.tiny import TINY_QWEN3_MOE

work = Path(sys.argv[1])
cpu_linear = sys.argv[2] if len(sys.argv) > 2 else "packed"
dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
path = work / "moe"
if not path.exists():
    save_tiny_model(TINY_QWEN3_MOE, path, seed=5)
engine = RolloutEngine(
    path,
    EngineConfig(
        max_model_len=64, load_tokenizer=False, cpu_linear=cpu_linear, dtype=dtype, cache_dir=str(work / "cache")
    ),
)
from safetensors.torch import load_file  # noqa: E402

source = {}
for f in sorted(path.glob("*.safetensors")):
    source.update(load_file(f))
source = {k: v.to(getattr(torch, dtype)) for k, v in source.items()}
sequences = [[5, 9, 17, 33, 2, 8, 40, 41, 42, 7], [3, 4, 5, 6, 7, 8, 90, 91]]
g = torch.Generator().manual_seed(3)


def push(weights: dict, mode: str) -> list:
    os.environ[MODE_ENV] = mode
    first = [(k, v) for k, v in weights.items() if ".layers." not in k or ".layers.0." in k]
    rest = [(k, v) for k, v in weights.items() if ".layers." in k and ".layers.0." not in k]
    paths = [engine.load_weights(first), engine.load_weights(rest)]
    engine.finish_weight_update()
    return paths


def max_diff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _count_linear(worker) -> tuple[int, int]:
    gemms = [m for m in worker.model_runner.model.modules() if hasattr(m, "cpu_linear")]
    plain = [m for m in gemms if m.cpu_linear is torch.nn.functional.linear and m.weight.numel() > 0]
    return len(gemms), len(plain)


def plain_linear_layers() -> int:
    """Linear layers (and LM head) served from a plain weight by torch's linear."""
    return engine.llm.collective_rpc(_count_linear)[0][1]


out_gemms = engine.llm.collective_rpc(_count_linear)[0][0]


before = engine.prompt_logprobs(sequences)
out = {"steps": [], "initial": before, "gemm_layers": out_gemms, "plain_linear_layers": plain_linear_layers()}
for _ in range(2):
    new = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in source.items()}
    fast_paths = push(new, "inplace")
    fast = engine.prompt_logprobs(sequences)
    fast_check = engine.check_weights(list(new.items()))
    slow_paths = push(new, "reload")
    slow = engine.prompt_logprobs(sequences)
    slow_check = engine.check_weights(list(new.items()))
    out["steps"].append(
        {
            "paths": fast_paths + slow_paths,
            "fast_vs_reload": max_diff(fast, slow),
            "moved": max_diff(fast, before),
            "checked": [fast_check.compared_elements, slow_check.compared_elements],
            "check_problems": [m.name for c in (fast_check, slow_check) for m in c.mismatches]
            + list(fast_check.unsupported + slow_check.unsupported),
        }
    )
    before = fast

# Buckets split inside decoder layers at module boundaries (attention, then the rest):
# each module's weights arrive in one call, the others keep theirs until their call.
new = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in source.items()}
os.environ[MODE_ENV] = "inplace"
attention = [(k, v) for k, v in new.items() if ".self_attn." in k]
engine.load_weights(attention)
half_served = engine.prompt_logprobs(sequences)
engine.load_weights([(k, v) for k, v in new.items() if ".self_attn." not in k])
engine.finish_weight_update()
split = engine.prompt_logprobs(sequences)
push(new, "reload")
out["split_vs_reload"] = max_diff(split, engine.prompt_logprobs(sequences))
out["half_vs_full"] = max_diff(half_served, split)
out["plain_linear_layers_after_reload"] = plain_linear_layers()

# The weight check against a bucket that differs from what was loaded: one element of one
# expert's down projection, a norm, a row of a fused-qkv input (q_proj), the embedding.
wrong = dict(new)
wrong["model.layers.1.mlp.experts.3.down_proj.weight"] = new["model.layers.1.mlp.experts.3.down_proj.weight"].clone()
wrong["model.layers.1.mlp.experts.3.down_proj.weight"][2, 5] += 1
wrong["model.layers.0.input_layernorm.weight"] = new["model.layers.0.input_layernorm.weight"].flip(0)
wrong["model.layers.0.self_attn.q_proj.weight"] = new["model.layers.0.self_attn.q_proj.weight"].roll(1, 0)
wrong["model.embed_tokens.weight"] = new["model.embed_tokens.weight"] * 2
check = engine.check_weights(list(wrong.items()))
out["wrong"] = {m.name: [m.differing, m.compared] for m in check.mismatches}
out["wrong_unsupported"] = list(check.unsupported)
print(json.dumps(out))
