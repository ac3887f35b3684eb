"""Single-process jobs (`python script.py`, a notebook): the trainer starts its generator ranks as children.

The parent hosts the job's store; each child joins it as one generator rank (`python -m hfllamarl.runtime.generation.generator_child`).
On a CPU the parent and each child get cores of their own, so that generation and training overlap
instead of fighting over the same cores. A child exits as soon as its parent is gone.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

from hfllamarl.runtime.world.core_lending import ENV_BOARD

logger = logging.getLogger(__name__)

ENV_STORE = "HFLLAMARL_STORE"  # host:port of the store a single-process parent hosts
ENV_RANK = "HFLLAMARL_RANK"
ENV_WORLD = "HFLLAMARL_WORLD_SIZE"
ENV_PARENT = "HFLLAMARL_PARENT_PID"
ENV_JOB = "HFLLAMARL_JOB_ID"
ENV_CPUS = "HFLLAMARL_CPUS"  # cores a generator child is pinned to
# In a child forked by the preload server (`hfllamarl.runtime.world.preload`): a pidfd of the trainer that asked for
# it. Its parent is the server, so "the parent is gone" is read from this instead of from getppid().
PARENT_PIDFD: int | None = None


def split_cpus(topo) -> dict[int, list[int]]:
    """Disjoint cores for the trainer (rank 0) and each generator child (empty: no split)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not topo.use_cpu or len(cpus) < topo.world_size or "OMP_NUM_THREADS" in os.environ:
        return {}
    trainer_share = len(cpus) - topo.num_generators
    split = {0: cpus[:trainer_share]}
    for i, rank in enumerate(topo.generator_ranks):
        split[rank] = [cpus[trainer_share + i]]
    return split


def _rank_env(topo, rank: int, split: dict) -> dict[str, str]:
    """What a generator child's environment says of its place in the job, whichever job it runs."""
    env = {
        ENV_RANK: str(rank),
        ENV_WORLD: str(topo.world_size),
        ENV_PARENT: str(os.getpid()),
        # vLLM's external launcher reads these: RANK/WORLD_SIZE describe the child's replica (its engine's
        # world), LOCAL_RANK is the device index on this machine (each generator its own).
        "RANK": str((rank - topo.num_trainers) % topo.replica_size),
        "LOCAL_RANK": str(rank - topo.num_trainers),
        "WORLD_SIZE": str(topo.replica_size),
        "LOCAL_WORLD_SIZE": str(topo.num_generators),
    }
    if split:
        env["OMP_NUM_THREADS"] = str(len(split[rank]))
        env[ENV_CPUS] = ",".join(map(str, split[rank]))
    return env


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hfllamarl.runtime.generation.generator_child", *args]


class Prestarted:
    """Generator children started ahead of `train()` (`AsyncAIPOTrainer.__init__`): each takes its cores, imports
    vLLM and the generator's modules, and waits on its standard input for its job. Importing vLLM takes a core
    several seconds (more on a GPU machine), which then overlap the trainer's own set-up (its tokenizer, the
    data set's checks, loading the policy). A child not used exits when this object is released or collected, or
    when its parent is gone."""

    def __init__(self, topo, output_dir: str):
        self.cwd, self.output_dir = os.getcwd(), os.path.abspath(output_dir)
        self.children: dict[int, tuple[subprocess.Popen, dict[str, str]]] = {}
        split = split_cpus(topo)
        for rank in topo.generator_ranks:
            env = {**os.environ, **_rank_env(topo, rank, split)}
            # The job's output directory is on the command line (as a job's spec is) so that `ps` and the
            # tools that look for a job's processes find this one too.
            proc = subprocess.Popen(_cmd("--prestarted", self.output_dir), env=env, stdin=subprocess.PIPE)
            self.children[rank] = (proc, env)

    def claim(self, topo, rank: int, split: dict, job_env: dict[str, str], spec_path: str):
        """The child started for `rank`, now running its job, or None: it is gone, or it was started for another
        job or process state (its rank, the world's size, its cores, the environment or the working directory
        have changed since; the trainer's config, a script's `os.environ`), and it is stopped."""
        proc, env = self.children.pop(rank, (None, None))
        if proc is None:
            return None
        now = {**os.environ, **_rank_env(topo, rank, split)}
        changed = sorted(k for k in set(env) | set(now) if env.get(k) != now.get(k))
        if os.getcwd() != self.cwd:
            changed.append("the working directory")
        if proc.poll() is None and not changed:
            try:
                proc.stdin.write((json.dumps({"spec": spec_path, "env": job_env}) + "\n").encode())
                proc.stdin.close()
                return proc
            except (BrokenPipeError, OSError):
                pass
        logger.info("rank %d: a new generator process starts: the one started with the trainer %s", rank,
                    f"was started with another {', '.join(changed)}" if changed else "is gone")
        _stop(proc)
        return None

    def release(self) -> None:
        """Stop the children not claimed."""
        children, self.children = [proc for proc, _ in self.children.values()], {}
        for proc in children:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """End a child that holds no job (it may still be importing): terminated, and reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        proc.stdin.close()
    except OSError:
        pass


def start_children(topo, spec_path: str, prestarted: Prestarted | None = None) -> list[tuple[int, subprocess.Popen]]:
    """Start one `hfllamarl.runtime.generation.generator_child` process per generator rank (or hand its job to the one
    `prestarted` holds for it); returns (rank, process) pairs."""
    host, port = topo.store_addr or ("127.0.0.1", topo.store().port)
    split = split_cpus(topo)
    board = None
    if split:  # the trainer (this process) keeps the first cores, and borrows the others when they idle
        import torch

        from hfllamarl.runtime.world.core_lending import CoreBoard, CoreLender

        board = CoreBoard(spec_path + ".cores", topo.num_generators, create=True)
        topo.core_lender = CoreLender(board, split[0], sorted(c for cpus in split.values() for c in cpus))
        topo.cores_before = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())  # (stop_children restores)
        os.sched_setaffinity(0, split[0])
        torch.set_num_threads(len(split[0]))
    children = []
    for rank in topo.generator_ranks:
        job_env = {ENV_STORE: f"{host}:{port}", ENV_JOB: str(topo.job_id)}
        if board is not None:
            job_env[ENV_BOARD] = board.path
        proc = prestarted.claim(topo, rank, split, job_env, spec_path) if prestarted is not None else None
        if proc is None:
            env = {**os.environ, **_rank_env(topo, rank, split), **job_env}
            proc = _forked(env, spec_path)
        if proc is None:
            proc = subprocess.Popen(_cmd(spec_path), env=env)
        children.append((rank, proc))
    return children


def _forked(env: dict, spec_path: str):
    """The generator child forked by the preload server (`preload.client()`), or None: spawn it."""
    from hfllamarl.runtime.world import preload

    client = preload.client()
    if client is None:
        return None
    try:
        return client.run(_cmd(spec_path)[2], _cmd(spec_path)[3:], env)
    except (OSError, ValueError) as e:
        preload._fallback(f"the server did not fork ({e})", named=os.environ.get(preload.ENV_PRELOAD) not in ("1", None))
        return None


def child_settings() -> dict | None:
    """In a generator child: where the parent's store is and which rank this is (None: not a child)."""
    if ENV_STORE not in os.environ:
        return None
    host, port = os.environ[ENV_STORE].rsplit(":", 1)
    return {"store_addr": (host, int(port)), "rank": int(os.environ[ENV_RANK]),
            "world_size": int(os.environ[ENV_WORLD]), "job_id": int(os.environ.get(ENV_JOB, "0")),
            "parent": int(os.environ[ENV_PARENT]), "cpus": os.environ.get(ENV_CPUS)}


def take_cores(cpus: str | None) -> None:
    """In a generator child: run on the cores the parent gave (`HFLLAMARL_CPUS`, "0,1"; empty: no pinning)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])


def watch_parent(parent: int, gone, name: str, until: threading.Event | None = None) -> None:
    """In a generator child: a thread that calls `gone()` (which ends the process) once the parent process is gone,
    looking every 0.5 s, until `until` is set."""

    def watch():
        while until is None or not until.is_set():
            if parent_gone(parent):
                gone()
            time.sleep(0.5)

    threading.Thread(target=watch, name=name, daemon=True).start()


def parent_gone(parent: int) -> bool:
    """Whether the trainer process `parent` is gone: this process's parent changed, or (forked by the preload
    server, whose child it is) the trainer's pidfd says it exited."""
    if PARENT_PIDFD is not None:
        import select

        return bool(select.select([PARENT_PIDFD], [], [], 0)[0])
    return os.getppid() != parent


def become_child(settings: dict) -> None:
    """In a generator child: take the cores the parent gave, and exit as soon as the parent is gone."""
    take_cores(settings["cpus"])
    parent = settings["parent"]

    def gone():
        from hfllamarl.runtime.world.processes import last_words

        last_words(f"\n[hfllamarl] rank {settings['rank']} (generator {settings['rank'] - 1}) stops because rank 0 "
                   f"(trainer 0), its parent process (pid {parent}), is gone.\n")
        os._exit(3)

    watch_parent(parent, gone, "hfllamarl-parent-watch")
