"""Keeping the ranks of one tensor-parallel vLLM engine in step when only the first rank decides.

Every rank of an engine (`external_launcher`) must call `generate` with the same requests at the same time.
Plain generation gets that for free: every rank computes the same requests. A multi-turn tick does not: tools
and environments run on the engine's first rank only (a tool must run once, not once per rank), and what
comes next depends on their results. So the first rank leads: before each of its `generate` calls it sends
the requests (token ids, completions wanted, token budget) to the other ranks, which only follow, and it ends
the tick with "done". Messages travel on a gloo group of the engine's ranks (a generator rank's default world is
its replica), each wait bounded by the job's collective timeout (and ended sooner by the watchdog when the leader
fails). With several replicas each has its own leader, tools and environments.
"""

from __future__ import annotations

from collections.abc import Callable

Request = tuple[list[int], int, int]  # (prompt token ids, completions, max new tokens)


class Lockstep:
    """The engine's ranks: `generate` on the leader, `follow` on the others. Build it on every rank at once."""

    def __init__(self, topology):
        import torch.distributed as dist

        self.size = getattr(topology, "replica_size", topology.num_generators)  # this engine's (replica's) ranks
        self.leader = topology.local_rank == 0  # the first rank of the replica
        self.group = dist.new_group(backend="gloo", timeout=topology.timeout) if self.size > 1 else None
        self.calls = 0  # generate calls this tick (the leader's count, or the follower's)

    def generate(self, run: Callable[[list[Request]], list], requests: list[Request]) -> list:
        """On the leader: send `requests` to the followers, then `run(requests)` (the local engine call)."""
        self._send(("generate", requests))
        self.calls += 1
        return run(requests)

    def done(self) -> None:
        """On the leader, at the end of its tick: the followers stop following."""
        self._send(("done", None))
        self.calls = 0

    def follow(self, run: Callable[[list[Request]], list]) -> int:
        """On a follower: run every request the leader sends until it says done; returns how many calls."""
        calls = 0
        if self.group is None:
            return calls
        import torch.distributed as dist

        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            kind, requests = box[0]
            if kind == "done":
                return calls
            run(requests)
            calls += 1

    def _send(self, message) -> None:
        if self.group is None:
            return
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.group)
