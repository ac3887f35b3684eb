"""`python_sandbox`: a tool that runs model-written Python in a sandboxed process.

The code is model output, so it never runs in the generator's process. It runs in a child process of
the reward sandbox (`hfllamarl.plugins.rewards._sandbox.SandboxWorker`: a fresh interpreter, killed and
replaced when it overruns) under these bounds:

- time: `timeout_s` of wall clock per call (a soft deadline inside the child, then a kill), and a CPU-time
  limit per call;
- memory: an address-space limit (`memory_mb`), so a huge allocation raises `MemoryError`;
- network: the child moves itself into new user and network namespaces before it takes any code (no
  interface but a down loopback: every connection fails). Where the kernel refuses namespaces, Python's
  `socket` module is disabled instead (weaker: C extensions could still open sockets) and
  `network_isolation()` says so;
- files: the child works in a scratch directory of its own and may write at most 16 MiB per file. It is
  not a file-system jail: code can read what the user running the job can read.

Each call starts from fresh globals; what it prints (stdout and stderr, at most `max_output_chars`) is the
tool's result, with the traceback's last line when the code raises.
"""

from __future__ import annotations

import queue
import threading

from hfllamarl.plugins.rewards._sandbox import SandboxError, SandboxTimeout, SandboxWorker

_FILE_SIZE_LIMIT = 16 << 20
_STATE = {"network": "not isolated"}  # in the child: how the network was cut


def _isolate() -> None:
    """Runs once in the sandbox child, before any code: cut the network, move to a scratch directory."""
    import ctypes
    import os
    import resource
    import tempfile

    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000 | 0x40000000) == 0:  # CLONE_NEWUSER | CLONE_NEWNET
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            try:
                with open(f"/proc/self/{name}", "w") as fh:
                    fh.write(text)
            except OSError:
                pass  # unmapped ids only change how files are owned in the scratch directory
        _STATE["network"] = "namespace"
    else:
        import socket

        def refuse(*args, **kwargs):
            raise OSError("network access is disabled in the python sandbox")

        for name in ("socket", "create_connection", "socketpair", "fromfd", "getaddrinfo"):
            setattr(socket, name, refuse)
        _STATE["network"] = "socket module disabled"
    os.chdir(tempfile.mkdtemp(prefix="hfllamarl-python-"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_LIMIT, _FILE_SIZE_LIMIT))


def _execute(code: str, max_chars: int) -> str:
    """Runs in the sandbox child: `code` with fresh globals; returns what it printed (and its error)."""
    import contextlib
    import io
    import traceback

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except BaseException as exc:  # the child's soft deadline is re-raised by the worker loop
            if type(exc).__name__ == "_SoftTimeout":
                raise
            lines = traceback.format_exception_only(type(exc), exc)
            out.write(lines[-1] if lines else type(exc).__name__)
    text = out.getvalue()
    return text if len(text) <= max_chars else text[:max_chars] + f"\n... ({len(text) - max_chars} more characters)"


class PythonSandbox:
    """An environment with one tool, `python`; the sandbox processes are shared by every instance of a job.

    Args:
        timeout_s: wall-clock bound of one call (keep it under the job's `tool_call_timeout_s`).
        memory_mb: address-space limit of the sandbox process.
        max_output_chars: longer output is cut.
        workers: sandbox processes, so that a call stuck until its timeout does not hold up the others.
    """

    _pools: dict[tuple, queue.Queue] = {}
    _lock = threading.Lock()

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_chars: int = 2000,
                 workers: int = 2):
        if not timeout_s > 0 or memory_mb < 64 or workers < 1:
            raise ValueError("PythonSandbox needs timeout_s > 0, memory_mb >= 64 and workers >= 1.")
        self.timeout_s, self.max_output_chars = float(timeout_s), int(max_output_chars)
        self._key = (int(memory_mb), int(workers), max(1.0, 2 * float(timeout_s)))

    def reset(self, **row) -> None:
        """Called before each rollout with the dataset row; adds nothing to the prompt."""
        return None

    def python(self, code: str) -> str:
        """Run Python code in a sandbox and return what it prints.

        Args:
            code: The Python program; print the values you need.
        """
        if not isinstance(code, str):
            raise ValueError(f"code must be a string, got {type(code).__name__}")
        pool = self._pool()
        worker = pool.get()
        try:
            return worker.call(("run", code, self.max_output_chars), timeout=self.timeout_s)
        except SandboxTimeout:
            raise TimeoutError(f"the code ran longer than {self.timeout_s:g} s and was stopped") from None
        except SandboxError as exc:
            raise RuntimeError(f"the sandbox failed: {exc}") from None
        finally:
            pool.put(worker)

    def network_isolation(self) -> str:
        """How the sandbox cuts the network: 'namespace', or 'socket module disabled' where namespaces are refused."""
        pool = self._pool()
        worker = pool.get()
        try:
            return worker.call(("state",), timeout=60.0)
        finally:
            pool.put(worker)

    def _pool(self) -> queue.Queue:
        with PythonSandbox._lock:
            pool = PythonSandbox._pools.get(self._key)
            if pool is None:
                memory_mb, workers, cpu_s = self._key
                pool = queue.Queue()
                for _ in range(workers):
                    pool.put(SandboxWorker(_dispatch, warmup=_isolate, cpu_limit_s=cpu_s,
                                           memory_limit_bytes=memory_mb << 20, startup_timeout=60.0))
                PythonSandbox._pools[self._key] = pool
            return pool


def _dispatch(request: tuple):
    """The sandbox worker's one function: ("run", code, max_chars), or ("state",) for the network isolation."""
    if request[0] == "state":
        return _STATE["network"]
    return _execute(*request[1:])


def run_python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints.

    Args:
        code: The Python program; print the values you need.
    """
    return _DEFAULT.python(code)


_DEFAULT = PythonSandbox()
