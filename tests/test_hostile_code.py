"""Hostile model code against both sandboxes (the python tool, and the grader's sandbox reached through a parser's
eval), with real processes: each attack is contained and the next normal call still answers correctly."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from hfllamarl.sandbox.client import Sandbox, SandboxError, SandboxTimeout, SandboxUnavailable

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

TIMEOUT_S = 2.0


class ToolRunner:
    """The python tool: output as text; its errors as the tool raises them."""

    name = "tool"

    def __init__(self):
        from hfllamarl.plugins.environments.python_sandbox import PythonSandbox

        self.box = PythonSandbox(timeout_s=TIMEOUT_S, memory_mb=512, max_output_chars=100_000)
        self.sandbox = self.box._sandbox()

    def run(self, code: str) -> str:
        try:
            return self.box.python(textwrap.dedent(code))
        except TimeoutError as exc:
            raise SandboxTimeout(str(exc)) from None
        except RuntimeError as exc:
            raise SandboxError(str(exc)) from None


class GraderRunner:
    """The grader's sandbox (math_sympy's warm-up and limits) calling a function that executes model text."""

    name = "grader"

    def __init__(self):
        self.sandbox = Sandbox("sandbox_targets:run_code", warmup="hfllamarl.plugins.rewards.math_sympy:_worker_warmup",
                               parallel=2, memory_mb=4096)

    def run(self, code: str) -> str:
        return self.sandbox.call(textwrap.dedent(code), timeout=TIMEOUT_S)


@pytest.fixture(scope="module", params=["tool", "grader"])
def box(request):
    runner = ToolRunner() if request.param == "tool" else GraderRunner()
    assert runner.sandbox.wait_ready(60)
    assert runner.sandbox.isolation == "namespaces"
    yield runner
    runner.sandbox.close()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` on the host (walks /proc's parent links)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier}
        found += frontier
    return found


def assert_unharmed(box) -> None:
    assert box.run("print(6 * 7)") == "42\n"
    assert descendants(box.sandbox.pid) == []


def test_a_pickle_on_the_reply_channel_is_never_unpickled(box):
    marker = Path(tempfile.mkdtemp()) / "pwned"
    code = f"""
    import os, pickle, stat
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch {marker}",))
    payload = pickle.dumps(Evil())
    for fd in range(3, 256):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, len(payload).to_bytes(4, "big") + payload)
        except OSError:
            pass
    os._exit(0)
    """
    with pytest.raises(SandboxError, match="malformed reply"):
        box.run(code)
    time.sleep(0.2)
    assert not marker.exists()
    shutil.rmtree(marker.parent)
    assert_unharmed(box)


def test_a_fork_bomb_is_capped_and_leaves_nothing(box):
    code = """
    import os, time
    made = 0
    for _ in range(300):
        try:
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            made += 1
        except OSError:
            pass
    print(made)
    """
    made = int(box.run(code))
    assert 0 < made < 32  # RLIMIT_NPROC of the call (32, the call itself included)
    assert_unharmed(box)


def test_a_setsid_child_does_not_outlive_the_call(box):
    code = """
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(60)
        os._exit(0)
    time.sleep(60)
    """
    start = time.monotonic()
    with pytest.raises(SandboxTimeout):
        box.run(code)
    assert time.monotonic() - start < TIMEOUT_S + 1.5
    assert descendants(box.sandbox.pid) == []  # the server answered after the namespace was gone
    assert_unharmed(box)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_writes_outside_scratch_are_refused(box):
    import hfllamarl

    ckpt = Path(tempfile.mkdtemp()) / "checkpoint-10"  # world-writable: only the sandbox stands in the way
    ckpt.mkdir()
    os.chmod(ckpt.parent, 0o777)
    os.chmod(ckpt, 0o777)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(b"weights")
    os.chmod(weights, 0o666)
    package_init = Path(hfllamarl.__file__)
    home = Path(os.path.expanduser("~"))
    before = {p: _digest(p) for p in (weights, package_init)}
    targets = [weights, ckpt / "optimizer.pt", package_init, package_init.parent / "evil.py", home / ".bashrc-evil",
               Path("/tmp/hfllamarl-evil")]
    code = f"""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    print("remount", libc.mount(None, b"/", None, 32 | 4096, None), ctypes.get_errno())  # MS_REMOUNT|MS_BIND
    for target in {[str(t) for t in targets]!r}:
        try:
            with open(target, "ab") as fh:
                fh.write(b"pwned")
            print("WROTE", target)
        except OSError as exc:
            print("refused", target, exc.errno)
    open("fine.txt", "w").write("scratch is writable")
    print(open("fine.txt").read())
    """
    out = box.run(code)
    assert "WROTE" not in out and out.count("refused") == len(targets), out
    assert "remount -1" in out and "scratch is writable" in out, out
    assert {p: _digest(p) for p in before} == before
    assert not any(t.exists() for t in targets[1:2] + targets[3:])
    shutil.rmtree(ckpt.parent)
    assert_unharmed(box)


def test_the_call_sees_a_minimal_root_not_the_hosts_temp_dirs_nor_homes(box):
    """A file another process of the job left readable to all in /tmp or /var/tmp (a token, a socket, another
    job's data) does not exist for the call, whose root shows those directories, /run and the homes empty but for
    the interpreter's own directories; the call still imports what the job can."""
    probes = []
    for top in ("/tmp", "/var/tmp"):
        directory = Path(tempfile.mkdtemp(dir=top, prefix="hfllamarl-probe-"))
        directory.chmod(0o755)
        (directory / "token").write_text("hunter3")
        (directory / "token").chmod(0o644)
        probes.append(directory)
    code = f"""
    import json, os, sys
    import hfllamarl
    for directory in {[str(p) for p in probes]!r}:
        try:
            print("READ", open(os.path.join(directory, "token")).read())
        except OSError as exc:
            print("absent", exc.errno)
    for top in ("/tmp", "/var/tmp", "/run", "/home"):
        if os.path.isdir(top) and not os.path.islink(top):
            print("list", top, json.dumps([e for e in os.listdir(top) if not e.startswith("hfllamarl-sandbox-")]))
    print("cwd", os.getcwd() == os.environ["TMPDIR"])
    """
    try:
        out = box.run(code)
    finally:
        for directory in probes:
            shutil.rmtree(directory)
    assert "READ" not in out and out.count("absent 2") == 2, out
    assert "cwd True" in out, out
    shown = {line.split()[1]: line.split(" ", 2)[2] for line in out.splitlines() if line.startswith("list ")}
    kept = [os.path.realpath(p) for p in sys.path if p] + [sys.prefix, os.path.dirname(sys.executable)]
    for top, entries in shown.items():
        # Only the way to the interpreter's own directories (a venv under /home/<user>, say) is left.
        assert all(any(k.startswith(f"{top}/{e}") for k in kept) for e in json.loads(entries)), (top, entries)
    assert_unharmed(box)


def test_filling_the_disk_gives_enospc_and_scratch_is_removed(box):
    code = """
    import errno, os
    print(os.getcwd())
    try:
        for i in range(1000):
            with open(f"big{i}", "wb") as fh:
                fh.write(b"x" * (8 << 20))
    except OSError as exc:
        print("bytes", errno.errorcode[exc.errno])
    try:
        for i in range(100000):
            open(f"f{i}", "w").close()
    except OSError as exc:
        print("inodes", errno.errorcode[exc.errno], i < 600)
    """
    out = box.run(code).split("\n")
    scratch = Path(out[0])
    assert out[1:3] == ["bytes ENOSPC", "inodes ENOSPC True"], out
    assert not scratch.exists()
    assert_unharmed(box)


def test_state_does_not_leak_from_one_call_to_the_next(box):
    module = ("hfllamarl.plugins.environments.python_sandbox" if box.name == "tool"
              else "hfllamarl.plugins.rewards.math_sympy")
    first = f"""
    import builtins, json, importlib
    builtins.leaked = 1
    json.dumps = lambda *a, **k: "hacked"
    m = importlib.import_module("{module}")
    m.hacked = True
    open("note.txt", "w").write("from call 1")
    print("edited")
    """
    second = f"""
    import builtins, json, importlib, os
    m = importlib.import_module("{module}")
    print(hasattr(builtins, "leaked"), json.dumps(1), hasattr(m, "hacked"), os.path.exists("note.txt"))
    """
    assert box.run(first) == "edited\n"
    assert box.run(second) == "False 1 False False\n"
    assert_unharmed(box)


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def test_no_connection_reaches_the_host(box, listener):
    port = listener.getsockname()[1]
    connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1); print('connected')"
    code = f"""
    import ctypes, socket, struct, subprocess, sys
    try:
        import _socket
        s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        s.settimeout(1)
        s.connect(("127.0.0.1", {port}))
        print("connected _socket")
    except OSError as exc:
        print("_socket", exc.errno)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)
    addr = struct.pack("=HH4s8x", 2, socket.htons({port}), bytes([127, 0, 0, 1]))
    print("ctypes", libc.connect(fd, addr, len(addr)), ctypes.get_errno())
    run = subprocess.run([sys.executable, "-c", {connect!r}], capture_output=True, text=True, timeout=5)
    print("subprocess", run.returncode, run.stdout.strip() or run.stderr.strip().splitlines()[-1])
    """
    out = box.run(code)
    assert "connected" not in out, out
    assert "ctypes -1 101" in out and "_socket 101" in out and "subprocess 1" in out, out  # ENETUNREACH
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert_unharmed(box)


def test_a_failed_isolation_step_fails_closed():
    marker = Path(tempfile.mkdtemp())
    os.chmod(marker, 0o777)
    code = f"open('{marker}/ran', 'w').write('x'); print('ran')"
    broken = Sandbox("sandbox_targets:run_code", _test_fail_step="call:make_tree_read_only")
    try:
        assert broken.wait_ready(30)
        with pytest.raises(SandboxError, match="make_tree_read_only.*did not run"):
            broken.call(code, timeout=10)
    finally:
        broken.close()
    unavailable = Sandbox("sandbox_targets:run_code", _test_fail_step="unshare")
    try:
        with pytest.raises(SandboxUnavailable, match=r"'unshare' failed.*isolation='process'"):
            unavailable.wait_ready(30)
        with pytest.raises(SandboxUnavailable):
            unavailable.call(code, timeout=10)
    finally:
        unavailable.close()
    assert not (marker / "ran").exists()
    shutil.rmtree(marker)


def test_a_probe_that_never_answers_is_called_slow_not_a_missing_kernel_feature():
    """The start-up probe (one isolated call doing nothing) stuck in an isolation step, as on a starved machine:
    the sandbox refuses to start within its budget (fail closed) and says the probe did not answer in time, not
    that the kernel lacks the isolation."""
    stuck = Sandbox("sandbox_targets:run_code", _test_fail_step="hang:chdir_scratch", startup_timeout=8)
    try:
        started = time.monotonic()
        with pytest.raises(SandboxError, match=r"probe .* did not answer within 4 s") as raised:
            stuck.wait_ready()
        assert not isinstance(raised.value, SandboxUnavailable) and "kernel" not in str(raised.value)
        assert time.monotonic() - started < 8
    finally:
        stuck.close()


_REFUSED_SCRIPT = """
from hfllamarl.plugins.environments.python_sandbox import PythonSandbox
from hfllamarl.sandbox.client import SandboxUnavailable
try:
    PythonSandbox(timeout_s=5)
except SandboxUnavailable as exc:
    print("REFUSED", exc)
else:
    print("BUILT")
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_a_kernel_that_refuses_namespaces_refuses_the_tool_at_start():
    """A real refusal (no user namespace may be created below this one), not a simulated step: the environment
    is refused when it is built (where the job builds its environments, at start-up), naming the way out."""
    inner = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c '{_REFUSED_SCRIPT}'"
    try:
        proc = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", inner], capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the refused sandbox hung")
    if "REFUSED" not in proc.stdout and "BUILT" not in proc.stdout:
        pytest.skip(f"cannot make a user namespace to test in: {proc.stderr[-300:]}")
    assert "REFUSED sandbox isolation 'namespaces' is not available" in proc.stdout, proc.stdout + proc.stderr
    assert "isolation='process'" in proc.stdout


def test_the_weaker_process_mode_is_named_loudly_and_still_kills_the_tree(caplog):
    from hfllamarl.plugins.environments.python_sandbox import PythonSandbox

    box = PythonSandbox(timeout_s=TIMEOUT_S, memory_mb=512, isolation="process")
    sandbox = box._sandbox()
    try:
        assert box.network_isolation() == "process"
        assert any("WEAKER" in r.getMessage() for r in caplog.records)  # said once, at start
        assert box.python("print(6 * 7)") == "42\n"
        assert "disabled" in box.python("import socket; socket.create_connection(('127.0.0.1', 9))").lower()
        code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)\n"
        with pytest.raises(TimeoutError):
            box.python(code)
        assert descendants(sandbox.pid) == []  # the session and the cgroup were killed (a cgroup is writable here)
        assert box.python("import builtins; print(hasattr(builtins, 'x')); builtins.x = 1") == "False\n"
        assert box.python("import builtins; print(hasattr(builtins, 'x'))") == "False\n"  # a fresh process per call
    finally:
        sandbox.close()


def test_a_temp_directory_under_a_private_directory_still_isolates(tmp_path):
    """TMPDIR under a 0700 directory (a SLURM job's directory, root's home in a container): the calls' scratch lives
    there and a call dropped to uid 65534 (as root) still reaches it, isolated as ever (a read-only view, no
    network). Once this failed as "namespaces not available on this machine"."""
    private = tmp_path / "private"
    (private / "tmp").mkdir(parents=True)
    private.chmod(0o700)
    code = textwrap.dedent("""
        import os, tempfile
        from hfllamarl.plugins.environments.python_sandbox import PythonSandbox
        box = PythonSandbox(timeout_s=10)
        print(box.python("import os, socket, tempfile\\n"
                         "open('mine.txt', 'w').write('x'); print(os.listdir('.'))\\n"
                         "try:\\n    open('/etc/hfllamarl-probe', 'w')\\nexcept OSError as e: print('ro', e.errno)\\n"
                         "try:\\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\\n"
                         "except OSError: print('no network')\\n"), flush=True)
        print("SCRATCH_UNDER", box._sandbox().wait_ready(30) and any(os.scandir(tempfile.gettempdir())))
    """)
    env = dict(os.environ, TMPDIR=str(private / "tmp"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "['mine.txt']" in proc.stdout and "ro 30" in proc.stdout and "no network" in proc.stdout, proc.stdout
    assert "SCRATCH_UNDER True" in proc.stdout  # (the sandbox's scratch is where TMPDIR says)


@pytest.fixture
def unix_listener():
    """A Unix socket the job created, writable by anyone (as a job that does not run as root has its own: the call
    runs as that uid), in a directory anyone may search; and a secret in the job's environment."""
    directory = Path(tempfile.mkdtemp(dir="/tmp"))
    directory.chmod(0o755)
    path = str(directory / "service.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(8)
    server.setblocking(False)
    yield path, server
    server.close()
    shutil.rmtree(directory)


def test_no_unix_socket_of_the_job_is_reachable_nor_its_environment(box, unix_listener, monkeypatch):
    """Model code cannot connect to a Unix socket the job created (the preload server's) by any path: socket(),
    ctypes, a datagram pair pointed at it, a subprocess; nor read the job's secrets from its environment."""
    path, server = unix_listener
    code = f"""
    import ctypes, os, socket, subprocess, sys
    try:
        socket.socket(socket.AF_UNIX).connect({path!r}); print("connected socket")
    except OSError as exc:
        print("socket", exc.errno)
    libc = ctypes.CDLL(None, use_errno=True)
    print("ctypes", libc.socket(1, 1, 0), ctypes.get_errno())
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM); a.connect({path!r}); print("connected pair")
    except OSError as exc:
        print("dgram pair", exc.errno)
    run = subprocess.run([sys.executable, "-c", "import socket; socket.socket(socket.AF_UNIX).connect({path!r})"],
                         capture_output=True, text=True, timeout=5)
    print("subprocess", run.returncode)
    print("env", sorted(k for k in os.environ if "SECRET" in k or "PRELOAD" in k),
          b"hunter2" in open("/proc/self/environ", "rb").read())
    """
    # (a server started before the secret was set would not see it either: the secret is set, a fresh server starts)
    monkeypatch.setenv("HFLLAMARL_TEST_SECRET", "hunter2")
    monkeypatch.setenv("HFLLAMARL_PRELOAD", path)
    fresh = ToolRunner() if box.name == "tool" else GraderRunner()
    try:
        assert fresh.sandbox.wait_ready(60)
        out = fresh.run(code)
    finally:
        fresh.sandbox.close()
    assert "connected" not in out, out
    assert "socket 13" in out and "ctypes -1 13" in out and "dgram pair 13" in out and "subprocess 1" in out, out
    assert "env [] False" in out, out
    with pytest.raises(BlockingIOError):
        server.accept()


def test_scratch_is_removed_on_every_exit_path(tmp_path):
    """A job that exits without closing its sandbox, or is killed, takes its server's scratch directories with it
    (the server is told by its parent's death and cleans up); a server killed itself (SIGKILL, no time to clean)
    leaves them to the next server of the same user, which removes them when it starts."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(Path(__file__).parent))
    script = ("import os, signal, sys\nfrom hfllamarl.sandbox import Sandbox\n"
              "box = Sandbox('sandbox_targets:run_code')\nassert box.wait_ready(60)\n"
              "print(box.call('print(1)', timeout=10).strip(), box.pid, flush=True)\n"
              "if sys.argv[1] == 'kill_job': os.kill(os.getpid(), signal.SIGKILL)\n"
              "if sys.argv[1] == 'kill_server': os.kill(box.pid, signal.SIGKILL); box._server.proc.wait()\n")

    def bases():
        return sorted(p.name for p in tmp.iterdir() if p.name.startswith("hfllamarl-sandbox-"))

    def run(how):
        proc = subprocess.run([sys.executable, "-c", script, how], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.stdout.startswith("1 "), proc.stderr[-2000:]
        return int(proc.stdout.split()[1])

    for how in ("exit", "kill_job"):
        pid = run(how)
        def server_alive():
            try:
                return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
            except OSError:
                return False

        deadline = time.monotonic() + 15
        while (bases() or server_alive()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert bases() == [] and not server_alive(), how
    pid = run("kill_server")
    assert [b.split("-")[2] for b in bases()] == [str(pid)]  # left behind: nobody could clean
    run("exit")  # the next server sweeps it
    assert bases() == []


def test_a_tools_timeout_counts_its_own_run_not_the_wait_for_a_worker():
    """One worker, three rollouts: two slow calls hold it for longer than a call's bound, a fast one queues behind
    them. The fast call still has its whole bound once it runs (it used to be charged the wait and time out); a call
    that never finds a free worker within `wait_s` says so, rather than that its code ran too long."""
    import threading

    from hfllamarl.plugins.environments.python_sandbox import PythonSandbox

    box = PythonSandbox(timeout_s=2.0, workers=1, memory_mb=256, wait_s=30.0)
    results = {}

    def run(name, code):
        try:
            results[name] = box.python(code)
        except Exception as exc:  # noqa: BLE001 - what the model would read
            results[name] = repr(exc)

    slow = [threading.Thread(target=run, args=(f"slow{i}", f"import time; time.sleep(1.5); print('slow{i}')"))
            for i in range(2)]
    for t in slow:
        t.start()
    time.sleep(0.3)  # (the slow calls hold the worker, one after the other: about 3 s, past the fast one's 2 s)
    run("fast", "print('fast')")
    for t in slow:
        t.join()
    assert results == {"slow0": "slow0\n", "slow1": "slow1\n", "fast": "fast\n"}, results
    impatient = PythonSandbox(timeout_s=2.0, workers=1, memory_mb=256, wait_s=0.2)
    slow = threading.Thread(target=run, args=("slow", "import time; time.sleep(1.5); print('slow')"))
    slow.start()
    time.sleep(0.3)
    with pytest.raises(TimeoutError, match="no sandbox worker came free within 0.2 s"):
        impatient.python("print('fast')")
    slow.join()


def test_a_calls_memory_is_bounded_as_a_whole_or_the_per_process_bound_is_said(caplog):
    """Five processes of one call each fill 100 MB under memory_mb=256: within each process's address-space limit,
    500 MB together, past the call's cgroup limit (memory_mb + scratch_mb + 64 MB). Where the call gets a memory
    cgroup the kernel enforces (a writable hierarchy: root here) they cannot all finish;
    where it gets none (a container without delegation, a job that does not run as root) they do, and the sandbox
    said so at start, naming the per-process bound. Either way the outcome and the warning agree."""
    import logging

    from hfllamarl.plugins.environments.python_sandbox import PythonSandbox
    from hfllamarl.sandbox import client

    client._NO_CGROUP_WARNED[0] = False
    with caplog.at_level(logging.WARNING, logger="hfllamarl.sandbox.client"):
        box = PythonSandbox(timeout_s=20, memory_mb=256)
        sandbox = box._sandbox()
        try:
            out = box.python(textwrap.dedent("""
                import os, time
                kids = []
                for _ in range(5):
                    pid = os.fork()
                    if pid == 0:
                        block = b"x" * (100 << 20)
                        time.sleep(1.5)
                        os._exit(0)
                    kids.append(pid)
                print(all(os.waitpid(k, 0)[1] == 0 for k in kids))
            """))
        except (TimeoutError, RuntimeError) as exc:  # the whole call killed by the cgroup
            out = f"killed: {exc}"
        finally:
            sandbox.close()
    warned = any("bounded per process, not per call" in r.getMessage() for r in caplog.records)
    all_finished = out.strip() == "True"
    assert all_finished == warned, (out, warned)

