"""Which isolations this machine gives the Python tool's sandbox, and the refusal when one lacks.

Each namespace is probed by running ``unshare <flag> true`` the way a call would create it
(inside a user namespace when the caller is not root), so "available" means "this process
can create it now", not "the kernel was built with it". The process limit is a separate
mechanism, because root ignores RLIMIT_NPROC:

- root: the code runs as a uid of its own, drawn for each call, with no capabilities, and
  RLIMIT_NPROC counts only that uid's processes;
- not root, with a user namespace: RLIMIT_NPROC counts the caller's uid inside the call's
  own user namespace, so concurrent calls do not share the budget;
- otherwise: none (RLIMIT_NPROC would count every process of the caller, the trainer's too).

A run states the report in one line at its start (:meth:`IsolationReport.line`) and,
through :func:`require_isolation`, refuses a missing isolation unless its config opts out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

PER_CALL_UID = "per-call uid"
USER_NAMESPACE = "user namespace"
PROBE_TIMEOUT_S = 10.0
"""A probe is one exec of `true`; far longer than that means the machine is stuck, and the
isolation is reported missing rather than the run waiting."""


class IsolationError(RuntimeError):
    """An isolation the sandbox needs is missing and the config did not opt out; one line."""


@dataclass(frozen=True)
class IsolationReport:
    """What the sandbox can isolate on this machine (see the module docstring)."""

    network: bool
    """Own network namespace: only a loopback that is down, so no connection anywhere."""
    mount: bool
    """Own mount namespace: the code sees a minimal root, not the host's files."""
    pid: bool
    """Own PID namespace: the code sees only its own processes, and all of them end with the call."""
    ipc: bool
    """Own IPC namespace: no System V or POSIX message queue or shared memory of the host."""
    process_limit: str
    """How max_processes is enforced: PER_CALL_UID, USER_NAMESPACE, or "" (not enforced)."""
    user_namespace: bool
    """The namespaces are created inside a user namespace (the caller is not root)."""
    unshare: str = ""
    """The `unshare` executable (util-linux) the sandbox starts through; "" without namespaces."""
    reasons: tuple[str, ...] = ()
    """Why each missing isolation is missing, as the probe saw it."""

    @property
    def missing(self) -> tuple[str, ...]:
        flags = {
            "network namespace": self.network,
            "mount namespace": self.mount,
            "pid namespace": self.pid,
            "ipc namespace": self.ipc,
            "process limit": bool(self.process_limit),
        }
        return tuple(name for name, available in flags.items() if not available)

    def line(self) -> str:
        """The run's one line about the sandbox, said at its start."""
        if not self.missing:
            how = "inside a user namespace" if self.user_namespace else "as root"
            return (
                f"tool sandbox: network, mount, pid and ipc namespaces ({how}); process limit by {self.process_limit}"
            )
        why = f" ({'; '.join(self.reasons)})" if self.reasons else ""
        return f"tool sandbox: MISSING {', '.join(self.missing)}{why}"

    def unshare_flags(self) -> list[str]:
        """The `unshare` options that create the available namespaces."""
        flags = ["--user", "--map-root-user"] if self.user_namespace else []
        flags += ["--net"] * self.network + ["--ipc"] * self.ipc + ["--mount"] * self.mount
        return flags + (["--pid", "--fork", "--kill-child"] if self.pid else [])


def _works(unshare: str, flags: list[str]) -> tuple[bool, str]:
    """Whether `unshare FLAGS true` runs; else its last line of stderr."""
    try:
        proc = subprocess.run(
            [unshare, *flags, "true"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"unshare {' '.join(flags)}: {err}"
    lines = proc.stderr.strip().splitlines()
    return proc.returncode == 0, lines[-1] if lines else f"unshare exited with {proc.returncode}"


def probe_isolation() -> IsolationReport:
    """Probe each isolation on this machine (a few execs of `true`, well under a second)."""
    unshare = shutil.which("unshare")
    root = os.geteuid() == 0
    if unshare is None:
        return IsolationReport(False, False, False, False, PER_CALL_UID if root else "", False, "", ("no unshare",))
    base = [] if root else ["--user", "--map-root-user"]
    if not root:
        ok, why = _works(unshare, base)
        if not ok:
            return IsolationReport(False, False, False, False, "", False, "", (f"no user namespace: {why}",))
    reasons = []

    def check(name: str, *flags: str) -> bool:
        ok, why = _works(unshare, base + list(flags))
        if not ok:
            reasons.append(f"{name}: {why}")
        return ok

    network = check("network namespace", "--net")
    ipc = check("ipc namespace", "--ipc")
    pid = check("pid namespace", "--pid", "--fork", "--kill-child")
    # The built root mounts a fresh /proc, which some containers forbid even where the
    # mount namespace itself is allowed: probe the two together.
    mount = check("mount namespace", "--mount", *(["--pid", "--fork", "--mount-proc"] if pid else []))
    limit = PER_CALL_UID if root else USER_NAMESPACE
    return IsolationReport(network, mount, pid, ipc, limit, not root, unshare, tuple(reasons))


def require_isolation(config, report: IsolationReport) -> None:
    """Raise IsolationError (one line) if an isolation is missing and `config` (a
    SandboxConfig) does not set allow_weaker_isolation."""
    if report.missing and not config.allow_weaker_isolation:
        why = f" ({'; '.join(report.reasons)})" if report.reasons else ""
        raise IsolationError(
            f"the Python tool's sandbox cannot have {', '.join(report.missing)} on this machine{why}; "
            "set allow_weaker_isolation=true in the sandbox config to run the tool without"
        )
