"""After the end of the job: a rank that never exits must not hold its launcher forever.

Past the end-of-job rendezvous (`Liveness.finish`) a rank has nothing left to do with the others, so nothing watches
it any more: a rank frozen there (SIGSTOP, a hung interpreter teardown, a non-daemon thread) keeps `torchrun` waiting
for its exit until the allocation's wall time, while every other rank has exited 0. So each launched rank, once past
the rendezvous, leaves behind a small watcher process (a new session: it outlives the rank and is not one of the
launcher's workers). The watcher waits for the other ranks of the job on this machine to exit; one still there after
`grace_s` is named on stderr, given the error torchrun prints as that rank's root cause, and killed, so the launcher
returns (non-zero: a rank did not end by itself) within `grace_s` of the end of the job. Its work was complete: it
had passed the rendezvous, after the job's last step, checkpoint and save. Before the kill, a rank that still runs
(not stopped) is asked for the Python stack of each of its threads (`dump_stacks_on_request`, SIGUSR1): they are
printed on its stderr, above the watcher's message, and show where its exit hangs.

Every rank's watcher looks at the same peers; a claim file per frozen process makes one of them report and kill it.
The watcher runs `python -S -I` on this file's `main` (no site, no package import: it starts in milliseconds).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def watch(peers: dict[str, dict], grace_s: float, job_id: str) -> subprocess.Popen | None:
    """Leave a watcher for `peers` ({description: `process_identity`}, the other ranks of the job on this machine);
    None when there are none or it cannot start (the job's exit is then as it was: nothing to lose but the watch)."""
    if not peers:
        return None
    spec = json.dumps({"peers": peers, "grace_s": float(grace_s), "job_id": job_id})
    try:
        return subprocess.Popen([sys.executable, "-S", "-I", os.path.abspath(__file__), spec],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
                                close_fds=True)
    except OSError:
        return None


DUMP_SIGNAL = signal.SIGUSR1
DUMP_WAIT_S = 1.0  # how long the stacks may take to print before the kill


def dump_stacks_on_request() -> None:
    """From here on (past the end-of-job rendezvous: nothing of the job's own uses the signal) SIGUSR1 prints every
    thread's Python stack on stderr; the watcher asks for it before it kills a rank whose exit hangs."""
    import faulthandler

    try:
        faulthandler.register(DUMP_SIGNAL, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError, RuntimeError):  # (no usable stderr: the kill comes without stacks)
        pass


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of `pid`, None when it is gone (as `processes.proc_stat`, which this file cannot import)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return fields[0], fields[19]


def _alive(where: dict) -> bool:
    stat = _stat(int(where["pid"]))
    return stat is not None and stat[0] not in ("Z", "X") and stat[1] == where.get("start", stat[1])


def _catches(pid: int, signum: int) -> bool:
    """Whether `pid` has a handler for `signum` (its SigCgt mask): the default action of SIGUSR1 would end it."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _error_file(pid: int) -> str | None:
    """The torchrun error file of process `pid` (its TORCHELASTIC_ERROR_FILE), if readable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"TORCHELASTIC_ERROR_FILE="):
            return item.split(b"=", 1)[1].decode(errors="replace")
    return None


def _claim(job_id: str, where: dict) -> bool:
    """Whether this watcher is the first to claim the frozen process `where` (one report, one kill)."""
    name = f"hfllamarl-exit-{job_id}-{where['pid']}-{where.get('start', '')}"
    try:
        os.close(os.open(os.path.join(tempfile.gettempdir(), name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True  # (no claim possible: report anyway, a second kill is harmless)
    return True


def _end(name: str, where: dict, grace_s: float) -> None:
    pid = int(where["pid"])
    state = _stat(pid)
    stopped = bool(state and state[0] in ("T", "t"))
    dumps = not stopped and _catches(pid, DUMP_SIGNAL)
    how = ("stopped (SIGSTOP or a tracer)" if stopped else
           "still running (its threads' Python stacks are printed above)" if dumps else "still running")
    message = (f"hfllamarl: {name} (pid {pid}) reached the end of the job but did not exit within {grace_s:.0f} s of "
               f"the other ranks: it is {how}; killed so that the launcher returns. The run's work is complete (that "
               f"rank had passed the end-of-job rendezvous, after the last step, checkpoint and save); the launcher "
               f"reports it as failed because it did not end by itself.")
    path = _error_file(pid)
    if path and not os.path.exists(path):
        try:
            with open(path, "w") as fh:
                json.dump({"message": {"message": message, "extraInfo": {
                    "py_callstack": message, "timestamp": str(int(time.time()))}}}, fh)
        except OSError:
            pass
    if dumps:
        try:
            os.kill(pid, DUMP_SIGNAL)
            time.sleep(DUMP_WAIT_S)
        except OSError:
            pass
    print(message, file=sys.stderr, flush=True)
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def main(spec: str) -> int:
    job = json.loads(spec)
    peers, grace_s = job["peers"], float(job["grace_s"])
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        peers = {name: where for name, where in peers.items() if _alive(where)}
        if not peers:
            return 0
        time.sleep(0.2)
    for name, where in sorted(peers.items()):
        if _alive(where) and _claim(job["job_id"], where):
            _end(name, where, grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
