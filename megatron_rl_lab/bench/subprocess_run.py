"""One bench run in a process of its own, for the scripts in tools/.

vLLM and torch.distributed keep process-wide state, so a script that runs several benches,
or prints a table after one, starts each as ``python -m megatron_rl bench ...`` and reads
back the JSON it wrote: the same code path a user's command line takes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

STDERR_TAIL = 3000
"""Characters of a failed bench's stderr worth showing (its one-line error is at the end)."""


def run_bench(name: str, options: Sequence[str], json_path: str | Path) -> dict:
    """Run ``megatron-rl bench name *options --json json_path`` and return what it wrote;
    on failure print the end of its stderr and exit with its exit code."""
    cmd = [sys.executable, "-m", "megatron_rl", "bench", name, *map(str, options), "--json", str(json_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-STDERR_TAIL:], file=sys.stderr)
        raise SystemExit(proc.returncode)
    return json.loads(Path(json_path).read_text())
