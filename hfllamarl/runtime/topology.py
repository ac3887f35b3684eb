"""Process layout: who trains, who generates, and the process groups that join them.

A job has N processes. Ranks `0 .. T-1` train, ranks `T .. N-1` generate. Each executor gets a
world of its own (the default process group of a trainer process holds only the trainer ranks,
that of a generator process only the generator ranks), so Accelerate/FSDP and vLLM each see only
their own ranks. All N ranks are also joined by a *bridge*: two process groups built on their own
store prefixes, one for picklable objects (always gloo) and one for tensors (gloo on CPU, NCCL on
GPU), which the channels and the weight sync use.

Everything is set up from the launcher's rendezvous alone (`MASTER_ADDR:MASTER_PORT`, as torchrun
and `accelerate launch` give it). Started as a single process (`python script.py`), the process
is the only trainer and starts the generators as child processes joined through a store it hosts.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from dataclasses import dataclass, field

from .liveness import Liveness, PeerLostError  # noqa: F401  (PeerLostError: re-exported for the channels)


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
    _store: object = field(default=None, repr=False)
    _bridge: dict = field(default_factory=dict, repr=False)
    _hosts_store: bool = field(default=False, repr=False)
    _children: list = field(default_factory=list, repr=False)  # single mode: (rank, Popen) of each generator
    core_lender: object = field(default=None, repr=False)  # single mode on a CPU: `core_lending.CoreLender`

    def __post_init__(self):
        self.liveness = Liveness(self)

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
    def role(self) -> str:
        return "trainer" if self.rank < self.num_trainers else "generator"

    @property
    def local_rank(self) -> int:
        """Rank inside this executor's own world."""
        return self.rank if self.role == "trainer" else self.rank - self.num_trainers

    @property
    def local_world_size(self) -> int:
        return self.num_trainers if self.role == "trainer" else self.num_generators

    @property
    def device_type(self) -> str:
        return "cpu" if self.use_cpu else "cuda"

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def describe(self, rank: int) -> str:
        """Human name of a bridge rank, e.g. 'rank 2 (generator 0)'."""
        if rank < self.num_trainers:
            return f"rank {rank} (trainer {rank})"
        return f"rank {rank} (generator {rank - self.num_trainers})"

    # ---------------------------------------------------------------- store and worlds
    def store(self):
        """The job's key-value store (created on first use)."""
        import torch.distributed as dist

        if self._store is None:
            if self.mode == "single":
                # This process hosts the store; children connect to its port.
                self._store = dist.TCPStore(
                    "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=self.timeout
                )
                self._hosts_store = True
                self.store_addr = ("127.0.0.1", self._store.port)
            else:
                host, port = self.store_addr
                agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
                self._hosts_store = self.mode == "launcher" and not agent and self.rank == 0
                self._store = dist.TCPStore(
                    host,
                    port,
                    is_master=self._hosts_store,
                    wait_for_workers=False,
                    timeout=self.timeout,
                )
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
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"hfllamarl/world/{self.role}", self.store()),
            rank=self.local_rank,
            world_size=self.local_world_size,
            timeout=self.timeout,
        )

    def bridge(self, kind: str = "object"):
        """The bridge process group across all ranks: kind "object" (gloo) or "tensor"."""
        import torch.distributed as dist

        if kind not in self._bridge:
            store = dist.PrefixStore(f"hfllamarl/{self.job_id}/bridge/{kind}", self.store())
            if kind == "object" or self.use_cpu:
                pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
            else:  # pragma: no cover - needs GPUs
                pg = dist.ProcessGroupNCCL(store, self.rank, self.world_size, dist.ProcessGroupNCCL.Options())
            self._bridge[kind] = pg
        return self._bridge[kind]

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
        self.liveness.stop()
        self.liveness = Liveness(self)

    def start_children(self, spec_path: str) -> None:
        """Single-process mode: start the generator ranks as child processes (`hfllamarl.runtime.spawn`)."""
        from .spawn import start_children

        self._children = start_children(self, spec_path)

    def exited_children(self) -> list[tuple[int, int]]:
        """(rank, exit code) of the generator children that exited with an error."""
        out = []
        for rank, proc in self._children:
            code = proc.poll()
            if code not in (None, 0):
                out.append((rank, code))
        return out

    def kill_children(self) -> None:
        for _, proc in self._children:
            if proc.poll() is None:
                proc.kill()

    def stop_children(self, grace_s: float = 10.0) -> None:
        """Wait up to `grace_s` for the child generators to finish, then kill the ones still running."""
        import subprocess

        for _, proc in self._children:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._children.clear()


_TOPOLOGY: Topology | None = None


def init_topology(num_generator_processes: int, timeout_s: float, use_cpu: bool) -> Topology:
    """Work out this process's place in the job and, under a launcher, split the worlds.

    Called by `AsyncAIPOConfig.__post_init__`, before transformers sets up its distributed state,
    so that Accelerate sees the trainer world only. Idempotent within a process.
    """
    global _TOPOLOGY
    if _TOPOLOGY is not None:
        if _TOPOLOGY.num_generators != num_generator_processes and _TOPOLOGY.mode != "single":
            raise TopologyError(
                f"This process already belongs to a job with {_TOPOLOGY.num_generators} generator processes; "
                f"a second config asks for {num_generator_processes}."
            )
        _TOPOLOGY.num_generators = num_generator_processes
        if _TOPOLOGY.mode == "single":
            _TOPOLOGY.world_size = 1 + num_generator_processes
        _TOPOLOGY.timeout_s = timeout_s
        return _TOPOLOGY

    from .spawn import become_child, child_settings

    child = child_settings()
    if child is not None:  # a generator child of a single-process job
        topo = Topology(mode="child", rank=child["rank"], world_size=child["world_size"],
                        num_generators=num_generator_processes, timeout_s=timeout_s, use_cpu=use_cpu,
                        store_addr=child["store_addr"], job_id=child["job_id"])
        become_child(child)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        topo = _launcher_topology(num_generator_processes, timeout_s, use_cpu)
    else:
        _refuse_single_process_accelerate_launch()
        topo = Topology(
            mode="single",
            rank=0,
            world_size=1 + num_generator_processes,
            num_generators=num_generator_processes,
            timeout_s=timeout_s,
            use_cpu=use_cpu,
        )
    _TOPOLOGY = topo
    if topo.mode != "single":
        topo.init_local_world()
        # From here on this rank's failures are reported to the others, and theirs watched for.
        topo.liveness.start()
        _report_uncaught_exceptions(topo)
    return topo


def _report_uncaught_exceptions(topo: Topology) -> None:
    """An exception that ends this process anywhere (the user's script included) is recorded for the other
    ranks, which then name it, before Python prints it."""
    previous = sys.excepthook

    def hook(kind, exc, tb):
        from .liveness import describe_exception

        if not topo.liveness.failing.is_set():
            topo.liveness.record_failure(f"{topo.describe(topo.rank)} raised " + describe_exception(exc))
        previous(kind, exc, tb)

    sys.excepthook = hook


def _launcher_topology(num_generators: int, timeout_s: float, use_cpu: bool) -> Topology:
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
