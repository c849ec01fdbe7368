"""Rollout throughput of tool-using episodes against single answers of the same length.

The recipe's episodes (examples/tool_grpo.yaml: its base, prompts, limits and sandbox) run
on one vLLM engine at world 1, each turn's calls made to take a duration drawn uniformly
from ``--tool-seconds`` (the tool's own time included: a call that ran longer is not
padded), the way slower tools (remote services, longer computations) would. ``--tool``
says what answers them: ``sandbox``, the recipe's python tool (a sandboxed interpreter per
call, ~0.1 s of this machine's CPU each, which competes with vLLM for the same cores), or
``service``, a stand-in for a tool that runs elsewhere: ``print(<arithmetic>)`` evaluated
from its syntax tree (numbers and + - * / // % ** only; anything else is an error
observation), no process, no CPU to speak of: the calls then cost only their latency.

Per batch of ``prompts_per_step x n_samples`` episodes, three modes, in turn so that the
machine's load drifts over all alike:

- ``overlap``: the driver generates the turns of episodes whose tools have answered
  while the other episodes' tools run (``environment.overlap=true``);
- ``lockstep``: every round waits for its slowest call (``environment.overlap=false``);
- ``single_turn``: one engine call, each episode's prompt sampled for exactly as many
  tokens as the overlap episode sampled in all its turns (EOS ignored): the same tokens
  generated without tools, turns or observations.

The two tool modes draw their own samples of the same prompts (episodes cannot be seeded
per prompt on CPU: docs/episodes.md), so their token counts differ a little. Tokens/s is
the sampled tokens over the batches' summed wall time from the second batch on (the first
pays the engine's warm-up); the target of the issue is overlap >= 0.7x single_turn.
Training is not timed: it is the same work whatever the rollout took. :func:`summarize`
turns the per-batch records into the JSON (a pure function).

    megatron-rl bench tools --json bench_tools.json
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import operator
import os
import platform as host
import random
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron_rl_lab.bench.args import BenchArgumentError, bench_parser, positive, run_checked, save_json, world_size

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "tool_grpo.yaml"
MODES = ("overlap", "lockstep", "single_turn")
TOOLS = ("sandbox", "service")
FIRST_BATCH = 1
"""Batches before this index are left out of the sums (the engine's first calls)."""
TARGET = 0.7
"""overlap tokens/s over single_turn tokens/s the issue asks for."""
EPILOG = """\
examples:
  megatron-rl bench tools --json bench_tools.json                  # the recipe's own base, built if needed
  megatron-rl bench tools --base runs/tool_grpo/base_model --batches 4 --tool-seconds 0.2,1.0
  megatron-rl bench tools --set rollout.prompts_per_step=16 --env-threads 128
"""


@dataclasses.dataclass(frozen=True)
class Plan:
    config: str
    overrides: tuple[str, ...]
    base: Optional[Path]
    batches: int
    tool: str
    tool_seconds: tuple[float, float]
    env_threads: int
    seed: int
    dir: Path
    json_path: Optional[Path]


def _seconds_range(text: str) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be LOW,HIGH in seconds, e.g. 0.2,1.0") from None
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r} must be LOW,HIGH with 0 <= LOW <= HIGH")
    return low, high


def add_parser(sub) -> argparse.ArgumentParser:
    p = bench_parser(
        sub,
        "tools",
        help="tokens/s of tool-using episodes (tools overlapped with generation, or not) vs single answers",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
    )
    p.add_argument("--config", default=str(RECIPE), help="the tool recipe (default: examples/tool_grpo.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--base", type=Path, default=None, help="the HF base directory (default: the recipe's task base)")
    p.add_argument("--batches", type=positive, default=4, help="batches of episodes per mode (sums from the 2nd)")
    p.add_argument("--tool", choices=TOOLS, default="sandbox", help="what answers the calls (module docstring)")
    p.add_argument("--tool-seconds", type=_seconds_range, default=(0.2, 1.0), help="LOW,HIGH of a call's duration")
    p.add_argument("--env-threads", type=positive, default=64, help="environment.env_threads (tool turns at once)")
    p.add_argument("--seed", type=int, default=1234, help="trainer.seed; also seeds the tool durations")
    p.add_argument("--dir", type=Path, default=Path("runs/bench-tools"), help="the base (if built) and vLLM cache")
    p.add_argument("--json", default=None, help="write the result here")
    return p


def make_plan(args: argparse.Namespace, world: int) -> Plan:
    if world != 1:
        raise BenchArgumentError(f"bench tools runs one engine in one process, not WORLD_SIZE={world}")
    if args.batches <= FIRST_BATCH:
        raise BenchArgumentError(f"--batches {args.batches}: the sums start at batch {FIRST_BATCH + 1}; pass more")
    if args.base is not None and not (args.base / "config.json").is_file():
        raise BenchArgumentError(f"--base {args.base}: no config.json there (an HF model directory)")
    plan = Plan(
        config=args.config,
        overrides=(*args.set, f"trainer.seed={args.seed}", f"environment.env_threads={args.env_threads}"),
        base=args.base,
        batches=args.batches,
        tool=args.tool,
        tool_seconds=tuple(args.tool_seconds),
        env_threads=args.env_threads,
        seed=args.seed,
        dir=args.dir,
        json_path=Path(args.json) if args.json else None,
    )
    config(plan)
    return plan


def config(plan: Plan):
    """The recipe with the plan's overrides, validated at world 1 (one line if it is not a
    tool recipe or does not validate)."""
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.from_config import validate

    try:
        cfg = validate(load_config(plan.config, list(plan.overrides)), 1)
    except (ConfigError, OSError) as err:
        raise BenchArgumentError(f"--config {plan.config}: {err}") from None
    if not cfg.environment.tools:
        raise BenchArgumentError(f"--config {plan.config}: environment.tools is empty; the bench times tool calls")
    return cfg


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
MAX_DIGITS = 100
"""The calculator refuses larger results (and exponents that would make them)."""


def _arithmetic(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arithmetic(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * len(str(abs(left))) > MAX_DIGITS:
            raise ValueError("result too large")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")


class CalculatorService:
    """``--tool service``: answers ``print(<arithmetic>)`` as the python tool would print it."""

    def run(self, calls):
        from megatron_rl.environments.tool_calls import ERROR, OK, ToolResult

        results = []
        for call in calls:
            try:
                (statement,) = ast.parse(str(call.arguments.get("code", ""))).body
                expr = getattr(statement, "value", None)
                if not (isinstance(expr, ast.Call) and getattr(expr.func, "id", None) == "print" and expr.args):
                    raise ValueError("only print(<arithmetic>) is served")
                results.append(ToolResult(" ".join(str(_arithmetic(a)) for a in expr.args) + "\n", OK))
            except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
                results.append(ToolResult(f"error: {type(err).__name__}: {err}", ERROR))
        return results


class PaddedRunner:
    """A tool runner whose turns take at least a duration drawn from [low, high] s: the
    calls run (in the sandbox), then the turn waits out the rest of its draw."""

    def __init__(self, runner, low: float, high: float, seed: int):
        self.runner, self.low, self.high = runner, low, high
        self._rng, self._lock = random.Random(seed), threading.Lock()

    def run(self, calls):
        start = time.perf_counter()
        with self._lock:
            duration = self._rng.uniform(self.low, self.high)
        results = self.runner.run(calls)
        time.sleep(max(0.0, start + duration - time.perf_counter()))
        return results


# -- the summary (pure: per-batch records in, JSON-able dict out) -----------------------------


def summarize(batches: Sequence[dict], first: int = FIRST_BATCH) -> dict:
    """``batches``: per batch, per mode ``{"tokens", "seconds", ...}``. Per mode the sums
    from batch ``first`` on, tokens/s as their ratio, and the two tool modes' tokens/s over
    single_turn's."""
    timed = batches[first:]
    if not timed:
        raise ValueError(f"no batches from index {first} on ({len(batches)} in all)")
    modes = {}
    for mode in timed[0]:
        rows = [b[mode] for b in timed]
        tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
        sums = {k: sum(r[k] for r in rows) for k in rows[0] if k not in ("tokens", "seconds")}
        modes[mode] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, **sums}
    single = modes["single_turn"]["tokens_per_s"]
    ratios = {f"{m}_vs_single_turn": modes[m]["tokens_per_s"] / single for m in modes if m != "single_turn"}
    return {"modes": modes, **ratios, "timed_batches": len(timed), "target_overlap_vs_single_turn": TARGET}


# -- the run ------------------------------------------------------------------------------------


def _episode_batch(driver, records) -> dict:
    start = time.perf_counter()
    results = driver.run(records)
    seconds = time.perf_counter() - start
    return {
        "tokens": sum(r.counts.sampled_tokens for r in results),
        "seconds": seconds,
        "episodes": len(results),
        "turns": sum(r.counts.turns for r in results),
        "tool_calls": sum(r.counts.tool_calls for r in results),
        "tool_s": sum(r.counts.env_seconds for r in results),
        "observation_tokens": sum(r.counts.observation_tokens for r in results),
        "generate_s": driver.times.generate_s,
        "tool_wait_s": driver.times.wait_s,
        "engine_calls": driver.times.engine_calls,
    }, results


def _single_turn_batch(engine, prompts: list[list[int]], lengths: list[int], temperature: float) -> dict:
    """One engine call sampling exactly ``lengths[i]`` tokens after ``prompts[i]``: vLLM's
    own SamplingParams, since the rollout engine's Sampling stops at EOS (a bench-only need)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(n=1, max_tokens=n, min_tokens=n, ignore_eos=True, temperature=temperature, logprobs=0)
        for n in lengths
    ]
    start = time.perf_counter()
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outputs), "seconds": seconds}


def run(plan: Plan) -> dict:
    from transformers import AutoTokenizer

    from megatron_rl import platform
    from megatron_rl.data import PromptLoader
    from megatron_rl.environments.driver import EpisodeDriver
    from megatron_rl.environments.interface import EnvironmentSetup, EpisodeRecord
    from megatron_rl.environments.isolation import probe_isolation
    from megatron_rl.environments.registry import get_environment
    from megatron_rl.environments.tools import build_tools
    from megatron_rl.from_config import setup
    from megatron_rl.from_config.sources import base_settings, verifier_name
    from megatron_rl.models.hf_config import arch_from_hf
    from megatron_rl.rollout import RolloutEngine
    from megatron_rl.tasks.base_model import make_tiny_base
    from megatron_rl.trainer.episodes import episode_spec

    cfg, started = config(plan), datetime.datetime.now(datetime.timezone.utc)
    platform.init_distributed()
    base = plan.base
    if base is None:
        base = plan.dir / "base_model"
        make_tiny_base(base, base_settings(cfg))
    tokenizer = AutoTokenizer.from_pretrained(base)
    engine = RolloutEngine(base, setup.engine_config(cfg, arch_from_hf(base), plan.dir / "cache"))
    rollout, spec = cfg.rollout, episode_spec(cfg, verifier_name(cfg))  # the trainer's environment and limits
    report = probe_isolation()
    specs, runner = build_tools(spec.tools, spec.sandbox, report)
    if plan.tool == "service":
        runner = CalculatorService()
    runner = PaddedRunner(runner, *plan.tool_seconds, seed=plan.seed)
    setup_ = EnvironmentSetup(reward=spec.reward, tools=specs, tool_runner=runner, tool_parser=spec.parser)
    environment = get_environment(spec.environment, setup_)
    drivers = {
        mode: EpisodeDriver(
            engine,
            tokenizer,
            environment,
            dataclasses.replace(spec.driver, env_threads=plan.env_threads, overlap=overlap),
        )
        for mode, overlap in (("overlap", True), ("lockstep", False))
    }
    dataset = setup.prompt_dataset(cfg, base, tokenizer)
    loader = PromptLoader(dataset, batch_size=rollout.prompts_per_step, seed=cfg.trainer.seed)
    batches, load = [], [os.getloadavg()]
    try:
        for b in range(plan.batches):
            prompts = loader.next_batch()
            g = rollout.n_samples
            records = [
                EpisodeRecord.from_messages(dataset[i].messages, dataset[i].answer)
                for i in prompts.dataset_indices
                for _ in range(g)
            ]
            batch = {}
            batch["overlap"], results = _episode_batch(drivers["overlap"], records)
            batch["lockstep"], _ = _episode_batch(drivers["lockstep"], records)
            lengths = [r.counts.sampled_tokens for r in results]
            firsts = [r.tokens[: r.prompt_length].tolist() for r in results]
            batch["single_turn"] = _single_turn_batch(engine, firsts, lengths, rollout.temperature)
            batches.append(batch)
            load.append(os.getloadavg())
            line = ", ".join(f"{m} {v['tokens'] / v['seconds']:.0f} tok/s" for m, v in batch.items())
            print(f"bench tools: batch {b + 1}/{plan.batches}: {line}", file=sys.stderr, flush=True)
    finally:
        for driver in drivers.values():
            driver.close()
        environment.close()
    result = {
        "bench": "tools",
        "recipe": plan.config,
        **summarize(batches),
        "batches": batches,
        "tool": plan.tool,
        "tool_seconds": list(plan.tool_seconds),
        "isolation": report.line() if plan.tool == "sandbox" else None,
        "episodes_per_batch": rollout.prompts_per_step * rollout.n_samples,
        "loadavg": load,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(plan).items()},
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join(["megatron-rl", *sys.argv[1:]]),
        "machine": {"host": host.node(), "cpus": os.cpu_count(), "platform": host.platform()},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "batches"}, indent=1))
    save_json(result, plan.json_path)
    return result


def run_args(args: argparse.Namespace) -> int:
    """``megatron-rl bench tools``: the exit code."""
    return run_checked("tools", lambda: make_plan(args, world_size()), run)
