"""Subprocess body of test_routes.py (vLLM keeps process-wide state).

Argument: WORKDIR. Prints one JSON line: for a tiny Qwen3-MoE, the routes vLLM recorded
for n=3 samples of two prompts compared with HF transformers' router top-k on the same
tokens (fp32), and the routes of T-PPO-style continued samples.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megatron_rl.rollout import EngineConfig, RolloutEngine, Sampling
from megatron_rl_lab.testing.hf_models import save_tiny_model
from megatron_rl_lab.testing.tiny import TINY_QWEN3_MOE

work = Path(sys.argv[1])
path = work / "moe"
save_tiny_model(TINY_QWEN3_MOE, path, seed=5)
engine = RolloutEngine(
    path, EngineConfig(max_model_len=64, load_tokenizer=False, cache_dir=str(work / "cache"), record_routes=True)
)
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
prompts = [[5, 9, 17, 33, 2, 8, 40, 41, 42, 7], [3, 4, 5, 6]]


def compare(samples) -> dict:
    """(token, layer) pairs whose recorded expert set equals HF's top-k, of all pairs."""
    agreed = total = missing = 0
    shapes_ok = True
    for s in samples:
        inputs = (s.prompt_ids + s.token_ids)[:-1]
        shapes_ok &= tuple(s.routes.shape) == (len(inputs), TINY_QWEN3_MOE.num_layers, TINY_QWEN3_MOE.moe_router_topk)
        missing += int((s.routes < 0).any(-1).sum())
        with torch.no_grad():
            router_logits = hf(torch.tensor([inputs]), output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            expected = (
                logits.reshape(len(inputs), -1).topk(TINY_QWEN3_MOE.moe_router_topk, dim=-1).indices.sort(-1).values
            )
            agreed += int((s.routes[:, layer].long().sort(-1).values == expected).all(-1).sum())
            total += len(inputs)
    return {"agreed": agreed, "total": total, "missing": missing, "shapes_ok": shapes_ok}


generated = [s for group in engine.generate(prompts, Sampling(n=3, max_tokens=6)) for s in group]
windows = [g[0] for g in engine.generate(prompts, Sampling(n=1, max_tokens=8, window=3))]
continued = engine.continue_(windows, Sampling(n=1, max_tokens=8, window=3))
plain = engine.prompt_logprobs([prompts[0]])  # not recorded: no routes kept for it
print(
    json.dumps(
        {
            "generated": compare(generated),
            "continued": compare(continued),
            "continued_lengths": [len(s.token_ids) for s in continued],
        }
    )
)
