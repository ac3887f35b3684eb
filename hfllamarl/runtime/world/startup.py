"""Where a job's start-up goes: each rank's start-up milestones, gathered on the first trainer rank.

Every process marks its milestones as it reaches them (`mark`, wall-clock time, the first mark of a name wins):

- a generator: `started` (its process began its generator work: spawned, prestarted or forked), `imported` (vLLM
  and the generator's modules imported), `job` (its job received), `engine` (its vLLM engine built), `ready` (its
  start-up done, about to wait for the others);
- a trainer: `train` (`train()` called), `ready` (the policy loaded and sharded, its start-up done),
  `first_rollouts` (the first batch arrived), `first_step` (the first optimizer step ended), and when it
  bootstrapped (`runtime.training.bootstrap`: it sampled the first batches itself while the generators started)
  `handover` (every generator up: they sample from the next batch on).

A generator writes its marks to the job's store (`publish`, JSON) before it waits for the others, so the first
trainer rank, past the same wait, reads them all (`collect`) and reports, in seconds after its `train()`:

    start-up (seconds after train()): generator imports done 7.2 s, engine built 9.5 s, ready 10.1 s; trainer
    ready 9.7 s; first rollouts 11.7 s; first step 13.2 s

(`AsyncAIPOTrainer.startup_profile` holds the figures; `hfllamarl bench vs-trl --profile` prints them.) A mark
before `train()` (a prestarted generator imports while the trainer is built) is a negative figure.
"""

from __future__ import annotations

import json
import logging
import time

logger = logging.getLogger(__name__)

GENERATOR_MARKS = ("started", "imported", "job", "engine", "ready")
TRAINER_MARKS = ("train", "ready", "first_rollouts", "first_step", "handover")
_MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    """This process reached `name` now (the first time only)."""
    _MARKS.setdefault(name, time.time())


def reset() -> None:
    """Forget this process's marks (a trainer starts a new job: a notebook's second `train()`)."""
    _MARKS.clear()


def marks() -> dict[str, float]:
    return dict(_MARKS)


def _key(topology, rank: int) -> str:
    return f"hfllamarl/{topology.job_id}/startup/{rank}"


def publish(topology) -> None:
    """A generator rank: write its marks to the job's store (best effort: a profile, never a failure)."""
    from hfllamarl.runtime.world.store_calls import STORE_CALL_S, timed

    payload = json.dumps(marks())
    try:
        timed(lambda: topology.liveness._locked(lambda c: c.set(_key(topology, topology.rank), payload)),
              STORE_CALL_S)
    except Exception as e:  # noqa: BLE001
        logger.debug("start-up marks not published: %s", e)


def collect(topology, ranks) -> dict[int, dict[str, float]]:
    """The marks `ranks` published (a rank that published none is left out). Only JSON numbers are kept."""
    from hfllamarl.runtime.world.store_calls import STORE_CALL_S, timed

    def read(client):
        found = {}
        for r in ranks:
            if client.check([_key(topology, r)]):
                found[r] = client.get(_key(topology, r))
        return found

    try:
        raw = timed(lambda: topology.liveness._locked(read), STORE_CALL_S)
    except Exception as e:  # noqa: BLE001
        logger.debug("start-up marks not read: %s", e)
        return {}
    out = {}
    for r, value in raw.items():
        try:
            data = json.loads(value)
        except ValueError:
            continue
        if isinstance(data, dict):
            out[r] = {k: float(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float))}
    return out


def profile(trainer_marks: dict[str, float], generators: dict[int, dict[str, float]]) -> dict[str, float]:
    """Seconds after the trainer's `train()` at which each milestone was reached (the slowest generator's, for the
    generators' milestones)."""
    origin = trainer_marks.get("train")
    if origin is None:
        return {}
    out = {}
    for name in GENERATOR_MARKS:
        times = [g[name] for g in generators.values() if name in g]
        if times:
            out[f"generator_{name}"] = round(max(times) - origin, 3)
    for name in TRAINER_MARKS[1:]:
        if name in trainer_marks:
            out[f"trainer_{name}"] = round(trainer_marks[name] - origin, 3)
    return out


def describe(p: dict[str, float]) -> str:
    """One line for the log."""
    parts = []
    gen = [(label, p[f"generator_{k}"]) for k, label in (("imported", "imports done"), ("engine", "engine built"),
                                                        ("ready", "ready")) if f"generator_{k}" in p]
    if gen:
        parts.append("generator " + ", ".join(f"{label} {s:.1f} s" for label, s in gen))
    for k, label in (("ready", "trainer ready"), ("first_rollouts", "first rollouts"), ("first_step", "first step"),
                     ("handover", "generators took over")):
        if f"trainer_{k}" in p:
            parts.append(f"{label} {p[f'trainer_{k}']:.1f} s")
    return "start-up (seconds after train()): " + "; ".join(parts)


# ---------------------------------------------------------------- a bootstrapping trainer and its generators
def generators_reached(topology, kind: str) -> bool:
    """Whether every generator rank has set its `kind` key ("joining": about to join the bridges; or a rendezvous
    reached, `liveness._reached`), without waiting; raises the verdict when a rank failed meanwhile."""
    from hfllamarl.runtime.world.liveness import PeerLostError
    from hfllamarl.runtime.world.store_calls import STORE_CALL_S, timed

    liveness = topology.liveness
    keys = [liveness._key(kind, r) for r in topology.generator_ranks]
    if timed(lambda: liveness._locked(lambda c: all(c.check([k]) for k in keys)), STORE_CALL_S):
        return True
    verdict = liveness.verdict()
    if verdict:
        raise PeerLostError(f"{topology.describe(topology.rank)} stops because {verdict}")
    return False


def hand_over(topology, tick: int) -> None:
    """The trainer: the generators start at `tick` (the batches before it were bootstrapped). Written before the
    start-up rendezvous, so every generator reads it past that rendezvous."""
    from hfllamarl.runtime.world.store_calls import STORE_CALL_S, timed

    timed(lambda: topology.liveness._locked(lambda c: c.set(_handover_key(topology), str(int(tick)))), STORE_CALL_S)


def handover_tick(topology) -> int:
    """A generator, past the start-up rendezvous: the tick it starts at (0: the trainer bootstrapped nothing)."""
    from hfllamarl.runtime.world.store_calls import STORE_CALL_S, timed

    key = _handover_key(topology)
    value = timed(lambda: topology.liveness._locked(lambda c: c.get(key) if c.check([key]) else b"0"), STORE_CALL_S)
    return int(value)


def bootstrapping(topology, seconds: float | None) -> None:
    """The trainer: it is about to sample and train one bootstrap batch, which may take up to `seconds` (None: it
    is done bootstrapping). A generator waiting at the start-up rendezvous waits for that batch even past its
    start-up budget (`busy_bootstrapping`): the trainer joins the rendezvous between batches, and its liveness is
    the watchdog's to judge meanwhile."""
    from hfllamarl.runtime.world.store_calls import STORE_CALL_S, timed

    value = "0" if seconds is None else repr(time.time() + seconds)
    timed(lambda: topology.liveness._locked(lambda c: c.set(_bootstrap_key(topology), value)), STORE_CALL_S)


def busy_bootstrapping(topology) -> bool:
    """Whether the trainer is inside a bootstrap batch it announced, within that batch's bound."""
    from hfllamarl.runtime.world.store_calls import STORE_CALL_S, timed

    key = _bootstrap_key(topology)
    try:
        value = timed(lambda: topology.liveness._locked(lambda c: c.get(key) if c.check([key]) else b"0"),
                      STORE_CALL_S)
    except Exception:  # (the store's silence is the verdict's to judge)
        return False
    return float(value) > time.time()


def _bootstrap_key(topology) -> str:
    return f"hfllamarl/{topology.job_id}/startup/bootstrapping"


def _handover_key(topology) -> str:
    return f"hfllamarl/{topology.job_id}/startup/handover"
