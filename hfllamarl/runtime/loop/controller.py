"""The controller loop every process runs (SPMD; paper, Algorithm 1).

A tick is a fixed list of stages that every rank walks through in the same order: a channel
stage moves data between executors, a step stage runs the local executor's `step()` if its role
matches. The asynchronous loop communicates first and then lets both executors step at once,
so generation of batch k+1 overlaps training on batch k; the synchronous loop
(`max_staleness=0`) puts the generator's step between the weight and rollout channels, so the
trainer always trains on samples from its current policy.
"""

from __future__ import annotations

import logging

from hfllamarl.runtime.loop.dispatch import Communicate, stages
from hfllamarl.runtime.loop.executor import Executor
from hfllamarl.runtime.loop.schedule import Schedule

logger = logging.getLogger(__name__)


def _is_communication_error(exc: Exception) -> bool:
    from hfllamarl.runtime.world.liveness import PeerLostError

    text = str(exc).lower()
    return isinstance(exc, PeerLostError) or "Dist" in type(exc).__name__ or any(
        word in text for word in ("connection", "timed out", "timeout", "peer", "gloo", "nccl"))


def fail(topology, exc: BaseException) -> BaseException:
    """This rank stops on `exc`: return the error to raise (one naming the rank at fault, ending with its own
    error, when another rank's failure caused `exc`), after recording it for the other ranks."""
    from hfllamarl.runtime.world.liveness import describe_exception

    liveness = topology.liveness
    liveness.failing.set()
    named = liveness.explain(exc) if _is_communication_error(exc) else None
    if named is not None:
        liveness.give_up(str(named), reaction=True)
        return named
    liveness.give_up(f"{topology.describe(topology.rank)} raised " + describe_exception(exc))
    return exc


class ExecutorController:
    """Runs `num_ticks` ticks of `stages` on the local `executor`."""

    def __init__(self, executor: Executor, stages: list, num_ticks: int, start_tick: int = 0):
        self.executor, self.stages = executor, stages
        self.num_ticks, self.start_tick = num_ticks, start_tick

    def run(self) -> None:
        executor = self.executor
        for tick in range(self.start_tick, self.num_ticks):
            executor.set_step(tick)
            for stage in self.stages:
                if isinstance(stage, Communicate):
                    stage.channel.communicate_with(executor)
                    if executor.stopped:  # every rank learns it in the same channel of the same tick
                        return
                elif stage.role is None or stage.role == executor.role:
                    executor.step()
            if executor.checkpoint_due():
                executor.save_checkpoint()


def run_job(executor: Executor, backend, topology, schedule: Schedule, start_tick: int = 0) -> None:
    """Build the job's stages (`hfllamarl.runtime.loop.dispatch.stages`: the weights and rollouts channels, and with
    generator_failure="continue" the recovery stage) and run the loop over the ticks of `schedule`
    (`hfllamarl.runtime.loop.schedule`): with `max_staleness = s >= 1` the trainer trains batch t-s at tick t while the
    generator samples batch t; `s = 0` runs the synchronous stage order. The loop ends after `schedule.total_ticks`:
    the last ticks only carry the evaluations due by the last step, so every one is logged before it returns.
    """
    stages_, dispatch = stages(topology, schedule, backend, executor)
    executor.backend, executor.dispatch = backend, dispatch
    topology.liveness.start()
    try:
        executor.init()  # start-up failures (an engine that cannot start) are reported like any other
        topology.containing = True  # every rank is up: from now on a lost replica may be survived
        start_tick = max(start_tick, executor.first_tick)  # (the trainer bootstrapped the batches before it)
        ExecutorController(executor, stages_, num_ticks=schedule.total_ticks, start_tick=start_tick).run()
    except Exception as exc:
        error = fail(topology, exc)
        culprit = topology.liveness.culprit if error is not exc else topology.rank
        if (topology.role == "generator" and topology.survivable and culprit is not None
                and topology.replica_of(culprit) == topology.replica):
            # This replica is lost and the job goes on without it (generator_failure="continue"): the trainer ranks
            # read the error recorded by `fail`; the process ends cleanly (a launcher such as torchrun stops every
            # rank when one exits with an error).
            import traceback

            traceback.print_exception(error)
            logger.warning("%s: this replica is lost; the job goes on without it (generator_failure='continue')",
                           topology.describe(topology.rank))
            return
        if error is exc:
            raise
        raise error from exc
    finally:
        executor.close()
    # (no "done" yet: this rank's heartbeat and watchdog run on until the end-of-job rendezvous, `Liveness.finish`,
    # so that a rank frozen or dead after the last step is found like one mid-run)


def run_without_generators(executor: Executor, schedule: Schedule) -> None:
    """A trainer replica group that shares group 0's generators (`trainer_replica_shared_generators`): no
    generator and no channel; each tick trains the share group 0 hands it in the step (or, while group 0 is away,
    samples it itself: `replica_makeup`), until the run's global step count (`stop_requested`)."""
    executor.prepare()
    try:
        for tick in range(schedule.total_ticks):
            executor.set_step(tick)
            executor.step()
            if executor.stop_requested():
                return
    finally:
        executor.close()
