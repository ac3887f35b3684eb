"""Head start: while it waits for the generator, the trainer samples the first tokens of the generator's next batch.

In a single-process job on a CPU the trainer and the generator child each run on their own cores. When generation
is the longer side, the trainer finishes its step and waits, its cores idle, for the generator's batch; the
generator cannot take those cores (a vLLM engine on a CPU runs on the threads it was built with), and splitting
the batch's rows between two samplers pays a decoding step's fixed cost twice. So the batch is split in time
instead: in the tick's channel stage, before the weights go out, the trainer samples the first tokens of every
completion of the batch the generator samples next, with the policy version it is about to send (its sampler is
the bootstrap's: the same prompts, rendering and processed distribution, each token's behaviour log-prob
recorded), until the generator has finished its tick (the core board). The rows go to the generator in the
weights header; it continues each from its prefix with the same version. All rows still decode together on
either side. Every token keeps its log-prob and version: the loss's correction is the same as for any token.

`trainer_head_start`: "auto" (sample until the generator is done, at most the completion's length), a number N
(exactly N tokens each tick, whatever the generator does: reproducible), or "off". Where it does not apply
(`blocker` says why, logged once): not a single-process CPU job with one trainer and one generator process, the
synchronous loop, partial rollouts, dynamic sampling, a sampler lookahead, trainer replica groups (trainer tensor
parallelism has several trainer processes), or anything the trainer's sampler cannot sample as vLLM does (`bootstrap.cannot_sample`).
"""

from __future__ import annotations

import time


def tokens_of(setting) -> int | None:
    """`trainer_head_start` as a token count: None for "auto", 0 for "off", N for a number (ValueError else)."""
    text = str(setting).strip().lower()
    if text in ("auto", "on", "true"):
        return None
    if text in ("off", "false", "0", "none"):
        return 0
    if text.isdigit():
        return int(text)
    raise ValueError(f"trainer_head_start={setting!r}: use 'auto', 'off' or a number of tokens (e.g. 8)")


def blocker(args, spec, topology) -> str | None:
    """Why this job's trainer takes no head start (None: it does). `spec`: the job's `GeneratorSpec`."""
    from hfllamarl.runtime.training.bootstrap import cannot_sample

    if tokens_of(args.trainer_head_start) == 0:
        return "trainer_head_start='off'"
    reasons = [
        (topology.core_lender is None, "it is not a single-process job on a CPU (the trainer and the generator "
                                       "on cores of their own)"),
        (topology.num_trainers != 1 or topology.num_generators != 1, "it has more than one trainer or generator process"),
        (spec.schedule.max_staleness == 0, "max_staleness=0 samples each batch after the step before it"),
        (spec.schedule.generation_ticks > 1, "partial rollouts are carried by the generator"),
        (bool(args.drop_zero_variance_groups), "dynamic sampling draws from the generator's reserve"),
        (args.sampler_lookahead != "none", "the generator samples with weights moved ahead of the trainer's"),
        (spec.replica_groups > 1, "trainer replica groups"),
    ]  # (trainer tensor parallelism has several trainer processes)
    why = cannot_sample(spec) + [text for hit, text in reasons if hit]
    return "; ".join(why) if why else None


class HeadStart:
    """The trainer's side (see the module's text). `sample(executor)` is called in every tick's weights channel."""

    def __init__(self, sampler, board, tokens: int | None):
        self.sampler, self.board, self.tokens = sampler, board, tokens
        self.first_tick: int | None = None  # the loop's first tick: no generator step runs before it
        self.seconds = 0.0  # this tick's sampling (logged with the next step)
        self.sampled = 0  # tokens per completion sampled this tick

    def sample(self, executor) -> dict | None:
        """The head start of the batch the generator samples in this tick (None: none), with the trainer's policy
        version (the one this tick's channel sends)."""
        tick = executor.tick
        self.seconds, self.sampled = 0.0, 0  # (a tick whose step trains nothing logs none of an earlier one)
        if self.first_tick is None:
            self.first_tick = tick
        batch = executor.spec.schedule.generator_batch(tick)  # (None after the last batch)
        if tick == self.first_tick or batch is None:
            return None
        topology = executor.topology
        liveness = getattr(topology, "liveness", None)
        start = time.perf_counter()
        deadline = start + topology.timeout_s / 3  # (a generator lost meanwhile is the channel's to find)

        def done() -> bool:  # the generator finished the tick before this one: it waits for this channel
            return (self.tokens is None and self.board.all_finished(tick - 1)) or time.perf_counter() > deadline \
                or (liveness is not None and (liveness.failing.is_set() or liveness.culprit is not None))

        if done():
            return None
        length = self.sampler.spec.max_completion_length
        rows = self.sampler.head_start(batch, executor.version, self.tokens or length, done)
        self.seconds = time.perf_counter() - start
        self.sampled = max((len(ids) for ids, _, _ in rows["rows"]), default=0) if rows else 0
        return rows

    def metrics(self) -> dict[str, float]:
        out = {"time/head_start": self.seconds, "head_start/tokens": float(self.sampled)}
        self.seconds, self.sampled = 0.0, 0
        return out
