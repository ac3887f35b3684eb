"""Process layout: who trains, who generates, and the process groups that join them.

A job has N processes. Ranks `0 .. T-1` train, ranks `T .. N-1` generate. The G generator ranks form
R = G / m *replicas*, each an independent vLLM engine, tensor parallel over m consecutive ranks
(replica r holds ranks `T + r*m .. T + (r+1)*m - 1`). Each executor gets a world of its own: the
default process group of a trainer process holds only the trainer ranks, that of a generator process
only the ranks of its replica (vLLM's external launcher takes the default world as the engine's), so
Accelerate/FSDP and each engine see only their own ranks.

The trainer ranks and each replica are joined by a *bridge*: two process groups on their own store
prefixes, one for picklable objects (always gloo) and one for tensors (gloo on CPU, NCCL on GPU), which
the channels and the weight sync use; with R replicas there are R bridges (trainers + replica r), so a
lost replica takes only its own bridge down. Replicas that relay weights to each other are joined by a
*relay* group (tensors only), built when a relay first needs it.

Everything is set up from the launcher's rendezvous alone (`MASTER_ADDR:MASTER_PORT`, as torchrun
and `accelerate launch` give it). Started as a single process (`python script.py`), the process
is the only trainer and starts the generators as child processes joined through a store it hosts, which
listens on the loopback address only (`host_store`).
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from hfllamarl.runtime.world.liveness import Liveness, PeerLostError  # noqa: F401  (PeerLostError: re-exported for the channels)
from hfllamarl.runtime.world.store import host_store  # noqa: F401  (re-exported)


def settle_collectives_at_exit() -> None:
    """Give gloo's worker threads the interpreter before it shuts down (registered once per process).

    A gloo worker frees a finished collective's tensors right after the caller's `wait()` returns, and freeing a
    tensor that Python knew takes the GIL. A script that ends right after a collective (a save, `train()`'s last
    step) can reach interpreter shutdown first; the worker's GIL request then unwinds its thread and the process
    aborts ("terminate called without an active exception", exit -6) after a run that succeeded. An exit handler
    runs while the threads can still take the GIL: it releases it for a moment so they finish.
    """
    global _SETTLE_REGISTERED
    if not _SETTLE_REGISTERED:
        import atexit
        import time

        atexit.register(time.sleep, 0.2)
        _SETTLE_REGISTERED = True


_SETTLE_REGISTERED = False


class TopologyError(RuntimeError):
    """A launch that cannot form a job; the message says how to launch instead."""


@dataclass
class Topology:
    """Where this process sits in the job."""

    mode: str  # "launcher" (torchrun / accelerate launch), "single" (python script.py), "child"
    rank: int  # rank on the bridge, 0 .. world_size-1
    world_size: int
    num_generators: int
    timeout_s: float
    use_cpu: bool
    store_addr: tuple[str, int] | None = None
    job_id: int = 0  # a single process may run train() several times (a notebook): one job each
    tensor_parallel_size: int | None = None  # ranks per vLLM replica (None: one replica over every generator rank)
    failure: str = "stop"  # generator_failure: "continue" survives the loss of a replica
    trainer_tp: int = 1  # trainer ranks per tensor-parallel group (consecutive ranks; they train the same data)
    trainer_shard: int | None = None  # data-parallel ranks FSDP2 shards over (None: all; fewer: hybrid sharding)
    _store: object = field(default=None, repr=False)
    _bridge: dict = field(default_factory=dict, repr=False)  # (kind, replica) or (kind, "relay", a, b) -> group
    _members: dict = field(default_factory=dict, repr=False)  # id(group) -> its bridge ranks, in group-rank order
    _hosts_store: bool = field(default=False, repr=False)
    _children: list = field(default_factory=list, repr=False)  # single mode: (rank, Popen) of each generator
    _prestarted: Any = field(default=None, repr=False)  # single mode: `spawn.Prestarted`, children awaiting a job
    # the staleness study's runner (`hfllamarl.study.lockstep`): this process samples its own batches, no children
    samples_in_process: bool = field(default=False, repr=False)
    core_lender: object = field(default=None, repr=False)  # single mode on a CPU: `core_lending.CoreLender`
    cores_before: object = field(default=None, repr=False)  # single mode: (cores, torch threads) before the job pinned

    def __post_init__(self):
        self.liveness = Liveness(self)
        self.lost: dict[int, str] = {}  # replica -> why it was lost (generator_failure="continue")
        self.containing = False  # a lost replica is survived from now on (set once every rank is up)

    @property
    def num_trainers(self) -> int:
        return self.world_size - self.num_generators

    @property
    def trainer_ranks(self) -> list[int]:
        return list(range(self.num_trainers))

    @property
    def generator_ranks(self) -> list[int]:
        return list(range(self.num_trainers, self.world_size))

    @property
    def data_parallel_size(self) -> int:
        """Trainer ranks that train different data: the trainer ranks over their tensor-parallel size."""
        return self.num_trainers // self.trainer_tp

    def data_rank_of(self, rank: int) -> int:
        """Which share of a batch trainer rank `rank` trains (its tensor-parallel group's index)."""
        return rank // self.trainer_tp

    @property
    def role(self) -> str:
        return "trainer" if self.rank < self.num_trainers else "generator"

    # ---------------------------------------------------------------- replicas
    @property
    def replica_size(self) -> int:
        """Ranks per vLLM replica (its tensor-parallel size)."""
        return self.tensor_parallel_size or self.num_generators

    @property
    def num_replicas(self) -> int:
        return self.num_generators // self.replica_size

    def replica_of(self, rank: int) -> int | None:
        """The replica bridge rank `rank` belongs to (None: a trainer rank)."""
        return None if rank < self.num_trainers else (rank - self.num_trainers) // self.replica_size

    def replica_ranks(self, replica: int) -> list[int]:
        first = self.num_trainers + replica * self.replica_size
        return list(range(first, first + self.replica_size))

    @property
    def replica(self) -> int | None:
        """This rank's replica (None on a trainer rank)."""
        return self.replica_of(self.rank)

    @property
    def live_replicas(self) -> list[int]:
        """Replicas not known to be lost, in order."""
        return [r for r in range(self.num_replicas) if r not in self.lost]

    def mark_lost(self, replica: int, cause: str) -> bool:
        """Record that `replica` is lost (generator_failure="continue"); True the first time. Waits on its ranks
        give up from now on (`channels`)."""
        if replica in self.lost:
            return False
        self.lost[replica] = cause
        return True

    @property
    def survivable(self) -> bool:
        """Whether the job goes on when a replica is lost: generator_failure="continue", several replicas, and the
        job has started (a replica that cannot start stops the job)."""
        return self.failure == "continue" and self.containing and self.num_replicas > 1

    def contained(self, rank: int) -> bool:
        """Whether a failure of bridge rank `rank` is survived, as seen from this rank: with generator_failure=
        "continue", once the job has started, the loss of another replica's generator rank."""
        other = self.replica_of(rank)
        return self.survivable and other is not None and other != self.replica

    def local_rank_of(self, rank: int) -> int:
        """Rank of bridge rank `rank` inside its executor's world (a generator rank: inside its replica)."""
        return rank if rank < self.num_trainers else (rank - self.num_trainers) % self.replica_size

    @property
    def local_rank(self) -> int:
        """Rank inside this executor's own world (a generator rank: inside its replica)."""
        return self.local_rank_of(self.rank)

    @property
    def local_world_size(self) -> int:
        return self.num_trainers if self.role == "trainer" else self.replica_size

    @property
    def device_type(self) -> str:
        return "cpu" if self.use_cpu else "cuda"

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def describe(self, rank: int) -> str:
        """Human name of a bridge rank, e.g. 'rank 2 (generator 0)', 'rank 3 (generator 1, replica 1)'."""
        if rank < self.num_trainers:
            return f"rank {rank} (trainer {rank})"
        if self.num_replicas > 1:
            return f"rank {rank} (generator {rank - self.num_trainers}, replica {self.replica_of(rank)})"
        return f"rank {rank} (generator {rank - self.num_trainers})"

    def engine_id(self, replica: int | None = None) -> str:
        """The name of a tensor-parallel vLLM replica's engine (its CPU shared memory ends with it: `engine.py`): the
        job's port, its number and the replica; without `replica`, the prefix every engine of the job shares."""
        prefix = f"{self.store_addr[1]}-{self.job_id}-"
        return prefix if replica is None else f"{prefix}{replica}"

    def describe_replica(self, replica: int) -> str:
        ranks = self.replica_ranks(replica)
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"replica {replica} ({where})"

    # ---------------------------------------------------------------- store and worlds
    def store(self):
        """The job's key-value store (created on first use)."""
        import torch.distributed as dist

        if self._store is None:
            if self.mode == "single":
                # This process hosts the store; children connect to its port, on this machine only.
                self._store = host_store("127.0.0.1", 0, self.timeout)
                self._hosts_store = True
                self.store_addr = ("127.0.0.1", self._store.port)
            else:
                host, port = self.store_addr
                agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
                self._hosts_store = self.mode == "launcher" and not agent and self.rank == 0
                if self._hosts_store:
                    self._store = host_store(host, port, self.timeout)
                else:
                    self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                                timeout=self.timeout)
        return self._store

    def init_local_world(self) -> None:
        """Make this executor's world the default process group (idempotent)."""
        import torch.distributed as dist

        if dist.is_initialized():
            if dist.get_world_size() != self.local_world_size:
                raise TopologyError(
                    f"torch.distributed was already initialized with {dist.get_world_size()} ranks, but this "
                    f"{self.role}'s world has {self.local_world_size}. Create AsyncAIPOConfig before anything "
                    "else initializes torch.distributed."
                )
            return
        backend = "gloo" if self.use_cpu else "nccl"
        settle_collectives_at_exit()
        world = "trainer" if self.role == "trainer" else f"generator/{self.replica}"  # a replica is a world
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"hfllamarl/world/{self.job_id}/{world}", self.store()),
            rank=self.local_rank,
            world_size=self.local_world_size,
            timeout=self.timeout,
        )

    def bridge(self, kind: str = "object", replica: int | None = None):
        """The bridge of `replica` (default: this generator's own; on a trainer rank, replica 0 when there is only
        one): a process group over the trainer ranks and that replica's ranks, kind "object" (gloo) or "tensor".
        Inside it the trainer ranks keep their numbers and the replica's ranks follow (`group_rank`)."""
        if replica is None:
            replica = self.replica if self.role == "generator" else 0
            if self.role == "trainer" and self.num_replicas > 1:
                raise ValueError("a trainer rank has one bridge per generator replica: name the replica")
        members = self.trainer_ranks + self.replica_ranks(replica)
        return self._group((kind, replica), f"bridge/{kind}/{replica}", members, kind)

    def relay(self, a: int, b: int):
        """The relay group of replicas a and b (tensors only; a replica passing weights on to another)."""
        a, b = sorted((a, b))
        members = self.replica_ranks(a) + self.replica_ranks(b)
        return self._group(("tensor", "relay", a, b), f"relay/{a}-{b}", members, "tensor")

    def _group(self, key, name: str, members: list[int], kind: str):
        import torch.distributed as dist

        if key not in self._bridge:
            if self.rank not in members:
                raise ValueError(f"{self.describe(self.rank)} is not in the group {name}")
            store = dist.PrefixStore(f"hfllamarl/{self.job_id}/{name}", self.store())
            rank, size = members.index(self.rank), len(members)
            if kind == "object" or self.use_cpu:
                settle_collectives_at_exit()
                pg = dist.ProcessGroupGloo(store, rank, size, self.timeout)
            else:  # pragma: no cover - needs GPUs
                pg = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
            self._bridge[key] = pg
            self._members[id(pg)] = members
        return self._bridge[key]

    def link(self, peer: int, kind: str = "object"):
        """(group, the peer's rank in it): the group this rank talks to bridge rank `peer` through."""
        mine, theirs = self.replica, self.replica_of(peer)
        if mine is None and theirs is None:  # trainer to trainer: through any bridge that still stands
            pg = self.bridge(kind, (self.live_replicas or [0])[0])
        elif mine is None or theirs is None or mine == theirs:
            pg = self.bridge(kind, theirs if mine is None else mine)
        elif kind != "tensor":
            raise ValueError(f"replicas exchange only tensors (weights relayed): {self.describe(self.rank)} -> "
                             f"{self.describe(peer)} ({kind})")
        else:
            pg = self.relay(mine, theirs)
        return pg, self._members[id(pg)].index(peer)

    def join_bridges(self) -> None:
        """Build every bridge this rank belongs to (a trainer: one per replica, in order; a generator: its
        replica's), both kinds: group creation is a rendezvous, so every rank does it up front."""
        for replica in (range(self.num_replicas) if self.role == "trainer" else [self.replica]):
            self.bridge("object", replica), self.bridge("tensor", replica)

    @property
    def hosts_store(self) -> bool:
        """Whether this process hosts the job's store (it must outlive the others' failure reports)."""
        return self._hosts_store

    @property
    def store_host_rank(self) -> int | None:
        """The rank whose process hosts the store (None: torchrun's agent, not a rank, hosts it)."""
        if self.mode in ("single", "child"):
            return 0
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return None
        return 0

    def drop_bridge(self) -> None:
        """Close this rank's bridge groups now: a peer blocked on this rank fails at once instead of at its timeout.
        (Only dropping the last reference closes a gloo group's connections; abort() does not.)"""
        groups = list(self._bridge.values())
        self._bridge.clear()
        for pg in groups:
            try:
                pg.abort()
            except Exception:
                pass
        del groups
        gc.collect()

    # ---------------------------------------------------------------- single-process mode
    def new_job(self) -> None:
        """Single-process mode: forget the previous job's bridge and liveness before starting children again."""
        if self._children:
            raise TopologyError("the previous job's generator processes are still running")
        self.job_id += 1
        self.core_lender = None
        self._bridge.clear()
        self.lost, self.containing = {}, False
        self.liveness.stop()
        self.liveness = Liveness(self)

    def prestart_children(self, output_dir: str):
        """Single-process mode: start the generator children of a job writing to `output_dir` ahead of it, to
        import vLLM while the trainer sets up (`spawn.Prestarted`; the next `start_children` hands them their
        jobs). Returns them (None: this process starts no children)."""
        if self.mode != "single" or not self.generator_ranks or self.samples_in_process:
            return None
        from hfllamarl.runtime.world import preload

        if preload.enabled():  # the children will be forked from a preloaded server (started now, if it is ours)
            preload.begin()
            return None
        prestarted = self._prestarted
        if prestarted is None or not prestarted.children or prestarted.output_dir != os.path.abspath(output_dir):
            from hfllamarl.runtime.world.spawn import Prestarted

            self.release_prestarted()  # (another job's)
            self._prestarted = Prestarted(self, output_dir)
        return self._prestarted

    def release_prestarted(self) -> None:
        """Stop the prestarted generator children (a `train()` that starts no job: a finished run resumed)."""
        prestarted, self._prestarted = self._prestarted, None
        if prestarted is not None:
            prestarted.release()

    def start_children(self, spec_path: str) -> None:
        """Single-process mode: start the generator ranks as child processes (`hfllamarl.runtime.world.spawn`), or hand
        the prestarted ones their jobs."""
        from hfllamarl.runtime.world.spawn import start_children

        prestarted, self._prestarted = self._prestarted, None
        try:
            self._children = start_children(self, spec_path, prestarted)
        finally:
            if prestarted is not None:
                prestarted.release()  # (any not claimed)

    def exited_children(self, ended=()) -> list[tuple[int, int]]:
        """(rank, exit code) of the generator children that exited with an error. A child of `ended` (seen gone)
        is waited for up to 5 s: poll() answers None while another thread of this process reaps it, or (a child forked
        by the preload server) until the server's report of its status arrives, late on a loaded machine."""
        import subprocess

        out = []
        for rank, proc in self._children:
            code = proc.poll()
            if code is None and rank in ended:
                try:
                    code = proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    pass
            if code not in (None, 0):
                out.append((rank, code))
        return out

    def kill_children(self, ranks=None) -> None:
        """Kill the generator children (`ranks`: only those ranks')."""
        for rank, proc in self._children:
            if proc.poll() is None and (ranks is None or rank in ranks):
                proc.kill()

    def stop_children(self, grace_s: float = 10.0, finished: bool = False) -> None:
        """Wait up to `grace_s` for the child generators to finish, then kill the ones still running.
        `finished`: every child reached the end of the job (the end-of-job rendezvous), so all that is left for
        it is its process's exit; one that does not exit within `grace_s` (frozen after the rendezvous) is killed
        with a warning, and the job, whose work is all delivered, still ends normally."""
        import logging
        import subprocess

        for rank, proc in self._children:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                if finished:
                    logging.getLogger("hfllamarl").warning(
                        "%s reached the end of the job but its process (pid %d) did not exit within %.0f s: killed "
                        "(the run is complete)", self.describe(rank), proc.pid, grace_s)
        self._children.clear()
        if self.use_cpu and self.store_addr is not None:  # what a killed child's tensor-parallel engine left behind
            from hfllamarl.runtime.world.processes import release_cpu_shm

            release_cpu_shm(self.engine_id())
        if self.cores_before is not None:  # the process goes on (a notebook) on the cores and threads it had before
            import torch

            (cores, threads), self.cores_before = self.cores_before, None
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)


_TOPOLOGY: Topology | None = None


def init_topology(num_generator_processes: int, timeout_s: float, use_cpu: bool,
                  tensor_parallel_size: int | None = None, failure: str = "stop", trainer_tp: int = 1) -> Topology:
    """Work out this process's place in the job and, under a launcher, split the worlds.

    Called by `AsyncAIPOConfig.__post_init__`, before transformers sets up its distributed state,
    so that Accelerate sees the trainer world only. Idempotent within a process.
    `tensor_parallel_size`: ranks per vLLM replica (None: one replica over all generator ranks); `trainer_tp`: trainer
    ranks per tensor-parallel group.
    """
    global _TOPOLOGY
    tp = tensor_parallel_size or num_generator_processes
    if _TOPOLOGY is not None:
        same = (_TOPOLOGY.num_generators, _TOPOLOGY.replica_size) == (num_generator_processes, tp)
        if not same and _TOPOLOGY.mode != "single":
            raise TopologyError(
                f"This process already belongs to a job with {_TOPOLOGY.num_generators} generator processes "
                f"(tensor parallel {_TOPOLOGY.replica_size}); a second config asks for {num_generator_processes} "
                f"(tensor parallel {tp}).")
        _TOPOLOGY.num_generators, _TOPOLOGY.tensor_parallel_size = num_generator_processes, tp
        if _TOPOLOGY.mode == "single":
            _TOPOLOGY.world_size = 1 + num_generator_processes
        _TOPOLOGY.timeout_s, _TOPOLOGY.failure, _TOPOLOGY.trainer_tp = timeout_s, failure, trainer_tp
        return _TOPOLOGY

    from hfllamarl.runtime.world.spawn import become_child, child_settings

    child = child_settings()
    if child is not None:  # a generator child of a single-process job
        topo = Topology(mode="child", rank=child["rank"], world_size=child["world_size"],
                        num_generators=num_generator_processes, timeout_s=timeout_s, use_cpu=use_cpu,
                        store_addr=child["store_addr"], job_id=child["job_id"], tensor_parallel_size=tp,
                        failure=failure)
        become_child(child)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        topo = _launcher_topology(num_generator_processes, timeout_s, use_cpu, tp, failure)
    else:
        _refuse_single_process_accelerate_launch()
        topo = Topology(
            mode="single",
            rank=0,
            world_size=1 + num_generator_processes,
            num_generators=num_generator_processes,
            timeout_s=timeout_s,
            use_cpu=use_cpu,
            tensor_parallel_size=tp,
            failure=failure,
        )
    topo.trainer_tp = trainer_tp
    _TOPOLOGY = topo
    if topo.mode != "single":
        topo.init_local_world()
        # From here on this rank's failures are reported to the others, and theirs watched for.
        topo.liveness.start()
        _report_uncaught_exceptions(topo)
        if topo.mode == "launcher":
            _meet_at_exit(topo)
    return topo


def _meet_at_exit(topo: Topology) -> None:
    """A launched rank's interpreter exit waits for the other ranks to exit too (`Liveness.finish`, bounded, watched):
    a rank that freezes or dies after the last step, in the script's `save_model` or in its own teardown, is named
    and its process ended, instead of a launcher waiting for it forever. (A generator child calls it itself.)"""
    import atexit

    atexit.register(lambda: topo.liveness.finish())


def _report_uncaught_exceptions(topo: Topology) -> None:
    """An exception that ends this process anywhere (the user's script included) is recorded for the other
    ranks, which then name it, before Python prints it."""
    previous = sys.excepthook

    def hook(kind, exc, tb):
        from hfllamarl.runtime.world.liveness import describe_exception

        if not topo.liveness.failing.is_set():
            topo.liveness.record_failure(f"{topo.describe(topo.rank)} raised " + describe_exception(exc))
        previous(kind, exc, tb)

    sys.excepthook = hook


def _launcher_topology(num_generators: int, timeout_s: float, use_cpu: bool, tp: int, failure: str) -> Topology:
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if num_generators >= world:
        raise TopologyError(
            f"num_generator_processes={num_generators} but the launcher started {world} processes: no process "
            f"is left to train. Launch more processes (e.g. --nproc_per_node {num_generators + 1}) or lower "
            "num_generator_processes."
        )
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise TopologyError("WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun or accelerate launch.")
    topo = Topology(
        mode="launcher",
        rank=rank,
        world_size=world,
        num_generators=num_generators,
        timeout_s=timeout_s,
        use_cpu=use_cpu,
        store_addr=(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
        tensor_parallel_size=tp,
        failure=failure,
        # A launcher's restart (torchrun --max-restarts) keeps its store: each attempt's keys are its own.
        job_id=launcher_attempt() * 1000,
    )
    # From here on, RANK/WORLD_SIZE describe this executor's own world (Accelerate, vLLM's external
    # launcher and FSDP read them); LOCAL_RANK stays the device index on this node.
    os.environ["HFLLAMARL_GLOBAL_RANK"] = str(rank)
    os.environ["HFLLAMARL_GLOBAL_WORLD_SIZE"] = str(world)
    os.environ["RANK"] = str(topo.local_rank)
    os.environ["WORLD_SIZE"] = str(topo.local_world_size)
    return topo


def _refuse_single_process_accelerate_launch() -> None:
    """`accelerate launch --num_processes N` without a GPU starts ONE process; say how to launch instead."""
    if "ACCELERATE_USE_CPU" not in os.environ and "ACCELERATE_MIXED_PRECISION" not in os.environ:
        return
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            argv = fh.read().decode(errors="replace").split("\0")
    except OSError:
        return
    n = None
    for i, arg in enumerate(argv):
        if arg in ("--num_processes", "--num-processes") and i + 1 < len(argv):
            n = argv[i + 1]
        elif arg.startswith(("--num_processes=", "--num-processes=")):
            n = arg.split("=", 1)[1]
    if n is not None and n.isdigit() and int(n) > 1:
        raise TopologyError(
            f"`accelerate launch --num_processes {n}` started a single process: without a GPU (and without "
            "--multi_gpu or a config file) Accelerate uses its single-process launcher. Launch with one of:\n"
            f"  accelerate launch --multi_gpu --num_processes {n} script.py\n"
            "  accelerate launch --config_file examples/accelerate/cpu_2proc.yaml script.py\n"
            f"  torchrun --nproc_per_node {n} script.py\n"
            "or simply `python script.py` (the generator then runs as a child process)."
        )


#: the restart count of a replica group that `hfllamarl train` started itself (`commands.replica_launch`)
ENV_RESTART_COUNT = "HFLLAMARL_RESTART_COUNT"


def launcher_attempt() -> int:
    """Which attempt of the job this process is: 0, or the launcher's restart count (torchrun --max-restarts,
    accelerate launch --max_restarts: TORCHELASTIC_RESTART_COUNT; a replica group `hfllamarl train` restarted:
    HFLLAMARL_RESTART_COUNT)."""
    counts = []
    for name in ("TORCHELASTIC_RESTART_COUNT", ENV_RESTART_COUNT):
        try:
            counts.append(int(os.environ.get(name, "0") or 0))
        except ValueError:
            pass
    return max(counts + [0])
