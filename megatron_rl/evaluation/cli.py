"""`megatron-rl eval`: the trainer's eval phase on a saved checkpoint or an HF directory.

    megatron-rl eval --config CFG [key=value ...] (--ckpt DIR | --hf DIR) [--step N]
                     [--sets a,b] [--json OUT]

The evaluation is the run's own (megatron_rl.evaluation.phase): the same sets, sampling,
per-sample seeds (from eval.seed, the set, the prompt and the sample), engine settings and
reward, so on the weights a run evaluated it gives that run's ``val/`` numbers. Give it
the run's config (``RUN_DIR/config.yaml`` is the resolved one) and its checkpoint.

``--ckpt`` takes a run directory (its ``checkpoints/``), a checkpoint root (the newest
committed step, or ``--step N``) or one ``step_<N>`` directory, saved in any layout: the
actor is built in the config's ``parallel`` layout, the step loaded into it, and its
weights synced into vLLM as in training. ``--hf`` takes an HF directory with its tokenizer,
served by vLLM as it is. Alone it runs at world size 1; under torchrun SPMD, each vLLM
replica evaluating a share of every set.

Everything that can be checked without a model is checked first (the config and the
overrides, the paths, the set names): one line and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_rl.launch.one_line_cli import OneLineParser

BAD_INPUT = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""One of these makes an HF directory's tokenizer loadable (the prompts are templated with it)."""


class EvalInputError(ValueError):
    """An option, path or set name the evaluation cannot use; the message says why."""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="megatron-rl eval",
        description="Evaluate a checkpoint or an HF model on the config's eval sets, as the trainer's "
        "eval phase does (same sampling and seeds): a table on stdout, a JSON report with --json.",
        epilog="example: megatron-rl eval --config runs/dapo/config.yaml --ckpt runs/dapo --json val.json",
    )
    parser.add_argument("--config", help="YAML recipe; RUN_DIR/config.yaml reproduces that run's evaluation")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. eval.n_samples=8")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--ckpt",
        type=Path,
        help="a run dir (its checkpoints/), a checkpoint root or one step_<N> directory, any saved layout",
    )
    model.add_argument("--hf", type=Path, help="an HF model directory with its tokenizer")
    parser.add_argument("--step", type=int, help="with --ckpt: the committed step (default: the newest)")
    parser.add_argument("--sets", help="comma-separated eval set names (default: every set of eval.sets)")
    parser.add_argument(
        "--json", type=Path, help="write the report here, and the per-prompt records beside it (OUT.prompts.jsonl)"
    )
    return parser


@dataclasses.dataclass(frozen=True)
class Target:
    """What is evaluated: a committed checkpoint step, or an HF directory as it is."""

    base_dir: Path
    """The HF directory vLLM starts from: tokenizer, config.json and, for task data, the
    held-out split (for a checkpoint, the directory its run started from)."""
    ckpt_root: Optional[Path] = None
    step: Optional[int] = None

    def describe(self) -> dict:
        if self.ckpt_root is None:
            return {"hf": str(self.base_dir)}
        return {"checkpoint": str(self.ckpt_root), "step": self.step, "base_model": str(self.base_dir)}


def checkpoint_step(path: Path, step: Optional[int]) -> tuple[Path, int]:
    """(checkpoint root, committed step) of a ``--ckpt`` path: a run dir, a root or a step dir."""
    from megatron_rl.checkpoint import format as fmt

    path = Path(path)
    if (path / "checkpoints").is_dir():  # a run dir
        path = path / "checkpoints"
    elif fmt.step_of_dir(path) is not None and path.is_dir():
        if step is not None and step != fmt.step_of_dir(path):
            raise EvalInputError(f"--step {step} names another step than --ckpt {path}")
        path, step = path.parent, fmt.step_of_dir(path)
    try:
        return path, fmt.resolve_step(path, step)
    except fmt.CheckpointError as err:
        raise EvalInputError(f"--ckpt {err}") from None


def checkpoint_target(path: Path, step: Optional[int], hf_path: Optional[str]) -> Target:
    """The step to load and the HF directory its run started from (recorded in the
    checkpoint; ``model.hf_path`` when that directory is gone)."""
    from megatron_rl.checkpoint import format as fmt

    root, step = checkpoint_step(path, step)
    try:
        recorded = fmt.read_metadata(root, step).extra.get("hf_source_dir")
    except fmt.CheckpointError as err:
        raise EvalInputError(f"--ckpt {err}") from None
    for candidate in (recorded, hf_path):
        if candidate and (Path(candidate) / "config.json").is_file():
            return Target(Path(candidate), root, step)
    raise EvalInputError(
        f"--ckpt {root} step {step}: the HF directory its run started from "
        f"({recorded or 'not recorded'}) is gone; pass model.hf_path=DIR (that model, with its tokenizer)"
    )


def hf_target(path: Path) -> Target:
    from megatron_rl.bridge.inputs import ConvertInputError, check_hf_model_dir

    try:
        check_hf_model_dir(path, flag="--hf")
    except ConvertInputError as err:
        raise EvalInputError(str(err)) from None
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise EvalInputError(f"--hf {path} has no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    return Target(path)


def select_sets(configured: dict, names: Optional[str]) -> dict:
    """The configured sets that ``--sets`` names (all of them without it), in its order."""
    if not configured:
        raise EvalInputError(
            "the config names no eval set (eval.sets): add one, e.g. eval.sets.held_out.source=held_out"
        )
    if names is None:
        return dict(configured)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in configured]
    if unknown or not wanted:
        raise EvalInputError(
            f"--sets {names!r}: unknown eval set {', '.join(map(repr, unknown)) or '(none named)'}; "
            f"configured: {', '.join(configured)}"
        )
    return {n: configured[n] for n in wanted}


def prepare(args: argparse.Namespace, world_size: int):
    """The config to evaluate with and the :class:`Target`, every input checked (no model built).

    The config gets the target's HF directory as model.hf_path (what the run started from:
    its held-out split and layouts are checked against it), only the selected sets, and the
    colocated engines this command runs; then the run's one validation pass."""
    from megatron_rl.config import load_config
    from megatron_rl.from_config import validate

    if args.hf is not None and args.step is not None:
        raise EvalInputError("--step applies to --ckpt, not to --hf")
    cfg = load_config(args.config, args.overrides)
    sets = select_sets(cfg.eval.sets, args.sets)
    target = hf_target(args.hf) if args.hf is not None else checkpoint_target(args.ckpt, args.step, cfg.model.hf_path)
    if args.json is not None and args.json.is_dir():
        raise EvalInputError(f"--json {args.json} is a directory; name the report file")
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, hf_path=str(target.base_dir)),
        rollout=dataclasses.replace(cfg.rollout, placement="colocated"),
        eval=dataclasses.replace(cfg.eval, sets=sets, at_end=True),  # at_end: "enabled", for validation
    )
    return validate(cfg, world_size), target


def format_table(metrics: dict, sizes: dict, pass_k: Sequence[int]) -> str:
    """One row per set: prompts, samples, accuracy (avg@n), pass@k, mean length, truncated share."""
    header = ["set", "prompts", "samples", "accuracy", *(f"pass@{k}" for k in pass_k), "length", "truncated"]
    rows = [header]
    for name, (prompts, samples) in sizes.items():
        val = f"val/{name}/"
        rows.append(
            [
                name,
                str(prompts),
                str(samples),
                f"{metrics[val + 'accuracy']:.4f}",
                *(f"{metrics[f'{val}pass@{k}']:.4f}" for k in pass_k),
                f"{metrics[val + 'response_length']:.2f}",
                f"{metrics[val + 'truncated']:.4f}",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    )


def records_path(report: Path) -> Path:
    """The per-prompt records beside the report: OUT.json -> OUT.prompts.jsonl."""
    return report.with_name(f"{report.stem}.prompts.jsonl")


def write_report(path: Path, report: dict) -> None:
    """Whole or not at all (written aside, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_rl.config import ConfigError

    args = build_parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    try:
        cfg, target = prepare(args, world_size)
    except (ConfigError, EvalInputError) as err:
        kind = "config error" if isinstance(err, ConfigError) else "error"
        print(f"megatron-rl eval: {kind}: {err}", file=sys.stderr)
        return BAD_INPUT
    from megatron_rl.checkpoint import CheckpointError
    from megatron_rl.evaluation.offline import evaluate_target

    try:
        result = evaluate_target(cfg, target, records_path(args.json) if args.json else None)
    except (CheckpointError, ConfigError) as err:  # a step that does not fit the model; a set that cannot be read
        print(f"megatron-rl eval: error: {err}", file=sys.stderr)
        return BAD_INPUT
    if not result.reports:
        return 0
    print(format_table(result.metrics, result.sizes, cfg.eval.pass_k))
    if args.json is not None:
        ev = cfg.eval
        write_report(
            args.json,
            {
                "model": target.describe(),
                "metrics": result.metrics,
                "sets": {
                    name: {"source": ev.sets[name].source, "prompts": prompts, "samples": samples}
                    for name, (prompts, samples) in result.sizes.items()
                },
                "eval": {
                    "n_samples": ev.n_samples,
                    "temperature": ev.temperature,
                    "top_p": ev.top_p,
                    "max_new_tokens": ev.max_new_tokens or cfg.rollout.max_new_tokens,
                    "pass_k": list(ev.pass_k),
                    "seed": ev.seed,
                },
                "world_size": world_size,
                "records": str(records_path(args.json)),
            },
        )
        print(f"wrote {args.json} and {records_path(args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
