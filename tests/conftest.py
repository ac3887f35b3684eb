"""Shared fixtures: a tiny local model (no hub), free ports, and a launcher for multi-process scripts."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# Jobs started side by side run one thread per process and unpinned: a single-process job pins its trainer and its
# generator child to cores of their own, the same cores for every job of the machine, so side-by-side jobs would
# queue on them while the others idle (three plain-python jobs: 52-60 s pinned, 38 s unpinned).
SIDE_BY_SIDE_ENV = {"OMP_NUM_THREADS": "1"}
SHARED_DATA = REPO.parent / "shared" / "data"
# The docs' code blocks as tests (docs/ is in pytest.ini's testpaths): tests/markdown_blocks.py.
pytest_plugins = ["markdown_blocks"]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# (no hub is reachable; and the jobs that say so themselves then share the preload server's import-time environment)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def preload_server():
    """One preloaded process server for the session (`hfllamarl.runtime.world.preload`), named to every job in
    `HFLLAMARL_PRELOAD`, so that the generator ranks of single-process jobs (this process's trainers, and the
    plain-python scripts the tests run) are forked from it in milliseconds instead of each importing vLLM again.
    `HFLLAMARL_TEST_PRELOAD=0` turns it off (every generator rank spawned, as a user's job without a server)."""
    if os.environ.get("HFLLAMARL_TEST_PRELOAD", "1") == "0" or "HFLLAMARL_PRELOAD" in os.environ:
        yield None
        return
    from hfllamarl.runtime.world.preload import DEFAULT_WARM, start_server

    # (the trainer's modules too: a job's trainer ranks are forked from it as well as its generator ranks)
    proc, client = start_server(modules=(*DEFAULT_WARM, "hfllamarl.trainers.async_aipo_trainer"))
    os.environ["HFLLAMARL_PRELOAD"] = client.path
    try:
        yield client
    finally:
        os.environ.pop("HFLLAMARL_PRELOAD", None)
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random-init tiny Llama with the answer format warmed up, saved with save_pretrained."""
    from hfllamarl.testing.tiny import build_tiny_model, warm_start_format

    path = str(tmp_path_factory.mktemp("tiny") / "model")
    build_tiny_model(path, seed=0)
    warm_start_format(path, steps=40, seed=0)
    return path


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> str:
    """The tiny model with Qwen3's chat template (tool-call markers as tokens), warmed up on the calculator task's
    two answer formats: a tool call (about a fifth of its answers), or a boxed guess; half the warm-up questions end
    with an environment's text, as test environments add it."""
    from hfllamarl.testing.tiny import build_tiny_model
    from hfllamarl.testing.tiny_chat import warm_start_tool_calls

    path = str(tmp_path_factory.mktemp("tool") / "model")
    build_tiny_model(path, chat_template="qwen3", max_position_embeddings=512, seed=0)
    warm_start_tool_calls(path, steps=120, call_share=0.5, seed=0, hint_share=0.5)
    return path


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    """`family_model(name)`: a random-init model of one of `hfllamarl.testing.tiny.FAMILIES`, built once per session."""
    from hfllamarl.testing.tiny import build_tiny_model

    built = {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = build_tiny_model(str(tmp_path_factory.mktemp(f"model-{family}") / "model"), family=family)
        return built[family]

    return get


def cpu_trainer(model, **fields):
    """A `TrainerExecutor` over `model` in one process, for one step's gradients: SGD at learning rate 0, AIPO
    (rho 4), a reward of 0, one batch at staleness 0, temperature 1, no clipping; `fields`: more `TrainerSpec`
    fields (num_generations, micro_batch_size, ...). Its layout is padded until the test sets or checks one."""
    import torch

    from hfllamarl.plugins.algorithms.aipo import AIPO
    from hfllamarl.runtime.data.rewards import RewardRunner
    from hfllamarl.runtime.loop.sampling import Sampling
    from hfllamarl.runtime.loop.schedule import Schedule
    from hfllamarl.runtime.training.trainer import TrainerExecutor, TrainerSpec
    from hfllamarl.runtime.world.topology import Topology

    spec = TrainerSpec(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), scheduler=None,
                       algorithm=AIPO(rho=4.0), rewards=RewardRunner([lambda completions, **kw: [0.0] * len(completions)]),
                       backend=None, schedule=Schedule(1, 0), sampling=Sampling(), max_grad_norm=None, pad_token_id=0,
                       device=torch.device("cpu"), **fields)
    return TrainerExecutor(spec, Topology(mode="single", rank=0, world_size=2, num_generators=1, timeout_s=10,
                                          use_cpu=True))


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (`hfllamarl.runtime.world.ports.free_port`, which says why:
    EADDRINUSE in a drill, seen in CI, and both xdist workers drawing the same ports after `random.seed(42)`)."""
    from hfllamarl.runtime.world.ports import free_port as pick

    return pick()


def run_script(args: list[str], nproc: int | None = None, timeout: float = 600, env: dict | None = None,
               launcher: str = "ranks") -> subprocess.CompletedProcess:
    """Run a script as one process (`nproc=None`) or as `nproc` ranks: `launcher="ranks"` forks them from the
    session's preload server as a batch scheduler starts ranks (RANK, WORLD_SIZE, MASTER_*; torchrun where there
    is no server); "torchrun" and "accelerate ..." launch them as users do, every rank importing everything."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.pop("WORLD_SIZE", None)
    full_env.pop("RANK", None)
    if nproc is None:  # (forked from the session's server where there is one, as `subprocess.run` runs it)
        proc = popen_script(args, full_env)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess([sys.executable, *args], proc.returncode, out, err)
    if launcher in ("ranks", "torchrun"):
        if launcher == "ranks":
            forked = _run_ranks_forked(nproc, args, full_env, timeout)
            if forked is not None:
                return forked
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher.split()[1:],
               "--num_processes", str(nproc), "--main_process_port", str(free_port()), *args]
    proc = subprocess.run(cmd, cwd=str(REPO), env=full_env, capture_output=True, text=True, timeout=timeout)
    return proc


def _session_client(env: dict):
    """The session's preload client, if the job's environment names the session's server (a job given
    `HFLLAMARL_PRELOAD=0` is spawned, imports and all); else None."""
    setting = os.environ.get("HFLLAMARL_PRELOAD")
    if not setting or env.get("HFLLAMARL_PRELOAD") != setting:
        return None
    from hfllamarl.runtime.world import preload

    return preload.client()


def rank_env(env: dict, rank: int, n: int, port: int) -> dict:
    """A rank's environment as a batch scheduler (or mpirun) sets it: rank 0 hosts the job's store."""
    e = dict(env, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    e.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return e


class _Drain:
    """Reads a pipe to its end in a thread of its own; `.text(timeout)` is what it read (TimeoutError before)."""

    def __init__(self, fd: int):
        self._chunks: list[bytes] = []
        self._future = ThreadPoolExecutor(1).submit(self._read, fd)

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as fh:
            for chunk in iter(lambda: fh.read1(1 << 16), b""):
                self._chunks.append(chunk)

    def text(self, timeout: float | None) -> str:
        self._future.result(timeout=timeout)
        return b"".join(self._chunks).decode(errors="replace")


def _fork_ranks(client, n: int, args: list[str], env: dict, stdio) -> list | None:
    """`n` ranks of `python args[0] args[1:]`, forked (None: the server would not fork them all)."""
    port = free_port()
    procs = []
    try:
        for rank in range(n):
            procs.append(client.run(None, args[1:], rank_env(env, rank, n, port), path=args[0],
                                    stdio=stdio(rank), cwd=str(REPO)))
    except (OSError, ValueError):
        for p in procs:
            p.kill()
            p.wait(30)
        return None
    return procs


def _run_ranks_forked(n: int, args: list[str], env: dict, timeout: float,
                      grace: float = 90.0) -> subprocess.CompletedProcess | None:
    """`n` ranks forked from the session's server, their output captured in one stream each (as torchrun's is). A
    rank that fails leaves the others `grace` s to end on their own (the job's liveness ends them, as under any
    launcher that does not); any still running then are killed, and said so. None: spawn them (torchrun)."""
    client = _session_client(env)
    if client is None:
        return None
    import time

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    procs = _fork_ranks(client, n, args, env, lambda rank: (null, out_w, err_w))
    for fd in (out_w, err_w, null):
        os.close(fd)
    if procs is None:
        os.close(out_r)
        os.close(err_r)
        return None
    out, err = _Drain(out_r), _Drain(err_r)
    deadline, failed_at, note = time.monotonic() + timeout, None, ""
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        late = failed_at is not None and now - failed_at > grace
        if now > deadline or late:
            left = [r for r, p in enumerate(procs) if p.poll() is None]
            for r in left:
                procs[r].kill()
            for p in procs:
                p.wait(30)
            if not late:
                err.text(30)
                raise subprocess.TimeoutExpired(args, timeout)
            note = f"\n[test launcher] ranks {left} were still running {grace:.0f} s after a rank failed: killed\n"
            break
        time.sleep(0.1)
    codes = [p.returncode for p in procs]
    code = next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(args, 1 if code else 0, out.text(60), err.text(60) + note)


def beside(fn, *args, **kwargs) -> Future:
    """`fn(*args, **kwargs)` started in a thread of its own: a job run beside the test's own (much of each is
    start-up). `.result()` gives its value, or raises its error (a timeout included)."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args, **kwargs)
    finally:
        pool.shutdown(wait=False)  # (the submitted job still runs to its end)


def prompts_log(path) -> list[dict]:
    """A trainer rank's prompts log (`trained_prompts-...jsonl`): one dict per step."""
    import json

    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def prompts_log_runs(log: list[dict]) -> list[list[dict]]:
    """A group's prompts log cut where a new process of the group took over: its launcher's restart count changed,
    or its own step count started again (a restart that resumed from a checkpoint written just before the kill
    goes on with the next step)."""
    runs = [[]]
    for e in log:
        if runs[-1] and (e["step"] <= runs[-1][-1]["step"] or e.get("attempt") != runs[-1][-1].get("attempt")):
            runs.append([])
        runs[-1].append(e)
    return runs


def tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-n:]}\n--- stderr ---\n{proc.stderr[-n:]}"


def step_logs(stdout: str) -> list[dict]:
    """The per-step log rows of `trainer.state.log_history`, as `tests/scripts/train_tiny.py` prints it."""
    import json

    line = [l for l in stdout.splitlines() if l.startswith("LOG_HISTORY ")][-1]
    return [h for h in json.loads(line[len("LOG_HISTORY "):]) if "reward" in h]


def assert_on_policy(h: dict) -> None:
    """pi/mu == 1 on every token of a step: the generator sampled with exactly the trainer's weights."""
    assert abs(h["is_ratio/max"] - 1.0) < 1e-4 and abs(h["is_ratio/min"] - 1.0) < 1e-4, h


def orphans(output_dir: str) -> list[dict]:
    """Processes still alive whose command line names `output_dir` (a job's leftovers after it ended)."""
    import psutil

    return [p.info for p in psutil.process_iter(["pid", "cmdline"])
            if any(c == output_dir or (c or "").startswith(output_dir + os.sep) for c in (p.info["cmdline"] or []))]


def kill_processes(processes) -> None:
    """SIGKILL each of `processes` (psutil), one that ended since it was listed included (its peer was killed
    first, or it was ending anyway)."""
    import psutil

    for p in processes:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def job_processes(proc, out: str) -> list:
    """A job's processes: `proc` (a Popen), its descendants, and every process whose command line names `out` (a
    generator rank forked by the session's preload server is the server's child, not the job's; its command line is
    the one a spawned rank has)."""
    import psutil

    found = {}
    try:
        top = psutil.Process(proc.pid)
        for p in [top] + top.children(recursive=True):
            found[p.pid] = p
    except psutil.NoSuchProcess:
        pass
    for info in orphans(out):
        try:
            found.setdefault(info["pid"], psutil.Process(info["pid"]))
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def trained_rows(out: str, rank: int = 0) -> dict[int, list[int]]:
    """step -> dataset rows trained at that step (the last line for a step wins after a resume)."""
    import json

    rows = {}
    for line in open(os.path.join(out, f"trained_prompts-rank{rank}.jsonl")):
        rec = json.loads(line)
        rows[rec["step"]] = rec["rows"]
    return rows


def launch_bare(n: int, args: list[str], env: dict) -> list:
    """Start n ranks with only RANK/WORLD_SIZE/MASTER_* set (rank 0 hosts the store), as mpirun or
    a batch scheduler would: unlike torchrun, nobody kills the survivors when one rank dies. Forked from the
    session's preload server (`ForkedRank`s) where there is one, else spawned (`subprocess.Popen`s); either way
    each has its own `stdout`/`stderr` pipes, `communicate()`, `send_signal()`, `kill()`."""
    full = dict(os.environ, **env)
    client = _session_client(full)
    if client is not None:
        pipes = {}

        def stdio(rank):
            pipes[rank] = os.pipe(), os.pipe()
            return os.open(os.devnull, os.O_RDONLY), pipes[rank][0][1], pipes[rank][1][1]

        procs = _fork_ranks(client, n, args, full, stdio)
        for (o_r, o_w), (e_r, e_w) in pipes.values():
            os.close(o_w)
            os.close(e_w)
            if procs is None:
                os.close(o_r)
                os.close(e_r)
        if procs is not None:
            return [ForkedRank(p, pipes[r][0][0], pipes[r][1][0], args) for r, p in enumerate(procs)]
    port = free_port()
    return [subprocess.Popen([sys.executable, *args], cwd=str(REPO), env=rank_env(full, rank, n, port), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(n)]


def popen_script(args: list[str], env: dict | None = None, stdout=subprocess.PIPE, stderr=subprocess.PIPE):
    """`subprocess.Popen([python, *args], cwd=REPO, env=env, stdout=stdout, stderr=stderr, text=True)` (`args`: a
    script and its arguments, or `-m module ...`), forked from the session's preload server where the environment
    names it (a `ForkedRank`); `stdout` a pipe or a file, `stderr` a pipe, a file or `subprocess.STDOUT`."""
    full = dict(os.environ) if env is None else dict(env)
    client = _session_client(full)
    if client is not None:
        module, path = (args[1], None) if args[0] == "-m" else (None, args[0])
        rest = args[2:] if module else args[1:]
        out_r = out_w = err_r = err_w = None
        if stdout == subprocess.PIPE:
            out_r, out_w = os.pipe()
        if stderr == subprocess.PIPE:
            err_r, err_w = os.pipe()
        o = out_w if out_w is not None else stdout.fileno()
        e = err_w if err_w is not None else (o if stderr == subprocess.STDOUT else stderr.fileno())
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            proc = client.run(module, rest, full, path=path, stdio=(null, o, e), cwd=str(REPO))
        except (OSError, ValueError):
            proc = None
        for fd in (out_w, err_w, null):
            if fd is not None:
                os.close(fd)
        if proc is not None:
            return ForkedRank(proc, out_r, err_r, args)
        for fd in (out_r, err_r):
            if fd is not None:
                os.close(fd)
    return subprocess.Popen([sys.executable, *args], cwd=str(REPO), env=full, stdout=stdout, stderr=stderr, text=True)


class ForkedRank:
    """A process forked from the session's server, held as `subprocess.Popen(..., text=True)` is: pid, returncode,
    poll(), wait(), send_signal(), kill(), communicate() (its output, where it goes to a pipe)."""

    def __init__(self, proc, out_fd: int | None, err_fd: int | None, args):
        self._proc, self.pid, self.args = proc, proc.pid, args
        self._out = None if out_fd is None else _Drain(out_fd)
        self._err = None if err_fd is None else _Drain(err_fd)

    @property
    def returncode(self):
        return self._proc.returncode

    def poll(self):
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self._proc.send_signal(sig)

    def kill(self) -> None:
        self._proc.kill()

    def terminate(self) -> None:
        self._proc.terminate()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        import time

        start = time.monotonic()
        self._proc.wait(timeout)
        rest = None if timeout is None else max(timeout - (time.monotonic() - start), 1.0)
        try:
            return tuple(None if d is None else d.text(rest) for d in (self._out, self._err))
        except TimeoutError as e:  # (a descendant still holds its output open)
            raise subprocess.TimeoutExpired(self.args, timeout) from e
