"""The checkpoint bench's scratch directory: it removes only what it created.

A bench that wipes its ``--dir`` deletes a user's data after one typo (the old script ran
``shutil.rmtree`` on it). Here ``--dir`` must not exist yet (it is created, with any missing
parents, and all of that is removed at the end) or be an empty directory (the bench's
subdirectories in it are removed, the directory stays). Anything else is refused before
torch is loaded. Without ``--dir`` the bench makes a new directory under the system temp
dir and removes it at the end.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Optional, Sequence


def scratch_problem(requested: Optional[Path]) -> Optional[str]:
    """Why ``requested`` cannot be the scratch directory (one line), or None."""
    if requested is None or not requested.exists():
        return None
    if not requested.is_dir():
        return f"--dir {requested} exists and is not a directory"
    if any(requested.iterdir()):
        return (
            f"--dir {requested} exists and is not empty; pass a new or empty directory "
            "(the bench removes only what it creates)"
        )
    return None


def _topmost_missing(path: Path) -> Path:
    """The first directory ``mkdir(parents=True)`` will create for the missing ``path``."""
    top = path.absolute()
    while not top.parent.exists():
        top = top.parent
    return top


def make_dirs(requested: Optional[Path], subdirs: Sequence[str]) -> tuple[Path, list[Path]]:
    """Create the scratch root (if needed) and its subdirectories: (root, what was created).

    What was created is the topmost new directory when the root is new, else the subdirectories.
    """
    if requested is None:
        root = Path(tempfile.mkdtemp(prefix="megatron-rl-bench-ckpt-"))
        created = [root]
    else:
        problem = scratch_problem(requested)  # again: it may have changed since the check
        if problem:
            raise FileExistsError(problem)
        root = requested
        created = [] if root.exists() else [_topmost_missing(root)]
        root.mkdir(parents=True, exist_ok=True)
    for name in subdirs:
        (root / name).mkdir()
    return root, created or [root / name for name in subdirs]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class Scratch:
    """Rank 0 creates the directories, every rank gets their paths, rank 0 removes them.

    ``created`` (rank 0 only) lists the top-level paths this object made; only those are
    ever removed. Without a process group it acts as the only rank.
    """

    def __init__(self, requested: Optional[Path], subdirs: Sequence[str]):
        self.requested = requested
        self.subdirs = tuple(subdirs)
        self.root: Optional[Path] = None
        self.created: list[Path] = []

    def create(self) -> Path:
        """Collective: make the root and one subdirectory per name; returns the root on every rank."""
        import torch.distributed as dist

        if not dist.is_initialized():
            self.root, self.created = make_dirs(self.requested, self.subdirs)
            return self.root
        dist.barrier()  # every rank has checked --dir before anything is written into it
        made = [None]
        if dist.get_rank() == 0:
            self.root, self.created = make_dirs(self.requested, self.subdirs)
            made = [str(self.root)]
        dist.broadcast_object_list(made, src=0)
        self.root = Path(made[0])
        return self.root

    def path(self, name: str) -> Path:
        if self.root is None or name not in self.subdirs:
            raise KeyError(f"{name!r} is not one of this scratch's created subdirectories {self.subdirs}")
        return self.root / name

    def empty(self, name: str) -> None:
        """Rank 0: remove the contents of one of the bench's subdirectories (it stays).

        The caller's next barrier orders this before any rank writes into it again.
        """
        if _rank() == 0:
            shutil.rmtree(self.path(name))
            self.path(name).mkdir()

    def remove(self) -> None:
        """Remove what this object created, nothing else (other ranks created nothing)."""
        for path in self.created:
            shutil.rmtree(path, ignore_errors=True)
        self.created = []
