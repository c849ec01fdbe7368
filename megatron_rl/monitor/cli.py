"""`monitor` subcommands: detect, eval, train-denoiser, synth.

`add_monitor_subcommands(subparsers)` registers them on any argparse subparsers object
(the top-level `megatron-rl monitor` command uses it); `main(argv)` is the standalone
entry point behind `python -m megatron_rl.monitor`. Exit status: 0 whether or not a
faulty machine was found, 2 for bad input (the message says what is wrong).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

from .actions import append_exclude, format_alerts, write_alerts
from .detect import DetectConfig, detect
from .evaluate import GENERATORS, EvalConfig
from .trace import TraceError, check_strict, read_trace, validate, write_trace

BAD_INPUT = 2


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 8,32,128") from None


def load_detect_config(path: str | None, overrides: dict) -> DetectConfig:
    """DetectConfig from a YAML/JSON mapping file plus CLI overrides; unknown keys fail."""
    values = {}
    if path:
        text = Path(path).read_text()
        if path.endswith((".yaml", ".yml")):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = json.loads(text)
        values = values.get("detect", values) if isinstance(values, dict) else values
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of DetectConfig fields")
    valid = {f.name for f in fields(DetectConfig)}
    unknown = sorted(set(values) - valid)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(valid))}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return DetectConfig(**values)


def _load_model(arg: str | None):
    """--model DIR, 'none' for raw windows, or the packaged default."""
    from .denoise import Denoiser, default_model_dir

    if arg == "none":
        return None, "none (raw windows)"
    path = arg or default_model_dir()
    if path is None:
        return None, "none (no packaged weights; train some with train-denoiser)"
    return Denoiser.load(path), str(path)


def cmd_detect(args) -> int:
    try:
        cfg = load_detect_config(
            args.config,
            {
                "threshold": args.threshold,
                "continuity_s": args.continuity_s,
                "window_s": args.window_s,
                "mode": args.mode,
            },
        )
        trace = read_trace(args.trace)
        report = validate(trace)
        if args.strict:
            check_strict(trace, where=str(args.trace))
        denoiser, model = _load_model(args.model)
    except (TraceError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    for line in report.lines():
        print(f"trace: {line}")
    print(f"denoiser: {model}")
    alerts = detect(trace, cfg, denoiser).alerts
    print(format_alerts(alerts))
    write_alerts(args.out, alerts)
    print(f"{len(alerts)} alert(s) written to {args.out}")
    if args.exclude_file and alerts:
        added = append_exclude(args.exclude_file, [a.machine for a in alerts])
        print(f"exclude file {args.exclude_file}: added {', '.join(added) or 'nothing new'}")
    return 0


def cmd_train(args) -> int:
    import numpy as np

    from .denoise import DenoiserConfig, train_denoiser
    from .evaluate import train_synthetic_denoiser
    from .windows import normal_windows, to_grid

    cfg = DenoiserConfig(window=args.window, steps=args.steps, seed=args.init_seed)
    if not args.trace:
        print(
            f"training on {args.synthetic} synthetic fault-free traces of {args.machines} machines "
            f"(seeds {args.seed}..{args.seed + args.synthetic - 1})"
        )
        den = train_synthetic_denoiser(args.seed, args.synthetic, args.machines, cfg, log=print)
        print(f"saved {den.save(args.out)}")
        return 0
    try:
        grids = [to_grid(read_trace(p)) for p in args.trace]
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    wins: dict = {}
    for g in grids:
        for k, w in normal_windows(g, cfg.window).items():
            wins.setdefault(k, []).append(w)
    den = train_denoiser({k: np.concatenate(v) for k, v in wins.items() if v}, cfg, log=print)
    print(f"saved {den.save(args.out)}")
    return 0


def cmd_eval(args) -> int:
    import torch

    from .denoise import DenoiserConfig
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
        den, _ = _load_model(args.model)
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


def add_monitor_subcommands(subparsers) -> None:
    """Register detect / eval / train-denoiser / synth on an argparse subparsers object."""
    p = subparsers.add_parser("detect", help="find faulty machines in a trace")
    p.add_argument("--trace", required=True, help="CSV/Parquet file or directory of them")
    p.add_argument("--out", default="alerts.jsonl", help="alerts as JSON lines (default: %(default)s)")
    p.add_argument("--model", help="denoiser directory, or 'none' (default: packaged weights)")
    p.add_argument("--config", help="YAML/JSON file of DetectConfig fields")
    p.add_argument("--threshold", type=float)
    p.add_argument("--continuity-s", type=float)
    p.add_argument("--window-s", type=float)
    p.add_argument("--mode", choices=("any", "top1"))
    p.add_argument("--exclude-file", help="append declared hostnames here (Slurm requeue)")
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse non-canonical metric names and time going back within a series "
        "(by default both are counted and tolerated)",
    )
    p.set_defaults(func=cmd_detect)

    p = subparsers.add_parser("eval", help="precision/recall/F1 on synthetic traces vs baselines")
    p.add_argument("--machines", type=_ints, default=(8, 32, 128, 512), help="held-out sizes")
    p.add_argument("--faulty", type=int, default=5, help="faulty traces per (kind, size)")
    p.add_argument("--fault-free", type=int, default=8, help="fault-free traces per size")
    p.add_argument("--seed", type=int, default=10_000, help="first held-out seed")
    p.add_argument("--tune-machines", type=_ints, default=(8, 32, 128))
    p.add_argument("--tune-faulty", type=int, default=3)
    p.add_argument("--tune-fault-free", type=int, default=4)
    p.add_argument("--tune-seed", type=int, default=1_000, help="first tuning seed")
    p.add_argument("--timing", type=_ints, default=(64, 256, 1024), help="machine counts to time")
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
    p.add_argument("--step-period", type=_ints, help="range of the step length in s, e.g. 40,90 (default 6,12)")
    p.add_argument("--duration-s", type=int, default=900, help="length of every trace in s")
    p.add_argument("--kinds", nargs="*", help="fault kinds to evaluate (default: all of the generator's)")
    p.add_argument("--threshold", type=float, help="use this threshold for every method; skip tuning")
    p.add_argument("--threads", type=int, default=1, help="torch threads (timings are for 1)")
    p.add_argument("--out", help="write the report as JSON here (and .md beside it)")
    p.set_defaults(func=cmd_eval)

    p = subparsers.add_parser("train-denoiser", help="train the per-metric LSTM-VAEs on normal data")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", nargs="+", help="fault-free trace(s) of your cluster")
    src.add_argument("--synthetic", type=int, default=4, help="else: this many synthetic fault-free traces")
    p.add_argument("--machines", type=int, default=64, help="machines per synthetic trace")
    p.add_argument("--out", required=True, help="directory for denoiser.safetensors")
    p.add_argument("--window", type=int, default=8, help="samples per window (= detector window_s at 1 Hz)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=100, help="first synthetic trace seed")
    p.add_argument("--init-seed", type=int, default=0, help="weight initialisation and batch order")
    p.set_defaults(func=cmd_train)

    p = subparsers.add_parser("synth", help="write a synthetic trace (and its fault labels)")
    p.add_argument("--out", required=True, help="trace file (.csv or .parquet)")
    p.add_argument("--machines", type=int, default=16)
    p.add_argument("--generator", choices=tuple(GENERATORS), default="synth", help="trace generator")
    p.add_argument("--fault", default=None, help="fault kind (default: fault-free)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration-s", type=int, default=900)
    p.add_argument("--step-metrics", action="store_true", help="add step and section times")
    p.set_defaults(func=cmd_synth)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_rl.monitor", description="Minder-style faulty-machine detection"
    )
    add_monitor_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
