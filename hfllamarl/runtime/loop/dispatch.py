"""Where each tick's work goes with several generator replicas, and how the loss of one is survived.

Batch b's prompts are split by position twice (`hfllamarl.runtime.loop.schedule`): live replica r generates
`replica_share(P, live, b)[r]`, the trainer ranks of data-parallel rank d (one tensor-parallel group) train
`trainer_positions(P, D, d)`. The `rollouts` channel
(`RolloutsChannel`) carries each replica's finished groups straight to the trainer rank that owns their
positions, and a trainer rank assembles its share of a batch in position order (`Dispatch.ordered`), so what a
trainer rank trains at each step does not depend on the replicas.

Each tick the trainer ranks agree on the live replicas (`Dispatch.begin_tick`, before the weights header that
tells the generators) and keep a ledger of which replica owes which position of every batch not trained yet.
With generator_failure="continue" a replica that dies, freezes or fails is marked lost by the watchdog or by a
failed transfer (`Topology.mark_lost`); the `RecoveryStage`, run every tick before any batch is trained or
sampled, then:

1. collects each live replica's status (did its last weight load complete? a replica whose relay source was
   lost mid-sync holds a partial load) and agrees, over the trainer ranks, on the lost replicas and on the
   positions the trainer ranks are owed by them (neither received nor to come);
2. sends each live replica an order: the current weights again (to the replicas whose load broke, and those
   downstream of them), and make-up work: the owed positions, split over the live replicas, generated now,
   whole, under the weights of this tick (so they reach the trainer in time and are never staler than the bound);
3. repeats until nothing is owed and every replica holds the current weights (a replica lost meanwhile is
   handled by the next round), or stops the job, naming them, when no replica is left.

Nothing is trained twice (a position is owed only while its trainer rank lacks it, and each owner receives it
once) and nothing is dropped (every position of a batch is required before it is trained).
"""

from __future__ import annotations

from dataclasses import dataclass

import logging

import torch
import torch.distributed as dist

from hfllamarl.runtime.loop.channels import recv_object, start_send_object
from hfllamarl.runtime.world.liveness import ReplicaLostError
from hfllamarl.runtime.loop.rollout import ROLLOUTS, RolloutGroup
from hfllamarl.runtime.loop.schedule import Schedule, even_runs, replica_share, trainer_positions
from hfllamarl.runtime.world.topology import Topology
from hfllamarl.runtime.loop.weights_channel import POLICY_WEIGHTS, settle

logger = logging.getLogger(__name__)


class NoReplicaLeftError(RuntimeError):
    """generator_failure="continue" and every generator replica is lost: the job cannot go on."""


class Dispatch:
    """The trainer ranks' ledger of who generates what, and their agreement on the live replicas."""

    def __init__(self, topology: Topology, schedule: Schedule):
        self.topology, self.schedule = topology, schedule
        self.prompts = schedule.prompts_per_batch
        self.live = topology.live_replicas
        self.assigned: dict[int, dict[int, int]] = {}  # batch -> {position: the replica that owes it}
        self.losses: list[dict] = []  # {"replica", "tick", "cause"}, in the order the trainer ranks agreed them
        self.regenerated = 0  # positions generated again for a lost replica

    @property
    def survives(self) -> bool:
        """Whether a lost replica is survived (generator_failure="continue" with several replicas)."""
        return self.topology.failure == "continue" and self.topology.num_replicas > 1

    # ------------------------------------------------------------------ trainer ranks
    def begin_tick(self, executor) -> list[int]:
        """Trainer ranks, first thing of every tick: agree on the live replicas and record who generates the
        batch that starts now. Returns the live replicas (the weights header tells the generators)."""
        tick = executor.tick
        if self.survives:
            self.agree(tick)
        done = self.schedule.trainer_batch(tick)
        for batch in [b for b in self.assigned if done is not None and b < done]:
            del self.assigned[batch]
        batch = self.schedule.generator_batch(tick)
        if batch is not None:
            self._assign(batch)
        return list(self.live)

    def _assign(self, batch: int) -> None:
        """Record which live replica generates each position of `batch` (as the replicas split it themselves)."""
        share = replica_share(self.prompts, self.live, batch)
        self.assigned[batch] = {p: r for r, positions in share.items() for p in positions}

    def agree(self, tick: int, extra=None) -> list:
        """Every trainer rank's view of the lost replicas (and `extra`) to all: the union is lost from now on (each
        new loss logged once). Returns the `extra` of every trainer rank; raises when no replica is left."""
        topo = self.topology
        mine = {"lost": dict(topo.lost), "extra": extra}
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        for view in everyone:
            for replica, cause in sorted(view["lost"].items()):
                topo.mark_lost(replica, cause)
        for replica in [r for r in self.live if r in topo.lost]:
            self.losses.append({"replica": replica, "tick": tick, "cause": topo.lost[replica]})
            if topo.rank == 0:
                logger.warning("generator %s is lost at tick %d (generator_failure='continue': the job goes on with "
                               "replicas %s): %s", topo.describe_replica(replica), tick, topo.live_replicas,
                               topo.lost[replica].strip().splitlines()[-1])
        self.live = topo.live_replicas
        if not self.live:
            raise NoReplicaLeftError("every generator replica is lost: " + "; ".join(
                f"{topo.describe_replica(r)}: {cause}" for r, cause in sorted(topo.lost.items())))
        return [view["extra"] for view in everyone]

    def owed(self, inbox: dict[int, list[RolloutGroup]]) -> dict[int, list[int]]:
        """This trainer rank's positions that a lost replica owes and that have not arrived: {batch: positions}."""
        topo, out = self.topology, {}
        for batch, owners in self.assigned.items():
            have = {g.position for g in inbox.get(batch, [])}
            mine = trainer_positions(self.prompts, topo.data_parallel_size, topo.data_rank_of(topo.rank))
            missing = [p for p in mine if owners[p] in topo.lost and p not in have]
            if missing:
                out[batch] = missing
        return out

    def plan(self, owed: dict[int, list[int]], stale: list[int], tick: int) -> dict[int, dict]:
        """The orders of one recovery round: every live replica gets one (empty ones keep it in the round) when
        something is owed or a replica holds stale weights; {} when there is nothing to do."""
        items = sorted((b, p) for b, positions in owed.items() for p in positions)
        if not items and not stale:
            return {}
        orders = {r: {"weights": r in stale, "work": {}} for r in self.live}
        for k, run in enumerate(even_runs(len(items), len(self.live))):
            replica = self.live[(k + tick) % len(self.live)]
            for b, p in (items[i] for i in run):
                orders[replica]["work"].setdefault(b, []).append(p)
                self.assigned.setdefault(b, {})[p] = replica
        self.regenerated += len(items)
        return orders

    def ordered(self, batch: int, groups: list[RolloutGroup]) -> list[RolloutGroup]:
        """This trainer rank's groups of `batch` in position order, checked to be exactly its positions (each once):
        a missing or doubled prompt stops the job instead of being trained around."""
        if not groups or any(g.position < 0 for g in groups):
            return groups
        topo = self.topology
        want = list(trainer_positions(self.prompts, topo.data_parallel_size, topo.data_rank_of(topo.rank)))
        groups = sorted(groups, key=lambda g: g.position)
        got = [g.position for g in groups]
        if got != want:
            missing, extra = sorted(set(want) - set(got)), sorted(p for p in set(got) if got.count(p) > 1)
            raise RuntimeError(f"trainer: batch {batch} reached {topo.describe(topo.rank)} with positions {got}, not "
                               f"{want} (missing {missing}, more than once {extra}); the dispatch is broken")
        return groups

    def metrics(self) -> dict[str, float]:
        if self.topology.num_replicas == 1:
            return {}
        return {"replicas/live": float(len(self.live)), "replicas/lost": float(len(self.losses)),
                "replicas/regenerated_prompts": float(self.regenerated)}

    def state(self) -> dict:
        """What a checkpoint keeps (every trainer rank holds the same ledger)."""
        return {"assigned": self.assigned, "losses": self.losses, "regenerated": self.regenerated}

    def load_state(self, state: dict) -> None:
        self.assigned = state.get("assigned", {})
        self.losses, self.regenerated = state.get("losses", []), state.get("regenerated", 0)
        for batch in state.get("unsampled", []):  # started before the resumed tick (`checkpoint.unsampled_batches`)
            self._assign(batch)

    def owing_replicas(self) -> set[int]:
        """Replicas the ledger says still owe positions of some batch (their generator state must be in a
        checkpoint for it to be resumable)."""
        return {r for owners in self.assigned.values() for r in owners.values()}


class RolloutsChannel:
    """The `rollouts` channel: the first rank of each live replica sends each trainer rank the finished groups of
    the positions it owns (`split`, e.g. `rollout.split_by_position`); a trainer rank receives from every live
    replica in order. A replica lost on the way (generator_failure="continue") is skipped: what it owed is made
    up by the `RecoveryStage`."""

    name = ROLLOUTS

    def __init__(self, topology: Topology, dispatch: Dispatch, split):
        self.topology, self.dispatch, self.split = topology, dispatch, split

    def communicate_with(self, executor) -> None:
        topo = self.topology
        if topo.role == "generator":
            groups = executor.get_output(ROLLOUTS)
            if topo.local_rank == 0:
                send_shares(topo, self.split(groups, topo.data_parallel_size), f"channel '{ROLLOUTS}'")
            return
        executor.put_input(ROLLOUTS, receive_shares(topo, self.dispatch.live, f"channel '{ROLLOUTS}'"))


def send_shares(topo: Topology, chunks: list[list], what: str) -> None:
    """A replica's first rank: chunk k to the trainer ranks of data-parallel rank k (each rank of a tensor-parallel
    group trains the same chunk), all at once."""
    waits = [w for dst in topo.trainer_ranks
             for w in start_send_object(topo, chunks[topo.data_rank_of(dst)], dst, what)]
    for wait in waits:
        wait()


def receive_shares(topo: Topology, replicas: list[int], what: str) -> list:
    """A trainer rank: what each of `replicas` sends it (a lost one contributes nothing), in replica order."""
    received = []
    for replica in replicas:
        try:
            received.extend(recv_object(topo, topo.replica_ranks(replica)[0], what))
        except ReplicaLostError:
            pass
    return received


class RecoveryStage:
    """A controller stage (generator_failure="continue" with several replicas): before anything is trained or
    sampled in a tick, make up what lost replicas owe and re-send weights a replica could not finish loading."""

    def __init__(self, topology: Topology, dispatch: Dispatch, weights, split):
        self.topology, self.dispatch, self.weights, self.split = topology, dispatch, weights, split

    def communicate_with(self, executor) -> None:
        if self.topology.role == "trainer":
            while self._trainer_round(executor):
                pass
        else:
            while self._generator_round(executor):
                pass

    def _trainer_round(self, executor) -> bool:
        topo, d = self.topology, self.dispatch
        statuses = {}
        if topo.rank == 0:
            for replica in d.live:
                try:
                    statuses[replica] = recv_object(topo, topo.replica_ranks(replica)[0], "replica status")
                except ReplicaLostError:
                    pass
        views = d.agree(executor.tick, {"owed": d.owed(executor.inbox), "statuses": statuses})
        owed: dict[int, list[int]] = {}
        for view in views:
            for batch, positions in view["owed"].items():
                owed.setdefault(batch, []).extend(positions)
        broken = [r for r, status in views[0]["statuses"].items() if status["incomplete"] and r in d.live]
        downstream = getattr(self.weights.backend, "downstream", lambda r: [])
        stale = sorted({r for b in broken for r in [b] + downstream(b) if r in d.live})
        orders = d.plan(owed, stale, executor.tick)
        if topo.rank == 0:
            for replica in d.live:
                order = orders.get(replica)
                if order is not None:
                    order = dict(order, version=executor.sent_version, targets=stale)
                settle([w for g in topo.replica_ranks(replica) for w in start_send_object(topo, order, g, "recovery order")])
        if not orders:
            return False
        if stale:
            self.weights.backend.targets = stale
            self.weights.backend.send(executor.weights)
        workers = [r for r in d.live if orders[r]["work"]]
        executor.put_input(ROLLOUTS, receive_shares(topo, workers, "recovery (make-up rollouts)"))
        return True

    def _generator_round(self, executor) -> bool:
        topo = self.topology
        incomplete = torch.tensor([float(executor.weights_broken)])
        if topo.replica_size > 1:  # the replica's ranks load together: one rank's broken load breaks the replica's
            dist.all_reduce(incomplete, op=dist.ReduceOp.MAX)
        if topo.local_rank == 0:
            settle(start_send_object(topo, {"incomplete": bool(incomplete.item())}, 0, "replica status"))
        order = recv_object(topo, 0, "recovery order")
        if order is None:
            return False
        if order["weights"]:
            self.weights.backend.targets = order["targets"]
            self.weights.receive(executor, order["version"])
        if order["work"]:
            groups = executor.generate_makeup(order["work"])
            if topo.local_rank == 0:
                send_shares(topo, self.split(groups, topo.data_parallel_size), "recovery (make-up rollouts)")
        return True


@dataclass
class Communicate:
    """Stage: one channel communicates (`channel.communicate(executor)`)."""

    channel: object


@dataclass
class Step:
    """Stage: executors of `role` (or every executor when None) run `step()`."""

    role: str | None = None


def stages(topology: Topology, schedule: Schedule, backend, executor) -> tuple[list, Dispatch]:
    """The controller's stages of a job and its `Dispatch`: the weights, rollouts and (generator_failure=
    "continue" with several replicas) recovery stages, in the asynchronous or the synchronous order."""
    from hfllamarl.runtime.loop.rollout import split_by_position
    from hfllamarl.runtime.loop.weights_channel import WeightsChannel

    dispatch = Dispatch(topology, schedule)
    dispatch.load_state(getattr(executor, "dispatch_state", None) or {})  # a resumed trainer rank's ledger
    split = split_by_position(schedule.prompts_per_batch)
    weights = WeightsChannel(backend, topology, dispatch)
    rollouts = RolloutsChannel(topology, dispatch, split)
    recovery = [Communicate(RecoveryStage(topology, dispatch, weights, split))] if dispatch.survives else []
    if hasattr(executor, "weights_channel"):
        executor.weights_channel = weights
    if schedule.synchronous:
        out = ([Communicate(weights)] + recovery + [Step("generator"), Communicate(rollouts)] + recovery
               + [Step("trainer")])
    else:
        out = [Communicate(weights), Communicate(rollouts)] + recovery + [Step()]
    return out, dispatch


__all__ = ["Communicate", "Dispatch", "NoReplicaLeftError", "RecoveryStage", "RolloutsChannel", "POLICY_WEIGHTS",
           "ROLLOUTS", "Step", "stages"]
