"""Check that vLLM serves the tiny base like transformers does: same chat template, same
greedy answers. Run it in its own process (``python -m megatron_rl.tasks.engine_check DIR``):
building a vLLM engine pins thread counts and memory policy for the rest of the process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
}


def compare_greedy(directory: str | Path, num_prompts: int = 8) -> dict:
    """Greedy responses of vLLM and transformers on the first held-out prompts."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.tasks.base_model import read_report

    directory = Path(directory)
    rows = [json.loads(row) for row in (directory / "eval.jsonl").read_text().splitlines()[:num_prompts]]
    messages = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    max_new_tokens = read_report(directory)["report"]["max_new_tokens"]

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    hf, hf_logprobs = [], []
    for m in messages:
        ids = tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(ids, add_special_tokens=False).input_ids])
        out = model.generate(
            ids, do_sample=False, max_new_tokens=max_new_tokens, output_scores=True, return_dict_in_generate=True
        )
        new = out.sequences[0, ids.shape[1] :]
        hf.append(tokenizer.decode(new, skip_special_tokens=True))
        hf_logprobs.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, new)])

    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=str(directory), dtype="float32", enforce_eager=True, max_model_len=128, seed=0, gpu_memory_utilization=0.5
    )
    build_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, logprobs=0)
    outputs = llm.chat(messages, params, use_tqdm=False)
    served = [o.outputs[0].text for o in outputs]
    served_logprobs = [
        [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs
    ]
    diffs = [abs(a - b) for x, y in zip(hf_logprobs, served_logprobs) if len(x) == len(y) for a, b in zip(x, y)]
    return {
        "transformers": hf,
        "vllm": served,
        "prompts": [r["prompt"] for r in rows],
        "answers": [r["answer"] for r in rows],
        "vllm_build_s": build_s,
        "max_logprob_abs_diff": max(diffs) if diffs else None,
    }


if __name__ == "__main__":
    print("ENGINE_CHECK " + json.dumps(compare_greedy(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8)))
