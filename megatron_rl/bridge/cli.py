"""`megatron-rl convert`: HF directory <-> megatron_rl checkpoint.

    megatron-rl convert hf-to-megatron --hf DIR --out DIR [--tp N --pp N --ep N --etp N]
    megatron-rl convert megatron-to-hf --ckpt DIR --out DIR [--step N] [--dtype bf16] [--merge]

hf-to-megatron runs alone (one process converts for any layout) or under torchrun with
the layout's world size (each rank then reads only its own slices of the HF files).
Paths are checked before any model is built: a missing or wrong input, or an output that
already holds something, is one line and exit status 2. megatron-to-hf copies the source
model's tokenizer and generation config, or says in one line that the output has none; a
reward model's checkpoint becomes a one-label ``*ForSequenceClassification`` directory.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from functools import partial
from pathlib import Path
from typing import Optional, Sequence

from megatron_rl.utils import dtypes

BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl convert",
        description="Convert between HF safetensors directories and megatron_rl checkpoints.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    to_m = sub.add_parser(
        "hf-to-megatron",
        help="HF directory -> megatron_rl checkpoint for a parallel layout",
        description="Alone, one process converts for any layout (the stored tensors are "
        "layout-free; the vocabulary is padded as --tp needs). Under torchrun with a world "
        "size that fits the layout, that layout is built and each rank reads its own slices.",
    )
    to_m.add_argument("--hf", required=True, type=Path, help="HF model directory (config.json + *.safetensors)")
    to_m.add_argument("--out", required=True, type=Path, help="checkpoint root to write")
    to_m.add_argument("--step", type=int, default=0, help="step number to save as (default 0)")
    for flag, name in (("--tp", "tensor"), ("--pp", "pipeline"), ("--ep", "expert")):
        to_m.add_argument(flag, type=int, default=1, help=f"{name} model parallel size of the target layout")
    to_m.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: = --tp)")
    to_hf = sub.add_parser(
        "megatron-to-hf",
        help="megatron_rl checkpoint -> HF directory (one process)",
        description="A policy becomes a causal LM; a reward model (algorithm.recipe=reward_model) "
        "a one-label *ForSequenceClassification whose score is the reward at the last token.",
    )
    to_hf.add_argument(
        "--ckpt", required=True, type=Path, help="checkpoint root (written by hf-to-megatron or training)"
    )
    to_hf.add_argument("--out", required=True, type=Path, help="new HF directory to write")
    to_hf.add_argument("--step", type=int, default=None, help="step to export (default: newest committed)")
    to_hf.add_argument(
        "--dtype", choices=dtypes.SHORT_NAMES, default=None, help="dtype to write (default: the HF config's)"
    )
    to_hf.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA checkpoint: write a full HF model with the adapters folded in (default: a PEFT adapter directory)",
    )
    to_hf.add_argument(
        "--expert-style",
        choices=("per_expert", "fused"),
        default=None,
        help="MoE expert names (default: those of the HF checkpoint the model came from)",
    )
    return parser


def _progress(desc: str, enabled: bool = True):
    from tqdm import tqdm

    return partial(tqdm, desc=desc, unit="tensor", disable=not enabled, file=sys.stderr)


def _hf_to_megatron(args) -> int:
    from megatron_rl.bridge.convert import hf_to_megatron
    from megatron_rl.bridge.inputs import check_hf_model_dir, check_new_checkpoint_root
    from megatron_rl.parallel import ParallelConfig

    check_hf_model_dir(args.hf)
    check_new_checkpoint_root(args.out)

    target = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp,
    )
    from megatron_rl.models.hf_config import arch_from_hf

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # Layout errors (e.g. EP not dividing the experts) before any process group exists;
    # alone, check against the smallest world the layout fits.
    smallest = math.lcm(target.tp * target.pp, target.etp * target.ep * target.pp)
    target.validate(world if world > 1 else smallest, arch_from_hf(args.hf).shape())
    rank0 = int(os.environ.get("RANK", "0")) == 0
    hf_to_megatron(args.hf, args.out, target, step=args.step, progress=_progress("hf -> megatron", rank0))
    if rank0:
        layout = f"TP{target.tp} PP{target.pp} EP{target.ep} ETP{target.etp}"
        print(f"wrote {args.out} (step {args.step}) for layout {layout}")
    return 0


def _megatron_to_hf(args) -> int:
    from megatron_rl.bridge.convert import megatron_to_hf

    dtype = dtypes.to_torch(args.dtype) if args.dtype else None
    export = megatron_to_hf(
        args.ckpt,
        args.out,
        step=args.step,
        dtype=dtype,
        style=args.expert_style,
        progress=_progress("megatron -> hf"),
        merge=args.merge,
    )
    copied = f" with {', '.join(export.copied)}" if export.copied else ""
    print(f"wrote {export.path}{copied}")
    if export.no_tokenizer:
        print(
            f"megatron-rl convert: note: {export.path} has no tokenizer: {export.no_tokenizer}; "
            "copy the tokenizer files of the original model into it",
            file=sys.stderr,
        )
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from megatron_rl.bridge.inputs import ConvertInputError
    from megatron_rl.bridge.mapping import BridgeError
    from megatron_rl.checkpoint.format import CheckpointError
    from megatron_rl.models.hf_config import UnsupportedModelError
    from megatron_rl.parallel import LayoutError

    errors = (
        ConvertInputError,
        BridgeError,
        CheckpointError,
        UnsupportedModelError,
        LayoutError,
        FileNotFoundError,
        FileExistsError,
    )
    try:
        return _hf_to_megatron(args) if args.command == "hf-to-megatron" else _megatron_to_hf(args)
    except errors as e:
        print(f"megatron-rl convert: error: {e}", file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
