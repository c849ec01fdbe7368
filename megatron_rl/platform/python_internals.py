"""Accessors for CPython internals that megatron_rl calls (CPython 3.11).

Each is the one place that knows the private name, says which release it was read from
and why it is needed, and is tested in tests/unit/platform/test_python_internals.py.
"""

from __future__ import annotations

import threading

PYTHON_VERSION = "3.11"
"""The CPython release these accessors were read from (the same in 3.9-3.13)."""


def finish_threads_as_at_exit() -> None:
    """What the interpreter's exit does first: wake the idle workers of every thread pool,
    then join every thread that is not a daemon.

    ``threading._shutdown`` (CPython 3.11), which ``Py_FinalizeEx`` calls. A process that
    leaves with ``os._exit`` (:mod:`megatron_rl.launch.process_exit`) skips it, and a plain
    join of the threads waits forever for idle ``concurrent.futures`` workers, which only
    the exit hook registered with ``threading._register_atexit`` wakes. Where the name is
    missing, the caller's ``except`` takes the usual exit."""
    threading._shutdown()
