"""The monitor's exclude file as a Slurm node list (for --exclude / ExcNodeList).

Format (written by megatron_rl.monitor.actions): one hostname per line, '#' comments and
blank lines ignored. Read here without importing the monitor package, which pulls in
numpy and torch: this runs in the batch script on every requeue.
"""

from __future__ import annotations

from pathlib import Path

EXCLUDE_FILE = Path("monitor") / "exclude_hosts.txt"


def excluded_hosts(run_dir) -> list[str]:
    """Hostnames in ``<run_dir>/monitor/exclude_hosts.txt`` (empty when the file is absent)."""
    path = Path(run_dir) / EXCLUDE_FILE
    if not path.exists():
        return []
    hosts = []
    for line in path.read_text().splitlines():
        host = line.strip()
        if not host or host.startswith("#") or host in hosts:
            continue
        if any(c.isspace() for c in host) or "," in host:
            raise ValueError(f"{path}: {host!r} is not a hostname (whitespace or comma); one hostname per line")
        hosts.append(host)
    return hosts


def node_list(run_dir) -> str:
    """Comma-separated, as `sbatch --exclude` and `scontrol update ExcNodeList=` take it."""
    return ",".join(excluded_hosts(run_dir))


class ExcludeWatch:
    """Whether this node is in the exclude file: a node declared faulty while the job runs on
    it (by the monitor, online or offline, or by an operator) makes the job stop after a
    checkpoint and requeue without it (launch/signals.py StopSignals.agree asks every step).

    The file is read again only when its modification time changes: one stat per step.
    """

    def __init__(self, run_dir, node: str):
        self.path = Path(run_dir) / EXCLUDE_FILE
        self.node = node
        self._mtime: int | None = None
        self._listed = False

    @classmethod
    def in_job(cls, run_dir) -> "ExcludeWatch | None":
        """The watch for this process's node inside a Slurm job; None outside one (no requeue)."""
        from megatron_rl.launch.slurm_env import SlurmEnv

        env = SlurmEnv.from_environ()
        return cls(run_dir, env.node) if env.job_id is not None else None

    def listed(self) -> bool:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return False
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                self._listed = self.node in excluded_hosts(self.path.parent.parent)
            except ValueError:  # a malformed line: the requeue ignores the file too (launch/cli.py)
                self._listed = False
        return self._listed
