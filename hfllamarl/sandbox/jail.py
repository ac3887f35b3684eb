"""The per-call side of the sandbox: the forked child that isolates itself, runs one call, and writes one reply.

The sandbox server (:mod:`.server`) forks one child per call. That child (the *intermediate*, still in the
host's namespaces) starts its own session, drops to uid/gid 65534 when running as root, moves into new user, mount,
network, pid and IPC namespaces, and forks the *runner*, which is PID 1 of the new pid namespace: when the runner
exits or is killed the kernel kills every process left in that namespace, so no forked or ``setsid`` child can
outlive the call. The runner makes the whole file system read-only except a size- and inode-capped tmpfs scratch
directory, hides the host's processes, drops every capability, sets resource limits, closes every file descriptor but
the reply pipe, and only then runs the call. Any failure in those steps ends the child with an isolation error
naming the step: the code never runs without the isolation it was promised (fail closed).

The reply is ONE frame on a pipe: a 4-byte big-endian length, then UTF-8 JSON. Nothing here or in the server is ever
unpickled.

In the weaker ``process`` mode (opt-in, for kernels that refuse user namespaces) the intermediate itself runs the
call after ``setsid``, the uid drop, resource limits and Python-level socket blocking; see :mod:`.sandbox`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import resource
import signal
import sys
from typing import Any, Callable

NOBODY = 65534
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 28, 38
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1
# mount_setattr shares the generic syscall table's number on x86_64 and aarch64 (Linux 5.12+).
SYS_MOUNT_SETATTR = {"x86_64": 442, "aarch64": 442}.get(platform.machine())
# SECBIT_NOROOT, NO_SETUID_FIXUP, KEEP_CAPS, NO_CAP_AMBIENT_RAISE and their locks: uid 0 of the namespace gets no
# capabilities back through execve.
SECUREBITS_LOCKED = 0x1 | 0x2 | 0x4 | 0x8 | 0x10 | 0x20 | 0x40 | 0x80
EXIT_ISOLATION = 70


class IsolationError(Exception):
    """An isolation step failed; ``step`` names it. The call's code is not run."""

    def __init__(self, step: str, detail: str):
        super().__init__(f"{step}: {detail}")
        self.step, self.detail = step, detail


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_LIBC = ctypes.CDLL(None, use_errno=True)
# Bound at import (in the server): a call that replaces json.dumps does not change how its reply is written.
_ENCODER = json.JSONEncoder(allow_nan=False)


def write_frame(fd: int, obj: Any) -> None:
    """Writes one length-prefixed JSON frame to ``fd`` (blocking, whole)."""
    data = _ENCODER.encode(obj).encode()
    view = memoryview(len(data).to_bytes(4, "big") + data)
    while view:
        view = view[os.write(fd, view):]


def _check(step: str, result: int, fail_step: str | None) -> None:
    """Raises :class:`IsolationError` for a failed libc call (or the test-only forced failure of ``step``)."""
    if fail_step == step:
        raise IsolationError(step, "failed on purpose (test hook)")
    if result != 0:
        err = ctypes.get_errno()
        raise IsolationError(step, f"{errno.errorcode.get(err, err)} ({os.strerror(err)})")


def _step(step: str, fail_step: str | None, fn: Callable[[], Any]) -> Any:
    """Runs a Python-level isolation step, turning any exception into :class:`IsolationError`."""
    if fail_step == step:
        raise IsolationError(step, "failed on purpose (test hook)")
    if fail_step == "hang:" + step:  # (test hook: a step that never ends, e.g. on a starved machine)
        signal.pause()
    try:
        return fn()
    except IsolationError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure of a step must close the call
        raise IsolationError(step, f"{type(exc).__name__}: {exc}") from None


def _write_file(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _join_cgroups(paths: list[str]) -> None:
    """Best effort (the server only hands out cgroups it could create and limit): moves this process in."""
    for path in paths:
        try:
            _write_file(os.path.join(path, "cgroup.procs"), str(os.getpid()))
        except OSError:
            pass


def _drop_user(fail_step: str | None) -> tuple[int, int]:
    """As root, becomes uid/gid 65534 with no supplementary groups; returns the (uid, gid) now held."""
    if os.geteuid() == 0:
        def drop():
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
        _step("drop_user", fail_step, drop)
    return os.getuid(), os.getgid()


def enter_namespaces(uid: int, gid: int, fail_step: str | None) -> None:
    """New user/mount/net/pid/IPC namespaces, mapping uid and gid 0 inside to ``uid``/``gid`` outside."""
    # setuid cleared the dumpable flag; /proc/self/uid_map then belongs to root and cannot be written.
    _check("set_dumpable", _LIBC.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), fail_step)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC
    _check("unshare", _LIBC.unshare(flags), fail_step)
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        _step(f"write_{name}", fail_step, lambda n=name, t=text: _write_file(f"/proc/self/{n}", t))


def _mount(step: str, source: str | None, target: str, fstype: str | None, flags: int, data: str | None,
           fail_step: str | None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    _check(step, _LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), fail_step)


def _mount_setattr(step: str, path: str, flags: int, attr_set: int, attr_clr: int, fail_step: str | None) -> None:
    if SYS_MOUNT_SETATTR is None:
        raise IsolationError(step, f"mount_setattr's syscall number is unknown on {platform.machine()}")
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    result = _LIBC.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
                           ctypes.c_uint(flags), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(step, result, fail_step)


def hidden_paths(paths: list[str]) -> dict[str, list[str]]:
    """Of ``paths`` (the interpreter's own directories), those uid 65534 cannot reach (``/root`` is mode 0700),
    grouped by the topmost directory on their way that others may not search, e.g. ``{"/root": [...]}``."""
    found: dict[str, list[str]] = {}
    for path in sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)}):
        parts, blocked = path.split("/")[1:], None
        for i in range(1, len(parts) + 1):
            ancestor = "/" + "/".join(parts[:i])
            if not os.stat(ancestor).st_mode & 0o001:
                blocked = ancestor
                break
        if blocked is not None and blocked != path:
            kept = found.setdefault(blocked, [])
            if not any(path.startswith(k + "/") for k in kept):
                kept.append(path)
    return found


def reveal_interpreter(hidden: dict[str, list[str]], fail_step: str | None) -> None:
    """As root, in a mount namespace of the call's own: covers each blocking directory with an empty tmpfs that
    holds only bind mounts of the interpreter's directories, so uid 65534 can import what the job can (and sees
    nothing else of, e.g., ``/root``)."""
    _check("unshare_mount_ns", _LIBC.unshare(CLONE_NEWNS), fail_step)
    _mount("make_mounts_private", None, "/", None, MS_REC | MS_PRIVATE, None, fail_step)
    cover_host_dirs(hidden, fail_step)


#: Host directories a call sees empty (each covered by a read-only tmpfs that holds only the interpreter's directories
#: found below it, and the call's scratch): other jobs' and the user's files, sockets and credentials live there.
COVERED = ("/tmp", "/var/tmp", "/run", "/var/run", "/home", "/root", "/mnt", "/media", "/srv", "/var/lib", "/var/spool",
           "/var/mail")

#: Never covered, whatever the job's home is.
SYSTEM_DIRS = ("/", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/opt", "/var", "/dev", "/proc", "/sys")


def covered_dirs(kept: list[str], extra: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """Of :data:`COVERED` and ``extra`` (the job user's home), the real directories (not symlinks) on this machine,
    each with the ``kept`` paths below it (the interpreter's own directories: what the call imports) to bind back.
    A directory that is kept itself, or lies below a kept one, is not covered."""
    kept = sorted({os.path.realpath(p) for p in kept if p and os.path.isdir(p)})
    found: dict[str, list[str]] = {}
    for top in dict.fromkeys((*COVERED, *extra)):
        if (not top.startswith("/") or top in SYSTEM_DIRS or os.path.islink(top) or not os.path.isdir(top)
                or os.path.realpath(top) != top or any(top.startswith(t + "/") for t in found)):
            continue
        if any(k == top or top.startswith(k.rstrip("/") + "/") for k in kept):
            continue
        below: list[str] = []
        for path in kept:
            if path.startswith(top + "/") and not any(path.startswith(b + "/") for b in below):
                below.append(path)
        found[top] = below
    return found


def cover_host_dirs(covered: dict[str, list[str]], fail_step: str | None) -> None:
    """Covers each directory of ``covered`` with an empty tmpfs and binds back the paths listed for it (the
    interpreter's directories below it)."""
    for top, paths in covered.items():
        fds = {p: _step("open_kept_dirs", fail_step, lambda p=p: os.open(p, os.O_PATH | os.O_DIRECTORY))
               for p in paths}
        _mount("cover_host_dir", "tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=256,mode=0755",
               fail_step)
        for path, fd in fds.items():
            _step("bind_kept_dirs", fail_step, lambda p=path: os.makedirs(p, exist_ok=True))
            _mount("bind_kept_dirs", f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None, fail_step)
            os.close(fd)


def build_file_system(job: dict, fail_step: str | None) -> None:
    """A minimal root: the host's directories of :data:`COVERED` empty but for the interpreter's (see
    :func:`covered_dirs`), everything read-only but a capped tmpfs on ``scratch``; a fresh /proc; a tiny /dev/shm."""
    scratch, scratch_mb, max_files = job["scratch"], job["scratch_mb"], job["max_files"]
    _mount("make_mounts_private", None, "/", None, MS_REC | MS_PRIVATE, None, fail_step)
    cover_host_dirs(job.get("covered") or {}, fail_step)
    _step("make_scratch_dir", fail_step, lambda: os.makedirs(scratch, mode=0o700, exist_ok=True))
    _mount("mount_scratch_tmpfs", "tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={scratch_mb}m,nr_inodes={max_files},mode=0700", fail_step)
    _mount_setattr("make_tree_read_only", "/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0, fail_step)
    _mount_setattr("make_scratch_writable", scratch, 0, 0, MOUNT_ATTR_RDONLY, fail_step)
    proc_flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if fail_step == "mount_proc" or _LIBC.mount(b"proc", b"/proc", b"proc", ctypes.c_ulong(proc_flags), None) != 0:
        # The kernel refuses a new proc where parts of the host's are masked (containers): hide it instead.
        _mount("hide_proc", "tmpfs", "/proc", "tmpfs", proc_flags | MS_RDONLY, "size=4k,nr_inodes=8", fail_step)
    if os.path.isdir("/dev/shm"):
        _mount("mount_dev_shm", "tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               "size=1m,nr_inodes=64,mode=0700", fail_step)


def drop_capabilities(fail_step: str | None) -> None:
    """No capability in the namespace, none regained by execve, no privilege gained by exec of set-id files."""
    _check("set_securebits", _LIBC.prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED, 0, 0, 0), fail_step)
    cap = 0
    while _LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # EINVAL past the kernel's last capability
        cap += 1
    if cap < 38:  # CAP_CHECKPOINT_RESTORE (Linux 5.9) is 40; any kernel here knows at least 38
        _check("drop_bounding_set", -1, fail_step)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3, all sets empty
    _check("capset", _LIBC.capset(ctypes.byref(header), ctypes.byref(data)), fail_step)
    _check("no_new_privs", _LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), fail_step)


def set_limits(limits: dict, fail_step: str | None) -> None:
    """Resource limits of the call (soft = hard, so the code cannot raise them)."""
    pairs = [
        (resource.RLIMIT_NPROC, limits["max_processes"]),
        (resource.RLIMIT_AS, limits["memory_mb"] << 20),
        (resource.RLIMIT_CPU, max(1, int(limits["cpu_limit_s"] + 0.999))),
        (resource.RLIMIT_FSIZE, limits["scratch_mb"] << 20),
        (resource.RLIMIT_NOFILE, 256),
        (resource.RLIMIT_CORE, 0),
    ]
    for which, value in pairs:
        _step("set_rlimits", fail_step, lambda w=which, v=value: resource.setrlimit(w, (v, v)))


def close_fds_but(keep: set[int]) -> None:
    """Closes every descriptor above 2 except those in ``keep`` (the reply pipe, the interpreter's directories)."""
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)


def filter_system_calls(allow_inet: bool, fail_step: str | None) -> None:
    """The seccomp filter (:mod:`.seccomp`): no socket but inet ones (none in process mode), no io_uring."""
    from . import seccomp

    if platform.machine() not in seccomp.ARCHES:
        raise IsolationError("seccomp_filter", f"no system-call filter is written for {platform.machine()}")
    result = _step("seccomp_filter", fail_step, lambda: seccomp.install(allow_inet, _LIBC))
    _check("seccomp_filter", result, fail_step)


def block_sockets() -> None:
    """Process mode only: Python-level refusal of sockets (C code, ctypes and subprocesses get around it)."""
    import _socket
    import socket

    def refuse(*args, **kwargs):
        raise OSError(errno.ENETUNREACH, "network access is disabled in the sandbox")

    for module in (socket, _socket):
        for name in ("socket", "create_connection", "socketpair", "fromfd", "getaddrinfo", "SocketType"):
            if hasattr(module, name):
                setattr(module, name, refuse)


def _run_and_reply(fn: Callable | None, args: list, reply_fd: int) -> None:
    """Runs the call and writes its one reply frame; never returns."""
    try:
        value = "probe" if fn is None else fn(*args)
        try:
            frame = {"status": "ok", "value": value}
            _ENCODER.encode(frame)
        except (TypeError, ValueError):
            frame = {"status": "error", "error": f"the result is not JSON data ({type(value).__name__})"}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent; str(exc) may be huge, the type is not
        frame = {"status": "error", "error": type(exc).__name__}
    try:
        write_frame(reply_fd, frame)
    finally:
        os._exit(0)


def _isolation_exit(reply_fd: int, exc: IsolationError) -> None:
    try:
        write_frame(reply_fd, {"status": "isolation", "step": exc.step, "error": exc.detail})
    finally:
        os._exit(EXIT_ISOLATION)


def _runner(fn: Callable | None, args: list, reply_fd: int, job: dict) -> None:
    """PID 1 of the call's pid namespace: finishes the isolation, then runs the call."""
    fail = job.get("fail_step")
    try:
        _check("set_pdeathsig", _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), fail)
        build_file_system(job, fail)
        drop_capabilities(fail)
        set_limits(job, fail)
        _step("chdir_scratch", fail, lambda: os.chdir(job["scratch"]))
        filter_system_calls(True, fail)  # (last: the steps above open no socket)
    except IsolationError as exc:
        _isolation_exit(reply_fd, exc)
    os.environ.update(HOME=job["scratch"], TMPDIR=job["scratch"])
    _run_and_reply(fn, args, reply_fd)


def child_main(fn: Callable | None, args: list, reply_fd: int, job: dict) -> None:
    """Entry of the forked child (never returns): isolation, then the call, per ``job["isolation"]``."""
    fail = job.get("fail_step")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the server's handler cleans the server up, not a call)
    try:
        close_fds_but({reply_fd})
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        _step("setsid", fail, os.setsid)
        _join_cgroups(job["cgroups"])
        if job["hidden"] and job["isolation"] == "namespaces":
            reveal_interpreter(job["hidden"], fail)
        uid, gid = _drop_user(fail)
        if job["isolation"] == "process":
            _check("set_pdeathsig", _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), fail)
            set_limits({**job, "max_processes": job["max_processes"] * job["parallel"]}, fail)
            _step("chdir_scratch", fail, lambda: os.chdir(job["scratch"]))
            close_fds_but({reply_fd})
            _step("block_sockets", fail, block_sockets)
            _check("no_new_privs", _LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), fail)
            filter_system_calls(False, fail)
            os.environ.update(HOME=job["scratch"], TMPDIR=job["scratch"])
            _run_and_reply(fn, args, reply_fd)
        enter_namespaces(uid, gid, fail)
        _check("set_pdeathsig", _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), fail)
        if os.getppid() != job["server_pid"]:
            os._exit(EXIT_ISOLATION)  # the server is gone: nobody waits for this call
        runner = _step("fork_pid1", fail, os.fork)
    except IsolationError as exc:
        _isolation_exit(reply_fd, exc)
    except BaseException:  # noqa: BLE001 - never fall back into the server's loop
        os._exit(EXIT_ISOLATION)
    if runner == 0:
        try:
            _runner(fn, args, reply_fd, job)
        finally:
            os._exit(EXIT_ISOLATION)
    os.close(reply_fd)
    try:
        _, status = os.waitpid(runner, 0)
        code = os.waitstatus_to_exitcode(status)
    except BaseException:  # noqa: BLE001
        code = EXIT_ISOLATION
    os._exit(code if code >= 0 else 128 - code)


def runs_as_root() -> bool:
    """Whether the calls drop to uid 65534 (only root can)."""
    return os.geteuid() == 0 and sys.platform.startswith("linux")
