"""A trainer job as one replica group of several (`trainer_replica_groups`): the groups train one policy together,
each on its own share of every batch, and a group that dies or freezes is left out while the others train on.

Each group is a whole job (its trainer ranks and its own generators, launched on its own: `python script.py` or
`torchrun --max-restarts N`), joined to the others through torchft's per-step quorum (`replica_quorum`, one
lighthouse for all groups). Global step k trains global batch k: `groups x prompts_per_generation` prompts, of
which group g trains share g (`prompts.group_batch_rows`). Per optimizer step, on every rank of every live group:

1. `begin(version)`: the step's quorum. A group behind its peers (restarted, or frozen and let go) copies their
   weights, optimizer and learning-rate schedule here; it then knows the global step, and `offset` (the global
   batch of its own batch 0) changes. What it sampled before under the old offset is not trained (those rows were
   sampled by weights it no longer holds, and their global step is past), and logged.
2. `step_tokens(local, holds)`: one small allreduce over the participants: the step's completion tokens over every
   group (the loss is normalised by them, so the groups' averaged gradient is the whole global batch's token mean,
   whatever the number of groups and whether a group trains rows at all), which groups take part, and which shares
   of the global batch they hold. A share no participant holds (its group away, or back but holding nothing
   current) is sampled by the group it is dealt to (`makes_up`), on its trainer, and trained in this step
   (`replica_makeup`); `more_tokens` then counts those tokens too. So no prompt of a global batch is skipped. With
   shared generators (`trainer_replica_shared_generators`) group 0 holds every share, and `exchange` hands each
   present group its own in the step (`replica_exchange`); a share whose group is away is trained by group 0.
3. forward and backward on the group's rows; `average(model)`: gradients averaged over the participants.
4. `commit()`: every collective of the step succeeded on every participant; else the same rows are trained again
   with the next quorum (a group lost mid-step costs that attempt, nothing else).

The quorum's own counters are global; the job's (its policy version, its ticks, what its generators sampled) stay
its own, so a restarted group runs the same loop as a fresh job: its first steps have nothing current to train
(their batches were keyed by the old offset), so it samples its share of them itself, then trains what its
generators sample.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

import torch

from hfllamarl.runtime.training.rank_metrics import all_max
from hfllamarl.runtime.training.replica_quorum import ReplicaQuorum, StepQuorum

logger = logging.getLogger("hfllamarl")

MAX_ATTEMPTS = 20  # attempts of one step (each a new quorum) before the job gives up on it


class ReplicaGroup:
    """This rank's handle on its group among the trainer replica groups (see the module docstring).

    Args:
        group, groups: this group's id and how many groups the job has (`trainer_replica_group(s)`).
        lighthouse: the torchft lighthouse's address.
        model, optimizer, scheduler: what a healing group copies from a peer (with the torch RNG).
        collective_timeout_s: the job's; a peer frozen inside a collective is dropped after a third of it
            (`ReplicaTimeouts`).
        store: (host, port) of this group's store; rank, world_size: this rank within its group's trainer ranks.
        is_main: logs the group's recoveries (its first trainer rank).
        peer_wait_s: how long a group other than 0 waits for a peer when it is alone at global step 0 at its first
            step (only group 0 starts a run, or resumes it from its checkpoint: `_wait_for_peer`), then stops (the
            job's: the start-up budget, vllm_server_timeout, and at most half of collective_timeout_s, since its
            generators wait for its weights meanwhile).
        shared_generators: the groups share group 0's generators (`trainer_replica_shared_generators`): checked
            alike in every group at each step.
    """

    def __init__(self, group: int, groups: int, lighthouse: str, model, optimizer, scheduler,
                 collective_timeout_s: float, device, store: tuple[str, int], rank: int, world_size: int,
                 is_main: bool = True, peer_wait_s: float = 240.0, shared_generators: bool = False):
        self.group, self.groups, self.is_main = int(group), int(groups), is_main
        self.peer_wait_s = float(peer_wait_s)
        # Built at the first step: from then on the lighthouse waits for this group at every quorum (up to its join
        # timeout), so a group that is still starting (its generators) must not be known to it yet.
        self._build = lambda: ReplicaQuorum(self.group, lighthouse, model, optimizer, collective_timeout_s,
                                            device=device, store=store, rank=rank, world_size=world_size)
        self._scheduler = scheduler
        self.quorum: ReplicaQuorum | None = None
        self.offset = 0  # global step - this job's policy version (changes when the group heals)
        self.members: set[int] = set()  # the groups of the last step
        self.participants = 0
        self.global_step = 0  # committed global steps (after `commit`: this step included)
        self.retries = 0  # attempts whose commit failed
        self.rows_lost = 0  # rows of this group's shares that were sampled under an old offset, not trained
        self.missing: list[int] = []  # shares of the step's batch no participant holds (`step_tokens`)
        self.handed: dict[int, int] = {}  # shares handed from their holder to their own group: their bytes
        self.shared_generators = bool(shared_generators)  # the groups share group 0's (`replica_exchange`)
        self.failed = False  # this attempt's count failed on a rank of the group: it does not commit, no work is done
        self.made_up = 0  # prompts of missing shares this group sampled and trained itself (`replica_makeup`)
        self.handed_prompts = 0  # shared generators: prompts of shares this group handed to their group, or was handed
        self.kept_prompts = 0  # and prompts of an away group's share this group held and trained itself
        self.steps_missed = 0  # global steps this group was not part of (restarted or frozen)
        self._failed_at: float | None = None  # when the first failed attempt of the current step ended
        self._attempts = 0  # failed attempts of the current step
        self._quorum: StepQuorum | None = None
        self._resume_step = 0  # resumed from a checkpoint: the global step it was written at
        self._left: dict[int, tuple[int, float]] = {}  # a group that left: (the first global step without it, when)
        self._seconds = {"quorum": 0.0, "average": 0.0}  # this step's time in the quorum's calls (all attempts)

    # ------------------------------------------------------------------ the step
    def begin(self, version: int) -> StepQuorum:
        """This step's quorum (a group behind its peers heals here). `version`: the job's own policy version."""
        with self._timed("quorum"):
            start = time.monotonic()
            first = self.quorum is None
            if first:
                self.quorum = self._build()
                if self._scheduler is not None:
                    self.quorum.register_state("scheduler", self._scheduler.state_dict,
                                               self._scheduler.load_state_dict)
                if self._resume_step:  # (torchft's step counter starts at 0)
                    self.quorum.manager.load_state_dict({"step": self._resume_step, "batches_committed": 0})
            q = self._quorum = self.quorum.begin_step()
            if first and self.group != 0 and q.step == 0 and q.participants == 1:  # (see `_wait_for_peer`)
                q, start = self._wait_for_peer(q)  # (the copy, if any, was in its last quorum: timed from there)
        seconds = time.monotonic() - start
        self.participants = q.participants
        offset = q.step - version
        if offset != self.offset:
            missed = offset - self.offset
            self.steps_missed += max(missed, 0)
            if self.is_main:
                how = f"copied the weights, optimizer and schedule from a peer in {seconds:.2f} s" \
                    if q.healed else "its state was current"
                logger.warning("trainer replica group %d: at global step %d, %d steps past its own count (%s); what "
                               "it sampled before is not trained", self.group, q.step + 1, missed, how)
            self.offset = offset
        return q

    @contextmanager
    def _timed(self, what: str):
        """Adds the block's seconds to this step's `what` ("quorum" or "average": `metrics`)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self._seconds[what] += time.monotonic() - start

    def _wait_for_peer(self, q: StepQuorum) -> tuple[StepQuorum, float]:
        """A group other than 0 alone at global step 0 at its first step: it would start over from the initial
        weights. Only group 0 starts a run: the run may be new (group 0 is still starting), or every group may have
        been lost (this one restarted by its launcher, or launched after the others were lost), and group 0 then
        resumes from its newest checkpoint by itself (or starts over, without one). Form the quorum again every
        second until another group joins (one that holds a policy: this one copies it; or one at step 0 too, which
        is then where the run stands: a new run, or a group lost in the run's first step), up to `peer_wait_s`,
        then stop with the error. (With 3 groups or more, two groups other than 0 that meet at step 0 start
        together; group 0, back from its checkpoint later, then copies their policy if they are ahead of it.)
        Returns the quorum and when it began."""
        start = time.monotonic()
        deadline = start + self.peer_wait_s
        if self.is_main:
            logger.warning("trainer replica group %d finds no live group to copy the policy from, and only group 0 "
                           "starts a run; waiting up to %.0f s for one (group 0, restarted by its launcher, resumes "
                           "from its newest checkpoint by itself)", self.group, self.peer_wait_s)
        while q.step == 0 and q.participants == 1:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"trainer replica group {self.group} found no live group to copy the policy from in "
                    f"{self.peer_wait_s:.0f} s (group 0 did not start, or every group ended or is lost; group 0, "
                    "restarted by its launcher, resumes from its newest checkpoint by itself): it would train from "
                    "the initial weights, and only group 0 starts a run. Start group 0 (again: "
                    "resume_from_checkpoint=True resumes it from its checkpoint), then this group.")
            time.sleep(1.0)
            start = time.monotonic()
            q = self._quorum = self.quorum.begin_step()  # (nothing was committed: the same step's quorum again)
        return q, start

    def resume_at(self, version: int, offset: int) -> None:
        """A job resumed from a checkpoint at its policy `version` and this group's `offset` then: the quorum starts
        at that global step (a peer ahead of it is copied from; one behind copies from this group)."""
        self.offset, self._resume_step = offset, version + offset

    def step_tokens(self, tokens: dict[int, float], sizes: dict[int, int] | None = None) -> float:
        """The step's completion tokens over every participating group (`tokens`: this group's, summed over its own
        ranks, for each share of the step's batch it holds: its own; with shared generators, group 0 every share);
        learns which groups take part and which shares of the global batch some participant holds, so that every
        participant knows the shares `missing` from it and the ones `handed` from their holder to their own group
        (`sizes`: the bytes of each share this group holds for another, `exchange`), and logs a change."""
        q, groups = self._quorum, self.groups
        vector = torch.zeros(1 + 4 * groups, dtype=torch.float64)  # (tokens, members, holds, bytes, shared)
        vector[0] = float(sum(tokens.values()))
        vector[1 + self.group] = 1.0
        for h in tokens:
            vector[1 + groups + h] = 1.0
        for h, size in (sizes or {}).items():
            vector[1 + 2 * groups + h] = float(size)
        vector[1 + 3 * groups + self.group] = float(self.shared_generators)
        with self._timed("quorum"):
            self.quorum.manager.allreduce(vector).wait()  # (AVG over the participants; a failure is recorded)
            # The group's ranks agree on whether the count failed: one that skipped its forward, or sampled a share
            # the others did not, would stall the collectives of the group's own sharded model.
            self.failed = all_max([float(self.quorum.manager.errored() is not None)])[0] > 0
        if self.failed:  # (this attempt does not commit: the vector is not the participants', and no work is done)
            self.missing, self.handed = [], {}
            return float(sum(tokens.values()))
        vector *= q.participants
        members = {g for g in range(groups) if vector[1 + g] > 0.5}
        sharing = sorted(g for g in members if vector[1 + 3 * groups + g] > 0.5)
        if sharing and len(sharing) < len(members):
            raise RuntimeError(
                f"trainer replica groups {sharing} share group 0's generators (trainer_replica_shared_generators) and "
                f"groups {sorted(members - set(sharing))} do not: set trainer_replica_shared_generators alike in every "
                "group's config (or recipe), then start the groups again.")
        self.missing = [g for g in range(groups) if vector[1 + groups + g] < 0.5]
        self.handed = {h: int(round(float(vector[1 + 2 * groups + h]))) for h in sorted(members)
                       if vector[1 + groups + h] > 0.5 and vector[1 + 2 * groups + h] > 0.5}
        if members != self.members and self.members:
            now, step = time.monotonic(), q.step + 1
            for g in self.members - members:
                self._left[g] = (step, now)
            back, new = [], []
            for g in sorted(members - self.members):
                if g in self._left:  # (absent since then: its share of those steps was not trained)
                    since, at = self._left.pop(g)
                    back.append(f"{g} (absent for global steps {since}-{step - 1}: {step - since} steps, "
                                f"{now - at:.1f} s)")
                else:
                    new.append(g)
            if self.is_main:
                left = sorted(self.members - members)
                logger.warning("trainer replica groups at global step %d: %s train it%s%s%s", step, sorted(members),
                               f"; left: {left}" if left else "", f"; joined: {new}" if new else "",
                               f"; rejoined: {', '.join(back)}" if back else "")
        self.members = members
        return float(vector[0])

    def trains_held(self, share: int) -> bool:
        """Whether this group trains a share it holds: its own, or another's whose group is away (with shared
        generators group 0 holds every share and hands each present group its own: `exchange`)."""
        return share == self.group or share not in self.members

    def exchange(self, payloads: dict[int, bytes]) -> bytes | None:
        """Shares `handed` from their holder to their own group this step (after `step_tokens`): one allreduce (a
        sum) of a byte buffer over the participants, each share in its own slice, written by its holder
        (`payloads`: this group's, as `replica_exchange.encode_share` wrote them). Returns the bytes of this group's
        own share when it was handed to it, else None (also when the exchange failed: `failed`, no commit)."""
        if not self.handed or self.failed:
            return None
        from torch.distributed import ReduceOp

        offsets, total = {}, 0
        for h, size in self.handed.items():
            offsets[h], total = total, total + size
        buffer = torch.zeros(total, dtype=torch.uint8)
        for h, data in payloads.items():
            if h in self.handed:
                if len(data) != self.handed[h]:
                    raise RuntimeError(f"trainer replica group {self.group}: share {h} is {len(data)} bytes, "
                                       f"{self.handed[h]} announced")
                buffer[offsets[h]:offsets[h] + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with self._timed("quorum"):
            self.quorum.manager.allreduce(buffer, reduce_op=ReduceOp.SUM).wait()
            self.failed = all_max([float(self.quorum.manager.errored() is not None)])[0] > 0
        if self.failed or self.group not in self.handed:
            return None
        start = offsets[self.group]
        return buffer[start:start + self.handed[self.group]].numpy().tobytes()

    def makes_up(self) -> list[int]:
        """The missing shares this group samples and trains itself this step (`replica_makeup`): its own when it
        takes part without it, and of the others' the ones dealt to it (share h: the (h mod n)-th of the n
        participants, in group order). Every participant deals the same way from the same `step_tokens` result."""
        members = sorted(self.members)
        return [h for h in self.missing
                if (h if h in self.members else members[h % len(members)]) == self.group]

    def more_tokens(self, local_tokens: float) -> float:
        """A second token count over the participants, when shares were missing: the completion tokens of the shares
        sampled for them (this group's: `local_tokens`), which the step's loss is normalised by too."""
        vector = torch.tensor([float(local_tokens)], dtype=torch.float64)
        with self._timed("quorum"):
            self.quorum.manager.allreduce(vector).wait()
        return float(vector[0]) * self._quorum.participants

    def average(self, model: torch.nn.Module) -> None:
        """Average the gradients over the participating groups (zeros where this group has none)."""
        with self._timed("average"):
            self.quorum.average_gradients(model.parameters())

    def commit(self) -> bool:
        """Whether the step counts (the optimizer may step). False: train the same rows again (`begin`)."""
        with self._timed("quorum"):
            ok = self.quorum.commit()
        now = time.monotonic()
        if ok:
            if self._failed_at is not None and self.is_main:
                logger.warning("trainer replica group %d: global step %d committed %.2f s after its first attempt "
                               "failed (%d attempt(s) lost; groups now %s)", self.group, self.quorum.step,
                               now - self._failed_at, self._attempts, sorted(self.members))
            self._failed_at, self._attempts = None, 0
            self.global_step = self.quorum.step
            return True
        self.retries += 1
        self._attempts += 1
        if self._failed_at is None:
            self._failed_at = now
        if self._attempts >= MAX_ATTEMPTS:
            raise RuntimeError(f"trainer replica group {self.group}: global step {self.quorum.step + 1} failed "
                               f"{self._attempts} times in a row ({now - self._failed_at:.1f} s); giving up")
        return False

    def discard(self, rows: int) -> None:
        """Count a share this group sampled under an old offset and does not train."""
        self.rows_lost += rows

    def metrics(self) -> dict[str, float]:
        """The step's (called once a step): the groups, what was lost so far, and the step's seconds in the quorum's
        own calls (`time/replica_quorum`: the quorum with any healing, the token count, the commit vote, with the waits
        for the slowest group in them) and in the gradient average (`time/replica_average`)."""
        out = {"replicas/trainer_groups": float(self.participants), "replicas/trainer_retries": float(self.retries),
               "replicas/trainer_rows_lost": float(self.rows_lost),
               "replicas/trainer_prompts_made_up": float(self.made_up),
               "replicas/trainer_prompts_handed": float(self.handed_prompts),
               "replicas/trainer_prompts_kept": float(self.kept_prompts),
               "replicas/trainer_steps_missed": float(self.steps_missed),
               "replicas/global_step": float(self.global_step),
               "time/replica_quorum": self._seconds["quorum"], "time/replica_average": self._seconds["average"]}
        self._seconds = {"quorum": 0.0, "average": 0.0}
        return out

    def shutdown(self) -> None:
        if self.quorum is not None:
            self.quorum.shutdown()


def lighthouse_address(configured: str | None) -> str | None:
    """The lighthouse to join: the config's `torchft_lighthouse`, else torchft's own TORCHFT_LIGHTHOUSE."""
    return configured or os.environ.get("TORCHFT_LIGHTHOUSE") or None
