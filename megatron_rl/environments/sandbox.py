"""Run untrusted Python in a fresh, limited, isolated process tree; one call, one sandbox.

Each call starts ``unshare`` (util-linux) with new network, IPC, mount and PID namespaces
(inside a new user namespace when the caller is not root). PID 1 of the new PID namespace
is ``sandbox_init.py``: it builds a minimal root, forks the code's process with its limits
and waits for it, for the wall-clock limit or for the caller's stop. When PID 1 exits the
kernel kills every process left in the namespace, so a call's whole process tree ends with
the call, daemons and fork bombs included; the caller waits until it has.

What the code sees (the built root, entered with pivot_root; the host's root is detached):

- read-only binds of ``/usr`` and those of ``/bin``, ``/sbin``, ``/lib``, ``/lib32``,
  ``/lib64``, ``/libx32`` that are directories (the ones that are symlinks into /usr are
  recreated as symlinks), and of the interpreter's ``sys.prefix``, ``sys.base_prefix``,
  ``sys.exec_prefix`` and the directory of its executable, each at its host path (with its
  site-packages: a venv's packages can be imported, its editable installs cannot, as their
  sources are not bound). Only the bound directory is visible, not its siblings: with a
  venv at /work/main/.venv, /work holds main/.venv and nothing else. Submounts beneath a
  bind are not bound;
- ``/dev/null``, ``/dev/zero``, ``/dev/random``, ``/dev/urandom`` and nothing else of /dev;
- a fresh ``/proc`` of the call's PID namespace (its own processes only; host-wide
  read-only files such as /proc/cpuinfo, /proc/meminfo and /proc/self/mountinfo, which
  names the bound host paths, stay readable, as in any container);
- ``/box``, the working directory: a tmpfs of ``workdir_mb`` MiB, empty, writable only by
  the code, gone with the call (``/tmp`` is a symlink to it unless the interpreter lives under
  /tmp; HOME and TMPDIR point at it).
  The code is ``/box/main.py``.

Everything else is invisible: /etc, /home, /root, /work, /tmp, /sys, /run, the run's
files, other calls' directories. The root itself is read-only. No network: the namespace
has only a loopback, which is down. The code runs with no capabilities and with
no_new_privs: as root outside, under a uid of its own drawn for the call (also the owner of
/box); otherwise as root of its user namespace with an empty capability bounding set.

Limits (SandboxConfig): wall clock (timeout_s, from the code's start), RLIMIT_CPU (cpu_s,
per process), RLIMIT_AS (memory_mb, per process), RLIMIT_NPROC (max_processes, counted for
this call alone, threads included), RLIMIT_FSIZE and the tmpfs size (workdir_mb), no core
dumps, and the output (max_output_bytes of stdout and stderr together: beyond it the call
is stopped). Memory is limited per process, not per call: max_processes processes may each
use memory_mb.

Where an isolation is missing (isolation.probe_isolation; a run refuses unless
allow_weaker_isolation is set) the call degrades as follows. Without a mount namespace the
code sees the host's files as its uid may, and works in a fresh host temp dir removed after
the call (as root, under the per-call uid, which must be able to run the interpreter
from its host path). Without a PID namespace the tree is ended by killing the code's process group,
which a process that calls setsid() escapes. Without a process limit, max_processes is not
enforced. Without a network namespace the code can open connections.

Calls are independent: no state is shared between them and nothing runs in the caller
between fork and exec (no preexec_fn), so many threads may call at once.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_rl.config.sandbox import SandboxConfig
from megatron_rl.environments.isolation import PER_CALL_UID, USER_NAMESPACE, IsolationReport

INIT_SCRIPT = str(Path(__file__).with_name("sandbox_init.py"))
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
CALL_UIDS = (1 << 24, 1 << 25)
"""Range of the per-call uids (as root outside): far above any account's uid."""
SETUP_GRACE_S = 5.0
"""Time allowed on top of timeout_s for starting and ending the sandbox (the code's clock
starts after the root is built). Past it the caller kills the tree itself: a backstop
for a stuck machine, never reached by anything the code does."""
STDERR_TAIL_BYTES = 4096
"""How much of stderr's end is kept beyond the output cap, for the traceback's last line."""
KILL_WAIT_S = 5.0
"""How long a SIGKILLed tree may take to be gone before the caller stops waiting for it."""
EXIT_POLL_S = 0.005
_READ = 1 << 16


@dataclass(frozen=True)
class Outcome:
    """What one call gave, before it is put into words for the model (python_tool.py)."""

    verdict: str
    """exit, signal, timeout (from sandbox_init, or the caller's backstop: SETUP_GRACE_S),
    cancelled (stopped for its output), setup (the sandbox could not start) or lost
    (sandbox_init ended without a verdict)."""
    stdout: bytes
    stderr: bytes
    """The two streams, together at most max_output_bytes."""
    stderr_tail: bytes
    """The end of stderr even past the cap (the traceback's last line)."""
    output_cut: bool
    """The output passed max_output_bytes and the call was stopped for it."""
    exit_code: Optional[int]
    """The code's exit status (verdict exit)."""
    signal: Optional[int]
    """The signal that ended the code (verdict signal)."""
    cpu_s: float
    """CPU seconds of the code's main process, for a death by signal."""
    detail: str
    """Why the sandbox could not start (verdict setup or lost)."""
    seconds: float
    """Wall-clock time of the whole call, sandbox included."""


@dataclass(frozen=True)
class Layout:
    """The built root: what is bound read-only, recreated as a symlink, or bound as a device."""

    binds: tuple[str, ...]
    """Host directories bound read-only at their own paths."""
    links: tuple[tuple[str, str], ...]
    """(path, target) of the system paths that are symlinks on the host (/bin -> usr/bin)."""
    devices: tuple[str, ...]
    """Device files bound as they are."""


def interpreter_dirs(python: str) -> list[str]:
    """The directories `python` needs (prefixes, its executable's directory), resolved."""
    query = "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
    try:
        out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as err:
        raise ValueError(f"python {python} cannot run: {err}") from None
    dirs = json.loads(out.stdout) + [os.path.dirname(python), os.path.dirname(os.path.realpath(python))]
    return [os.path.realpath(d) for d in dirs]


def plan_layout(python: str) -> Layout:
    """The system directories and the interpreter's, each bound once (nested ones dropped)."""
    binds, links = [], []
    for path in SYSTEM_PATHS:
        if os.path.islink(path):
            links.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            binds.append(path)
    for path in sorted(set(interpreter_dirs(python))):
        if path == "/":
            raise ValueError(f"python {python} lives at the root of the file system, which cannot be bound")
        if not any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds):
            binds.append(path)
    return Layout(tuple(binds), tuple(links), tuple(d for d in DEVICES if os.path.exists(d)))


class Sandbox:
    """Runs code under one SandboxConfig with the isolations of one IsolationReport.

    Immutable once built (the layout is planned here, once); `run` may be called from many
    threads at once."""

    def __init__(self, config: SandboxConfig, report: IsolationReport):
        self.config = config
        self.report = report
        self.layout = plan_layout(config.python) if report.mount else None

    def _spec(self, code_bytes: int, status_fd: int, workdir: Optional[str]) -> dict:
        cfg, report = self.config, self.report
        uid, nproc = None, None
        if report.process_limit == PER_CALL_UID:
            uid, nproc = secrets.randbelow(CALL_UIDS[1] - CALL_UIDS[0]) + CALL_UIDS[0], cfg.max_processes
        elif report.process_limit == USER_NAMESPACE:  # unshare and sandbox_init share the count
            nproc = cfg.max_processes + 2
        home = "/box" if workdir is None else workdir
        layout = self.layout or Layout((), (), ())
        return {
            "root": workdir is None,
            "binds": layout.binds,
            "links": layout.links,
            "devices": layout.devices,
            "proc": report.pid,
            "workdir": workdir,
            "workdir_mb": cfg.workdir_mb,
            "uid": uid,
            "drop_caps": report.user_namespace,
            "nproc": nproc,
            "python": cfg.python,
            "code_bytes": code_bytes,
            "timeout_s": cfg.timeout_s,
            "cpu_s": cfg.cpu_s,
            "memory_mb": cfg.memory_mb,
            "status_fd": status_fd,
            "kill_group": not report.pid,
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": home,
                "TMPDIR": home,
                "LANG": "C.UTF-8",
                "PYTHONUNBUFFERED": "1",  # what was printed before a timeout still reaches the model
                "PYTHONDONTWRITEBYTECODE": "1",
                "OMP_NUM_THREADS": "1",  # BLAS thread pools would eat the process budget
                "OPENBLAS_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
            },
        }

    def _argv(self, spec: dict) -> list[str]:
        init = [sys.executable, "-I", "-S", "-B", INIT_SCRIPT, json.dumps(spec)]
        flags = self.report.unshare_flags()
        return [self.report.unshare, *flags, "--", *init] if flags else init

    def run(self, code: str) -> Outcome:
        """Run `code` as one call; returns when every process of the call has ended."""
        start = time.monotonic()
        source = code.encode("utf-8", "surrogatepass")  # bad text: a SyntaxError, not a crash
        workdir = None if self.report.mount else tempfile.mkdtemp(prefix="megatron-rl-tool-")
        status_r, status_w = os.pipe()
        try:
            spec = self._spec(len(source), status_w, workdir)
            if workdir is not None and spec["uid"] is not None:
                os.chown(workdir, spec["uid"], spec["uid"])
            try:
                proc = subprocess.Popen(
                    self._argv(spec),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(status_w,),
                    start_new_session=True,  # the tree's process group, for the backstop
                    env={"PATH": "/usr/bin:/bin"},
                )
            finally:
                os.close(status_w)
            with proc:
                return _Call(proc, status_r, source, self.config, start).collect()
        finally:
            os.close(status_r)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)


class _Call:
    """The caller's side of one running call: feed the code, read both streams under the
    output cap, stop the call when the cap is passed, read the verdict."""

    def __init__(self, proc: subprocess.Popen, status_fd: int, source: bytes, config: SandboxConfig, start: float):
        self.proc, self.config, self.start = proc, config, start
        self.deadline = start + config.timeout_s + SETUP_GRACE_S
        self.pending = memoryview(source)
        self.streams = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
        self.tail = bytearray()
        self.cut = False
        self.fds = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_fd: "status"}

    def _take(self, name: str, data: bytes) -> bool:
        """Keep what fits under the cap; True when this data passed it."""
        if name == "status":
            self.streams[name] += data
            return False
        if name == "stderr":
            self.tail = (self.tail + data)[-STDERR_TAIL_BYTES:]
        room = self.config.max_output_bytes - len(self.streams["stdout"]) - len(self.streams["stderr"])
        self.streams[name] += data[: max(room, 0)]
        passed = len(data) > room and not self.cut
        self.cut = self.cut or passed
        return passed

    def _stop(self) -> None:
        """Close the control pipe: sandbox_init ends the call (its end of file means stop)."""
        self.pending = memoryview(b"")
        try:
            self.proc.stdin.close()
        except OSError:  # the code was not all written and sandbox_init is gone
            pass

    def _feed(self) -> None:
        try:
            written = os.write(self.proc.stdin.fileno(), self.pending[:_READ])
            self.pending = self.pending[written:]
        except BrokenPipeError:  # sandbox_init is gone (its verdict says why)
            self.pending = memoryview(b"")

    def _pump(self) -> bool:
        """Move data until every stream is at its end; False if the backstop deadline passed."""
        stdin = self.proc.stdin.fileno()
        with selectors.DefaultSelector() as sel:
            for fd in self.fds:
                sel.register(fd, selectors.EVENT_READ)
            if self.pending:
                os.set_blocking(stdin, False)
                sel.register(stdin, selectors.EVENT_WRITE)
            reading = len(self.fds)
            while reading:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    return False
                for key, _ in sel.select(left):
                    if key.fd == stdin:
                        self._feed()
                        if not self.pending:
                            sel.unregister(stdin)
                        continue
                    data = os.read(key.fd, _READ)
                    if not data:
                        sel.unregister(key.fd)
                        reading -= 1
                    elif self._take(self.fds[key.fd], data):
                        if self.pending:  # unregistered before closing: the number may be reused at once
                            sel.unregister(stdin)
                        self._stop()
        return True

    def collect(self) -> Outcome:
        finished = self._pump()
        if not finished:
            _kill_children(self.proc.pid)
        self._stop()
        if not _exited(self.proc.pid, max(self.deadline - time.monotonic(), 1.0)):
            _kill_children(self.proc.pid)
            _exited(self.proc.pid, KILL_WAIT_S)
        # Exited (or stuck) but not reaped, so its pid, the group's id, cannot have been reused:
        # what is left of the group ends here (the code's processes, without a PID namespace).
        _kill_group(self.proc.pid)
        self.proc.wait()
        verdict = _parse_status(bytes(self.streams["status"])) if finished else {"kind": "timeout"}
        return Outcome(
            verdict=verdict["kind"],
            stdout=bytes(self.streams["stdout"]),
            stderr=bytes(self.streams["stderr"]),
            stderr_tail=bytes(self.tail),
            output_cut=self.cut,
            exit_code=verdict.get("code"),
            signal=verdict.get("signal"),
            cpu_s=verdict.get("cpu_s", 0.0),
            detail=verdict.get("error", ""),
            seconds=time.monotonic() - self.start,
        )


def _parse_status(data: bytes) -> dict:
    try:
        verdict = json.loads(data.decode())
    except ValueError:
        return {"kind": "lost", "error": f"sandbox_init ended without a verdict ({data[:200]!r})"}
    return verdict if isinstance(verdict, dict) and "kind" in verdict else {"kind": "lost", "error": repr(verdict)}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_children(pid: int) -> None:
    """SIGKILL the children of `pid`: the PID namespace's init under `unshare` (every process
    of the namespace dies with it), the code's process without one."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        try:
            os.kill(int(child), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _exited(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` for the child `pid` to exit, without reaping it. `unshare`
    exits only once its namespace is empty, so after this no process of the call is left."""
    end = time.monotonic() + timeout
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        if time.monotonic() >= end:
            return False
        time.sleep(EXIT_POLL_S)
    return True
