"""`monitor` subcommands: detect and train-denoiser here, more from installed packages.

`add_monitor_subcommands(subparsers)` registers the runtime's own on any argparse
subparsers object; `main(argv)` is what `megatron-rl monitor` and `python -m
megatron_rl.monitor` run. It also lists and runs the subcommands that installed packages
declare as `monitor.<name>` entry points (megatron_rl.commands): the lab's `eval`, `synth`
and `train-synthetic` (megatron_rl_lab), which study the detector on synthetic traces.
Exit status: 0 whether or not a faulty machine was found, 2 for bad input (the message
says what is wrong).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from megatron_rl.commands import installed

from .actions import append_exclude, format_alerts, write_alerts
from .detect import DetectConfig, detect
from .trace import TraceError, check_strict, read_trace, validate

BAD_INPUT = 2
PROG = "python -m megatron_rl.monitor"


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


def load_model(arg: str | None):
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
        denoiser, model = load_model(args.model)
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
    from .windows import normal_windows, to_grid

    cfg = DenoiserConfig(window=args.window, steps=args.steps, seed=args.init_seed)
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


def add_monitor_subcommands(subparsers) -> None:
    """Register detect and train-denoiser on an argparse subparsers object."""
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

    p = subparsers.add_parser("train-denoiser", help="train the per-metric LSTM-VAEs on normal data")
    p.add_argument(
        "--trace",
        nargs="+",
        required=True,
        help="fault-free trace(s) of your cluster (synthetic ones: `monitor train-synthetic`, megatron_rl_lab)",
    )
    p.add_argument("--out", required=True, help="directory for denoiser.safetensors")
    p.add_argument("--window", type=int, default=8, help="samples per window (= detector window_s at 1 Hz)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--init-seed", type=int, default=0, help="weight initialisation and batch order")
    p.set_defaults(func=cmd_train)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    others = installed("monitor")
    parser = argparse.ArgumentParser(prog=PROG, description="Minder-style faulty-machine detection")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_monitor_subcommands(subparsers)
    own = set(subparsers.choices)
    if argv[:1] and argv[0] in others and argv[0] not in own:  # its own parser takes the rest
        return others[argv[0]].run(argv[1:])
    for name, command in others.items():
        if name not in own:  # listed in the help; never parsed here
            subparsers.add_parser(name, help=command.help, add_help=False)
    args = parser.parse_args(argv)
    return args.func(args)
