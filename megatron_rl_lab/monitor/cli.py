"""The lab's `monitor` subcommands: eval, synth, train-synthetic.

Each is an entry point of the group `megatron_rl.commands` (setup.py: `monitor.eval`,
`monitor.synth`, `monitor.train-synthetic`); the runtime's `megatron-rl monitor` and
`python -m megatron_rl.monitor` list them and call `eval_main`, `synth_main` or
`train_synthetic_main` with the arguments after the subcommand's name. Exit status: 0
when the command ran, 2 for bad input (one line saying what is wrong).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from megatron_rl.monitor.cli import BAD_INPUT, PROG, load_detect_config, load_model
from megatron_rl.monitor.config import DetectConfig
from megatron_rl.monitor.trace import write_trace

from .evaluate import GENERATORS, EvalConfig


def ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 8,32,128") from None


def cmd_eval(args) -> int:
    import torch

    from megatron_rl.monitor.denoise import DenoiserConfig

    from .evaluate import EvalPlan, format_report, run_evaluation, train_synthetic_denoiser

    try:
        cfg = load_detect_config(args.config, {"mode": args.mode, "continuity_s": args.continuity_s})
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    extra = dict(kinds=tuple(args.kinds)) if args.kinds else {}
    if args.step_period:
        extra["step_period_s"] = tuple(float(x) for x in args.step_period)
    shared = dict(
        distractors=args.distractors,
        step_metrics=args.step_metrics,
        generator=args.generator,
        duration_s=args.duration_s,
        **extra,
    )
    try:  # before any model is loaded: a bad generator, kind or duration is one line
        plan = EvalPlan(
            tune=EvalConfig(
                seed=args.tune_seed,
                machines=args.tune_machines,
                faulty_per_cell=args.tune_faulty,
                fault_free_per_size=args.tune_fault_free,
                **shared,
            ),
            test=EvalConfig(
                seed=args.seed,
                machines=args.machines,
                faulty_per_cell=args.faulty,
                fault_free_per_size=args.fault_free,
                **shared,
            ),
            timing_machines=args.timing,
            only=tuple(args.only or ()),
            threshold=args.threshold,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    torch.set_num_threads(args.threads)
    if args.model == "train":
        print(f"training a denoiser on {args.train_traces} fault-free traces (seeds from {args.train_seed})")
        den = train_synthetic_denoiser(args.train_seed, args.train_traces, cfg=DenoiserConfig(steps=args.steps))
    else:
        den, _ = load_model(args.model)
    if plan.tune.seed + 1000 > plan.test.seed and plan.test.seed + 1000 > plan.tune.seed:
        print("warning: tuning and test seeds are within 1000 of each other and may overlap", file=sys.stderr)
    result = run_evaluation(plan, den, cfg)
    text = format_report(result)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        Path(args.out).with_suffix(".md").write_text(text + "\n")
        print(f"report written to {args.out} and {Path(args.out).with_suffix('.md')}")
    return 0


def cmd_synth(args) -> int:
    try:  # the evaluation's registry turns the options into the generator's own config
        ec = EvalConfig(generator=args.generator, duration_s=args.duration_s, step_metrics=args.step_metrics)
        st = ec.generate(GENERATORS[args.generator].config(ec, args.machines, args.seed, args.fault))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    write_trace(st.to_trace(), args.out)
    labels = [asdict(lb) for lb in st.labels]
    Path(args.out).with_suffix(".labels.json").write_text(json.dumps(labels, indent=1))
    print(f"wrote {args.out} ({args.machines} machines, {args.duration_s} s); faults: {labels or 'none'}")
    return 0


def cmd_train_synthetic(args) -> int:
    from megatron_rl.monitor.denoise import DenoiserConfig

    from .evaluate import train_synthetic_denoiser

    cfg = DenoiserConfig(window=args.window, steps=args.steps, seed=args.init_seed)
    print(
        f"training on {args.synthetic} synthetic fault-free traces of {args.machines} machines "
        f"(seeds {args.seed}..{args.seed + args.synthetic - 1})"
    )
    den = train_synthetic_denoiser(args.seed, args.synthetic, args.machines, cfg, log=print)
    print(f"saved {den.save(args.out)}")
    return 0


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROG} eval")
    p.add_argument("--machines", type=ints, default=(8, 32, 128, 512), help="held-out sizes")
    p.add_argument("--faulty", type=int, default=5, help="faulty traces per (kind, size)")
    p.add_argument("--fault-free", type=int, default=8, help="fault-free traces per size")
    p.add_argument("--seed", type=int, default=10_000, help="first held-out seed")
    p.add_argument("--tune-machines", type=ints, default=(8, 32, 128))
    p.add_argument("--tune-faulty", type=int, default=3)
    p.add_argument("--tune-fault-free", type=int, default=4)
    p.add_argument("--tune-seed", type=int, default=1_000, help="first tuning seed")
    p.add_argument("--timing", type=ints, default=(64, 256, 1024), help="machine counts to time")
    p.add_argument("--model", default=None, help="denoiser dir, 'none', or 'train' (default: packaged)")
    p.add_argument("--train-seed", type=int, default=100)
    p.add_argument("--train-traces", type=int, default=4)
    p.add_argument("--steps", type=int, default=600, help="denoiser steps with --model train")
    p.add_argument("--config", help="YAML/JSON file of DetectConfig fields (as for detect)")
    p.add_argument("--mode", choices=("any", "top1"), help="overrides the config (default: any)")
    p.add_argument("--continuity-s", type=float, help=f"overrides the config (default: {DetectConfig.continuity_s})")
    p.add_argument("--only", nargs="*", help="evaluate methods whose name contains these")
    p.add_argument(
        "--generator",
        choices=tuple(GENERATORS),
        default="synth",
        help="trace generator (coupled: the independent step-schedule simulation)",
    )
    p.add_argument(
        "--distractors",
        action="store_true",
        help="harder synth traces: job-wide load changes, pipeline phases, sensor spikes "
        "(coupled traces always carry their own)",
    )
    p.add_argument(
        "--step-metrics",
        action="store_true",
        help="every trace carries step and section times (straggler traces always do)",
    )
    p.add_argument("--step-period", type=ints, help="range of the step length in s, e.g. 40,90 (default 6,12)")
    p.add_argument("--duration-s", type=int, default=900, help="length of every trace in s")
    p.add_argument("--kinds", nargs="*", help="fault kinds to evaluate (default: all of the generator's)")
    p.add_argument("--threshold", type=float, help="use this threshold for every method; skip tuning")
    p.add_argument("--threads", type=int, default=1, help="torch threads (timings are for 1)")
    p.add_argument("--out", help="write the report as JSON here (and .md beside it)")
    p.set_defaults(func=cmd_eval)
    return p


def synth_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROG} synth")
    p.add_argument("--out", required=True, help="trace file (.csv or .parquet)")
    p.add_argument("--machines", type=int, default=16)
    p.add_argument("--generator", choices=tuple(GENERATORS), default="synth", help="trace generator")
    p.add_argument("--fault", default=None, help="fault kind (default: fault-free)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration-s", type=int, default=900)
    p.add_argument("--step-metrics", action="store_true", help="add step and section times")
    p.set_defaults(func=cmd_synth)
    return p


def train_synthetic_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{PROG} train-synthetic",
        description="train the denoiser on synthetic fault-free traces (how the packaged weights are made)",
    )
    p.add_argument("--synthetic", type=int, default=4, help="this many synthetic fault-free traces")
    p.add_argument("--machines", type=int, default=64, help="machines per synthetic trace")
    p.add_argument("--out", required=True, help="directory for denoiser.safetensors")
    p.add_argument("--window", type=int, default=8, help="samples per window (= detector window_s at 1 Hz)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=100, help="first synthetic trace seed")
    p.add_argument("--init-seed", type=int, default=0, help="weight initialisation and batch order")
    p.set_defaults(func=cmd_train_synthetic)
    return p


def _run(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    return args.func(args)


def eval_main(argv: list[str] | None = None) -> int:
    return _run(eval_parser(), argv)


def synth_main(argv: list[str] | None = None) -> int:
    return _run(synth_parser(), argv)


def train_synthetic_main(argv: list[str] | None = None) -> int:
    return _run(train_synthetic_parser(), argv)
