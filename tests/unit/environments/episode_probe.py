"""torchrun body (world 1) of test_episode_vllm.py: vLLM keeps process-wide state, and
Megatron needs a process group.

Arguments: WORKDIR. Case ``episodes`` builds a tiny tool-using base (tokenizer + dense model
warmed up on two-turn conversations: a python tool call, its result, the answer) and runs
multi-turn episodes with the tools environment on a colocated vLLM engine (a deterministic
eval runner as the tool); it reports the episodes' arrays, what vLLM returned for every
turn, and the logprobs transformers and vLLM's prefill compute on the episodes' tokens.
Case ``megatron`` loads the base into Megatron (TP = PP = 1, fp32) and reports the
logprobs the trainer's ``compute_logprobs`` gives the episodes' tokens.
"""

import sys
import time
from pathlib import Path

import torch

from megatron_rl.environments.driver import DriverConfig, EpisodeDriver
from megatron_rl.environments.episode import EpisodeLimits, ObservationEncoder, encode_prompt
from megatron_rl.environments.interface import EnvironmentSetup, EpisodeRecord
from megatron_rl.environments.registry import get_environment
from megatron_rl.environments.tool_calls import ToolResult, ToolSpec
from megatron_rl.tasks.base_model import BaseModelSettings, hf_config, save_base
from megatron_rl.tasks.chat_format import render_chat
from megatron_rl.tasks.digits import DigitTask
from megatron_rl.tasks.tokenizer import train_tokenizer
from megatron_rl.tasks.warmup import supervised_warmup

WORK = Path(sys.argv[1])
TASK = DigitTask(op="max", min_digits=2, max_digits=4)
PYTHON = ToolSpec(
    "python", "Evaluate Python", {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}
)
SETTINGS = BaseModelSettings(family="qwen3", tokenizer_vocab_size=512, max_position_embeddings=512, seed=3)


class EvalRunner:
    """Deterministic stand-in for the sandbox (tests only): the code as a Python expression."""

    def run(self, calls):
        results = []
        for call in calls:
            try:
                results.append(ToolResult(str(eval(call.arguments["code"], {"__builtins__": {}}, {"max": max}))))
            except Exception as exc:
                results.append(ToolResult(f"{type(exc).__name__}: {exc}", "error"))
        return results


def conversation(example):
    code = f"max({', '.join(map(str, example.digits))})"
    call = f'<tool_call>{{"name": "python", "arguments": {{"code": "{code}"}}}}</tool_call>'
    return [{"role": "user", "content": example.prompt}], call, example.answer, f"Answer: {example.answer}"


def build_base(out: Path) -> dict:
    """Warm up on (prompt -> call) and (prompt, call, result -> answer), encoded token-in."""
    started = time.perf_counter()
    examples = TASK.generate(1500, seed=0)
    texts = []
    for e in examples:
        user, call, result, answer = conversation(e)
        full = [*user, {"role": "assistant", "content": call}, {"role": "tool", "content": result}]
        texts.append(render_chat([*full, {"role": "assistant", "content": answer}], False, tools=[PYTHON.schema()]))
    tokenizer = train_tokenizer(texts, SETTINGS.tokenizer_vocab_size)
    observations = ObservationEncoder(tokenizer)
    encoded = []
    for e in examples:
        user, call, result, answer = conversation(e)
        prompt = encode_prompt(tokenizer, user, (PYTHON,))
        call_ids = tokenizer(call, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        encoded.append((prompt, call_ids))
        context = prompt + call_ids + observations.encode([{"role": "tool", "content": result}])
        encoded.append((context, tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]))
    vocab = -(-len(tokenizer) // SETTINGS.vocab_multiple) * SETTINGS.vocab_multiple
    torch.manual_seed(SETTINGS.seed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        hf_config(SETTINGS, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id), dtype=torch.float32
    )
    losses = supervised_warmup(model, encoded, steps=100, batch_size=16, lr=3e-3, seed=0, pad_id=tokenizer.pad_token_id)
    save_base(model, tokenizer, out)
    return {"losses": [losses[0], losses[-1]], "seconds": time.perf_counter() - started, "prompt": len(encoded[0][0])}


class Recording:
    """The engine, with every sample it returned kept."""

    def __init__(self, engine):
        self.engine, self.samples = engine, []

    def generate(self, prompts, sampling, seeds=None, max_tokens=None):
        groups = self.engine.generate(prompts, sampling, seeds, max_tokens)
        self.samples += [
            {
                "prompt": g[0].prompt_ids,
                "tokens": g[0].token_ids,
                "logprobs": g[0].logprobs,
                "finish": g[0].finish_reason,
            }
            for g in groups
        ]
        return groups


STATE = {}


def episodes_case() -> dict:
    base = WORK / "tool_base"
    report = build_base(base)
    from transformers import AutoTokenizer

    from megatron_rl.rollout import EngineConfig, RolloutEngine
    from megatron_rl_lab.testing.hf_models import load_reference, token_logprobs

    tokenizer = AutoTokenizer.from_pretrained(str(base))
    engine = Recording(RolloutEngine(base, EngineConfig(max_model_len=512, seed=5, cache_dir=str(WORK / "cache"))))
    env = get_environment("tools", EnvironmentSetup(reward="digits", tools=(PYTHON,), tool_runner=EvalRunner()))
    examples = TASK.generate(6, seed=7)
    records = [EpisodeRecord.from_messages([{"role": "user", "content": e.prompt}], e.answer) for e in examples]
    config = DriverConfig(limits=EpisodeLimits(max_turns=3, max_tokens=512, max_turn_tokens=64), temperature=1.0)
    with EpisodeDriver(engine, tokenizer, env, config) as driver:
        results = driver.run(records, policy_version=1, seeds=[1000 * i for i in range(len(records))])
    reference = load_reference(base)
    episodes = []
    for r in results:
        seq = r.tokens.tolist()
        episodes.append(
            {
                "tokens": seq,
                "loss_mask": r.loss_mask.tolist(),
                "old_logprobs": r.old_logprobs.tolist(),
                "versions": r.versions.tolist(),
                "spans": [[s.start, s.stop, s.sampled] for s in r.spans],
                "counts": vars(r.counts),
                "end": r.end,
                "reward": r.reward,
                "text": tokenizer.decode(seq),
                "transformers": token_logprobs(reference, seq) + [0.0],
                "vllm_prefill": engine.engine.prompt_logprobs([seq])[0] + [0.0],
            }
        )
    STATE.update(base=base, results=results)
    return {"base": report, "episodes": episodes, "samples": engine.samples}


def megatron_case() -> dict:
    """The trainer's recomputation on the episodes' tokens, prediction-aligned [N, S]."""
    from megatron_rl.bridge import load_hf
    from megatron_rl.models import build_model
    from megatron_rl.models.builder import BuildOptions
    from megatron_rl.models.hf_config import arch_from_hf
    from megatron_rl.parallel import ParallelConfig, initialize
    from megatron_rl.schedules import TrainBatch, compute_logprobs, local_batch

    base, results = STATE["base"], STATE["results"]
    arch = arch_from_hf(base)
    initialize(ParallelConfig(), seed=1, model=arch.shape())
    chunks = build_model("actor", arch, ParallelConfig(), BuildOptions(dtype="fp32"))
    load_hf(chunks, base, arch)
    length = max(len(r.tokens) for r in results)
    tokens = torch.zeros((len(results), length), dtype=torch.long)
    mask = torch.zeros((len(results), length), dtype=torch.bool)
    for n, r in enumerate(results):
        tokens[n, : len(r.tokens)], mask[n, : len(r.tokens)] = r.tokens, r.loss_mask
    batch = TrainBatch(tokens=tokens, loss_mask=mask)
    logp, _ = compute_logprobs(chunks, local_batch(chunks, batch), 1, arch.vocab_size)
    return {"logprobs": [logp[n, : len(r.tokens)].tolist() for n, r in enumerate(results)]}


if __name__ == "__main__":
    from megatron_rl_lab.testing.torchrun import run_cases

    run_cases({"episodes": episodes_case, "megatron": megatron_case})
