"""The trainer replicas' per-step quorum on torchft: which replica groups take part in this step, the gradients
averaged over exactly those, and the weights, optimizer state and counters a restarted replica copies from a
healthy peer.

A replica group is one FSDP2 mesh of trainer ranks (`trainer_fsdp_shard_size` of them); several groups hold the
same weights and split each step's rows (HSDP's replica dimension). Here that dimension is made fault tolerant:
every step starts with a quorum the torchft lighthouse forms from the groups that are alive, the step's rows are
split over its participants (`replica_rows`), their gradients are averaged over them only, and the optimizer
steps only if the step's collectives all succeeded (`commit`). A group that died or froze is left out of the next
quorum; a group that (re)joins behind the others receives their state before its first step, over the same
process group (torchft's `PGTransport`), and trains on from the step they are at.

Per step, in every rank of every live group:

    q = quorum.begin_step()            # -> StepQuorum(step, index, participants, ...)
    rows = batch(q.step)               # the same on every group
    share = replica_slice(len(rows), q.index, q.participants)
    loss(rows[share.start:share.stop], normalised for the whole batch).backward()
    quorum.average_gradients(model.parameters())
    if quorum.commit(): optimizer.step()   # else: the same q.step (the same batch) again

`q.step` counts committed steps; it is the batch index, so a step whose commit failed is retried with the same
batch and a healed group continues at its peers' batch: nothing is trained twice or skipped.

Measured on torchft 0.2.0 (CPU, gloo; docs/design/elastic.md): a killed group is dropped within the lighthouse's
heartbeat timeout; a frozen one after the collective timeout; recovery copies weights and AdamW state in
0.03-0.1 s for a small model. torchft's own `DistributedDataParallel` wrapper is not used (its comm hook asserts
when a peer dies mid-allreduce); gradients are averaged here instead.

torchft is imported only when a quorum is built (`pip install torchft==0.2.0`). The trainer's replica groups
(`replica_group`, `trainer_replica_groups`) run on it; docs/design/elastic.md has the design and the drills.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable

import torch

TORCHFT_VERSION = "0.2.0"
logger = logging.getLogger("hfllamarl")

QUORUM_TRIES = 3  # quorum calls that time out before the group gives up (one frozen in the call times out once)
BUCKET_BYTES = 25 * 1024 * 1024  # one allreduce per bucket: per-tensor collectives cost a round trip each


def import_torchft():
    """The `torchft` module, or an ImportError saying how to install the version this module was measured with."""
    try:
        import torchft
        import torchft.checkpointing.pg_transport  # noqa: F401 (the checkpoint transport ReplicaQuorum uses)
    except ImportError as e:
        raise ImportError(f"Fault-tolerant trainer replicas need torchft: pip install torchft=={TORCHFT_VERSION} "
                          f"({e})") from e
    import logging

    logging.getLogger("torchft.manager").addFilter(_not_about_nccl_on_a_cpu)  # (idempotent: the same function)
    return torchft


def _not_about_nccl_on_a_cpu(record) -> bool:
    """torchft's manager warns at each new quorum of a build of torch without NCCL's flight recorder ("Unable to
    reset NCCL flight recorder recording"): a CPU build, whose groups use gloo, has none to reset. Dropped there."""
    return torch.cuda.is_available() or "NCCL flight recorder" not in record.getMessage()


@dataclass(frozen=True)
class ReplicaTimeouts:
    """The quorum's waits, in seconds, from the job's `collective_timeout_s` (t).

    collective: an allreduce, a commit vote or a state transfer (a frozen peer is dropped after this): t / 3;
    quorum: forming the quorum (longer: the lighthouse first waits for a lost group's heartbeat to lapse, and a
    group that heals sends its state inside the quorum): 2t / 3; connect: reaching the lighthouse or a peer's
    manager. Both below t: a group's own generators wait for its trainer up to t, and a trainer held by a peer
    frozen inside a collective must drop it, form the next quorum and go on before they give up on it (at t for
    both, a peer frozen inside a collective for longer than t ended the survivor's group too: its generator timed
    out waiting for the weights first).
    """

    collective: float
    quorum: float
    connect: float

    @classmethod
    def from_collective_timeout(cls, collective_timeout_s: float) -> "ReplicaTimeouts":
        t = float(collective_timeout_s)
        if not t > 0:
            raise ValueError(f"collective_timeout_s={collective_timeout_s} must be positive")
        return cls(collective=t / 3.0, quorum=2.0 * t / 3.0, connect=min(t / 3.0, 60.0))


@dataclass(frozen=True)
class StepQuorum:
    """This step's quorum, as seen by one replica group.

    step: committed steps so far, the index of the batch this step trains; index: this group's index among the
    participants (None: it does not take part, it then trains no rows); participants: how many groups take part;
    quorum_id: changes whenever the set of groups changes; healed: this group's state was copied from a peer at
    the start of this step.
    """

    step: int
    index: int | None
    participants: int
    quorum_id: int
    healed: bool


def start_lighthouse(min_replicas: int = 1, heartbeat_timeout_s: float = 2.0, join_timeout_s: float = 1.0,
                     quorum_tick_s: float = 0.1, bind: str = "[::]:0"):
    """A torchft lighthouse in this process (tests and single-host jobs; a multi-host job runs `torchft_lighthouse`
    on a host every group reaches). Its `address()` is what each `ReplicaQuorum` is given; `shutdown()` stops it.

    Args:
        min_replicas: groups a quorum needs (1: a single survivor trains on).
        heartbeat_timeout_s: a group silent this long (killed, frozen) is left out of the next quorum.
        join_timeout_s: how long a quorum waits for a live group that has not asked to join yet.
        quorum_tick_s: how often the lighthouse re-evaluates waiting quorum requests.
    """
    import_torchft()
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=int(min_replicas), join_timeout_ms=int(join_timeout_s * 1000),
                            quorum_tick_ms=int(quorum_tick_s * 1000),
                            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))


def group_store(host: str = "127.0.0.1"):
    """A TCPStore hosted by this process, for a replica group of one rank started without a launcher (torchrun's
    store, named by MASTER_ADDR/MASTER_PORT, serves otherwise). Returns (store, host, port); keep the store alive."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return store, host, store.port


class ReplicaQuorum:
    """One rank's handle on its replica group's per-step quorum (see the module docstring).

    Args:
        replica_id: this group's id, the same on every rank of the group and across its restarts (e.g. 0, 1).
        lighthouse_addr: the lighthouse's address (`start_lighthouse(...).address()`).
        model: the module whose state a healing group receives (FSDP2-sharded or not: each rank sends its shards).
        optimizer: its optimizer (its state travels with the weights).
        collective_timeout_s: the job's collective timeout (`ReplicaTimeouts.from_collective_timeout`).
        device: where gradients live; cuda picks torchft's NCCL group, anything else gloo.
        min_replicas: groups a step needs to commit.
        store: (host, port) of the group's TCPStore; None: MASTER_ADDR/MASTER_PORT (torchrun's).
        rank, world_size: this rank within its group; None: RANK / WORLD_SIZE (1 group rank when unset).
    """

    def __init__(self, replica_id: int | str, lighthouse_addr: str, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, collective_timeout_s: float, device: torch.device | str = "cpu",
                 min_replicas: int = 1, store: tuple[str, int] | None = None, rank: int | None = None,
                 world_size: int | None = None):
        torchft = import_torchft()
        from torchft.checkpointing.pg_transport import PGTransport

        self.model, self.optimizer, self.device = model, optimizer, torch.device(device)
        self.replica_id, self.lighthouse_addr = replica_id, lighthouse_addr
        self.timeouts = ReplicaTimeouts.from_collective_timeout(collective_timeout_s)
        collective = timedelta(seconds=self.timeouts.collective)
        pg_class = torchft.ProcessGroupNCCL if self.device.type == "cuda" else torchft.ProcessGroupGloo
        self._pg = pg_class(timeout=collective)
        host, port = store if store is not None else (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        if host is None or port is None:
            raise ValueError("ReplicaQuorum needs its group's TCPStore: pass store=(host, port) (`group_store()` "
                             "for a group of one rank) or start the group under torchrun (MASTER_ADDR/MASTER_PORT).")
        self._healed = False
        self._collective_start: float | None = None
        self._states: dict[str, tuple[Callable[[], object], Callable[[object], None]]] = {}
        self.manager = torchft.Manager(
            pg=self._pg, load_state_dict=None, state_dict=None, min_replica_size=int(min_replicas),
            # Quorum before the forward pass: a healing group loads its peer's state before computing anything, so
            # it takes part in the very step it rejoins (async quorum would leave it out of that step).
            use_async_quorum=False,
            timeout=collective, quorum_timeout=timedelta(seconds=self.timeouts.quorum),
            connect_timeout=timedelta(seconds=self.timeouts.connect),
            rank=int(os.environ.get("RANK", 0)) if rank is None else rank,
            world_size=int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size,
            store_addr=str(host), store_port=int(port), lighthouse_addr=lighthouse_addr,
            replica_id=f"replica_{replica_id}",
            checkpoint_transport=PGTransport(self._pg, timeout=collective, device=self.device),
        )
        self.register_state("model", model.state_dict, model.load_state_dict)
        self.register_state("optimizer", optimizer.state_dict, optimizer.load_state_dict)
        self.register_state("rng", self._rng_state, self._set_rng_state)

    def register_state(self, key: str, state_dict: Callable[[], object], load_state_dict: Callable[[object], None]):
        """Add state a healing group must copy to continue exactly (the trainer's counters, a data cursor);
        call before the first `begin_step`. model, optimizer and the torch RNG are registered already."""
        def load(value, _load=load_state_dict):
            self._healed = True
            _load(value)

        self._states[key] = (state_dict, load)
        self.manager.register_state_dict_fn(key, load, state_dict)

    def begin_step(self) -> StepQuorum:
        """Join this step's quorum (blocks until the lighthouse forms it); a group behind its peers loads their state
        here, before its forward pass."""
        self._healed = False
        self._collective_start = None
        for attempt in range(1, QUORUM_TRIES + 1):
            started = time.monotonic()
            try:
                self.manager.start_quorum()  # (synchronous: the quorum, any healing, then return)
                break
            except TimeoutError as exc:  # (a lighthouse that did not answer in time; or this group frozen in the call)
                if attempt == QUORUM_TRIES:
                    raise TimeoutError(
                        f"trainer replica group {self.replica_id}: the lighthouse at {self.lighthouse_addr} formed no "
                        f"quorum in {QUORUM_TRIES} tries of up to {self.timeouts.quorum:.0f} s (two thirds of "
                        f"collective_timeout_s, each): is it running and reachable from here? ({exc})") from None
                logger.warning("trainer replica group %s: no quorum after %.1f s (%s); asking the lighthouse again",
                               self.replica_id, time.monotonic() - started, exc)
        return StepQuorum(step=self.manager.current_step(), index=self.manager.participating_rank(),
                          participants=self.manager.num_participants(), quorum_id=int(self.manager._quorum_id),
                          healed=self._healed)

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average every gradient over this step's participating groups (for a DTensor gradient, this rank's shard:
        FSDP2 has reduced it over the group already). A parameter without a gradient gets zeros, so that every group
        runs the same collectives. A failed collective is recorded, not raised: `commit()` then returns False."""
        self._collective_start = time.monotonic()
        grads = []
        for p in params:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
        works = []
        for bucket in _buckets(grads, BUCKET_BYTES):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            works.append((self.manager.allreduce(flat), flat, bucket))
        for work, flat, bucket in works:
            work.wait()
            offset = 0
            for g in bucket:  # (the averaged values back into each gradient)
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def commit(self) -> bool:
        """Whether this group may step its optimizer: every collective of the step succeeded on every rank of the
        group, and enough groups took part. False: do not step; the next `begin_step` retries the same batch.

        A group whose collectives lasted longer than the collective timeout was frozen inside them (a gloo or NCCL
        collective gives up at that timeout): its peers may have timed out and redone the step without it, so it
        votes against committing and heals from them next step instead of applying a step they discarded.
        """
        started = self._collective_start
        if started is not None and time.monotonic() - started > self.timeouts.collective:
            self.manager.report_error(TimeoutError(
                f"this group's gradient average took {time.monotonic() - started:.1f} s, longer than the collective "
                f"timeout ({self.timeouts.collective:.1f} s): it was frozen; its peers went on without it"))
        return self.manager.should_commit()

    @property
    def step(self) -> int:
        """Committed steps so far: the next batch's index."""
        return self.manager.current_step()

    def shutdown(self) -> None:
        """Leave the quorum (the lighthouse drops this group) and stop the manager's servers."""
        self.manager.shutdown(wait=False)

    def _rng_state(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"].cpu())
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"].cpu(), self.device)


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, up to `limit` bytes per bucket (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        if last is None or size + nbytes > limit or (t.dtype, t.device) != (last[0].dtype, last[0].device):
            out.append([t])
            size = nbytes
        else:
            last.append(t)
            size += nbytes
    return out
