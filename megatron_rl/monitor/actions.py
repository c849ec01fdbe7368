"""What happens when a machine is declared faulty: alert records and the exclude file.

The exclude file is the contract with the Slurm scripts: one hostname per line, no
duplicates; on requeue they pass its contents to `sbatch --exclude`. Writers take an
exclusive lock and replace the file atomically, so a reader never sees half a list and
two writers (several jobs, or a job and an operator) never lose each other's entries.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

from .detect import Alert


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _replace(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_exclude(path: str | os.PathLike) -> list[str]:
    """Hostnames in an exclude file (blank lines and '#' comments ignored)."""
    p = Path(path)
    if not p.exists():
        return []
    lines = (ln.strip() for ln in p.read_text().splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def append_exclude(path: str | os.PathLike, hosts: Iterable[str]) -> list[str]:
    """Add hosts to the exclude file, keeping order and dropping duplicates.

    Returns the hosts that were new. Safe against concurrent writers (lock + rename).
    """
    p = Path(path)
    with _locked(p):
        present = read_exclude(p)
        new = []
        for h in hosts:
            h = h.strip()
            if h and h not in present and h not in new:
                if any(c.isspace() for c in h) or "," in h:
                    raise ValueError(f"hostname {h!r} has whitespace or a comma; Slurm cannot exclude it")
                new.append(h)
        if new:
            _replace(p, "".join(f"{h}\n" for h in present + new))
    return new


def write_alerts(path: str | os.PathLike, alerts: Iterable[Alert], append: bool = False) -> None:
    """Alerts as JSON lines. append=False replaces the file atomically."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(a.to_json() + "\n" for a in alerts)
    if append:
        with _locked(p), open(p, "a") as f:
            f.write(text)
    else:
        _replace(p, text)


def read_alerts(path: str | os.PathLike) -> list[Alert]:
    return [Alert(**json.loads(ln)) for ln in Path(path).read_text().splitlines() if ln.strip()]


def format_alerts(alerts: list[Alert]) -> str:
    """A fixed-width table for the terminal."""
    if not alerts:
        return "no faulty machine declared"
    head = f"{'machine':<24} {'metric':<24} {'first_seen':>11} {'declared_at':>12} {'score':>8}"
    rows = [
        f"{a.machine:<24} {a.metric:<24} {a.first_seen:>11.1f} {a.declared_at:>12.1f} {a.score:>8.2f}" for a in alerts
    ]
    return "\n".join([head, "-" * len(head)] + rows)
