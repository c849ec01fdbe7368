"""metrics.jsonl across restarts: continued, not truncated, and never duplicated.

A run that resumes from the checkpoint of step N re-runs steps N+1... . Rows the earlier
attempt wrote past N (work lost with the crash or signal) are dropped, so the file ends
with exactly one row per step 1..max_steps whatever the restarts were.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def continue_metrics(path, resumed_step: int):
    """Keep the rows with step <= resumed_step (a torn last line is dropped too), then open
    the file for appending. resumed_step=0 starts an empty file."""
    path = Path(path)
    kept = []
    if resumed_step > 0 and path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # torn write of a killed attempt
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= resumed_step:
                kept.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return path.open("a")
