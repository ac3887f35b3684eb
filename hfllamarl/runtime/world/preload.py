"""A preloaded process server: one process that has imported torch, transformers and vLLM forks generator ranks.

    python -m hfllamarl.runtime.world.preload_server --socket PATH --owner PID [--warm MODULE ...]   (the server)

Importing vLLM costs a core several seconds; every generator process of a single-process job pays it (ahead of
`train()`, `spawn.Prestarted`), and so does every multi-process test. The server pays it once: it imports the
modules named by `--warm` (each one's `warm()` is called; `hfllamarl.runtime.generation.generator_child` by
default), checks that no Python thread was started (forking a process with threads is unsafe: a lock held by another
thread stays held in the child forever; torch's import leaves two idle native threads, as it does wherever
`import torch` is followed by a fork), and listens on a private unix socket. On a request it forks a child that
runs a module as `python -m MODULE ARGS` (or a script as `python SCRIPT ARGS`) would, in milliseconds:

- its environment is the request's (applied to `os.environ` before the module runs), its working directory and
  cores the requester's, and torch's thread count is set again from them (OpenMP read its settings at import);
- its standard input, output and error are the requester's, passed as file descriptors (SCM_RIGHTS);
- it is put in the requester's process group (a Ctrl-C reaches it as it reaches a spawned child) and watches the
  requester (not the server, its parent) through a pidfd: `spawn.watch_parent` ends it when the trainer is gone;
- its pid, then its exit status, go back to the requester over the same connection, so that the requester holds
  a `Popen`-like handle (`PreloadedProcess`: pid, poll(), wait(), kill(), terminate()).

Its command line and environment read as a spawned child's (`ps`, psutil, /proc). This module is the client side
and the protocol; the server's own code is `preload_server`. Requests and answers are JSON lines; nothing is ever
unpickled. The socket's directory is the user's own (0700)
and the server serves only its own user (SO_PEERCRED). It exits when its owner process is gone.

Where it is used (`client()`): `HFLLAMARL_PRELOAD=PATH` names a running server (the test suite starts one per
session); `HFLLAMARL_PRELOAD=1` makes a single-process trainer start one of its own when it is built (where
`spawn.Prestarted` starts its children), reused by later trainers of the process and ended with it. Unset or
`0`: generator children are spawned as before. A server that cannot be reached or started, or is not safe to
fork (threads), falls back to spawning, logged once at debug level. Under a launcher (torchrun, accelerate) the
ranks are the launcher's and nothing is forked; on a platform without fork nothing is either.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

ENV_PRELOAD = "HFLLAMARL_PRELOAD"
DEFAULT_WARM = ("hfllamarl.runtime.generation.generator_child",)
_MAX_MSG = 1 << 20


# ------------------------------------------------------------------------------------------------ wire format
def _send(sock: socket.socket, obj: dict, fds=()) -> None:
    data = (json.dumps(obj) + "\n").encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


class _Lines:
    """JSON lines (and any file descriptors that came with them) read from one connection."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buf, self.fds = sock, b"", []

    def read(self, timeout: float | None) -> dict | None:
        """The next message, or None when the peer closed the connection; TimeoutError after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not select.select([self.sock], [], [], left)[0]:
                raise TimeoutError("no answer from the preload server")
            data, fds, _, _ = socket.recv_fds(self.sock, 65536, 8)
            self.fds.extend(fds)
            if not data:
                return None
            self.buf += data
            if len(self.buf) > _MAX_MSG:
                raise ValueError("preload: a message past 1 MiB")
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


# ------------------------------------------------------------------------------------------------ the server
def fingerprint() -> dict:
    """What code a process runs: its interpreter, the versions of the packages a generator uses, and the newest
    source file of this package (an edited checkout). A server whose fingerprint differs from its client's would
    fork children running other code than the job's: the client spawns them instead."""
    from importlib import metadata

    versions = {}
    for name in ("torch", "vllm", "transformers", "trl", "hfllamarl"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the hfllamarl package
    newest = 0.0
    for where, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                try:
                    newest = max(newest, os.stat(os.path.join(where, f)).st_mtime)
                except OSError:
                    pass
    return {"python": sys.executable, "prefix": sys.prefix, "versions": versions, "source": root,
            "source_mtime": newest}


ROOM = 768  # characters of command line a server reserves (`--room`) for its children's own (`retitle`)
ENV_ROOM = "HFLLAMARL_PRELOAD_ROOM"  # ... and of environment, for theirs (`show_environ`)
ENV_ROOM_SIZE = 32768


class PreloadedProcess:
    """A child forked by the server, held as a `subprocess.Popen` is: pid, returncode, poll(), wait(), kill()."""

    stdin = stdout = stderr = None

    def __init__(self, conn: socket.socket, pid: int):
        self._conn, self._lines, self.pid, self.returncode = conn, _Lines(conn), pid, None
        self._lock = threading.Lock()  # (a watchdog thread polls while the main thread waits: one reads at a time)
        try:
            self._pidfd = os.pidfd_open(pid)  # (its pid cannot be reused while this is open)
        except OSError:
            self._pidfd = None

    def _take(self, timeout: float | None) -> None:
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return  # (another thread is reading the status)
        try:
            if self.returncode is None:
                self._read_status(timeout)
        finally:
            self._lock.release()

    def _read_status(self, timeout: float | None) -> None:
        try:
            msg = self._lines.read(timeout)
        except TimeoutError:
            return
        if msg is None:  # the server is gone: the child's status is not known
            if self._pidfd is None or select.select([self._pidfd], [], [], timeout or 0)[0]:
                self.returncode = 255
            elif timeout is not None:
                return
            else:
                select.select([self._pidfd], [], [])
                self.returncode = 255
        else:
            self.returncode = int(msg["exit"])
        self._close()

    def _close(self) -> None:
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._take(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._take(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"preloaded process {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """As `Popen.send_signal`: nothing once the child has ended (exited but not yet reported included)."""
        if self.poll() is None and self._pidfd is not None:
            import signal

            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:  # (it ended; its status is on its way)
                pass

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


class Client:
    """A connection maker for one server (its socket path)."""

    def __init__(self, path: str):
        self.path = path

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(self.path)
        sock.settimeout(None)
        return sock

    def hello(self, timeout: float = 5.0) -> dict:
        with self._connect(timeout) as sock:
            _send(sock, {"op": "hello"})
            msg = _Lines(sock).read(timeout)
        if msg is None or "error" in msg:
            raise OSError(f"preload server {self.path}: {msg}")
        return msg

    def run(self, module: str | None, args, env: dict, timeout: float = 30.0, path: str | None = None,
            stdio=(0, 1, 2), cwd: str | None = None) -> PreloadedProcess:
        """Fork a child running `python -m module args` (or `python path args`) with `env`, `stdio` (this
        process's by default: file descriptors for its standard input, output and error), `cwd` (this process's
        by default) and this process's cores."""
        sock = self._connect(timeout)
        try:
            cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
            what = {"path": os.path.abspath(path)} if path is not None else {"module": module}
            _send(sock, {"op": "run", **what, "args": list(args), "env": dict(env), "cwd": cwd or os.getcwd(),
                         "cpus": cpus}, fds=tuple(stdio))
            msg = _Lines(sock).read(timeout)
            if msg is None or "pid" not in msg:
                raise OSError(f"preload server {self.path} did not fork: {msg}")
        except BaseException:
            sock.close()
            raise
        return PreloadedProcess(sock, int(msg["pid"]))


def start_server(owner: int | None = None, modules=DEFAULT_WARM, ready_timeout: float = 180.0,
                 wait: bool = True) -> tuple[subprocess.Popen, Client]:
    """Start a server owned by `owner` (this process by default) on a fresh private socket; with `wait`, until it
    answers (OSError if it does not within `ready_timeout` s)."""
    d = tempfile.mkdtemp(prefix="hfllamarl-preload-")  # (0700: only this user reaches the socket)
    path = os.path.join(d, "s")
    cmd = [sys.executable, "-m", "hfllamarl.runtime.world.preload_server", "--socket", path,
           "--owner", str(owner or os.getpid()), "--room", " " * ROOM]
    for m in modules:
        cmd += ["--warm", m]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env={**os.environ, ENV_ROOM: " " * ENV_ROOM_SIZE})
    client = Client(path)
    if wait:
        wait_ready(proc, client, ready_timeout)
    return proc, client


def wait_ready(proc: subprocess.Popen, client: Client, timeout: float) -> dict:
    """Wait until the server answers; OSError if it exited, or is not safe to fork, or took past `timeout` s."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(client.path):
        if proc.poll() is not None:
            raise OSError(f"the preload server exited ({proc.returncode}) before it was ready")
        if time.monotonic() > deadline:
            raise OSError(f"the preload server was not ready within {timeout:.0f} s")
        time.sleep(0.05)
    return usable(client.hello())


def usable(info: dict) -> dict:
    """A server's hello `info`, if this process may have its children forked there; OSError saying why not."""
    if info.get("threads") != 1:
        raise OSError(f"the preload server runs {info.get('threads')} Python threads after its imports: forking it "
                      "is unsafe")
    mine = fingerprint()
    theirs = info.get("code") or {}
    differs = [k for k in ("python", "prefix", "versions", "source") if theirs.get(k) != mine[k]]
    if theirs.get("source_mtime", 0.0) < mine["source_mtime"]:
        differs.append("source files changed since it started")
    if differs:
        raise OSError(f"the preload server runs other code than this process ({', '.join(differs)}): restart it")
    return info


_OWN: dict = {}  # this process's own server (HFLLAMARL_PRELOAD=1): {"proc", "client", "ready"}
_LOGGED: set = set()


def _fallback(why: str, named: bool = False) -> None:
    """Say once why children are spawned: a warning when the user named the server (`HFLLAMARL_PRELOAD=PATH`)."""
    if why not in _LOGGED:
        _LOGGED.add(why)
        log = logger.warning if named else logger.debug
        log("generator processes are spawned, not forked from a preloaded server: %s", why)


def enabled_here() -> bool:
    """Whether this platform can fork children from a server (fork, and pidfds to watch processes by)."""
    return hasattr(os, "fork") and hasattr(os, "pidfd_open")


def enabled() -> bool:
    """Whether generator children are to be forked from a server (`HFLLAMARL_PRELOAD` set, on a platform with fork),
    so that none is prestarted."""
    return os.environ.get(ENV_PRELOAD, "") not in ("", "0") and enabled_here()


def begin() -> None:
    """When a single-process trainer is built: with `HFLLAMARL_PRELOAD=1`, start this process's own server (once;
    its imports overlap the trainer's set-up)."""
    if os.environ.get(ENV_PRELOAD) != "1" or _OWN or not hasattr(os, "fork"):
        return
    try:
        proc, client = start_server(wait=False)
        _OWN.update(proc=proc, client=client, ready=False)
        import atexit

        atexit.register(_end_own)
    except OSError as e:
        _fallback(f"the server did not start ({e})")


def _end_own() -> None:
    proc = _OWN.get("proc")
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()


def client(ready_timeout: float = 180.0) -> Client | None:
    """The server generator children are forked from, ready (None: spawn them, as without a server)."""
    setting = os.environ.get(ENV_PRELOAD, "")
    if not enabled():
        return None
    try:
        if setting == "1":
            begin()
            if not _OWN or _OWN.get("failed"):
                return None
            if not _OWN["ready"]:
                wait_ready(_OWN["proc"], _OWN["client"], ready_timeout)
                _OWN["ready"] = True
            return _OWN["client"]
        c = Client(setting)
        usable(c.hello())
        return c
    except (OSError, ValueError) as e:
        _fallback(str(e), named=setting != "1")
        if setting == "1":
            _end_own()
            _OWN.clear()
            _OWN["failed"] = True  # (not tried again by this process)
        return None


