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
