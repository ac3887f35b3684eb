"""Runs untrusted work (model-written code, parsers fed model text) in isolated, fresh processes.

A :class:`Sandbox` starts one *server* process: a fresh interpreter (``subprocess`` with a tiny bootstrap; no
multiprocessing spawn, no torch) that imports the call's function and runs a warm-up once, then forks one fresh child
per call (:mod:`.server`). Each child, before it runs anything (:mod:`.jail`), in the default
``isolation="namespaces"``:

* starts its own session and, when the job runs as root, drops to uid/gid 65534;
* enters new user, mount, network, pid and IPC namespaces and forks PID 1 of the new pid namespace, which runs the
  call: when it ends or is killed, the kernel kills every process left in the namespace (``setsid`` children too);
* sees a minimal root: the host's temp, run-time and home directories (:data:`.jail.COVERED`, the job user's home)
  empty but for the interpreter's own directories below them; everything read-only, except its own tmpfs scratch
  directory (``scratch_mb``, ``max_files`` inodes), its working directory, removed after the call; a fresh ``/proc``
  (the host's processes are hidden);
* has no network: the namespace has only a loopback that is down, whatever the API (``socket``, ``_socket``,
  ``ctypes``, a subprocess);
* can open no socket but an inet one (which reaches nothing there) and stream ``socketpair``s, and no io_uring
  (a seccomp filter, :mod:`.seccomp`): no Unix socket the job created (the preload server's, a database's) is
  reachable, though the file system shows it;
* starts from an allow-listed environment (``PATH``, ``TMPDIR``, locale, ``TZ``, thread counts;
  :data:`CALL_ENVIRONMENT`): the job's tokens, keys and socket paths are not in it, nor in ``/proc/self/environ``;
* holds no capability, and runs under ``RLIMIT_NPROC``, ``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``,
  ``RLIMIT_NOFILE``, no core dumps, and a pids/memory cgroup of its own where the hierarchy is writable;
* keeps only its reply pipe open. Any failing step ends the call with :class:`SandboxError` naming the step, before
  any code runs (fail closed).

Replies are one length-prefixed JSON frame (never pickle), capped at ``max_reply_bytes``; arguments and results are
JSON values; functions travel as ``"module:function"`` strings. Every call is fresh: nothing a call changes (a module,
``builtins``, a file) is seen by the next. At its deadline a call's namespace is killed, and :class:`SandboxTimeout`
is raised; a call never returns a value for a timeout.

Where the kernel refuses the isolation (e.g. unprivileged user namespaces disabled), :meth:`Sandbox.wait_ready`
raises :class:`SandboxUnavailable` naming the failed step; ``isolation="process"`` is the opt-in weaker mode (fork per
call, ``setsid``, uid drop, rlimits, session and cgroup kill, scratch removed, no socket at all but stream
pairs (the seccomp filter), the allow-listed environment), with a loud warning of what it does not guarantee.

Not guaranteed: outside the covered directories the code can read every file the job's user (or uid 65534) can
read (files, not sockets); CPU
time is bounded, not its share of the cores; a tmpfs the code mounts in a nested user namespace of its own is
bounded only by the memory cgroup. A call's memory is bounded as a whole only where its memory cgroup is enforced (the
server checks at start that a limited cgroup really stops a process); elsewhere each process is bounded (RLIMIT_AS)
and the call to max_processes of them, which the sandbox says in a warning at start.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["Sandbox", "SandboxBusy", "SandboxError", "SandboxTimeout", "SandboxUnavailable"]

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("namespaces", "process")
#: The variables a sandbox server (and so every call it forks) keeps from the job's environment: what an interpreter
#: needs to run as the job's does (TMPDIR: where the calls' scratch directories go). Nothing else (tokens, API keys,
#: socket paths such as HFLLAMARL_PRELOAD).
CALL_ENVIRONMENT = ("PATH", "TMPDIR", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH",
                    "PYTHONHASHSEED", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE", "OMP_NUM_THREADS",
                    "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
_NO_CGROUP_WARNED = [False]  # the per-process memory bound is said once per process
_GRACE_S = 1.5  # the parent waits this much past a call's budget before it declares the server stuck
_PROCESS_MODE_WARNING = (
    "SANDBOX RUNS WITH isolation='process' (WEAKER): calls are forked fresh, get their own session, run as uid "
    "65534 (when the job is root) under rlimits, and are killed by session and cgroup at the timeout, but they "
    "are NOT in a read-only file system (they can write wherever uid 65534 can, e.g. /tmp), NOT cut from the "
    "network (only Python's socket module is disabled; ctypes, C extensions and subprocesses get around it), can "
    "see the host's processes, and a forked child that leaves the session escapes the kill where no cgroup is "
    "writable. Use isolation='namespaces' wherever the kernel allows user namespaces.")


class SandboxTimeout(Exception):
    """The call did not finish within its time budget; its whole process tree was killed."""


class SandboxBusy(SandboxTimeout):
    """The call never started: no slot came free (or the server did not start) within its wait."""


class SandboxError(Exception):
    """The call raised, crashed, hit a limit, failed an isolation step, or the server failed."""


class SandboxUnavailable(SandboxError):
    """The machine cannot give the requested isolation; the message names the failed step."""


def _frame(obj: Any) -> bytes:
    data = json.dumps(obj, allow_nan=False).encode()
    return len(data).to_bytes(4, "big") + data


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("sandbox server closed its socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# Runs in the server as ``python -c``: read the config frame, take the parent's sys.path, import the server.
_BOOTSTRAP = (
    "import json, socket, sys\n"
    "sock = socket.socket(fileno=int(sys.argv[1]))\n"
    "def exact(n):\n"
    "    b = b''\n"
    "    while len(b) < n:\n"
    "        c = sock.recv(n - len(b))\n"
    "        if not c: raise SystemExit(0)\n"
    "        b += c\n"
    "    return b\n"
    "config = json.loads(exact(int.from_bytes(exact(4), 'big')))\n"
    "sys.path[:] = config['sys_path']\n"
    "from hfllamarl.sandbox.server import main\n"
    "main(sock, config)\n"
)


class _Launcher:
    """Starts servers from one long-lived thread: a server dies with the thread that forked it (PDEATHSIG)."""

    _requests: queue.Queue = queue.Queue()
    _thread: threading.Thread | None = None
    _lock = threading.Lock()

    @classmethod
    def popen(cls, *args, **kwargs) -> subprocess.Popen:
        with cls._lock:
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(target=cls._loop, name="sandbox-launcher", daemon=True)
                cls._thread.start()
        answer: queue.Queue = queue.Queue(1)
        cls._requests.put((args, kwargs, answer))
        ok, value = answer.get(timeout=60.0)
        if not ok:
            raise value
        return value

    @classmethod
    def _loop(cls) -> None:
        while True:
            args, kwargs, answer = cls._requests.get()
            try:
                answer.put((True, subprocess.Popen(*args, **kwargs)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                answer.put((False, exc))


class _Server:
    """One server process, its socket, and a reader thread that hands replies to the waiting calls by id."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, max_frame: int):
        self.proc, self.sock, self.max_frame = proc, sock, max_frame
        self.ready = threading.Event()
        self.info: dict | None = None  # the ready (or unavailable) frame
        self.dead: str | None = None
        self.pending: dict[int, list] = {}  # id -> [event, reply]
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        threading.Thread(target=self._read, name="sandbox-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                size = int.from_bytes(_recv_exact(self.sock, 4), "big")
                if size > self.max_frame:
                    raise ValueError(f"a frame of {size} bytes from the sandbox server is over the cap")
                message = json.loads(_recv_exact(self.sock, size).decode("utf-8"))
                if not isinstance(message, dict):
                    raise ValueError("a sandbox server frame is not an object")
                if "type" in message:
                    self.info = message
                    self.ready.set()
                    continue
                with self.lock:
                    slot = self.pending.pop(message.get("id"), None)
                if slot is not None:
                    slot[1] = message
                    slot[0].set()
        except (EOFError, OSError, ValueError) as exc:
            self.fail(f"the sandbox server stopped ({exc})")

    def fail(self, reason: str) -> None:
        with self.lock:
            self.dead = self.dead or reason
            slots, self.pending = list(self.pending.values()), {}
        self.ready.set()
        for slot in slots:
            slot[0].set()

    def submit(self, request_id: int, args: list, timeout: float) -> list:
        slot = [threading.Event(), None]
        with self.lock:
            if self.dead:
                raise SandboxError(self.dead)
            self.pending[request_id] = slot
        try:
            with self.send_lock:
                self.sock.sendall(_frame({"op": "call", "id": request_id, "args": args, "timeout": timeout}))
        except OSError as exc:
            self.fail(f"the sandbox server stopped ({exc})")
        return slot

    def kill(self) -> None:
        self.fail("the sandbox server was stopped")
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass


class Sandbox:
    """Runs ``fn(*args)`` in a fresh isolated process per call, under a wall-clock bound.

    Thread-safe: up to ``parallel`` calls from different threads run at once (one child each).

    Args:
        fn: ``"module:function"``; imported in the server, run in each call's child. Arguments and result are JSON
            values (str, int, float, bool, None, lists, dicts with string keys).
        warmup: Optional trusted ``"module:function"`` the server runs once before it reports ready (heavy
            imports), so each call starts warm.
        isolation: ``"namespaces"`` (default; see the module docstring) or ``"process"`` (weaker, opt-in).
        parallel: Calls that may run at once.
        memory_mb: Address-space limit of each process of a call (and, with a memory cgroup, of the call).
        cpu_limit_s: CPU seconds per process of a call (a backstop; the wall-clock timeout comes first).
        max_processes: Processes (threads count too) a call may have.
        scratch_mb: Size of a call's scratch directory (tmpfs), and the largest file it may write.
        max_files: Inodes of the scratch directory.
        max_reply_bytes: Largest reply accepted; a larger one is an error.
        startup_timeout: Seconds :meth:`wait_ready` waits for the server by default (warm-up included).
    """

    def __init__(self, fn: str, *, warmup: str | None = None, isolation: str = "namespaces", parallel: int = 1,
                 memory_mb: int = 1024, cpu_limit_s: float = 10.0, max_processes: int = 32, scratch_mb: int = 64,
                 max_files: int = 512, max_reply_bytes: int = 1 << 20, startup_timeout: float = 60.0,
                 _test_fail_step: str | None = None) -> None:
        for name, ref in (("fn", fn), ("warmup", warmup)):
            if ref is not None and (not isinstance(ref, str) or ref.count(":") != 1):
                raise ValueError(f"Sandbox {name} must be a 'module:function' string, got {ref!r}.")
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"Sandbox isolation must be one of {ISOLATION_MODES}, got {isolation!r}.")
        numbers = dict(parallel=parallel, memory_mb=memory_mb, cpu_limit_s=cpu_limit_s, max_processes=max_processes,
                       scratch_mb=scratch_mb, max_files=max_files, max_reply_bytes=max_reply_bytes)
        bad = [k for k, v in numbers.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0]
        if bad or memory_mb < 64 or max_processes < 2:
            raise ValueError(f"Sandbox limits must be positive numbers (memory_mb >= 64, max_processes >= 2); "
                             f"check {bad or ['memory_mb', 'max_processes']}.")
        self.fn, self.warmup, self.requested_isolation = fn, warmup, isolation
        self.parallel, self.startup_timeout = int(parallel), float(startup_timeout)
        self.max_reply_bytes = int(max_reply_bytes)
        self._limits = {"memory_mb": int(memory_mb), "cpu_limit_s": float(cpu_limit_s),
                        "max_processes": int(max_processes), "scratch_mb": int(scratch_mb),
                        "max_files": int(max_files)}
        self._fail_step = _test_fail_step
        self._slots = threading.BoundedSemaphore(self.parallel)
        self._lock = threading.RLock()
        self._server: _Server | None = None
        self._ids = itertools.count()
        self._owner_pid = os.getpid()
        self.starts = 0  # servers started, the first one included

    @property
    def pid(self) -> int | None:
        """Process id of the current server, or None."""
        server = self._server
        return server.proc.pid if server is not None else None

    @property
    def isolation(self) -> str | None:
        """The isolation the running server got ("namespaces" or "process"), or None before it is ready."""
        server = self._server
        info = server.info if server is not None else None
        return info.get("isolation") if info and info.get("type") == "ready" else None

    def start(self) -> None:
        """Starts a server if none is alive; does not wait for it (see :meth:`wait_ready`)."""
        with self._lock:
            self._forget_if_forked()
            if self._server is not None and self._server.proc.poll() is None and not self._server.dead:
                return
            self._discard()
            ours, theirs = socket.socketpair()
            try:
                env = {k: os.environ[k] for k in CALL_ENVIRONMENT if k in os.environ}
                proc = _Launcher.popen([sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno())],
                                       pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                                       stdout=subprocess.DEVNULL)  # stderr stays: a crash leaves a traceback
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            config = {"sys_path": list(sys.path), "parent_pid": os.getpid(), "fn": self.fn, "warmup": self.warmup,
                      "isolation": self.requested_isolation, "parallel": self.parallel, "limits": self._limits,
                      "max_reply_bytes": self.max_reply_bytes, "fail_step": self._fail_step,
                      # (the probe takes at most half the start-up budget)
                      "probe_timeout": min(30.0, self.startup_timeout / 2)}
            self._server = _Server(proc, ours, self.max_reply_bytes + 65536)
            self.starts += 1
            try:
                ours.sendall(_frame(config))
            except OSError as exc:
                self._server.fail(f"the sandbox server died at start ({exc})")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Starts the server if needed and waits up to ``timeout`` s (default ``startup_timeout``) for it.

        Returns:
            True when it takes calls; False when it is still starting.

        Raises:
            SandboxUnavailable: The isolation cannot be had here (the message names the step and the way out).
            SandboxError: The server died while starting.
        """
        self.start()
        server = self._server
        if not server.ready.wait(self.startup_timeout if timeout is None else max(timeout, 0.0)):
            return False
        info = server.info or {}
        if info.get("type") == "unavailable":
            self._discard()
            mode = self.requested_isolation
            hint = (" Fix the kernel setting (e.g. allow unprivileged user namespaces: kernel.apparmor_restrict_"
                    "unprivileged_userns=0 or kernel.unprivileged_userns_clone=1), or opt into the weaker "
                    "isolation='process' (see the sandbox documentation for what it does not guarantee)."
                    if mode == "namespaces" else "")
            raise SandboxUnavailable(f"sandbox isolation {mode!r} is not available on this machine: step "
                                     f"{info.get('step')!r} failed: {info.get('error')}.{hint}")
        if info.get("type") == "slow":
            self._discard()
            raise SandboxError(f"the sandbox's start-up probe (one isolated call that does nothing) did not answer "
                               f"within {info.get('seconds', 0):.0f} s: the machine is overloaded or the isolation "
                               "hangs here. Nothing runs unisolated; retry when the machine is less busy.")
        if server.dead or info.get("type") != "ready":
            self._discard()
            raise SandboxError(server.dead or "the sandbox server sent no ready message")
        if info.get("isolation") == "process" and not getattr(server, "warned", False):
            server.warned = True
            logger.warning(_PROCESS_MODE_WARNING)
        if not info.get("memory_cgroup") and not _NO_CGROUP_WARNED[0]:
            _NO_CGROUP_WARNED[0] = True
            mb, n = self._limits["memory_mb"], self._limits["max_processes"]
            logger.warning(
                "Sandbox: no writable memory cgroup here (a container without cgroup delegation, or a read-only "
                "/sys/fs/cgroup), so a call's memory is bounded per process, not per call: each process gets "
                "memory_mb=%d MB of address space (RLIMIT_AS), and a call may run up to max_processes=%d of them "
                "(up to %d MB together). Lower max_processes for a tighter bound, or run the job where the "
                "cgroup hierarchy is writable (systemd-run --user --scope -p Delegate=yes, or a container with "
                "cgroupns=private and a writable cgroup mount).", mb, n, mb * n)
        return True

    def call(self, *args: Any, timeout: float, wait_s: float | None = None) -> Any:
        """Runs ``fn(*args)`` in a fresh isolated child and returns its JSON result.

        Args:
            *args: JSON values for ``fn``.
            timeout: Wall-clock budget in seconds; without ``wait_s``, waiting for a free slot or a starting server
                included (a batch's budget), with it the call's own run only (one call's bound, which another
                call's slow code must not use up).
            wait_s: Seconds the call may wait for a free slot and a ready server before it starts
                (:class:`SandboxBusy` past them); None: within ``timeout``.

        Raises:
            SandboxTimeout: No result in time (the call's processes were killed).
            SandboxError: ``fn`` raised (the message is the exception's type), the call crashed, hit a limit,
                failed an isolation step, or replied something malformed.
            SandboxUnavailable: The isolation cannot be had here.
            TypeError: The arguments are not JSON values.
        """
        try:
            json.dumps(list(args), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"Sandbox arguments must be JSON values (str, numbers, bool, None, lists, dicts): {exc}")
        wait = timeout if wait_s is None else wait_s
        started = time.monotonic()
        if not self._slots.acquire(timeout=max(wait, 0.0)):
            raise SandboxBusy(f"all {self.parallel} sandbox slots stayed busy for {wait:.2f} s")
        try:
            if not self.wait_ready(started + wait - time.monotonic()):
                raise SandboxBusy("the sandbox server is still starting")
            deadline = (started if wait_s is None else time.monotonic()) + timeout
            return self._call_ready(list(args), deadline)
        finally:
            self._slots.release()

    def _call_ready(self, args: list, deadline: float) -> Any:
        server = self._server
        remaining = deadline - time.monotonic()
        if remaining < 0.01 or server is None:
            raise SandboxTimeout("no time left to send the call")
        slot = server.submit(next(self._ids), args, remaining)
        if not slot[0].wait(remaining + _GRACE_S):
            with self._lock:
                if self._server is server:
                    self._discard()  # stuck: kill and replace; the next call starts a new one
            raise SandboxTimeout("the sandbox server did not answer in time; it was replaced")
        reply = slot[1]
        if reply is None:
            raise SandboxError(server.dead or "the sandbox server stopped")
        return _checked_result(reply)

    def close(self) -> None:
        """Stops the server (its running calls are killed)."""
        with self._lock:
            self._forget_if_forked()
            server = self._server
            if server is not None and server.proc.poll() is None and not server.dead:
                try:
                    with server.send_lock:
                        server.sock.sendall(_frame({"op": "close"}))
                    server.proc.wait(2.0)
                except (OSError, subprocess.TimeoutExpired):
                    pass
            self._discard()

    def _forget_if_forked(self) -> None:
        """In a forked copy of the owning process, drops (without killing) the owner's server."""
        if self._owner_pid != os.getpid():
            self._server, self._owner_pid = None, os.getpid()

    def _discard(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.kill()


def _checked_result(reply: Any) -> Any:
    """The value of a reply frame, after checking its shape; raises for anything but success."""
    if not isinstance(reply, dict) or not isinstance(reply.get("status"), str):
        raise SandboxError("malformed reply from the sandbox server")
    status = reply["status"]
    if status == "ok":
        return reply.get("value")
    if status == "timeout":
        raise SandboxTimeout("the call ran past its deadline; its processes were killed")
    detail = str(reply.get("error", ""))[:500]
    if status == "isolation":
        raise SandboxError(f"isolation step {str(reply.get('step'))[:100]!r} failed ({detail}); the code did not run")
    raise SandboxError(detail or f"unknown reply status {status[:50]!r}")
