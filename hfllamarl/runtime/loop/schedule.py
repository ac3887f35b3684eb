"""The job's clock: which batch each side works on at each tick, and what a tick or a step means.

Every side reads the same `Schedule`, so the generator, the trainer, the controller and the checkpoints
agree by construction. With `max_staleness = s`:

    tick t:   the generator starts batch t (while t < num_batches)
              the trainer trains batch t - s (while 0 <= t - s < num_batches): trainer step t - s + 1
    ticks:    num_batches + s in all

A batch the generator starts at tick t was sampled with the weights of trainer step >= t - s, so no
token is more than s versions stale. With partial rollouts a batch spans up to `generation_ticks`
ticks (<= max(s, 1), checked by the config); the trainer keeps sending weights while any are carried.

A batch of P prompts is split twice, by position (a prompt's place in the batch, `prompts.batch_rows`
order), independently: trainer rank k of T trains positions `trainer_positions(P, T, k)` whichever replica
generated them, and live replica r generates `replica_share(P, live, b)[r]`. So which prompts a trainer rank
trains at each step depends only on (seed, batch index, T): not on the number of replicas, nor on which of
them are still live.

Several optimizer passes per batch (TRL's `num_iterations = k`): a tick still trains one generation batch, in
k optimizer steps, each one policy version (so versions, `global_step`, `max_steps`, the learning-rate schedule,
logging, saving and evaluation all count optimizer steps, as in TRL). A run of `num_steps` steps has
ceil(num_steps / k) batches; the last one gets the passes left (TRL trains its last generation batch until
max_steps too). Weights go to the generator once per tick, after the batch's last pass; checkpoints fall on
batch boundaries only (the config refuses a save or eval interval that is not a multiple of k). A batch the
generator starts at tick t was sampled with weights at most s batches = s * k versions old at its first pass.
"""

from __future__ import annotations

from dataclasses import dataclass


def even_runs(n: int, parts: int) -> list[range]:
    """`range(n)` cut into `parts` contiguous runs whose sizes differ by at most one (the longer ones first)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def trainer_positions(prompts: int, trainers: int, rank: int) -> range:
    """The positions of a batch of `prompts` prompts that trainer rank `rank` of `trainers` trains."""
    return even_runs(prompts, trainers)[rank]


def position_owner(position: int, prompts: int, trainers: int) -> int:
    """The trainer rank that trains position `position` of a batch of `prompts` prompts."""
    return next(k for k, run in enumerate(even_runs(prompts, trainers)) if position in run)


def replica_share(prompts: int, live: list[int], batch_index: int) -> dict[int, list[int]]:
    """Which positions of batch `batch_index` each live replica generates (whole prompts: a group never splits):
    contiguous runs of sizes differing by at most one, the runs handed to the live replicas rotated by the
    batch index, so that the longer runs go to each replica in turn."""
    runs = even_runs(prompts, len(live))
    return {live[(k + batch_index) % len(live)]: list(run) for k, run in enumerate(runs)}


def ticks_per_batch(max_completion_length: int, partial_rollout_tokens: int | None) -> int:
    """The most ticks the generator spends on one batch: ceil(L / B) with partial rollouts, else 1."""
    budget = partial_rollout_tokens or max_completion_length
    return max(1, -(-max_completion_length // budget))


@dataclass(frozen=True)
class Schedule:
    num_batches: int
    max_staleness: int
    generation_ticks: int = 1  # ticks_per_batch(...)
    prompts_per_batch: int = 0  # prompts in one batch (P: positions 0 .. P-1)
    iterations: int = 1  # optimizer passes over each batch (TRL's num_iterations)
    steps: int | None = None  # optimizer steps of the run (max_steps); None: num_batches * iterations
    eval_every: int = 0  # policy versions (optimizer steps) that are multiples of this are evaluated (0: none)
    eval_delay: int = 0  # ... from this version on
    eval_last: bool = False  # and the last version (transformers evaluates at the last step: "steps" and "epoch")

    def __post_init__(self):
        if self.iterations < 1:
            raise ValueError(f"Schedule: iterations={self.iterations}; it must be >= 1")
        if self.steps is not None and not (self.num_batches - 1) * self.iterations < self.steps <= \
                self.num_batches * self.iterations:
            raise ValueError(f"Schedule: {self.steps} optimizer steps do not fill {self.num_batches} batches of "
                             f"{self.iterations} passes (the last one may be partial)")

    @classmethod
    def of_steps(cls, steps: int, max_staleness: int, generation_ticks: int = 1, prompts_per_batch: int = 0,
                 iterations: int = 1, **evaluations) -> "Schedule":
        """The schedule of a run of `steps` optimizer steps, `iterations` passes per batch (`evaluations`: the
        eval_* fields)."""
        return cls(-(-steps // iterations), max_staleness, generation_ticks, prompts_per_batch, iterations, steps,
                   **evaluations)

    @property
    def num_steps(self) -> int:
        """Optimizer steps (policy versions) of the whole run: TRL's max_steps."""
        return self.steps if self.steps is not None else self.num_batches * self.iterations

    @property
    def version_staleness(self) -> int:
        """The most policy versions a token may be stale at its batch's first pass: max_staleness batches."""
        return self.max_staleness * self.iterations

    def passes(self, batch: int) -> int:
        """Optimizer passes over batch `batch` (iterations, fewer for a last batch cut by max_steps)."""
        return max(0, min(self.iterations, self.num_steps - batch * self.iterations))

    @property
    def num_ticks(self) -> int:
        """The ticks that sample and train: the generator's batches and the trainer's steps."""
        return self.num_batches + self.max_staleness

    def evaluates(self, version: int) -> bool:
        """Whether policy version `version` (1 .. num_steps) is evaluated during the run (eval_on_start's version
        0 aside), as transformers' DefaultFlowCallback decides it at step `version`. (With several passes per batch
        the config keeps eval_steps a multiple of them: an evaluated version ends a batch.)"""
        return (self.eval_every > 0 and 0 < version <= self.num_steps and version >= self.eval_delay
                and (version % self.eval_every == 0 or (self.eval_last and version == self.num_steps)))

    @property
    def total_ticks(self) -> int:
        """`num_ticks`, and the ticks after them that finish the evaluations due by the last step: version v (ending
        batch b, 1-based) reaches the generator at tick b + s, is evaluated there, and its results reach the trainer
        at the next tick's rollouts channel (the same tick when synchronous). Nothing is sampled or trained in those
        ticks."""
        last = max([v for v in (self.num_steps, self.num_steps - self.num_steps % max(self.eval_every, 1))
                    if self.evaluates(v)], default=0)
        if not last:
            return self.num_ticks
        batch = -(-last // self.iterations)  # version `last` ends this batch (1-based): its weights leave then
        return max(self.num_ticks, batch + 1 if self.synchronous else batch + self.max_staleness + 2)

    def results_arrive(self, tick: int) -> bool:
        """Whether what the generator produces at `tick` still reaches the trainer within the run."""
        return tick < self.total_ticks if self.synchronous else tick + 1 < self.total_ticks

    @property
    def synchronous(self) -> bool:
        """s = 0: the generator waits for the weights of the previous step (strictly on-policy)."""
        return self.max_staleness == 0

    def generator_batch(self, tick: int) -> int | None:
        """The batch the generator starts at `tick`, or None once every batch is started."""
        return tick if 0 <= tick < self.num_batches else None

    def trainer_batch(self, tick: int) -> int | None:
        """The batch the trainer trains on at `tick`, or None (the first s ticks, and after the last batch)."""
        batch = tick - self.max_staleness
        return batch if 0 <= batch < self.num_batches else None

    def step_done(self, tick: int) -> int:
        """The optimizer step complete at the end of `tick` (0: none yet): the last pass of the batch trained."""
        batches = max(0, min(tick - self.max_staleness + 1, self.num_batches))
        return min(batches * self.iterations, self.num_steps)

    def tick_of_step(self, step: int) -> int:
        """The tick at whose end optimizer step `step` is complete (a checkpoint of that step resumes after it);
        with several passes per batch, `step` must end a batch (checkpoints fall on batch boundaries)."""
        if step % self.iterations and step != self.num_steps:
            raise ValueError(f"step {step} is inside a batch of {self.iterations} optimizer passes: only a batch's last "
                             "pass can be checkpointed")
        return -(-step // self.iterations) - 1 + self.max_staleness

    def generator_samples(self, tick: int) -> bool:
        """Whether the generator still samples at `tick`: a new batch, or completions carried from earlier ticks."""
        return tick < self.num_batches + self.generation_ticks - 1
