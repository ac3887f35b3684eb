"""The sandbox server: one per :class:`~.client.Sandbox`, a fresh interpreter that forks one isolated child per call.

It imports the call's function and runs the (trusted) warm-up once, so every child starts from that clean state and
nothing a call does (to ``builtins``, a module, a file) reaches the next one. It never runs model code itself and is
not dumpable. Requests and replies travel as length-prefixed JSON frames over its socket to the parent; each child's
reply comes as one frame on a pipe, read up to a cap and parsed with ``json.loads`` only.

One thread, one ``select`` loop: the parent's socket, each call's reply pipe and a pidfd of each call's child, and
the nearest deadline. At a call's deadline the server kills the call's pid namespace (SIGKILL to its PID 1 by host
pid; the kernel kills the rest), waits for the child to be reaped, removes its scratch directory and cgroups, then
answers "timeout". It exits, killing its children, when the parent's socket closes or the parent pid changes.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import shutil
import signal
import socket
import tempfile
import time
from typing import Any, Callable

from hfllamarl.sandbox import jail

POLL_S = 0.5  # how often the server checks that its parent is still there
KILL_GRACE_S = 2.0  # after a kill, how long before the server answers without waiting for the reap


def resolve(ref: str | None) -> Callable | None:
    """The function a ``"module:function"`` reference names."""
    if ref is None:
        return None
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def send_frame(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj, allow_nan=False).encode()
    sock.sendall(len(data).to_bytes(4, "big") + data)


_MEMORY_ENFORCED: dict[tuple, bool] = {}  # cgroup bases -> whether a memory limit there is enforced


class _Cgroups:
    """Per-call pids and memory cgroups where the hierarchy is writable (best effort; v1 or v2)."""

    def __init__(self, server_pid: int):
        self.prefix = f"hfllamarl-sandbox-{server_pid}"
        self.bases: list[tuple[str, str]] = []  # (directory, kind)
        try:
            lines = open("/proc/self/cgroup").read().splitlines()
        except OSError:
            return
        own = {}
        for line in lines:
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else ["unified"]:
                own[name] = path
        if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # a pure v2 host
            self.bases.append((os.path.join("/sys/fs/cgroup", own.get("unified", "/").lstrip("/")), "v2"))
        else:
            for kind in ("pids", "memory"):
                if kind in own:
                    self.bases.append((os.path.join("/sys/fs/cgroup", kind, own[kind].lstrip("/")), kind))

    def create(self, call_id: int, max_processes: int, memory_bytes: int) -> list[str]:
        """Creates and limits the call's cgroups; returns those that worked."""
        made = []
        for base, kind in self.bases:
            path = os.path.join(base, f"{self.prefix}-{call_id}")
            files = {"pids": {"pids.max": max_processes}, "memory": {"memory.limit_in_bytes": memory_bytes},
                     "v2": {"pids.max": max_processes, "memory.max": memory_bytes}}[kind]
            try:
                os.mkdir(path)
                for name, value in files.items():
                    with open(os.path.join(path, name), "w") as fh:
                        fh.write(str(value))
                made.append(path)
            except OSError:
                self.remove(path)
        return made

    def enforces_memory(self) -> bool:
        """Whether a memory cgroup made here really bounds its processes: a child in one limited to 16 MB fills
        64 MB; the kernel kills it where the limit is enforced (some container runtimes accept the limit and
        enforce nothing). Probed once per process and hierarchy: a server started again reads the answer."""
        key = tuple(self.bases)
        if key not in _MEMORY_ENFORCED:
            _MEMORY_ENFORCED[key] = self._probe_memory()
        return _MEMORY_ENFORCED[key]

    def _probe_memory(self) -> bool:
        paths = self.create(-1, 4, 16 << 20)
        memory = [p for p in paths if os.path.exists(os.path.join(p, "memory.max"))
                  or os.path.exists(os.path.join(p, "memory.limit_in_bytes"))]
        try:
            if not memory:
                return False
            pid = os.fork()
            if pid == 0:  # the probe: join (4: could not), fill (3: refused, the limit working), 0: nothing stopped it
                try:
                    for path in memory:
                        with open(os.path.join(path, "cgroup.procs"), "w") as fh:
                            fh.write(str(os.getpid()))
                except BaseException:  # noqa: BLE001
                    os._exit(4)
                try:
                    block = bytearray(b"x" * (64 << 20))
                    os._exit(0 if block else 1)
                except BaseException:  # noqa: BLE001 - a MemoryError is the limit working too
                    os._exit(3)
            _, status = os.waitpid(pid, 0)
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
            return code not in (0, 4)
        finally:
            for path in paths:
                self.kill_all(path)
                self.remove(path)

    @staticmethod
    def kill_all(path: str) -> None:
        for _ in range(20):
            try:
                pids = [int(p) for p in open(os.path.join(path, "cgroup.procs")).read().split()]
            except (OSError, ValueError):
                return
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.005)

    @staticmethod
    def remove(path: str) -> bool:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False


class _Call:
    """One call in flight: its child, reply pipe, deadline and scratch directory."""

    def __init__(self, request_id: Any, pid: int, reply_fd: int, deadline: float, scratch: str, cgroups: list):
        self.id, self.pid, self.reply_fd, self.deadline = request_id, pid, reply_fd, deadline
        self.scratch, self.cgroups = scratch, cgroups
        self.pidfd = os.pidfd_open(pid)
        self.buf = bytearray()
        self.verdict: dict | None = None  # set when the call was killed (timeout, reply too large)
        self.killed_at: float | None = None


class Server:
    """The select loop; see the module docstring."""

    def __init__(self, sock: socket.socket, config: dict):
        self.sock, self.config = sock, config
        self.parent_pid = config["parent_pid"]
        self.fn = resolve(config["fn"])
        self.limits = config["limits"]
        self.isolation = config["isolation"]
        self.reply_cap = int(config["max_reply_bytes"])
        sweep_stale_bases()
        # (its real path: the call rebuilds it below the host directories it covers, where a symlink may not exist)
        self.base = os.path.realpath(tempfile.mkdtemp(prefix=f"hfllamarl-sandbox-{os.getpid()}-"))
        os.chmod(self.base, 0o711)  # uid 65534 must reach its scratch directory below
        self.cgroups = _Cgroups(os.getpid())
        self.hidden: dict[str, list[str]] = {}
        if self.isolation == "namespaces" and jail.runs_as_root():
            import sys

            # (the scratch directories too: a TMPDIR under a private directory, e.g. a SLURM job's or root's home)
            self.hidden = jail.hidden_paths([*sys.path, sys.prefix, sys.base_prefix, sys.exec_prefix,
                                             sys.base_exec_prefix, self.base])
        self.covered: dict[str, list[str]] = {}
        if self.isolation == "namespaces":
            import pwd
            import sys

            kept = [os.path.abspath(p or os.curdir) for p in sys.path]
            kept += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                     os.path.dirname(os.path.realpath(sys.executable))]
            try:
                home = (pwd.getpwuid(os.getuid()).pw_dir,)
            except KeyError:  # (a uid without a passwd entry, as in some containers)
                home = ()
            self.covered = jail.covered_dirs(kept, extra=home)
        self.calls: dict[int, _Call] = {}  # by reply fd
        self.queue: list[tuple[Any, list, float]] = []  # requests waiting for a free slot
        self.inbox = bytearray()
        self.counter = 0
        self.closing = False

    # ------------------------------------------------------------------ calls
    def fork_call(self, request_id: Any, args: list, timeout: float, fn: Callable | None, fail: str | None) -> None:
        self.counter += 1
        scratch = os.path.join(self.base, f"call-{self.counter}")
        os.mkdir(scratch, 0o700)
        if self.isolation == "process" and jail.runs_as_root():
            os.chown(scratch, jail.NOBODY, jail.NOBODY)
        lim = self.limits
        memory = (lim["memory_mb"] + lim["scratch_mb"] + 64) << 20
        cgroups = self.cgroups.create(self.counter, lim["max_processes"] + 2, memory)
        job = {**lim, "scratch": scratch, "cgroups": cgroups, "isolation": self.isolation, "fail_step": fail,
               "server_pid": os.getpid(), "parallel": self.config["parallel"], "hidden": self.hidden,
               "covered": self.covered}
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_fd)
                jail.child_main(fn, args, write_fd, job)
            finally:
                os._exit(jail.EXIT_ISOLATION)
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        call = _Call(request_id, pid, read_fd, time.monotonic() + timeout, scratch, cgroups)
        self.calls[read_fd] = call

    def kill(self, call: _Call, verdict: dict) -> None:
        """Kills the call's whole tree; the answer goes out once the child is reaped."""
        if call.killed_at is not None:
            return
        call.verdict, call.killed_at = verdict, time.monotonic()
        self.kill_tree(call)

    @staticmethod
    def kill_tree(call: _Call) -> None:
        """SIGKILL to the child, its namespace's PID 1, its session and its cgroups (the child is not yet reaped,
        so its pid, and so its session id, cannot have been reused)."""
        try:  # PID 1 of the call's namespace, by host pid: the kernel then kills everything in it
            children = open(f"/proc/{call.pid}/task/{call.pid}/children").read().split()
        except OSError:
            children = []
        for pid in [*map(int, children), call.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.killpg(call.pid, signal.SIGKILL)  # process mode: the session the child started
        except OSError:
            pass
        for path in call.cgroups:
            _Cgroups.kill_all(path)

    def read_reply(self, call: _Call) -> None:
        try:
            while True:
                chunk = os.read(call.reply_fd, 65536)
                if not chunk:
                    return
                call.buf += chunk
                if len(call.buf) > self.reply_cap + 4:
                    self.kill(call, {"status": "error", "error": f"reply larger than {self.reply_cap} bytes"})
                    call.buf = bytearray()
                    return
        except BlockingIOError:
            return
        except OSError:
            return

    def parse_reply(self, call: _Call, exit_code: int) -> dict:
        """The child's one frame, checked; or an error saying why there is none."""
        buf = call.buf
        if len(buf) >= 4:
            size = int.from_bytes(buf[:4], "big")
            if size <= self.reply_cap and len(buf) == 4 + size:
                try:
                    frame = json.loads(bytes(buf[4:]).decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    frame = None
                if isinstance(frame, dict) and frame.get("status") in ("ok", "error", "isolation"):
                    return frame
            return {"status": "error", "error": "malformed reply from the sandboxed call"}
        if exit_code >= 128:
            return {"status": "error", "error": f"the call was killed by signal {exit_code - 128} without a reply "
                                                "(memory, CPU-time or process limit?)"}
        return {"status": "error", "error": f"the call exited with status {exit_code} without a reply"}

    def finish(self, call: _Call) -> dict:
        """Reaps the child, cleans up, and returns the answer frame for the parent."""
        if self.isolation == "process" or call.cgroups:
            self.kill_tree(call)  # leftovers of process mode (its session, its cgroup)
        try:
            _, status = os.waitpid(call.pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            code = -1
        code = code if code >= 0 else 128 - code
        self.read_reply(call)
        os.close(call.reply_fd)
        os.close(call.pidfd)
        del self.calls[call.reply_fd]
        answer = dict(call.verdict) if call.verdict else self.parse_reply(call, code)
        for path in call.cgroups:
            _Cgroups.kill_all(path)
            for _ in range(50):
                if _Cgroups.remove(path):
                    break
                time.sleep(0.002)
        shutil.rmtree(call.scratch, ignore_errors=True)
        answer["id"] = call.id
        return answer

    # ------------------------------------------------------------------ loop
    def run_one(self, fn: Callable | None, timeout: float, fail: str | None) -> dict:
        """Runs one call synchronously (the start-up probe)."""
        self.fork_call("probe", [], timeout, fn, fail)
        while True:
            done = self.step(accept_requests=False)
            for answer in done:
                if answer["id"] == "probe":
                    return answer

    def step(self, accept_requests: bool = True) -> list[dict]:
        """One turn of the loop; returns the answers of the calls that ended."""
        now = time.monotonic()
        wait = POLL_S
        for call in self.calls.values():
            end = call.deadline if call.killed_at is None else call.killed_at + KILL_GRACE_S
            wait = min(wait, max(0.0, end - now))
        watched = [self.sock] if accept_requests else []
        watched += [c.reply_fd for c in self.calls.values()] + [c.pidfd for c in self.calls.values()]
        readable, _, _ = select.select(watched, [], [], wait)
        done = []
        by_pidfd = {c.pidfd: c for c in self.calls.values()}
        for fd in readable:
            if fd is self.sock:
                self.receive()
            elif fd in self.calls:
                self.read_reply(self.calls[fd])
        for fd in readable:
            if fd in by_pidfd and by_pidfd[fd].reply_fd in self.calls:
                done.append(self.finish(by_pidfd[fd]))
        now = time.monotonic()
        for call in list(self.calls.values()):
            if call.killed_at is None and now >= call.deadline:
                self.kill(call, {"status": "timeout"})
            elif call.killed_at is not None and now >= call.killed_at + KILL_GRACE_S:
                os.kill(call.pid, signal.SIGKILL)  # the reap then cannot block for long
                done.append(self.finish(call))
        return done

    def receive(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self.closing = True
            return
        self.inbox += data
        while len(self.inbox) >= 4:
            size = int.from_bytes(self.inbox[:4], "big")
            if len(self.inbox) < 4 + size:
                break
            request = json.loads(bytes(self.inbox[4:4 + size]).decode())
            del self.inbox[:4 + size]
            if request.get("op") == "close":
                self.closing = True
            else:
                self.queue.append((request["id"], request["args"], time.monotonic() + float(request["timeout"])))

    def start_queued(self) -> None:
        while self.queue and len(self.calls) < self.config["parallel"]:
            request_id, args, deadline = self.queue.pop(0)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                send_frame(self.sock, {"id": request_id, "status": "timeout"})
                continue
            self.fork_call(request_id, args, remaining, self.fn, self.config.get("fail_step"))

    def serve(self) -> None:
        while not self.closing and os.getppid() == self.parent_pid:
            self.start_queued()
            for answer in self.step():
                send_frame(self.sock, answer)

    def shutdown(self) -> None:
        for call in list(self.calls.values()):
            self.kill(call, {"status": "error", "error": "the sandbox is shutting down"})
        for call in list(self.calls.values()):
            self.finish(call)
        shutil.rmtree(self.base, ignore_errors=True)


def sweep_stale_bases() -> None:
    """Removes the scratch bases of this user's sandbox servers that are gone (killed with SIGKILL, which leaves no
    time to clean): each base is named after its server's pid."""
    from hfllamarl.runtime.world.processes import sweep_dead_owners

    sweep_dead_owners("hfllamarl-sandbox-")


_STOPPING = [False]


def _terminate(signum, frame) -> None:
    if not _STOPPING[0]:  # (once: a second SIGTERM must not cut the clean-up short)
        _STOPPING[0] = True
        raise SystemExit(0)  # (main's `finally` kills the calls and removes the scratch base)


def main(sock: socket.socket, config: dict) -> None:
    """The server process: warm up, probe the isolation with a real child, report, serve."""
    libc = ctypes.CDLL(None, use_errno=True)
    signal.signal(signal.SIGTERM, _terminate)  # the parent's death (below) or a kill: clean up, then exit
    libc.prctl(jail.PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != config["parent_pid"]:
        return
    libc.prctl(jail.PR_SET_DUMPABLE, 0, 0, 0, 0)  # calls run as another uid: they must not ptrace or read us
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    server = Server(sock, config)
    try:
        warmup_error = None
        try:
            warmup = resolve(config["warmup"])
            if warmup is not None:
                warmup()
        except Exception as exc:  # noqa: BLE001 - a failed warm-up only makes calls slower
            warmup_error = f"{type(exc).__name__}: {exc}"
        fail = config.get("fail_step")
        probe_s = float(config.get("probe_timeout", 30.0))  # the start-up probe: one isolated call doing nothing
        probe = server.run_one(None, probe_s, None if fail and fail.startswith("call:") else fail)
        if fail and fail.startswith("call:"):
            server.config["fail_step"] = fail[len("call:"):]
        if probe.get("status") == "timeout":  # slow, not refused: the isolation itself is not known to fail
            send_frame(sock, {"type": "slow", "seconds": probe_s})
            return
        if probe.get("status") != "ok":
            send_frame(sock, {"type": "unavailable", "step": probe.get("step", "probe"),
                              "error": probe.get("error", "no reply")})
            return
        send_frame(sock, {"type": "ready", "pid": os.getpid(), "isolation": server.isolation,
                          "cgroups": [kind for _, kind in server.cgroups.bases], "warmup_error": warmup_error,
                          "memory_cgroup": server.cgroups.enforces_memory()})
        server.serve()
    finally:
        while True:  # (the parent's death both ends `serve` and sends SIGTERM: either may come first)
            try:
                _STOPPING[0] = True
                server.shutdown()
                break
            except SystemExit:
                continue
