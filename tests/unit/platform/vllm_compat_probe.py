"""Subprocess body of test_vllm_compat.py (an engine keeps vLLM's process-wide state).

Arguments: WORKDIR. Builds one engine (cpu_linear="plain") for a tiny MoE model and
reloads the model's own, unchanged weights with vLLM's ``reload_weights``: first with the
global patches in place, then with each one removed and put back. Prints one JSON line:
the largest logprob change against the freshly built engine after each reload, whether
the LM head still serves its plain weight, and whether an in-place sync of a new LM head
serves what vLLM's reload of it serves.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_rl.platform import vllm_compat
from megatron_rl.rollout import EngineConfig, RolloutEngine
from megatron_rl_lab.testing.hf_models import save_tiny_model
from megatron_rl_lab.testing.tiny import TINY_QWEN3_MOE

work = Path(sys.argv[1])
path = work / "moe"
if not path.exists():
    save_tiny_model(TINY_QWEN3_MOE, path, seed=5)
engine = RolloutEngine(
    path, EngineConfig(max_model_len=64, load_tokenizer=False, cpu_linear="plain", cache_dir=str(work / "cache"))
)
weights = {}
for f in sorted(path.glob("*.safetensors")):
    weights.update(load_file(f))
sequences = [[5, 9, 17, 33, 2, 8, 40, 41, 42, 7], [3, 4, 5, 6, 7, 8, 90, 91]]


def _lm_head_is_plain(worker) -> bool:
    head = worker.model_runner.model.lm_head
    return head.cpu_linear is torch.nn.functional.linear


def reload() -> dict:
    """vLLM's own reload of the unchanged weights: how far the served logprobs moved."""
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
    engine.llm.reset_prefix_cache()
    after = engine.prompt_logprobs(sequences)
    moved = max(abs(a - b) for ra, rb in zip(after, built) for a, b in zip(ra, rb))
    return {"moved": moved, "lm_head_plain": engine.llm.collective_rpc(_lm_head_is_plain)[0]}


def synced_head_served() -> float:
    """A weight sync of a new LM head in place, against vLLM's reload of the same weights:
    the largest logprob difference (0 when the sync reaches what the engine serves)."""
    head = {**weights, "lm_head.weight": weights["lm_head.weight"] * 1.5}
    engine.load_weights([("lm_head.weight", head["lm_head.weight"])])
    engine.finish_weight_update()
    synced = engine.prompt_logprobs(sequences)
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(head.items())})
    engine.llm.reset_prefix_cache()
    served = engine.prompt_logprobs(sequences)
    return max(abs(a - b) for ra, rb in zip(synced, served) for a, b in zip(ra, rb))


built = engine.prompt_logprobs(sequences)
out = {
    "installed": [p.name for p in vllm_compat.PATCHES if p.applied],
    "built_lm_head_plain": engine.llm.collective_rpc(_lm_head_is_plain)[0],
    "patched": reload(),
}
out["patched"]["synced_head_vs_reload"] = synced_head_served()
for patch in (vllm_compat.MOE_RELOAD_REPACK, vllm_compat.PLAIN_GEMM_DISPATCH):
    patch.revert()
    out[f"without_{patch.name}"] = reload()
    if patch is vllm_compat.PLAIN_GEMM_DISPATCH:
        out[f"without_{patch.name}"]["synced_head_vs_reload"] = synced_head_served()
    patch.apply()
    out[f"with_{patch.name}_again"] = reload()
print(json.dumps(out))
