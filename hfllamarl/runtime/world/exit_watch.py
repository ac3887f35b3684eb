"""After the end of the job: a rank that never exits must not hold its launcher forever.

Past the end-of-job rendezvous (`Liveness.finish`) a rank has nothing left to do with the others, so nothing watches
it any more: a rank frozen there (SIGSTOP, a hung interpreter teardown, a non-daemon thread) keeps `torchrun` waiting
for its exit until the allocation's wall time, while every other rank has exited 0. So each launched rank, once past
the rendezvous, leaves behind a small watcher process (a new session: it outlives the rank and is not one of the
launcher's workers). The watcher waits for the other ranks of the job on this machine to exit. A rank's exit is not
instant: the interpreter's teardown of torch, transformers and vLLM takes seconds of CPU (about 3 s measured on an
idle 2-core machine; several times that on a crowded one). So a rank is judged by its progress, not by the clock: one
that is still there and has used (almost) no CPU time for `grace_s` (stopped, or waiting on something that never
comes) is named on stderr, given the error torchrun prints as that rank's root cause, and killed; one that keeps
working is given up to `BUSY_LIMIT` x `grace_s`, then treated the same way. The launcher so returns (non-zero: a rank
did not end by itself) within `grace_s` of a frozen rank's last work. Its work was complete: it had passed the
rendezvous, after the job's last step, checkpoint and save. Before the kill, a rank that still runs (not stopped) is
asked for the Python stack of each of its threads (`dump_stacks_on_request`, SIGUSR1): they are printed on its stderr,
above the watcher's message, and show where its exit hangs.

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


BUSY_LIMIT = 4  # a rank still working at exit is given at most this many times the grace
WORKING_SHARE = 0.05  # working: at least this share of a core over the last `grace_s` (idle threads' wake-ups use less)


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(state, start time, CPU ticks used) of `pid`, None when it is gone (as `processes.proc_stat`, which this file
    cannot import)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return fields[0], fields[19], int(fields[11]) + int(fields[12])


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


def write_error_file(path: str | None, message: str, callstack: str) -> None:
    """Write a rank's torchrun error file (what torchrun prints as its root cause), unless it has one: whole or not
    at all. torchrun reads the file as soon as the rank is gone, and one left empty (its writer ended by torchrun's
    SIGTERM between creating and filling it) ends torchrun itself in a JSONDecodeError, the rank's own error lost;
    so the text goes to a temporary file first, linked into place (a link never replaces an existing file)."""
    if not path or os.path.exists(path):
        return
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w") as fh:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": callstack, "timestamp": str(int(time.time()))}}}, fh)
        os.link(temporary, path)
    except OSError:
        pass
    finally:
        try:
            os.unlink(temporary)
        except OSError:
            pass


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


def _end(name: str, where: dict, why: str) -> None:
    pid = int(where["pid"])
    state = _stat(pid)
    stopped = bool(state and state[0] in ("T", "t"))
    dumps = not stopped and _catches(pid, DUMP_SIGNAL)
    how = ("stopped (SIGSTOP or a tracer)" if stopped else
           "still running (its threads' Python stacks are printed above)" if dumps else "still running")
    message = (f"hfllamarl: {name} (pid {pid}) reached the end of the job but {why}: it is {how}; killed so that "
               f"the launcher returns. The run's work is complete (that rank had passed the end-of-job rendezvous, "
               f"after the last step, checkpoint and save); the launcher reports it as failed because it did not end "
               f"by itself.")
    write_error_file(_error_file(pid), message, message)
    if dumps:
        try:
            os.kill(pid, DUMP_SIGNAL)
            time.sleep(DUMP_WAIT_S)
        except OSError:
            pass
    try:  # (whatever state stderr is in, a pipe whose reader is gone too: the kill must follow)
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def main(spec: str) -> int:
    job = json.loads(spec)
    peers, grace_s = job["peers"], float(job["grace_s"])
    start = time.monotonic()
    ticks_s = os.sysconf("SC_CLK_TCK")
    seen = {name: [] for name in peers}  # name -> [(when, CPU ticks)] over the last grace_s
    while peers:
        now = time.monotonic()
        for name, where in list(peers.items()):
            stat = _stat(int(where["pid"]))
            if stat is None or stat[0] in ("Z", "X") or stat[1] != where.get("start", stat[1]):
                del peers[name]  # (exited, or the pid is another process's now)
                continue
            samples = seen[name]
            samples.append((now, stat[2] if stat[0] not in ("T", "t") else None))
            while len(samples) > 1 and samples[1][0] <= now - grace_s:
                samples.pop(0)
            stopped = samples[-1][1] is None
            ticks = [t for _, t in samples if t is not None]  # (a rank stopped, then continued, works again)
            used_s = 0.0 if stopped else (ticks[-1] - ticks[0]) / ticks_s
            idle = now - start >= grace_s and (stopped or used_s < WORKING_SHARE * grace_s)
            if idle or now - start > BUSY_LIMIT * grace_s:
                why = (f"did not exit and did no work for {grace_s:.0f} s" if idle else
                       f"still worked on its exit {now - start:.0f} s after the other ranks")
                if _claim(job["job_id"], where):  # (else another rank's watcher reports and kills it)
                    _end(name, where, why)
                del peers[name]
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
