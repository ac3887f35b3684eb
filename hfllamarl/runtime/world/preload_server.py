"""The preloaded process server itself: imports once, then forks children on request (`preload` is its client).

    python -m hfllamarl.runtime.world.preload_server --socket PATH --owner PID [--warm MODULE ...] [--room BLANKS]

How it is used, and what a forked child gets, is told in `hfllamarl.runtime.world.preload`. This module is what
runs in the server's process and, after each fork, in the child until the requested module or script runs: the
requester's stdio, environment, directory, cores and process group; a command line and an environment that read
as a spawned child's (`retitle`, `show_environ`, written where the kernel reads /proc/PID/cmdline and environ);
and, when the program ends, what the interpreter does at exit.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys

from hfllamarl.runtime.world.preload import DEFAULT_WARM, ENV_ROOM, _MAX_MSG, _send, fingerprint


def _os_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def warm(modules) -> None:
    """Import each module and call its `warm()` (if any): what the forked children will use."""
    import gc

    gc.disable()  # (as the generator child does while it imports: a collection per import is seconds here)
    try:
        for name in modules:
            mod = importlib.import_module(name)
            if hasattr(mod, "warm"):
                mod.warm()
    finally:
        gc.enable()
    gc.collect()
    gc.freeze()  # the children's pages stay shared: no collection touches what was imported


#: Environment variables the warm modules read once, at import (huggingface_hub's cache and offline constants,
#: transformers' and datasets', torch's, the interpreter's hash seed): a child whose environment differs from the
#: server's in one of them would run with the server's value, so it is spawned instead.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH_", "PYTORCH_")
IMPORT_TIME_NAMES = ("HOME", "XDG_CACHE_HOME", "PYTHONHASHSEED")


def import_time_environment(env) -> dict:
    """The part of `env` the warm modules read at import (see `IMPORT_TIME_PREFIXES`)."""
    return {k: v for k, v in env.items() if k in IMPORT_TIME_NAMES or k.startswith(IMPORT_TIME_PREFIXES)}


def _read_at_import(before: dict) -> tuple[dict, set]:
    """The import-time environment the warm modules read (the server's before it imported them), and the variables
    those imports set themselves (vLLM sets PYTORCH_NVML_BASED_CUDA_CHECK when imported; a spawned job's imports set
    it the same way, so a job with or without it is served alike)."""
    after = import_time_environment(os.environ)
    changed = {k for k in {*before, *after} if before.get(k) != after.get(k)}
    return {k: v for k, v in before.items() if k not in changed}, changed


#: Variables the warm imports set whatever the environment held (vLLM's `env_override` sets
#: PYTORCH_NVML_BASED_CUDA_CHECK=1). Taken out of the environment while the server imports, so that they count as
#: set by the imports even when whoever started the server had imported vLLM already (its environment then holds
#: them, a shell's does not); put back if the imports leave them unset, and then compared as any other.
SET_BY_IMPORTS = ("PYTORCH_NVML_BASED_CUDA_CHECK",)


def _warm_reading_environment(modules) -> tuple[dict, set]:
    """`warm(modules)`; returns `_read_at_import`'s answer for those imports."""
    held = {k: os.environ.pop(k) for k in SET_BY_IMPORTS if k in os.environ}
    before = import_time_environment(os.environ)
    warm(modules)
    for k, v in held.items():
        if k not in os.environ:
            os.environ[k] = before[k] = v
    return _read_at_import(before)


def _terminate(signum, frame) -> None:
    raise SystemExit(0)


def serve(path: str, owner: int, modules=DEFAULT_WARM) -> int:
    """Import `modules`, then fork children on request until `owner` is gone. Returns the exit code."""
    import selectors
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C in the owner's terminal: the owner ends this server)
    signal.signal(signal.SIGTERM, _terminate)  # a kill: the `finally` below removes the socket, then exit
    os.environ.pop(ENV_ROOM, None)  # (its span stays: the children's environment is shown there)
    owner_fd = os.pidfd_open(owner)
    import_env, set_at_import = _warm_reading_environment(modules)
    import threading

    # Python threads: none but this one may run (a lock one holds would stay held in every child). The imports of
    # torch and vLLM leave two native helper threads parked on a futex, as after any `import torch`; they are not
    # copied into a child (only the forking thread is) and hold no lock the child takes, which is what makes
    # forking after `import torch` usual practice (DataLoader's forked workers). They are reported, not refused.
    threads = threading.active_count()
    native = _os_threads()
    code = fingerprint()
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path + f".{os.getpid()}.tmp"
    lsock.bind(tmp)
    os.chmod(tmp, 0o600)
    lsock.listen(64)
    os.replace(tmp, path)  # (the path exists only once the server answers)
    own = os.stat(path).st_ino  # (the file's inode: fstat of the socket gives sockfs's, never the file's)
    rfd, wfd = os.pipe()
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    sel = selectors.DefaultSelector()
    sel.register(lsock, selectors.EVENT_READ, "accept")
    sel.register(owner_fd, selectors.EVENT_READ, "owner")
    sel.register(rfd, selectors.EVENT_READ, "sigchld")
    children: dict[int, socket.socket] = {}
    state = {"lsock": lsock, "sel": sel, "pipe": (rfd, wfd), "owner_fd": owner_fd, "threads": threads,
             "native_threads": native, "code": code}
    state["import_env"], state["set_at_import"] = import_env, set_at_import
    try:
        while True:
            for key, _ in sel.select(timeout=1.0):
                if key.data == "owner":
                    return 0
                if key.data == "accept":
                    conn, _ = lsock.accept()
                    sel.register(conn, selectors.EVENT_READ, "conn")
                elif key.data == "sigchld":
                    os.read(rfd, 4096)
                else:
                    _handle(key.fileobj, children, state)
            _reap(children, sel)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (a second kill must not cut the cleanup short)
        try:
            if os.path.exists(path) and os.stat(path).st_ino == own:  # (not a newer server's socket)
                os.unlink(path)
                if os.path.basename(os.path.dirname(path)).startswith("hfllamarl-preload-"):
                    os.rmdir(os.path.dirname(path))  # (start_server's own directory; fails if anything else is in it)
        except OSError:
            pass
        for conn in children.values():
            conn.close()


def _reap(children: dict, sel) -> None:
    """Tell each requester whose child exited its exit status (Popen's convention: -N for signal N)."""
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 255 << 8
        if done:
            conn = children.pop(pid)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                _send(conn, {"exit": code})
            except OSError:
                pass
            _forget(conn, sel)


def _forget(conn, sel) -> None:
    try:
        sel.unregister(conn)
    except (KeyError, ValueError):
        pass
    conn.close()


def _handle(conn: socket.socket, children: dict, state: dict) -> None:
    """One request on `conn`: "hello" (is this server usable) or "run" (fork a child)."""
    sel = state["sel"]
    try:
        data, fds, _, _ = socket.recv_fds(conn, _MAX_MSG, 8)
    except OSError:
        data, fds = b"", []
    if not data.endswith(b"\n"):  # closed, or not one whole message: a requester holding no child is done
        for fd in fds:
            os.close(fd)
        if conn not in children.values():
            _forget(conn, sel)
        return
    req = json.loads(data)
    pid, uid, _ = _peer(conn)
    if uid != os.getuid():
        _send(conn, {"error": "another user's request"})
        _forget(conn, sel)
        return
    if req.get("op") == "hello":
        _send(conn, {"pid": os.getpid(), "python": sys.executable, "threads": state["threads"],
                     "native_threads": state["native_threads"], "code": state["code"]})
        for fd in fds:
            os.close(fd)
        return
    ours = state["import_env"]
    theirs = {k: v for k, v in import_time_environment(req.get("env", {})).items() if k not in state["set_at_import"]}
    differs = sorted(k for k in {*theirs, *ours} if theirs.get(k) != ours.get(k))
    if differs:  # (names only: the values may be tokens)
        _send(conn, {"error": f"the job's environment differs from the server's in {', '.join(differs)}, read once "
                              "when the server imported its modules: start the server with the job's environment"})
        for fd in fds:
            os.close(fd)
        _forget(conn, sel)
        return
    requester = os.pidfd_open(pid)
    child = os.fork()
    if child == 0:
        _become(req, fds, requester, pid, state, conn)  # never returns
    for fd in (*fds, requester):
        os.close(fd)
    children[child] = conn
    sel.unregister(conn)  # (its next news is the child's exit)
    _send(conn, {"pid": child})


def _peer(conn: socket.socket) -> tuple[int, int, int]:
    import struct

    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def _become(req: dict, fds: list[int], requester: int, requester_pid: int, state: dict, conn) -> None:
    """In the forked child: the requester's stdio, environment, directory, cores and process group; then run the
    module as `python -m` would, and exit with its status."""
    import signal

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        state["sel"].close()
        state["lsock"].close()
        for fd in (*state["pipe"], state["owner_fd"]):
            os.close(fd)
        conn.close()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        try:
            os.setpgid(0, os.getpgid(requester_pid))
        except OSError:
            pass
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        if req.get("cpus") and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, req["cpus"])
        _threads_again()
        from hfllamarl.runtime.world import spawn

        spawn.PARENT_PIDFD = requester
        import runpy

        # (as `python -m` / `python script.py` would: the working directory or the script's, then PYTHONPATH's
        # entries, ahead of the server's path)
        script = req.get("path")
        first = os.path.dirname(os.path.abspath(script)) if script else req["cwd"]
        extra = [first, *filter(None, req["env"].get("PYTHONPATH", "").split(os.pathsep))]
        sys.path[:0] = [p for p in extra if p not in sys.path]
        if script:
            sys.argv = [script, *req.get("args", [])]
            retitle([sys.executable, *sys.argv])
        else:
            sys.argv = [req["module"], *req.get("args", [])]
            retitle([sys.executable, "-m", *sys.argv])
        show_environ(req["env"])
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
        _exit_as_python_does()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
        _exit_as_python_does()
    except BaseException:  # noqa: BLE001 - the child's error reaches the requester's stderr, as a spawned one's
        import traceback

        traceback.print_exc()
        _exit_as_python_does()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _spans() -> tuple[int, int, int, int] | None:
    """This process's command-line and environment spans (arg_start, arg_end, env_start, env_end: fields 48-51 of
    /proc/PID/stat), where the kernel reads /proc/PID/cmdline and /proc/PID/environ from."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return int(fields[45]), int(fields[46]), int(fields[47]), int(fields[48])
    except (OSError, ValueError, IndexError):
        return None


def show_environ(env: dict) -> bool:
    """Make /proc/PID/environ (psutil's `environ()`, what tools read of a process) show `env`, as a spawned child's
    would, by writing over the span it is read from (the server reserves room there with `ENV_ROOM`). Safe only once
    the C environment no longer points into that span: `_become` cleared `os.environ` (unsetenv of every initial
    variable) and set the job's (setenv copies them), so nothing reads the old strings. Variables that do not fit
    are left out, the job's own (`HFLLAMARL_*`, `RANK`, ...) first in. Returns whether it was written."""
    import ctypes

    spans = _spans()
    if spans is None:
        return False
    start, end = spans[2], spans[3]
    size = end - start
    first = sorted(env, key=lambda k: (not k.startswith(("HFLLAMARL_", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                          "MASTER_", "OMP_")), k))
    data = b""
    for k in first:
        item = os.fsencode(f"{k}={env[k]}") + b"\0"
        if len(data) + len(item) <= size:
            data += item
    if size <= 0:
        return False
    ctypes.memmove(start, data + b"\0" * (size - len(data)), size)
    return True


def retitle(argv: list[str]) -> bool:
    """Make this process's command line (`ps`, /proc/PID/cmdline, psutil) read `argv`, as a spawned child's would,
    by writing over the memory the kernel reads it from (the span /proc/self/stat gives). A forked child keeps its
    server's span: the server reserves room for it with `--room`. Too long for the room, the interpreter's path is
    left out, then the end is cut. (Arguments are joined by spaces, as setproctitle(3) does: one holding a space
    reads as two.) Returns whether the command line was written."""
    import ctypes

    spans = _spans()
    if spans is None:
        return False
    start, end = spans[0], spans[1]
    size = end - start
    if size <= 1:
        return False
    for candidate in (argv, argv[1:]):
        title = " ".join(candidate).encode(errors="replace")
        if len(title) < size:
            break
    title = title[:size - 2]
    # The title, its end, then blanks up to the span's last byte: that byte not being NUL, the kernel reads the
    # command line up to the first NUL (as it does for setproctitle(3)), and `ps` and psutil split it at the spaces.
    ctypes.memmove(start, title + b"\0" + b" " * (size - len(title) - 1), size)
    return True


def _exit_as_python_does() -> None:
    """What the interpreter does at a normal exit, before this child's `os._exit`: wait for the program's
    non-daemon threads, then run its atexit functions (a job's logging flush, its own server's end)."""
    try:
        import threading

        threading._shutdown()
    except Exception:  # noqa: BLE001
        pass
    try:
        import atexit

        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001
        pass


def _threads_again() -> None:
    """torch's (OpenMP's) thread count, read at import in the server: from this child's environment and cores."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    n = os.environ.get("OMP_NUM_THREADS")
    n = int(n) if n and n.isdigit() else len(os.sched_getaffinity(0))
    torch.set_num_threads(max(n, 1))


# ------------------------------------------------------------------------------------------------ the client
def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m hfllamarl.runtime.world.preload_server", description=__doc__.split("\n")[0])
    p.add_argument("--socket", required=True, help="the unix socket's path (its directory should be private)")
    p.add_argument("--owner", type=int, default=os.getppid(), help="exit once this process is gone (default: parent)")
    p.add_argument("--warm", action="append", help="module to import (and call its warm()) before serving")
    p.add_argument("--room", default="", help="blank room on the command line for the children's own (`retitle`)")
    a = p.parse_args(argv)
    return serve(a.socket, a.owner, tuple(a.warm or DEFAULT_WARM))


if __name__ == "__main__":
    sys.exit(main())
