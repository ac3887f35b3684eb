"""Liveness: who is alive, who failed first and why, and a watchdog that ends a job nobody can finish.

Every rank keeps three kinds of keys in the job's store: a heartbeat (a thread writes the time every
second), `failed/<rank>` (what the rank raised, with its traceback, written before it exits; a rank
that only reacts to another's failure says so) and `done/<rank>`. From them any rank can tell why the
job cannot go on (`verdict`): the first rank that failed on its own, with its exception; else a rank
whose heartbeat stopped (SIGKILL, or SIGSTOP: alive but frozen); else the store itself, when its host
stopped answering.

The watchdog thread asks for that verdict every second. A rank blocked in a collective with a frozen
peer would otherwise wait the whole `collective_timeout_s`, and a rank waiting for a peer that failed
during start-up would wait for a connection that never comes; the watchdog ends it within seconds,
with the verdict as the last thing it prints (a single-process job's parent, which may be a notebook,
instead kills its generator children, which fails its pending collectives at once, and raises the
verdict from its main thread). Under torchrun the verdict also goes into the error file torchrun
reports as the root cause.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback

from hfllamarl.runtime.world.processes import (last_words, proc_stat, process_gone, process_identity, same_pid_space,
                                               stopped)
from hfllamarl.runtime.world.store_calls import STORE_CALL_S, SingleFlight, timed


class PeerLostError(RuntimeError):
    """Another rank of the job died, froze or failed; the message names it and ends with its own error."""


class ReplicaLostError(PeerLostError):
    """A generator replica was lost and the job survives it (generator_failure="continue"): the caller goes on
    without that replica."""

    def __init__(self, replica: int, message: str):
        super().__init__(message)
        self.replica = replica


def heartbeat_timeout(collective_timeout_s: float) -> float:
    """Seconds without a heartbeat after which a rank counts as lost (frozen or dead)."""
    return min(max(collective_timeout_s / 4.0, 10.0), 60.0)


def describe_exception(exc: BaseException, frames: int = 12) -> str:
    """`Type: message`, the last frames of its traceback, and `Type: message` again as the last line: how a
    failing rank reports itself to the others."""
    head = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    stack = traceback.format_tb(exc.__traceback__)[-frames:]
    return f"{head}\n" + "".join(stack).rstrip() + f"\n{head}"


# A rank still starting (its 'start-up' mark not set) loads native libraries and imports torch, transformers and
# vLLM: on a crowded machine one such step can hold its interpreter's lock long enough to starve its heartbeat
# thread for more than the heartbeat timeout. Its silence counts after this many timeouts instead (a rank frozen
# or killed while starting is still named well within the start-up budget, vllm_server_timeout).
STARTING_SLACK = 4
STARTUP = "start-up"  # the rendezvous every executor reaches once it has started (`executor.wait_for_startup`)
END = "end of the job"  # the rendezvous every rank reaches once it is done with the others (`Liveness.finish`)


def _reached(what: str) -> str:
    """The store key kind a rank sets once it has reached the rendezvous `what`."""
    return "reached/" + what.replace(" ", "_")


class Liveness:
    """Heartbeats, failure causes and the watchdog of one rank of a job (`topology.liveness`)."""

    def __init__(self, topology):
        self.topology = topology
        self.failing = threading.Event()  # this rank is already going down: the watchdog stays quiet
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._client = None
        self._store_silent_since: float | None = None
        self._stopped_since: dict[int, float] = {}  # a starting child seen stopped (`_stopped_starting`): since when
        self.verdict_cause: str | None = None  # what the watchdog found (a single-process parent raises it)
        self._lock = threading.Lock()  # one store call at a time on the shared client
        self._look = SingleFlight(self._read_store, "hfllamarl-store-look")  # one look at the others at a time
        self._where: dict[int, dict] = {}  # rank -> its `process_identity`, read while the store answers
        self._here: dict = {}  # this process's, set by `start`
        self._started: set[int] = set()  # ranks seen past their start-up (their heartbeats count at once)
        self._frozen: list[int] = []  # the ranks the last verdict found silent
        self.culprit: int | None = None  # the rank the last verdict names
        self._ended: set[int] = set()  # lost ranks (of another replica) whose processes this rank ended
        self._acted = threading.Event()  # `_act` ran (the watchdog and `finish` may both find a verdict)
        self._act_lock = threading.Lock()

    # ---------------------------------------------------------------- keys
    def _key(self, kind: str, rank: int) -> str:
        return f"hfllamarl/{self.topology.job_id}/{kind}/{rank}"

    @property
    def stale_s(self) -> float:
        return heartbeat_timeout(self.topology.timeout_s)

    def _quick_client(self):
        """A store client of its own with a short timeout (call under `self._lock`, through `timed`)."""
        if self._client is None:
            import datetime

            import torch.distributed as dist

            host, port = self.topology.store_addr
            self._client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                         timeout=datetime.timedelta(seconds=5))
        return self._client

    # ---------------------------------------------------------------- this rank
    def start(self, period_s: float = 1.0) -> None:
        """Start this rank's heartbeat and watchdog threads (idempotent)."""
        if self._threads:
            return
        self.topology.store()  # make sure the store exists (a single-process job hosts it)
        host, port = self.topology.store_addr
        import datetime

        import torch.distributed as dist

        beat_client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=5))
        key = self._key("heartbeat", self.topology.rank)
        self._here = process_identity()
        try:  # where this rank runs: a survivor on the same machine sees it end, and can clean up after it
            beat_client.set(self._key("process", self.topology.rank), json.dumps(self._here))
        except Exception:
            pass

        def beat():
            while not self._stop.is_set():
                try:
                    beat_client.set(key, repr(time.time()))
                except Exception:  # the store is away: the watchdog decides what that means
                    pass
                self._stop.wait(period_s)

        def watch():
            while not self._stop.wait(period_s):
                if self.failing.is_set():
                    return
                verdict = self.verdict()  # (its evidence already spans stale_s: no second look needed)
                if verdict and not self.failing.is_set():
                    self._act(verdict)
                    return

        for name, target in (("hfllamarl-heartbeat", beat), ("hfllamarl-watchdog", watch)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the heartbeat and the watchdog and wait for them (a thread left inside a store call when the
        interpreter exits can abort the process)."""
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=STORE_CALL_S + 2)
        self._threads = []

    def finish(self) -> None:
        """The end-of-job rendezvous, the last thing a rank does with the others (after `train()`, the user's
        `save_model`, process-group teardown: at interpreter exit under a launcher, `trainer.end()`, the end of a
        generator child, the end of a single-process `train()`): say so, wait until every other rank says so too,
        then mark this rank done and stop beating. Until then the heartbeat and the watchdog run, so a rank that
        freezes or dies after the last step is found as one mid-run is; a rank that still beats and never arrives
        (hung, e.g. in a collective's teardown or a non-daemon thread) is named after `collective_timeout_s`, the
        bound of any collective. Either way this rank acts as the watchdog does (`_act`: under a launcher it exits
        non-zero naming that rank, after killing it if it runs here; a single-process parent kills its children
        and raises). Ranks already done (a resumed, finished run) and lost replicas are not waited for."""
        if not self._threads or self.failing.is_set():  # not started, done already, or failing: nothing to meet
            self.stop()
            return
        topo = self.topology
        kind, deadline = _reached(END), time.monotonic() + topo.timeout_s
        keys = {r: (self._key(kind, r), self._key("done", r)) for r in self._others()}
        try:
            timed(lambda: self._locked(lambda c: c.set(self._key(kind, topo.rank), "1")), STORE_CALL_S)
        except Exception:  # (the store's silence is the watchdog's to judge)
            pass
        while True:
            if self.verdict_cause is not None:  # the watchdog acted: a launched rank is exiting in that thread
                if topo.mode == "single":
                    raise PeerLostError(f"{topo.describe(topo.rank)} stops because {self.verdict_cause}")
                time.sleep(0.2)
                continue
            try:
                missing = timed(lambda: self._locked(lambda c: [r for r, k in keys.items() if not c.check([k[0]])
                                                                and not c.check([k[1]])]), STORE_CALL_S)
            except Exception:
                missing = None
            if missing is not None:
                missing = [r for r in missing if topo.replica_of(r) not in topo.lost]
                if not missing:
                    break
                if time.monotonic() > deadline:
                    self.culprit = missing[0]
                    self._act(f"{', '.join(topo.describe(r) for r in missing)} did not reach the end of the job "
                              f"within {topo.timeout_s:.0f} s (collective_timeout_s) of this rank, and still runs: "
                              "it hangs (or works on alone for longer than that bound: raise collective_timeout_s).",
                              frozen=missing)
            time.sleep(0.05)  # (a clean exit waits for the last rank's mark: look often, the store answers at once)
        if topo.mode == "launcher":  # nothing watches a rank past this point: a watcher sees that each one exits
            from hfllamarl.runtime.world.exit_watch import dump_stacks_on_request, watch

            dump_stacks_on_request()
            watch(self._local_peers(), self.stale_s, topo.job_id)
        self.mark_done()
        self._linger()  # (the store's host stays until the others have seen every rank arrive)

    def _local_peers(self) -> dict[str, dict]:
        """The other ranks on this machine (not of a lost replica), by description: their `process_identity`."""
        topo = self.topology

        def read(client):
            for r in self._others():
                if r not in self._where and client.check([self._key("process", r)]):
                    self._where[r] = json.loads(client.get(self._key("process", r)).decode())

        try:
            timed(lambda: self._locked(read), STORE_CALL_S)
        except Exception:  # (the ones read while the store answered still count)
            pass
        return {topo.describe(r): where for r, where in sorted(self._where.items())
                if same_pid_space(where, self._here) and topo.replica_of(r) not in topo.lost}

    def mark_done(self) -> None:
        """This rank finished normally (it is not lost when its heartbeat stops)."""
        try:
            timed(lambda: self._locked(lambda c: c.set(self._key("done", self.topology.rank), "1")), STORE_CALL_S)
        except Exception:
            pass
        self.stop()

    def record_failure(self, cause: str, reaction: bool = False) -> None:
        """Write why this rank stops (once): its own error, or (`reaction`) the failure of another rank it saw."""
        self.failing.set()
        record = json.dumps({"time": time.time(), "cause": cause[-6000:], "reaction": reaction})
        key = self._key("failed", self.topology.rank)

        def write(client):
            if not client.check([key]):
                client.set(key, record)

        try:
            timed(lambda: self._locked(write), STORE_CALL_S)
        except Exception:
            pass
        _write_torchelastic_error(cause)

    def give_up(self, cause: str, reaction: bool = False, linger_s: float = 15.0) -> None:
        """This rank is failing: record why, drop the bridge at once (peers blocked on this rank fail now, not at
        their timeout) and, if this process hosts the job's store, keep the store up until every other rank has
        finished, failed, ended or gone silent, so that they can still tell who failed first."""
        self.record_failure(cause, reaction)
        self.topology.drop_bridge()
        self._linger(linger_s)

    def _linger(self, linger_s: float = 15.0) -> None:
        """If this process hosts the job's store: keep it up until every other rank has finished, failed, ended or
        gone silent (at most `linger_s`): a rank that lost the store before it looked could only blame the store.
        Also when the watchdog gives up (a dead peer is seen within a second: the others must see it too)."""
        if not self.topology.hosts_store:
            return
        deadline = time.monotonic() + linger_s
        while time.monotonic() < deadline:
            try:
                failed, beats, done = self._look(STORE_CALL_S)
            except Exception:
                return
            pending = [r for r in self._others() if r not in done and r not in failed]
            if not set(pending) - set(self._stale(beats, done)) - set(self._ended_peers()):
                return
            time.sleep(0.1)  # (at the end of a clean job the others are done within moments: no need to wait long)

    def announce_joining(self) -> None:
        """A generator child is about to join the bridge (its parent waits for this before it does)."""
        timed(lambda: self._locked(lambda c: c.set(self._key("joining", self.topology.rank), "1")), STORE_CALL_S)

    def await_joining(self, ranks: list[int], budget_s: float) -> None:
        """Single-process parent: wait (at most `budget_s`, the start-up budget) until every child announced it
        joins the bridge, or raise the verdict if one failed first (joining a group a peer never joins would block
        for the whole timeout)."""
        self._await_marks("joining", ranks, budget_s, lambda names: (
            f"{names} did not join the job within {budget_s:.0f} s (vllm_server_timeout: the start-up budget) and "
            "did not fail: raise that budget for a large model or a busy machine."))

    def rendezvous(self, what: str, budget_s: float, why: str = "") -> None:
        """Wait until every rank of the job has reached `what` (e.g. its vLLM engine is up), for at most
        `budget_s`. A start-up step takes as long as it takes on a busy machine, so the wait is bounded by the
        start-up budget, not the collective timeout; a rank that fails or goes silent meanwhile ends it at once
        with the verdict. `why` names the budget's setting in the error."""
        topo = self.topology
        kind = _reached(what)
        self._patient(lambda c: c.set(self._key(kind, topo.rank), "1"), time.monotonic() + budget_s)
        self._await_marks(kind, self._others(), budget_s, lambda names: (
            f"{names} did not reach '{what}' within {budget_s:.0f} s{why} (seen from {topo.describe(topo.rank)}) "
            "and did not fail: raise that budget for a large model or a busy machine."))

    def _await_marks(self, kind: str, ranks: list[int], budget_s: float, late, poll_s: float = 0.2) -> None:
        """Wait until each of `ranks` has set its `kind` key: raise the verdict as soon as there is one, or
        `late(names of the ranks still missing)` after `budget_s`."""
        topo = self.topology
        deadline = time.monotonic() + budget_s
        keys = {r: self._key(kind, r) for r in ranks}
        while missing := self._patient(lambda c: [r for r, k in keys.items() if not c.check([k])], deadline):
            verdict = self.verdict()
            if verdict:
                raise PeerLostError(f"{topo.describe(topo.rank)} stops because {verdict}")
            if time.monotonic() > deadline:
                from hfllamarl.runtime.world.startup import busy_bootstrapping

                if not (kind == _reached(STARTUP) and busy_bootstrapping(topo)):
                    raise PeerLostError(late(", ".join(topo.describe(r) for r in missing)))
            time.sleep(poll_s)

    def _patient(self, call, deadline: float):
        """`call(client)` on the store, tried again while the store does not answer: its host (a trainer rank,
        frozen while this rank starts) is named by the verdict once it has been silent for the heartbeat timeout,
        instead of this rank failing on the first unanswered call. Past `deadline`, the store's own error."""
        while True:
            try:
                return timed(lambda: self._locked(call), STORE_CALL_S)
            except Exception:  # noqa: BLE001 - a store that does not answer (TimeoutError) or is gone
                verdict = self.verdict()
                if verdict:
                    topo = self.topology
                    raise PeerLostError(f"{topo.describe(topo.rank)} stops because {verdict}") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    # ---------------------------------------------------------------- the others
    def _others(self) -> list[int]:
        return [r for r in range(self.topology.world_size) if r != self.topology.rank]

    def _locked(self, fn):
        """`fn(client)` on this rank's shared store client, one call at a time. The wait for the client is bounded
        like the call itself: a helper thread whose caller gave up (`timed`) does not queue on behind a call that
        has not come back."""
        if not self._lock.acquire(timeout=STORE_CALL_S):
            raise TimeoutError(f"the job's store did not answer an earlier call within {STORE_CALL_S:.0f} s")
        try:
            return fn(self._quick_client())
        finally:
            self._lock.release()

    def _read_store(self) -> tuple[dict[int, dict], dict[int, float], set[int]]:
        """The other ranks' failure records, last heartbeats and done marks (call it through `self._look`)."""
        return self._locked(self._read)

    def _read(self, client) -> tuple[dict[int, dict], dict[int, float], set[int]]:
        failed, beats, done = {}, {}, set()
        for r in self._others():
            if client.check([self._key("done", r)]):
                done.add(r)
            key = self._key("failed", r)
            if client.check([key]):
                raw = client.get(key).decode()
                try:
                    failed[r] = json.loads(raw)
                except ValueError:
                    failed[r] = {"time": 0.0, "cause": raw, "reaction": False}
            if client.check([self._key("heartbeat", r)]):
                beats[r] = float(client.get(self._key("heartbeat", r)).decode())
            if r not in self._where and client.check([self._key("process", r)]):
                self._where[r] = json.loads(client.get(self._key("process", r)).decode())
            if r not in self._started and client.check([self._key(_reached(STARTUP), r)]):
                self._started.add(r)
        return failed, beats, done

    def _silence_s(self, rank: int) -> float:
        """How long `rank` may go without a heartbeat: the heartbeat timeout, or `STARTING_SLACK` times it while
        the rank is still starting."""
        return self.stale_s if rank in self._started else STARTING_SLACK * self.stale_s

    def _stale(self, beats: dict[int, float], done: set[int]) -> list[int]:
        """Ranks whose heartbeat stopped (and that did not finish), the longest silent first. A rank that never
        beat is not counted: it may still be starting."""
        now = time.time()
        return [r for last, r in sorted((last, r) for r, last in beats.items()
                                        if r not in done and now - last > self._silence_s(r))]

    def _stopped_starting(self, beats: dict[int, float]) -> list[int]:
        """Generator children of this process that never beat (still importing or loading) and whose process has
        been stopped (SIGSTOP) for as long as a starting rank may be silent: frozen, not slow."""
        now, out = time.monotonic(), []
        for rank, proc in getattr(self.topology, "_children", []):
            if rank in beats or not stopped(proc.pid):
                self._stopped_since.pop(rank, None)
            elif now - self._stopped_since.setdefault(rank, now) > self._silence_s(rank):
                out.append(rank)
        return out

    def lost_ranks(self) -> list[int]:
        try:
            _, beats, done = self._look(STORE_CALL_S)
        except Exception:
            return []
        return self._stale(beats, done)

    def verdict(self) -> str | None:
        """Why this job cannot go on, naming the rank at fault and ending with its own error; None if it can.

        With generator_failure="continue", a failed, dead or frozen rank of another generator replica is not a
        verdict: its replica is marked lost (`Topology.mark_lost`) and the job goes on, unless no replica is left."""
        topo = self.topology
        asked = time.monotonic()
        # Looked at before the store: a rank that ended after writing its failure or done mark shows them there.
        ended = self._ended_peers()
        try:
            failed, beats, done = self._look(STORE_CALL_S)
            self._store_silent_since = None
        except Exception:  # (the store host may have finished and gone: only its silence over stale_s counts)
            now = time.monotonic()
            # (silent since this rank first asked in vain, or since a look that overran its caller came back)
            self._store_silent_since = max(self._store_silent_since or asked, self._look.answered_at or 0.0)
            if now - self._store_silent_since < self.stale_s:
                return None
            host = topo.store_host_rank
            self._frozen = [host] if host is not None else []
            who = f"{topo.describe(host)}, which hosts the job's store," if host is not None else "the job's store"
            return (f"{who} stopped answering for {self.stale_s:.0f} s (the process is frozen, e.g. SIGSTOP, or gone "
                    f"together with its machine).")
        exited = topo.exited_children(ended)  # a single-process job's generator children
        seen = {r for r, _ in exited}
        exited += [(r, None) for r in ended if r not in failed and r not in done and r not in seen]
        stale = self._stale(beats, done)
        stale += [r for r in self._stopped_starting(beats) if r not in stale]
        if topo.failure == "continue" and topo.containing:
            failed, exited, stale = self._contain(failed, exited, stale)
            if topo.role == "trainer" and not topo.live_replicas:
                return "every generator replica is lost: " + "; ".join(
                    f"{topo.describe_replica(r)}: {cause}" for r, cause in sorted(topo.lost.items()))
        own = [(rec["time"], r, rec) for r, rec in failed.items() if not rec.get("reaction")]
        if own:
            _, r, rec = min(own)
            self.culprit = r
            return f"{topo.describe(r)} failed:\n{rec['cause']}"
        for r, code in exited:
            if r not in failed:
                self.culprit = r
                return f"{topo.describe(r)} {self._how(r, code)} without reporting an error."
        lost = self._frozen = stale
        if lost:
            self.culprit = lost[0]
            names = ", ".join(topo.describe(r) for r in lost)
            starting = " while starting" if self.culprit not in self._started else ""
            return (f"{names} stopped answering: no heartbeat for more than {self._silence_s(self.culprit):.0f} s"
                    f"{starting} (the process was killed, or is frozen, e.g. SIGSTOP).")
        if failed:  # only reactions: name the first
            _, r, rec = min((rec["time"], r, rec) for r, rec in failed.items())
            self.culprit = r
            return f"{topo.describe(r)} stopped:\n{rec['cause']}"
        return None

    def _ended_peers(self) -> list[int]:
        """Other ranks on this machine whose processes have ended (`process_gone`): named at once, not after their
        heartbeat's silence. None under torchrun, whose agent watches its workers and names a dead one itself."""
        if not self._here or "TORCHELASTIC_RUN_ID" in os.environ:
            return []
        # (sorted() takes its snapshot in one step: the watchdog thread may add ranks meanwhile)
        return [r for r, where in sorted(self._where.items()) if process_gone(where, self._here)]

    def _how(self, rank: int, code: int | None) -> str:
        """How a rank ended: its exit code (a child of this process), or (None) its process seen gone."""
        if code is None:
            return f"is gone (its process, pid {self._where[rank]['pid']} on this machine, ended)"
        return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def _contain(self, failed: dict, exited: list, stale: list) -> tuple[dict, list, list]:
        """Mark the replicas of contained ranks (`Topology.contained`) lost, with the first cause seen, end their
        frozen processes where this rank can, and return the evidence about the other ranks only."""
        topo = self.topology
        causes: dict[int, str] = {}
        for r, rec in sorted(failed.items(), key=lambda item: item[1]["time"]):
            if topo.contained(r) and not rec.get("reaction"):
                causes.setdefault(topo.replica_of(r), f"{topo.describe(r)} failed: {rec['cause']}")
        for r, code in exited:
            if topo.contained(r):
                causes.setdefault(topo.replica_of(r), f"{topo.describe(r)} {self._how(r, code)}")
        frozen = [r for r in stale if topo.contained(r)]
        for r in frozen:
            causes.setdefault(topo.replica_of(r), f"{topo.describe(r)} stopped answering: no heartbeat for more than "
                                                  f"{self._silence_s(r):.0f} s (killed, or frozen)")
        for replica, cause in causes.items():
            topo.mark_lost(replica, cause)
        frozen = [r for r in frozen if r not in self._ended]
        if frozen:  # a frozen process never ends by itself: whoever shares its machine ends it (once: a pid is reused)
            self._ended.update(frozen)
            topo.kill_children(frozen)
            self._frozen = frozen
            self._kill_frozen_local_peers()
        keep = lambda r: not topo.contained(r)  # noqa: E731
        return ({r: rec for r, rec in failed.items() if keep(r)}, [(r, c) for r, c in exited if keep(r)],
                [r for r in stale if keep(r)])

    def explain(self, exc: BaseException) -> PeerLostError | None:
        """After a failed collective: the verdict as an error (waiting long enough for a peer that just died to
        miss its heartbeat), or None when no other rank is at fault."""
        deadline = time.monotonic() + max((self._silence_s(r) for r in self._others()), default=self.stale_s) + 2.0
        while True:
            verdict = self.verdict_cause or self.verdict()
            if verdict or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not verdict:
            return None
        return PeerLostError(f"{self.topology.describe(self.topology.rank)} stops because {verdict}")

    def _act(self, verdict: str, frozen: list[int] | None = None) -> None:
        """The watchdog's decision: this job cannot go on (`frozen`: the ranks to end, if not the verdict's)."""
        topo = self.topology
        me = topo.describe(topo.rank)
        message = f"{me} stops because {verdict}"
        with self._act_lock:  # (once: the watchdog and `finish` may both get here)
            if self._acted.is_set():
                return
            self._acted.set()
            if frozen is not None:
                self._frozen = frozen
        self.verdict_cause = verdict
        if topo.mode == "single":
            # The user's process (maybe a notebook) stays: kill the children, whose sockets closing fails the
            # main thread's pending collectives at once; it then raises the verdict.
            topo.kill_children()
            return
        self.record_failure(message, reaction=True)
        # A rank of this rank's own replica is at fault and the job survives the replica's loss: leaving is not a
        # failure of the job, and a non-zero exit would make torchrun stop every rank.
        code = 0 if topo.survivable and topo.replica_of(self.culprit if self.culprit is not None else 0) == \
            topo.replica else 1
        last_words(f"\n[hfllamarl] {message}" + ("\n[hfllamarl] this replica is lost; the job goes on without it "
                                                "(generator_failure='continue')" if not code else "") + "\n")
        if topo.mode == "launcher":  # (a generator child leaves its frozen parent, the user's process, alone)
            if self._frozen and "TORCHELASTIC_RUN_ID" in os.environ:
                # torchrun names as the root cause the failure with the earliest timestamp, in whole seconds, the
                # lowest rank on a tie: a frozen rank killed in the second this rank recorded its failure would be
                # named instead, for the SIGKILL it got. The kill waits for the next second.
                time.sleep(1.05 - time.time() % 1.0)
            self._kill_frozen_local_peers()
        self._linger()
        os._exit(code)

    def _kill_frozen_local_peers(self) -> None:
        """A frozen rank (SIGSTOP) never exits by itself and holds its launcher (torchrun waits 30 s before it
        kills it; a bare launch waits forever): the survivor that gives up kills the frozen ranks of its machine."""
        import signal

        here = self._here or process_identity()
        for r in self._frozen:
            where = self._where.get(r)
            if not where or not same_pid_space(where, here) or where["pid"] == os.getpid():
                continue
            try:
                if "start" in where and proc_stat(int(where["pid"]))[1] != where["start"]:
                    continue  # the pid is another process's by now
                os.kill(int(where["pid"]), signal.SIGKILL)
            except (OSError, ValueError, IndexError):
                pass


def _write_torchelastic_error(message: str) -> None:
    """Give torchrun the message it prints as this rank's error (its "root cause" section)."""
    from hfllamarl.runtime.world.exit_watch import write_error_file

    write_error_file(os.environ.get("TORCHELASTIC_ERROR_FILE"), message.splitlines()[-1] if message else "failed",
                     message)
