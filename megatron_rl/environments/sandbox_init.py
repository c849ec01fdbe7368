"""The sandbox's first process: builds the minimal root, starts the tool's code, supervises it.

Run as a script (``python -I -S -B sandbox_init.py SPEC_JSON``), never imported by the
runtime: it uses the standard library only, because it runs where the package may not be
importable. Under ``unshare --pid --fork`` it is PID 1 of the call's PID namespace, so
when it exits the kernel kills every process left in that namespace; that is how a call's
whole process tree ends. megatron_rl.environments.sandbox starts it and documents what the
sandbox isolates; this file only carries the plan out.

Protocol with the parent:
- stdin: first ``code_bytes`` bytes are the code; then the pipe stays open as the control
  channel, and its end of file means "stop now" (the parent saw too much output).
- fd ``status_fd``: one JSON line with the verdict, written just before this process ends:
  ``exit`` (code), ``signal`` (number, CPU seconds used), ``timeout``, ``cancelled`` or
  ``setup`` (the root or the limits could not be set up; message).
- stdout/stderr: the code's own, passed through untouched.
"""

import ctypes
import json
import os
import platform
import resource
import select
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
STAGING_DIRS = ("/tmp", "/mnt", "/media", "/srv", "/var/tmp", "/opt")
"""Where the new root's tmpfs may be mounted before pivot_root (hidden from the host: the
mount namespace is private): the first of these that exists and holds none of the paths to
bind, since the tmpfs hides what lies beneath it (a virtual environment under /tmp)."""
WORKDIR = "/box"
"""The code's working directory inside the built root (a size-limited tmpfs)."""
STATVFS_TO_MS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC))
"""Flags a bind's read-only remount must keep: in a user namespace the source mount's
flags are locked, and a remount that drops one fails."""

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The root or the limits could not be set up; the message says which step failed."""


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)}")


def _bytes(text):
    return None if text is None else text.encode()


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)), f"mount {target}")


def _bind_read_only(path: str, target: str) -> None:
    """Bind one mount (not its submounts: nothing beneath it is exposed by accident), then
    make the bind read-only, keeping the flags the source mount already has."""
    _mount(path, target, None, MS_BIND)
    kept = os.statvfs(path).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    flags |= sum(ms for st, ms in STATVFS_TO_MS if kept & st)
    _mount(None, target, None, flags)


def _mount_point(target: str, is_dir: bool) -> None:
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()


def _staging_dir(spec: dict) -> str:
    """The first of STAGING_DIRS that exists and contains no path the root binds."""
    sources = [*spec["binds"], *spec["devices"]]
    for candidate in STAGING_DIRS:
        inside = any(p == candidate or p.startswith(candidate + "/") for p in sources)
        if os.path.isdir(candidate) and not inside:
            return candidate
    raise SetupError(f"no place to build the root: each of {', '.join(STAGING_DIRS)} is missing or holds a bind")


def _pivot_root(new_root: str) -> None:
    """Make `new_root` the root and detach the old one: unlike chroot, nothing of the host's
    tree stays reachable from this mount namespace afterwards."""
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise SetupError(f"pivot_root: no syscall number known for {platform.machine()}")
    os.chdir(new_root)
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir("/")


def build_root(spec: dict) -> str:
    """A tmpfs root holding only read-only binds of what the interpreter needs, the devices
    in spec["devices"], a fresh /proc (with a PID namespace) and a writable, size-limited
    tmpfs working directory; returns the working directory."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    new_root = _staging_dir(spec)
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for path in spec["binds"]:
        target = new_root + path
        _mount_point(target, os.path.isdir(path))
        _bind_read_only(path, target)
    for link, points_to in spec["links"]:
        os.symlink(points_to, new_root + link)
    for device in spec["devices"]:  # writable (/dev/null), so bound without a read-only remount
        _mount_point(new_root + device, is_dir=False)
        _mount(device, new_root + device, None, MS_BIND)
    if spec["proc"]:
        os.makedirs(new_root + "/proc")
        _mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(new_root + WORKDIR)
    owner = f",uid={spec['uid']},gid={spec['uid']}" if spec["uid"] is not None else ""
    size = f"size={spec['workdir_mb']}m,mode=0700{owner}"
    _mount("tmpfs", new_root + WORKDIR, "tmpfs", MS_NOSUID | MS_NODEV, size)
    if not os.path.lexists(new_root + "/tmp"):  # /tmp holds a bind when the interpreter lives there
        os.symlink(WORKDIR.lstrip("/"), new_root + "/tmp")
    _pivot_root(new_root)
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return WORKDIR


def _read_code(size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(0, min(left, 1 << 16))
        if not chunk:
            raise SetupError(f"the code ended after {size - left} of {size} bytes")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _limit_and_exec(spec: dict, workdir: str) -> None:
    """In the forked child: the limits, the unprivileged identity, then the code. Never returns."""
    try:
        mb = 1 << 20
        resource.setrlimit(resource.RLIMIT_AS, (spec["memory_mb"] * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"],) * 2)  # soft = hard: SIGKILL, no core
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["workdir_mb"] * mb,) * 2)
        if spec["nproc"] is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (spec["nproc"],) * 2)
        if spec["uid"] is not None:  # root outside: a uid of this call's own, no capabilities
            os.setgroups([])
            os.setresgid(spec["uid"], spec["uid"], spec["uid"])
            os.setresuid(spec["uid"], spec["uid"], spec["uid"])
        if spec["drop_caps"]:  # root of a user namespace: keep the uid, lose every capability
            for cap in range(spec["last_cap"] + 1):
                _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid binary regains privileges
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.chdir(workdir)
        os.execve(spec["python"], [spec["python"], "main.py"], spec["env"])
    except BaseException as err:  # noqa: B036 - a forked child must never return into the parent's code
        os.write(2, f"sandbox: could not start the code: {err}\n".encode())
    os._exit(126)


def supervise(child: int, timeout_s: float) -> dict:
    """Wait for the child, the parent's stop (control pipe closed) or the wall-clock limit."""
    pidfd = os.pidfd_open(child)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return {"kind": "timeout"}
        ready, _, _ = select.select([pidfd, 0], [], [], left)
        if pidfd in ready:
            _, status, usage = os.wait4(child, 0)
            if os.WIFSIGNALED(status):
                cpu = usage.ru_utime + usage.ru_stime
                return {"kind": "signal", "signal": os.WTERMSIG(status), "cpu_s": round(cpu, 3)}
            return {"kind": "exit", "code": os.WEXITSTATUS(status)}
        if 0 in ready and not os.read(0, 1 << 16):
            return {"kind": "cancelled"}


def main(argv: list) -> int:
    spec = json.loads(argv[1])
    status = spec["status_fd"]
    os.set_inheritable(status, False)  # the code must not be able to forge the verdict
    try:
        with open("/proc/sys/kernel/cap_last_cap") as file:  # read while the host's /proc is there
            spec["last_cap"] = int(file.read())
        code = _read_code(spec["code_bytes"])
        workdir = build_root(spec) if spec["root"] else spec["workdir"]
        path = os.path.join(workdir, "main.py")
        with open(path, "wb") as file:
            file.write(code)
        if spec["uid"] is not None:
            os.chown(path, spec["uid"], spec["uid"])
    except (OSError, SetupError) as err:
        verdict = {"kind": "setup", "error": str(err)}
    else:
        child = os.fork()
        if child == 0:
            _limit_and_exec(spec, workdir)
        verdict = supervise(child, spec["timeout_s"])
    os.write(status, (json.dumps(verdict) + "\n").encode())
    os.close(status)
    if spec["kill_group"]:  # no PID namespace: end the code's process group (and this process)
        os.killpg(0, 9)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
