"""Where a process runs and what state it is in, read from the kernel (`/proc`): what the liveness of a job's ranks
rests on when they share a machine (a rank seen gone is named at once, not after its heartbeat's silence; a child
stopped while it starts is named as frozen)."""

from __future__ import annotations

import os


def last_words(text: str) -> None:
    """Write `text` to stderr before this process ends itself, whatever state stderr is in: a pipe whose reader is
    gone too (the process that started the job was killed) raises, and an exit that waits on its message would not
    happen (the thread that was to end the process dies with the error instead)."""
    import sys

    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def process_identity(pid: int | None = None) -> dict:
    """Where a process runs, precise enough for a peer to tell whether it shares that process's pid space: the host
    name, and on Linux the kernel's boot id, the pid namespace and the process's start time (a reused pid has
    another)."""
    import socket

    pid = os.getpid() if pid is None else pid
    info: dict = {"host": socket.gethostname(), "pid": pid}
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            info["boot"] = fh.read().strip()
        info["pidns"] = os.stat("/proc/self/ns/pid").st_ino
        info["start"] = proc_stat(pid)[1]
    except (OSError, ValueError, IndexError):
        pass
    return info


def proc_stat(pid: int) -> tuple[str, str]:
    """(state, start time) of a process, from /proc/<pid>/stat (fields 3 and 22; the command name may hold
    spaces and parentheses, so count from its closing parenthesis)."""
    with open(f"/proc/{pid}/stat") as fh:
        data = fh.read()
    fields = data[data.rindex(")") + 2:].split()
    return fields[0], fields[19]


def same_pid_space(where: dict, here: dict) -> bool:
    """Whether the process `where` describes runs in the pid space of `here` (same machine, boot and pid
    namespace); without Linux's ids on both sides, by the host name alone."""
    if where.get("host") != here.get("host"):
        return False
    if "boot" in where or "boot" in here:
        return where.get("boot") == here.get("boot") and where.get("pidns") == here.get("pidns")
    return True


def process_gone(where: dict, here: dict) -> bool:
    """Whether the process `where` describes has ended, on evidence only: it shares this pid space (Linux ids
    known) and its pid is free, a zombie, or another process's (a different start time). Anything unreadable
    counts as alive."""
    if "start" not in where or "boot" not in here or not same_pid_space(where, here):
        return False
    pid = int(where["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it exists (another user's process: not ours to judge further)
        return False
    try:
        state, start = proc_stat(pid)
    except (OSError, ValueError, IndexError):
        return False
    return state in ("Z", "X") or start != where["start"]


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, SIGTSTP, a tracer): frozen until someone continues it."""
    try:
        return proc_stat(pid)[0] in ("T", "t")
    except (OSError, ValueError, IndexError):
        return False


def release_cpu_shm(engine_id: str) -> None:
    """Remove the shared-memory segments of the tensor-parallel CPU engines named `engine_id` (a prefix: every
    replica of a job; with a trailing "_": one engine), once their ranks are done. vLLM's CPU backend does not unlink
    them when its process ends without tearing the engine down (a generator ends with `os._exit`), so every
    tensor-parallel job would leave megabytes in /dev/shm, and a later engine with the same name would fail to start
    (errno 17). Unlinking a segment leaves it mapped in any process still using it."""
    import glob

    if not engine_id:
        return
    for path in glob.glob(f"/dev/shm/*-cpushm-{glob.escape(engine_id)}*"):
        try:
            os.unlink(path)
        except OSError:  # (already gone: another rank of the engine released it)
            pass


def sweep_dead_owners(prefix: str) -> None:
    """Removes this user's directories `<temp dir>/<prefix><pid>-...` whose owner process `pid` is gone: scratch a
    process killed with SIGKILL (or ended by `os._exit`) had no time to clean up."""
    import re
    import shutil
    import tempfile

    pattern = re.compile(re.escape(prefix) + r"(\d+)-\w+")
    for entry in os.scandir(tempfile.gettempdir()):
        m = pattern.fullmatch(entry.name)
        try:
            if not m or not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.geteuid():
                continue
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except OSError:  # (alive under another uid, or gone meanwhile)
            continue
