"""Worker processes that run a function per item and kill any item that overruns.

Why processes: math-verify's own timeout uses ``signal.alarm``, which only works in the
main thread and cannot interrupt a hang inside C code (sympy's big-integer arithmetic).
A separate process can always be killed. A killed worker is replaced, its item is
reported as ``timeout``, and the other items go on.

Workers are fresh interpreters (``python -m megatron_rl.rewards.pool_worker``), not
forks: the trainer may hold threads and process groups that must not be forked, and
multiprocessing's spawn/forkserver would re-import the trainer's main module in every
worker. Messages are JSON lines over the worker's stdin/stdout.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import multiprocessing.connection
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


@dataclasses.dataclass(frozen=True)
class ItemResult:
    """Outcome of one item: ``status`` is ok | timeout | error (exception or dead worker)."""

    status: str
    value: Any = None
    message: str = ""


def _resolve(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def serve(target: str, warmup_args: Sequence[Any] | None, init_args: Sequence[Any] | None = None) -> None:
    """Worker main loop: one JSON request per stdin line, one JSON reply per stdout line.
    With ``init_args`` the target is a factory (a class): its result, built once, is what
    each item calls (a worker that holds a model between items)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything the libraries print goes to stderr, not into the protocol
    fn = _resolve(target)
    if init_args is not None:
        fn = fn(*init_args)
    if warmup_args is not None:
        fn(*warmup_args)  # pay lazy initialisation before the first timed item
    replies.write('{"ready": true}\n')
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"status": "ok", "value": fn(*request["args"])}
        except Exception as exc:  # the item failed, the worker lives on
            reply = {"status": "error", "message": f"{type(exc).__name__}: {exc}"}
        reply["index"] = request["index"]
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class _Worker:
    def __init__(self, target: str, warmup_args: Optional[Sequence[Any]], init_args: Optional[Sequence[Any]]):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO_ROOT, env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "megatron_rl.rewards.pool_worker",
                target,
                json.dumps(warmup_args),
                json.dumps(init_args),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self.ready = False
        self.busy_with: Optional[tuple[int, float]] = None  # (item index, deadline)

    def read_reply(self) -> Optional[dict]:
        line = self.process.stdout.readline()
        return json.loads(line) if line else None  # None: the worker died

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()

    def stop(self) -> None:
        try:
            self.process.stdin.close()  # end of input: the worker's loop ends
            self.process.wait(timeout=2.0)
            self.process.stdout.close()
        except (OSError, subprocess.TimeoutExpired):
            self.kill()


class TimedWorkerPool:
    """Runs ``target(*args)`` for each item in worker processes, at most ``timeout_s`` each.

    ``target`` is ``"package.module:function"``, importable in a fresh interpreter;
    arguments and results must be JSON values. The timeout counts from the moment a
    ready worker receives the item, so start-up and queueing never count against it;
    ``warmup_args``, when given, are run once by each new worker before it reports ready.
    With ``init_args``, ``target`` names a factory (a class) each worker calls once with
    them, and items call what it returned. Workers start lazily (or at :meth:`start`) and
    persist across calls.
    """

    def __init__(
        self,
        target: str,
        *,
        num_workers: int = 1,
        timeout_s: float = 5.0,
        warmup_args: Optional[Sequence[Any]] = None,
        init_args: Optional[Sequence[Any]] = None,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        _resolve(target)  # fail here, not in a worker, when the name is wrong
        self.target = target
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.warmup_args = None if warmup_args is None else list(warmup_args)
        self.init_args = None if init_args is None else list(init_args)
        self._workers: list[_Worker] = []

    def _new_worker(self) -> _Worker:
        return _Worker(self.target, self.warmup_args, self.init_args)

    def start(self) -> None:
        """Start the workers now (their start-up then overlaps with the caller's own)."""
        while len(self._workers) < self.num_workers:
            self._workers.append(self._new_worker())

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = self._new_worker()

    def _on_readable(self, worker: _Worker, results: list) -> None:
        reply = worker.read_reply()
        if not worker.ready:
            if reply is None:
                raise RuntimeError(
                    f"a worker for {self.target} exited during start-up (code "
                    f"{worker.process.wait()}); its error is on stderr above"
                )
            worker.ready = True
            return
        index, _ = worker.busy_with
        if reply is None:  # died mid-item (e.g. killed for memory)
            results[index] = ItemResult("error", message="worker process died")
            self._replace(worker)
        else:
            results[index] = ItemResult(reply["status"], reply.get("value"), reply.get("message", ""))
        worker.busy_with = None

    def map(self, items: Sequence[Sequence[Any]]) -> list[ItemResult]:
        """One :class:`ItemResult` per argument tuple, in order."""
        self.start()
        results: list[Optional[ItemResult]] = [None] * len(items)
        queue = collections.deque(range(len(items)))
        while queue or any(w.busy_with for w in self._workers):
            for worker in self._workers:
                if worker.ready and worker.busy_with is None and queue:
                    index = queue.popleft()
                    worker.process.stdin.write(json.dumps({"index": index, "args": list(items[index])}) + "\n")
                    worker.process.stdin.flush()
                    worker.busy_with = (index, time.monotonic() + self.timeout_s)
            waiting = [w for w in self._workers if w.busy_with or not w.ready]
            deadlines = [w.busy_with[1] for w in waiting if w.busy_with]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            readable = multiprocessing.connection.wait([w.process.stdout for w in waiting], timeout)
            for worker in waiting:
                if worker.process.stdout in readable:
                    self._on_readable(worker, results)
                elif worker.busy_with and time.monotonic() >= worker.busy_with[1]:
                    results[worker.busy_with[0]] = ItemResult("timeout", message=f"over {self.timeout_s:g} s")
                    self._replace(worker)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> "TimedWorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        for worker in getattr(self, "_workers", []):
            if worker.process.poll() is None:
                worker.process.kill()
