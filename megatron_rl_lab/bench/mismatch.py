"""Train-inference mismatch benchmark: vLLM's sampling logprobs against Megatron's, for a
MoE model, without and with router replay.

One process (world 1) builds one HF model (a qwen3_moe size preset, or ``--hf DIR``), a
vLLM engine that records its routes and the Megatron actor in the same dtype, samples
``--prompts`` x ``--samples`` responses to random prompts, and recomputes the sampled
tokens' logprobs with Megatron twice: with its own routers and replaying vLLM's routes.
Per pass: mean |Δlogp| and the k3 estimate of KL(vLLM || Megatron) over the response
tokens (float64), and the router agreement (share of (token, layer) where Megatron's own
top-k set equals vLLM's). One dtype per process (vLLM's state is process-wide):
tools/bench_mismatch.py runs the grid and writes the table.

    megatron-rl bench mismatch --model cpu-moe-64e --dtype bf16 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform as host
import time
from pathlib import Path
from typing import Optional

from megatron_rl.models.hf_config import ModelArch
from megatron_rl.utils import dtypes
from megatron_rl_lab.bench.args import (
    BenchArgumentError,
    bench_parser,
    model_option,
    positive,
    run_checked,
    save_json,
    world_size,
)
from megatron_rl_lab.bench.presets import PRESETS, model_label

DESCRIPTION = (
    "Mean |dlogp|, k3 KL(vLLM || Megatron) and router agreement of sampled tokens, "
    "without and with router replay (MoE, one dtype per run, world 1)."
)
EPILOG = """\
examples:
  megatron-rl bench mismatch --model tiny-moe-4l --dtype fp32
  megatron-rl bench mismatch --model cpu-moe-64e --dtype bf16 --prompts 16 --json mismatch.json
  python tools/bench_mismatch.py   # tiny-moe-4l and cpu-moe-64e, fp32 and bf16, with a table
"""


@dataclasses.dataclass(frozen=True)
class Plan:
    arch: ModelArch
    model_label: str
    hf_dir: Optional[Path]
    dtype: str
    """Long dtype name (float32 | bfloat16)."""
    prompts: int
    samples: int
    prompt_len: int
    max_tokens: int
    seed: int
    work_dir: Path
    json_path: Optional[Path]


def add_parser(sub) -> argparse.ArgumentParser:
    p = bench_parser(
        sub,
        "mismatch",
        help="train-inference mismatch of a MoE model, without and with router replay",
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    p.add_argument("--model", default="tiny-moe-4l", help=f"a MoE preset ({', '.join(_moe_presets())}) or an HF dir")
    p.add_argument("--dtype", default="bf16", help="fp32 | bf16 (model, optimizer-free forward and vLLM)")
    p.add_argument("--prompts", type=positive, default=8, help="random prompts")
    p.add_argument("--samples", type=positive, default=4, help="responses per prompt")
    p.add_argument("--prompt-len", type=positive, default=16)
    p.add_argument("--max-tokens", type=positive, default=32, help="response budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="/tmp/megatron-rl-bench-mismatch")
    p.add_argument("--json", default=None, help="write the result here")
    return p


def _moe_presets() -> list[str]:
    return [name for name, arch in PRESETS.items() if arch.is_moe]


def make_plan(args: argparse.Namespace, world: int) -> Plan:
    if world != 1:
        raise BenchArgumentError(f"bench mismatch runs in one process; WORLD_SIZE={world}")
    if args.dtype not in ("fp32", "bf16"):
        raise BenchArgumentError(f"--dtype {args.dtype!r}; allowed: fp32, bf16")
    arch = model_option(args.model)
    if not arch.is_moe:
        raise BenchArgumentError(f"--model {args.model} is not a MoE model; MoE presets: {', '.join(_moe_presets())}")
    hf_dir = Path(args.model) if args.model not in PRESETS else None
    return Plan(
        arch=arch,
        model_label=model_label(args.model),
        hf_dir=hf_dir,
        dtype=dtypes.long_name(args.dtype),
        prompts=args.prompts,
        samples=args.samples,
        prompt_len=args.prompt_len,
        max_tokens=args.max_tokens,
        seed=args.seed,
        work_dir=Path(args.work_dir),
        json_path=Path(args.json) if args.json else None,
    )


def _rollouts(plan: Plan, engine) -> list:
    import torch

    from megatron_rl.rollout import Sampling

    g = torch.Generator().manual_seed(plan.seed)
    prompts = [
        torch.randint(3, plan.arch.vocab_size, (plan.prompt_len,), generator=g).tolist() for _ in range(plan.prompts)
    ]
    groups = engine.generate(prompts, Sampling(n=plan.samples, max_tokens=plan.max_tokens, temperature=1.0))
    return [s for group in groups for s in group]


def _measure(chunks, replay, samples, arch: ModelArch, seq_length: int, replayed: bool) -> dict:
    """One Megatron pass over the sampled tokens: |Δlogp|, k3 KL and router agreement."""
    import torch

    from megatron_rl.algorithms import kl_penalty
    from megatron_rl.schedules import TrainBatch, compute_logprobs
    from megatron_rl.schedules.batch import pack_sequences, scatter_response
    from megatron_rl.trainer.assembly import pack_routes

    tokens, response = pack_sequences([s.prompt_ids for s in samples], [s.token_ids for s in samples], seq_length)
    mask = scatter_response(
        [torch.ones(len(s.token_ids)) for s in samples], [len(s.prompt_ids) for s in samples], seq_length
    ).bool()
    vllm = scatter_response(
        [torch.tensor(s.logprobs) for s in samples], [len(s.prompt_ids) for s in samples], seq_length
    ).double()
    batch = TrainBatch(tokens=tokens, loss_mask=mask, routes=pack_routes(samples, seq_length))
    replay.begin(replay=replayed)
    logp, _ = compute_logprobs(chunks, batch, 1, arch.vocab_size)
    ours = logp.double()
    stats = replay.stats()
    tokens_counted = mask.sum()
    return {
        "mean_abs_dlogp": float(((ours - vllm).abs() * mask).sum() / tokens_counted),
        "k3_kl": float((kl_penalty(vllm, ours, "k3") * mask).sum() / tokens_counted),
        "router_agreement": stats["agreed"] / max(stats["compared"], 1),
        "tokens": int(tokens_counted),
    }


def run(plan: Plan) -> dict:
    from megatron_rl import platform
    from megatron_rl.bridge import load_hf
    from megatron_rl.models.builder import BuildOptions, build_model
    from megatron_rl.models.route_replay import RouteReplay
    from megatron_rl.parallel import ParallelConfig, initialize
    from megatron_rl.rollout import EngineConfig, RolloutEngine
    from megatron_rl_lab.testing.hf_models import save_tiny_model

    platform.init_distributed()
    hf_dir = plan.hf_dir or plan.work_dir / "models" / plan.model_label
    if plan.hf_dir is None and not (hf_dir / "config.json").exists():
        save_tiny_model(plan.arch, hf_dir, seed=0)
    seq_length = plan.prompt_len + plan.max_tokens
    engine = RolloutEngine(
        hf_dir,
        EngineConfig(
            dtype=plan.dtype,
            max_model_len=seq_length,
            load_tokenizer=False,
            seed=plan.seed,
            record_routes=True,
            cache_dir=str(plan.work_dir / "cache"),
        ),
    )
    started = time.perf_counter()
    samples = _rollouts(plan, engine)
    initialize(ParallelConfig(), seed=1, model=plan.arch.shape())
    chunks = build_model("actor", plan.arch, ParallelConfig(), BuildOptions(dtype=dtypes.short_name(plan.dtype)))
    load_hf(chunks, hf_dir, plan.arch)
    replay = RouteReplay(chunks)
    result = {
        "bench": "mismatch",
        "model": plan.model_label,
        "dtype": plan.dtype,
        "experts": plan.arch.num_moe_experts,
        "topk": plan.arch.moe_router_topk,
        "layers": plan.arch.num_layers,
        "samples": len(samples),
        "own_routers": _measure(chunks, replay, samples, plan.arch, seq_length, False),
        "replayed": _measure(chunks, replay, samples, plan.arch, seq_length, True),
        "seconds": round(time.perf_counter() - started, 1),
        "date": datetime.date.today().isoformat(),
        "host": host.node(),
    }
    own, replayed = result["own_routers"]["k3_kl"], result["replayed"]["k3_kl"]
    result["k3_ratio_replay_over_own"] = replayed / own if own > 0 else None
    print(json.dumps(result, indent=1))
    save_json(result, plan.json_path)
    return result


def run_args(args: argparse.Namespace) -> int:
    """``megatron-rl bench mismatch``: the exit code."""
    return run_checked("mismatch", lambda: make_plan(args, world_size()), run)
