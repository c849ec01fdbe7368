"""`megatron-rl ckpt inspect DIR`: what a checkpoint directory holds, without Megatron.

DIR is a checkpoint root (all steps are listed, the newest is described) or one
``step_<N>`` directory. Exit status 0, or 2 with one line saying what is wrong: a missing
or empty directory, or one with no committed step, is not a checkpoint.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from megatron_rl.checkpoint import format as fmt

BAD_INPUT = 2


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _root_and_step(path: Path, step: Optional[int]) -> tuple[Path, Optional[int]]:
    """A ``step_<N>`` directory names its root and step; anything else is a root."""
    match = re.match(r"^step_(\d+)$", path.name)
    if match and path.is_dir() and not (path / fmt.COMMIT).exists() and not fmt.committed_steps(path):
        raise fmt.CheckpointError(f"{path} has no COMMIT marker: its save never finished, so it is not a checkpoint")
    if match and (path / fmt.COMMIT).exists():
        return path.parent, int(match.group(1)) if step is None else step
    return path, step


def inspect(path: Path, step: Optional[int] = None, tensors: bool = False, verify: bool = False) -> str:
    """The description of ``step`` (default: the newest committed) under a checkpoint root.

    Raises CheckpointError when ``path`` is not a checkpoint (missing, empty, nothing
    committed): a listing of nothing would read as success to a script.
    """
    root, step = _root_and_step(Path(path), step)
    step = fmt.resolve_step(root, step)
    steps = fmt.committed_steps(root)
    pending = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp_step_"))
    lines = [f"checkpoint root: {root}", f"committed steps: {steps}"]
    if pending:
        lines.append(f"uncommitted (ignored): {', '.join(pending)}")
    meta = fmt.read_metadata(root, step)
    files = Counter()
    for entry in meta.tensors.values():
        for c in entry.chunks:
            files[c.file] += c.nbytes
    model = {n: e for n, e in meta.tensors.items() if not n.startswith("optimizer.")}
    optim = {n: e for n, e in meta.tensors.items() if n.startswith("optimizer.")}
    layout = ", ".join(f"{k}={v}" for k, v in meta.layout.items() if v is not None)
    lines += [
        f"step {meta.step} ({fmt.step_dir(root, step)})",
        f"  saved with: {layout}",
        f"  model tensors: {len(model)} ({_size(sum(_nbytes(e) for e in model.values()))})",
        f"  optimizer tensors: {len(optim)} ({_size(sum(_nbytes(e) for e in optim.values()))})"
        + (f", {len(meta.optimizer['param_groups'])} param groups" if meta.optimizer else ""),
        f"  data files: {len(files)} ({_size(sum(files.values()))}); "
        + ", ".join(f"{f} {_size(n)}" for f, n in sorted(files.items())),
        f"  rng states: {len(meta.rng)} ranks; extra keys: {sorted(meta.extra)}",
    ]
    if meta.hosts:
        by_host: dict[str, list[str]] = {}
        for rank, host in sorted(meta.hosts.items(), key=lambda kv: int(kv[0])):
            by_host.setdefault(host, []).append(rank)
        lines.append("  written on: " + ", ".join(f"{h} (ranks {','.join(r)})" for h, r in by_host.items()))
    if tensors:
        for name, entry in meta.tensors.items():
            lines.append(
                f"    {name}  {entry.dtype} {entry.shape}  {len(entry.chunks)} chunk(s)  {_size(_nbytes(entry))}"
            )
    if verify:
        from megatron_rl.checkpoint.reader import Reader

        with Reader(fmt.step_dir(root, step), meta) as reader:
            reader.verify()
        lines.append("  verify: every chunk read back and matched its checksums")
    return "\n".join(lines)


def _nbytes(entry: fmt.TensorEntry) -> int:
    return sum(c.nbytes for c in entry.chunks)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rl ckpt", description="Checkpoint tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("inspect", help="list steps, tensors, the saving layout and sizes")
    p.add_argument("dir", type=Path, help="checkpoint root or one step_<N> directory")
    p.add_argument("--step", type=int, help="describe this step (default: the newest committed)")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--verify", action="store_true", help="read every chunk and check its checksums")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        print(inspect(args.dir, args.step, args.tensors, args.verify))
    except fmt.CheckpointError as e:
        print(f"megatron-rl ckpt: error: {e}", file=sys.stderr)
        return BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
