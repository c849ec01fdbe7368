"""Entry point of a ``TimedWorkerPool`` worker process (kept apart from ``timed_pool`` so
``python -m`` does not run a module the package has already imported)."""

import json
import sys

from megatron_rl.rewards.timed_pool import serve

if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)
