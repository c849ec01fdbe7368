"""Which committed step a run resumes from when the newest one is damaged.

A step can be committed and still be unreadable later: a flipped bit on disk, a file
truncated by a full volume or a careless copy. Loading it would fail half-way through the
model (or, for a byte no rank happens to read, never). So before a run resumes, the
candidate step is read once in full against its checksums, and a damaged step is either
the end of the run (``fail``) or set aside under a new name and the step before tried
(``fallback``). A step is never deleted: whoever looks later finds ``step_<N>.corrupt``
beside the others, and the format ignores it (it is no ``step_<N>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_rl.checkpoint import format as fmt
from megatron_rl.checkpoint.reader import Reader

ON_CORRUPT = ("fallback", "fail")
"""fallback: set a damaged step aside and resume from the newest intact one; fail: stop."""
CORRUPT_SUFFIX = ".corrupt"


def verify_step(root: Path, step: int) -> None:
    """Raise CheckpointError naming the bad file unless every byte of ``step`` matches its
    checksums (the metadata against its COMMIT marker, every data block against the metadata)."""
    metadata = fmt.read_metadata(root, step)
    with Reader(fmt.step_dir(root, step), metadata) as reader:
        reader.verify()


def set_aside(root: Path, step: int) -> Path:
    """Rename ``step_<N>`` to ``step_<N>.corrupt`` (``.corrupt.2``, ... if taken) and point
    ``latest`` at the newest step left; the new path."""
    source = fmt.step_dir(root, step)
    target, n = source.with_name(source.name + CORRUPT_SUFFIX), 1
    while target.exists():
        n += 1
        target = source.with_name(f"{source.name}{CORRUPT_SUFFIX}.{n}")
    source.rename(target)
    fmt.fsync_path(Path(root))
    newest = fmt.latest_step(root)
    if newest is not None and (Path(root) / fmt.LATEST).exists():  # for people: name a step that exists
        fmt.write_durably(Path(root) / fmt.LATEST, f"{newest}\n".encode())
    return target


def newest_intact_step(roots: Sequence[Path], on_corrupt: str, warn: Callable[[str], None] = print) -> Optional[int]:
    """The newest step committed under ``roots[0]`` whose files are intact in every root
    that holds it (an actor's root and its critic's); None when nothing is committed.

    ``on_corrupt="fail"``: a damaged newest step raises CheckpointError. ``"fallback"``:
    it is set aside in every root, ``warn`` gets one line naming the step and the bad
    file, and the step before is tried; when no committed step is intact it raises, since
    starting afresh would silently throw the run's progress away.
    """
    if on_corrupt not in ON_CORRUPT:
        raise ValueError(f"on_corrupt={on_corrupt!r}; allowed: {list(ON_CORRUPT)}")
    roots = [Path(r) for r in roots]
    steps = fmt.committed_steps(roots[0])
    for step in reversed(steps):
        holders = [root for root in roots if step in fmt.committed_steps(root)]
        try:
            for root in holders:
                verify_step(root, step)
            return step
        except fmt.CheckpointError as err:
            if on_corrupt == "fail":
                raise fmt.CheckpointError(
                    f"checkpoint step {step} under {roots[0]} is corrupt: {err} (checkpoint.on_corrupt=fail; "
                    "fallback sets it aside and resumes from the newest intact step)"
                ) from err
            moved = [str(set_aside(root, step)) for root in holders]
            warn(
                f"warning: checkpoint step {step} is corrupt: {err}; moved aside to {', '.join(moved)}; "
                "trying the step before"
            )
    if steps:
        raise fmt.CheckpointError(
            f"no intact checkpoint under {roots[0]}: steps {steps} are all corrupt "
            f"(set aside as step_<N>{CORRUPT_SUFFIX}); use a new trainer.run_dir"
        )
    return None
