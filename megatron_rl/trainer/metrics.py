"""Per-step metrics: metrics.jsonl always, the loggers of trainer.loggers (TensorBoard by
default: trainer/loggers.py), a progress line.

A row holds a step's training metrics, and its held-out evaluation (``val/<set>/...``)
when one ran after it; the evaluation of the starting weights (``eval.at_start``) is a row
of its own, step 0, with no training metrics. The progress line carries the latest
accuracy of the first eval set on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_rl.trainer.loggers import ScalarLogger


class MetricsLog:
    """Rank 0 writes; other ranks hold a disabled log."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        total_steps: int,
        resume_after: int = 0,
        loggers: Sequence[ScalarLogger] = (),
        line: Optional[Callable[[dict], str]] = None,
    ):
        self.enabled = enabled
        if line is not None:  # another trainer's progress line (the reward model's)
            self.line = line
        self.total = total_steps
        self._file = None
        self.loggers = list(loggers)
        self._val: str | None = None
        """The latest eval accuracy, as the progress line shows it."""
        if not enabled:
            return
        path = Path(run_dir) / "metrics.jsonl"
        kept = []
        if resume_after and path.exists():  # rows past the resumed step were not saved: drop them
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= resume_after
            ]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
        self._file = path.open("a")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in clean.items() if k != "step" and isinstance(v, (int, float)) and v is not None}
        for logger in self.loggers:
            logger.log(record["step"], scalars)
        print(self.line(record), flush=True)

    def line(self, r: dict) -> str:
        accuracy = next((k for k in r if k.startswith("val/") and k.endswith("/accuracy")), None)
        if accuracy is not None:
            self._val = f"val {r[accuracy]:.3f}"
        if "reward/mean" not in r:  # the evaluation of the starting weights
            return "  ".join([f"step {r['step']:>4d}/{self.total}", f"{self._val} (starting weights)", _eval_time(r)])
        parts = [
            f"step {r['step']:>4d}/{self.total}",
            f"reward {r['reward/mean']:.3f}",
            f"len {r['response_length/mean']:.1f}",
        ]
        if "actor/pg_loss" in r:
            parts += [f"pg {r['actor/pg_loss']:+.4f}", f"ent {r['actor/entropy']:.3f}"]
        if "actor/pg_loss" in r and "rollout/logprob_abs_diff" in r:  # only tokens of the current weights
            parts.append(f"|dlogp| {r['rollout/logprob_abs_diff']:.1e}")
        if r.get("rollout/staleness_max"):
            parts.append(f"stale {r['rollout/staleness_mean']:.1f}")
        parts += [f"{r['throughput/tokens_per_s']:.0f} tok/s", f"{r['timing/step_s']:.1f}s"]
        if self._val is not None:
            parts.append(self._val + (f" ({_eval_time(r)})" if accuracy is not None else ""))
        return "  ".join(parts)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        for logger in self.loggers:
            logger.close()


def _eval_time(r: dict) -> str:
    return f"eval {r['timing/eval_s']:.1f}s"
