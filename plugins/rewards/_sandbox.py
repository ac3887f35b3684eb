"""A persistent worker process that runs one function under a wall-clock bound.

Reward functions grade untrusted model text. Parsing and simplifying it with sympy can
run for minutes, or forever, inside C code that ``signal.alarm`` in the calling process
cannot interrupt (``10^{10^{10}}``, ``1000000!``). :class:`SandboxWorker` moves that work
into a single long-lived child process and bounds every call from the outside:

* The child is a fresh interpreter, started the way multiprocessing's ``spawn`` starts
  one (fork+exec, so nothing of the trainer's ``torch.distributed`` threads is copied), but
  through :mod:`subprocess` with a tiny bootstrap instead of ``multiprocessing.Process``:
  ``spawn`` re-imports the launching script in the child, which needs an
  ``if __name__ == "__main__":`` guard, fails for ``python - < script``, and would import
  torch, transformers and vLLM into the worker. Messages travel over a
  :class:`multiprocessing.connection.Connection` on a socket pair.
* One child is reused for all calls (a fresh process per call costs about a second).
* Each call waits at most ``timeout`` seconds. Inside the child a soft deadline
  (``SIGALRM`` raising :class:`_SoftTimeout`) usually ends Python-level work first, so the
  child survives and answers ``"timeout"``. If the child does not answer in time (stuck in
  C code), the parent kills it and starts a replacement straight away, which boots in the
  background while the caller carries on.
* The child never outlives the trainer: when idle it exits on EOF of its socket or when
  its parent pid changes; while busy, a CPU-time timer (``ITIMER_PROF``, whose default
  action terminates the process) bounds every request; its address space is capped so a
  huge integer raises ``MemoryError`` instead of exhausting the machine.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

__all__ = ["SandboxError", "SandboxTimeout", "SandboxWorker"]

# Seconds (at most a third of the budget) the child keeps in reserve so that its own
# "timeout" answer reaches the parent before the parent's deadline, sparing it a kill.
_SOFT_MARGIN_S = 0.15


class SandboxTimeout(Exception):
    """The call did not finish within its time budget (the caller scores it as a timeout)."""


class SandboxError(Exception):
    """The worker raised, crashed, or could not be started."""


class SandboxWorker:
    """Runs ``fn(*args)`` in a persistent child process with a per-call timeout.

    Thread-safe: calls are serialised by a lock (there is one child).

    Args:
        fn: A module-level (picklable by reference) function; it runs in the child. Its
            arguments and result must be picklable.
        warmup: Optional module-level function the child runs once before it reports
            ready (e.g. heavy imports), so the first real call is fast.
        startup_timeout: Seconds :meth:`wait_ready` waits for a child on first start.
        cpu_limit_s: CPU seconds after which the child terminates itself while busy with
            one request (a backstop for when the parent is gone and cannot kill it).
        memory_limit_bytes: Address-space limit of the child (``RLIMIT_AS``); ``None``
            leaves it unlimited.
        poll_interval_s: How often an idle child checks that its parent is still alive.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        warmup: Callable[[], Any] | None = None,
        startup_timeout: float = 60.0,
        cpu_limit_s: float = 10.0,
        memory_limit_bytes: int | None = 4 << 30,
        poll_interval_s: float = 0.5,
    ) -> None:
        self._fn = fn
        self._warmup = warmup
        self.startup_timeout = startup_timeout
        self._limits = (cpu_limit_s, memory_limit_bytes, poll_interval_s)
        self._lock = threading.RLock()
        self._proc: Any = None
        self._conn: Any = None
        self._ready = False
        self._ids = itertools.count()
        self._owner_pid = os.getpid()
        self.starts = 0  # child processes started, the first one included

    @property
    def pid(self) -> int | None:
        """Process id of the current child, or ``None`` when there is none."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Starts a child if none is alive; does not wait for it to be ready."""
        with self._lock:
            self._forget_if_forked()
            if self._proc is not None and self._proc.poll() is None:
                return
            self._discard()
            parent_sock, child_sock = socket.socketpair()
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, str(child_sock.fileno()), __name__],
                    pass_fds=(child_sock.fileno(),),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,  # stderr stays: a crash leaves a traceback
                )
            except BaseException:
                parent_sock.close()
                raise
            finally:
                child_sock.close()  # the child holds its own copy; EOF if it dies
            conn = Connection(parent_sock.detach())
            self._proc, self._conn, self._ready = proc, conn, False
            self.starts += 1
            try:
                conn.send(list(sys.path))  # so the child imports what this process imports
                conn.send((os.getpid(), self._fn, self._warmup, *self._limits))
            except OSError:
                self._discard()  # died at once; the next wait_ready reports it

    def wait_ready(self, timeout: float) -> bool:
        """Starts the child if needed and waits up to ``timeout`` s for it to be ready.

        Returns:
            True when the child is ready to take calls.

        Raises:
            SandboxError: The child died while starting.
        """
        with self._lock:
            self.start()
            if self._ready:
                return True
            if self._conn is None:
                raise SandboxError("reward sandbox worker could not be started")
            try:
                if not self._conn.poll(max(timeout, 0.0)):
                    return False
                message = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._discard()
                raise SandboxError("reward sandbox worker died while starting") from exc
            self._ready = message[0] == "ready"
            return self._ready

    def call(self, *args: Any, timeout: float) -> Any:
        """Runs ``fn(*args)`` in the child and returns its result.

        Args:
            *args: Arguments for ``fn``.
            timeout: Wall-clock budget in seconds, including any wait for a child that
                is still starting.

        Raises:
            SandboxTimeout: No answer in time. A stuck child is killed and replaced.
            SandboxError: ``fn`` raised in the child, or the child crashed.
        """
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=max(timeout, 0.0)):  # another thread's call
            raise SandboxTimeout("reward sandbox worker busy with another call")
        try:
            return self._call_locked(args, deadline)
        finally:
            self._lock.release()

    def _call_locked(self, args: tuple, deadline: float) -> Any:
        if not self.wait_ready(deadline - time.monotonic()):
            raise SandboxTimeout("reward sandbox worker is still starting")
        remaining = deadline - time.monotonic()
        if remaining < 0.02:
            raise SandboxTimeout("no time left to send the request")
        soft = remaining - min(_SOFT_MARGIN_S, remaining / 3)
        request_id = next(self._ids)
        try:
            self._conn.send((request_id, soft, args))
            answered = self._conn.poll(max(deadline - time.monotonic(), 0.0))
            reply = self._conn.recv() if answered else None
        except (EOFError, OSError) as exc:
            self._discard()
            raise SandboxError("reward sandbox worker crashed") from exc
        if reply is None:
            self._discard()  # stuck, most likely in C code: kill it ...
            self.start()  # ... and let a replacement boot while the caller goes on
            raise SandboxTimeout("no answer in time; the worker was replaced")
        reply_id, status, value = reply
        if reply_id != request_id:  # cannot happen with one lock-held request in flight
            self._discard()
            raise SandboxError("reward sandbox protocol out of step")
        if status == "ok":
            return value
        if status == "timeout":
            raise SandboxTimeout(f"soft deadline of {soft:.2f} s reached in the worker")
        raise SandboxError(value)

    def close(self) -> None:
        """Stops the child (politely, then by force)."""
        with self._lock:
            self._forget_if_forked()
            if self._conn is not None and self._proc is not None and self._proc.poll() is None:
                try:
                    self._conn.send(None)
                    self._proc.wait(0.5)
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    pass
            self._discard()

    def _forget_if_forked(self) -> None:
        """In a forked copy of the owning process, drops (without killing) the owner's child."""
        if self._owner_pid != os.getpid():
            self._proc = self._conn = None
            self._ready, self._owner_pid = False, os.getpid()

    def _discard(self) -> None:
        """Kills and forgets the current child, if any."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._ready = False
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(1.0)  # reap it
            except subprocess.TimeoutExpired:
                pass
        if conn is not None:
            conn.close()


class _SoftTimeout(BaseException):
    """Raised inside the child at the soft deadline; a BaseException so that library
    code's ``except Exception`` does not swallow it."""


_ARMED = [False]


def _on_alarm(signum: int, frame: Any) -> None:
    if _ARMED[0]:
        raise _SoftTimeout()


def _arm(soft_s: float, cpu_limit_s: float) -> None:
    _ARMED[0] = True
    signal.setitimer(signal.ITIMER_PROF, cpu_limit_s)  # default action of SIGPROF: terminate
    signal.setitimer(signal.ITIMER_REAL, soft_s, 0.05)  # repeats if someone swallows it


def _disarm() -> None:
    _ARMED[0] = False
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.setitimer(signal.ITIMER_PROF, 0)


def _apply_memory_limit(limit: int | None) -> None:
    if limit is None:
        return
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):
        pass  # best effort: not every platform has RLIMIT_AS


# Runs in the child as ``python -c``: learn sys.path, then import this module by name.
_BOOTSTRAP = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    "import importlib\n"
    "importlib.import_module(sys.argv[2])._worker_main(conn)\n"
)


def _worker_main(conn: Connection) -> None:
    """Child process loop: one request ``(id, soft_deadline_s, args)`` at a time."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        parent_pid, fn, warmup, cpu_limit_s, memory_limit_bytes, poll_interval_s = conn.recv()
    except (EOFError, OSError):
        return
    _apply_memory_limit(memory_limit_bytes)
    if warmup is not None:
        try:
            warmup()
        except Exception:  # a failed warm-up only makes the first call slower
            pass
    signal.signal(signal.SIGALRM, _on_alarm)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            if not conn.poll(poll_interval_s):
                if os.getppid() != parent_pid:
                    return  # orphaned: the trainer is gone
                continue
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        request_id, soft_s, args = request
        try:
            try:
                _arm(soft_s, cpu_limit_s)
                reply = (request_id, "ok", fn(*args))
            except Exception as exc:  # reported to the parent, which scores 0.0
                reply = (request_id, "error", type(exc).__name__)  # str(exc) may be huge
            finally:
                _disarm()
        except _SoftTimeout:
            _disarm()
            reply = (request_id, "timeout", None)
        try:
            conn.send(reply)
        except Exception:  # e.g. an unpicklable result
            try:
                conn.send((request_id, "error", "unpicklable result"))
            except (EOFError, OSError):
                return
