"""Leave a training process without the interpreter's teardown.

When ``train`` returns, everything the run owes the disk is already done: the checkpoint
writer has committed, the metrics file and TensorBoard are closed, the status file is
written (``RLTrainer.close``). What is left is the interpreter's own teardown: vLLM's
engine shutdown at exit (two full ``gc.collect`` passes over every torch, Megatron and
vLLM object) and the module teardown after it. On this 2-core VM that took 7.5-8.2 s
after the last line of a four-rank run (2-4 s of exit handlers per rank, then 2.6-4 s
of finalisation), against 0.5 s with :func:`end_process`: a batch job, a requeue and a
test launch wait for it every time.

What the teardown did that still matters outside the process is done here instead: vLLM's
shared memory is freed (the engine's shutdown used to; left behind, its segments fill
/dev/shm), other threads that are not daemons finish, idle thread-pool workers included
(the interpreter's own first step of an exit), and log handlers and the standard streams
are flushed. Then the process ends with ``os._exit``; if any of that fails, it exits the
usual way.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from megatron_rl.platform.python_internals import finish_threads_as_at_exit


def end_process(code: int) -> NoReturn:
    """Finish what a normal exit would finish for the outside world, then leave at once.
    Should any of that fail, the process exits the usual way instead, with the same code:
    slower, never a different outcome."""
    try:
        _finish_for_the_outside_world()
    except Exception as err:
        print(
            f"megatron-rl: quick exit not possible ({type(err).__name__}: {err}); exiting normally",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(code)
    os._exit(code)


def _finish_for_the_outside_world() -> None:
    # First, while imports still work (a module imported after the thread shutdown below
    # cannot register its exit hooks and fails): free vLLM's shared memory.
    if "vllm" in sys.modules:  # only a vLLM engine made CPU communicator segments
        from megatron_rl.platform.vllm_shm import release_shared_memory

        release_shared_memory()
    # What the interpreter's exit does first: wake the idle workers of every thread pool
    # (a join alone waits for them forever), then join the non-daemon threads.
    finish_threads_as_at_exit()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
