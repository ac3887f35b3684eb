"""`python_sandbox`: a tool that runs model-written Python in a sandboxed process.

The code is model output, so it never runs in the generator's process. Each call runs in a fresh process of
:class:`hfllamarl.sandbox.client.Sandbox` (fresh globals, fresh scratch directory, nothing left from other calls or
rollouts) under these bounds:

- time: `timeout_s` of wall clock per call, counted from when it starts (the wait for a free worker has its own
  bound, `wait_s`); at the deadline the call's whole process tree is killed;
- memory: an address-space limit (`memory_mb`), so a huge allocation raises `MemoryError`;
- isolation `"namespaces"` (default): its own user, mount, network, pid and IPC namespaces; a read-only file system
  but a 64 MiB tmpfs scratch directory (its working directory, removed after the call); no network at all; at most
  32 processes. Where the kernel refuses namespaces the tool refuses to start and says why, unless `isolation=
  "process"` is chosen (weaker, logged loudly at start). `network_isolation()` reports the mode in force.
- It is not a read jail: code can read what the job's user (or uid 65534) can read.

What the code prints (stdout and stderr, at most `max_output_chars`) is the tool's result, with the traceback's last
line when the code raises.
"""

from __future__ import annotations

import threading

from hfllamarl.sandbox import Sandbox, SandboxBusy, SandboxError, SandboxTimeout


def _execute(code: str, max_chars: int) -> str:
    """Runs in a sandboxed child: `code` with fresh globals; returns what it printed (and its error)."""
    import contextlib
    import io
    import traceback

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are output too
            lines = traceback.format_exception_only(type(exc), exc)
            out.write(lines[-1] if lines else type(exc).__name__)
    return _cut(out.getvalue(), max_chars)


class PythonSandbox:
    """An environment with one tool, `python`; the sandbox server is shared by every instance of a job.

    Args:
        timeout_s: wall-clock bound of one call's own run (keep it under the job's `tool_call_timeout_s`): the wait
            for a free worker, behind other rollouts' calls, is not counted in it.
        wait_s: how long a call may wait for a free worker before it fails with an error saying so (default 60 s).
        memory_mb: address-space limit of each process of a call.
        max_output_chars: longer output is cut.
        workers: calls that may run at once.
        isolation: "namespaces" (default) or the weaker, opt-in "process" (see the module docstring).
    """

    _sandboxes: dict[tuple, Sandbox] = {}
    _lock = threading.Lock()

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_chars: int = 2000,
                 workers: int = 2, isolation: str = "namespaces", wait_s: float = 60.0):
        if not timeout_s > 0 or memory_mb < 64 or workers < 1 or not wait_s > 0:
            raise ValueError("PythonSandbox needs timeout_s > 0, memory_mb >= 64, workers >= 1 and wait_s > 0.")
        if isolation not in ("namespaces", "process"):
            raise ValueError(f"PythonSandbox isolation must be 'namespaces' or 'process', got {isolation!r}.")
        self.timeout_s, self.max_output_chars, self.wait_s = float(timeout_s), int(max_output_chars), float(wait_s)
        self._key = (int(memory_mb), int(workers), max(1.0, 2 * float(timeout_s)), isolation)
        # Refuse here, where the job builds its environments at start-up, rather than turn every call into an
        # error the model reads: SandboxUnavailable names the step the kernel refused and the opt-in way out.
        sandbox = self._sandbox()
        if not sandbox.wait_ready(sandbox.startup_timeout):
            raise RuntimeError(f"the python sandbox did not start within {sandbox.startup_timeout:g} s")

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
        try:
            out = self._sandbox().call(code, self.max_output_chars, timeout=self.timeout_s, wait_s=self.wait_s)
        except SandboxBusy:
            raise TimeoutError(f"no sandbox worker came free within {self.wait_s:g} s; the code did not run") from None
        except SandboxTimeout:
            raise TimeoutError(f"the code ran longer than {self.timeout_s:g} s and was stopped") from None
        except SandboxError as exc:
            raise RuntimeError(f"the sandbox failed: {exc}") from None
        if not isinstance(out, str):
            raise RuntimeError("the sandbox failed: its reply is not text")
        return out if len(out) <= self.max_output_chars + 64 else _cut(out, self.max_output_chars)  # forged reply

    def network_isolation(self) -> str:
        """The isolation in force: 'namespaces' (no network at all) or 'process' (Python's socket module disabled)."""
        sandbox = self._sandbox()
        if not sandbox.wait_ready(sandbox.startup_timeout):
            raise RuntimeError("the python sandbox did not start in time")
        return sandbox.isolation

    def _sandbox(self) -> Sandbox:
        with PythonSandbox._lock:
            sandbox = PythonSandbox._sandboxes.get(self._key)
            if sandbox is None:
                memory_mb, workers, cpu_s, isolation = self._key
                sandbox = Sandbox(f"{__name__}:_execute", isolation=isolation, parallel=workers,
                                  memory_mb=memory_mb, cpu_limit_s=cpu_s, startup_timeout=60.0)
                PythonSandbox._sandboxes[self._key] = sandbox
            return sandbox


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + f"\n... ({len(text) - max_chars} more characters)"


def run_python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints.

    Args:
        code: The Python program; print the values you need.
    """
    if not _DEFAULT:  # built at the first call, not at import: building one starts the sandbox server
        box = PythonSandbox()  # two threads may both build one: they share the same server
        with PythonSandbox._lock:
            if not _DEFAULT:
                _DEFAULT.append(box)
    return _DEFAULT[0].python(code)


_DEFAULT: list = []
