"""What each phase of an RL step would cost with nothing around it: the floors of
``megatron-rl bench step``, measured in the trainer's process on the step's own data.

* generation: vLLM's own ``LLM.generate`` of the requests the engine sent (same prompts,
  same sampling parameters and seeds), without our waves, route recording or bookkeeping;
* the no-grad passes and the update: a bare forward (and forward plus backward of the mean
  logit) of the same micro-batches through the same Megatron model, without the schedules,
  losses or optimizer; and the same through transformers' model of the same architecture
  (the floor a small model meets in plain PyTorch);
* the weight sync: one copy of the actor's parameter bytes into a buffer (the least any sync
  must move).

Each floor is the median of ``repeats`` runs after one untimed run.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from megatron_rl import platform


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of ``run()`` over ``repeats`` calls, after one untimed call."""
    run()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def vllm_generate(engine, calls: Sequence[tuple], tokens: list) -> Callable[[], None]:
    """vLLM's own generate of each recorded (requests, params) call, in order; each run
    appends the tokens it generated to ``tokens`` (so the caller sees it did the same work)."""
    from megatron_rl_lab.bench.step_phases import generated_tokens

    def run():
        count = 0
        for requests, params in calls:
            count += generated_tokens(engine.llm.generate(requests, [p.clone() for p in params], use_tqdm=False))
        tokens.append(count)

    return run


def megatron_pass(chunks: list, inputs: Sequence[tuple], backward: bool) -> Callable[[], None]:
    """One forward (and backward of the mean logit) of each micro-batch through ``chunks[0]``."""
    from megatron_rl.models import route_replay

    model = chunks[0]

    def run():
        with platform.megatron_scope(), torch.set_grad_enabled(backward):
            route_replay.set_targets(model, None)  # the routers' own top-k: the same work
            for tokens, position_ids, packed in inputs:
                logits = model(tokens, position_ids, None, packed_seq_params=packed)
                if backward:
                    logits.float().mean().backward()
            if backward:
                model.zero_grad_buffer()

    return run


def transformers_model(base_dir, dtype: torch.dtype):
    """transformers' model of the run's base (its architecture; the weights do not matter)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).to(platform.current().device)
    return model.train()


def transformers_pass(model, inputs: Sequence[tuple], backward: bool) -> Callable[[], None]:
    """The same micro-batches through transformers' model: one causal row per packed row
    (attention across its sequences, a few more FLOPs than per-sequence attention)."""

    def run():
        with torch.set_grad_enabled(backward):
            for tokens, position_ids, _ in inputs:
                logits = model(input_ids=tokens, position_ids=position_ids).logits
                if backward:
                    logits.float().mean().backward()
            if backward:
                model.zero_grad(set_to_none=True)

    return run


def byte_copy(tensors: Sequence[torch.Tensor]) -> tuple[int, Callable[[], None]]:
    """The tensors' bytes and one copy of all of them into a preallocated buffer."""
    flat = [t.detach().reshape(-1).view(torch.uint8) for t in tensors]
    total = sum(f.numel() for f in flat)
    buffer = torch.empty(total, dtype=torch.uint8, device=flat[0].device if flat else "cpu")

    def run():
        offset = 0
        for f in flat:
            buffer[offset : offset + f.numel()].copy_(f)
            offset += f.numel()

    return total, run
