"""The job's clock, by hand: which batch each side works on at each tick (hfllamarl.runtime.loop.schedule)."""

from hfllamarl.runtime.loop.schedule import Schedule, ticks_per_batch


def test_staleness_two():
    s = Schedule(num_batches=5, max_staleness=2)
    assert s.num_ticks == 7 and not s.synchronous
    assert [s.generator_batch(t) for t in range(7)] == [0, 1, 2, 3, 4, None, None]
    assert [s.trainer_batch(t) for t in range(7)] == [None, None, 0, 1, 2, 3, 4]
    assert [s.step_done(t) for t in range(7)] == [0, 0, 1, 2, 3, 4, 5]
    assert [s.tick_of_step(k) for k in range(1, 6)] == [2, 3, 4, 5, 6]
    assert all(s.step_done(s.tick_of_step(k)) == k for k in range(1, 6))
    assert [s.generator_samples(t) for t in range(7)] == [True] * 5 + [False] * 2


def test_synchronous():
    s = Schedule(num_batches=3, max_staleness=0)
    assert s.synchronous and s.num_ticks == 3
    assert [s.trainer_batch(t) for t in range(3)] == [0, 1, 2] == [s.generator_batch(t) for t in range(3)]
    assert [s.step_done(t) for t in range(3)] == [1, 2, 3]


def test_partial_rollouts_keep_the_weights_coming_while_completions_are_carried():
    assert ticks_per_batch(8, None) == 1 and ticks_per_batch(8, 3) == 3 and ticks_per_batch(8, 8) == 1
    s = Schedule(num_batches=4, max_staleness=3, generation_ticks=3)
    # batch 3 starts at tick 3 and may finish at tick 5: the generator samples until then
    assert [s.generator_samples(t) for t in range(7)] == [True] * 6 + [False]


def test_the_last_ticks_carry_the_evaluations_due_by_the_last_step():
    # s=1, 3 batches, eval every 2 steps: version 2 is made at tick 2, reaches the generator at tick 3 (the last
    # tick that trains), is evaluated there, and its results reach the trainer at tick 4: one tick more
    s = Schedule(num_batches=3, max_staleness=1, eval_every=2)
    assert [v for v in range(5) if s.evaluates(v)] == [2]
    assert s.num_ticks == 4 and s.total_ticks == 5
    assert [s.results_arrive(t) for t in range(5)] == [True] * 4 + [False]
    # the last version itself (4 of 4): made at tick 4, evaluated at tick 5, logged at tick 6
    assert Schedule(num_batches=4, max_staleness=1, eval_every=2).total_ticks == 7
    # synchronous: version 3 reaches the generator at tick 3, is evaluated and logged in that tick
    assert Schedule(num_batches=3, max_staleness=0, eval_every=1).total_ticks == 4
    # no evaluation, or eval_delay past the run: no extra tick
    # version 4 of 5 (s=2): made at tick 5, evaluated at tick 6, logged at tick 7 (the 8th)
    assert Schedule(num_batches=5, max_staleness=2, eval_every=2).total_ticks == 8
    assert Schedule(num_batches=6, max_staleness=2, eval_every=2).total_ticks == 10
    assert Schedule(num_batches=3, max_staleness=1).total_ticks == 4
    assert Schedule(num_batches=5, max_staleness=3, eval_every=3).total_ticks == 8  # (version 3: logged at tick 7)
    assert Schedule(num_batches=3, max_staleness=1, eval_every=2, eval_delay=3).total_ticks == 4


def test_the_last_step_is_evaluated_as_transformers_does():
    # DefaultFlowCallback evaluates at max_steps when it is not a multiple of eval_steps (eval_delay allowing)
    s = Schedule(num_batches=3, max_staleness=1, eval_every=2, eval_last=True)
    assert [v for v in range(5) if s.evaluates(v)] == [2, 3]
    assert s.total_ticks == 3 + 1 + 2  # version 3: made at tick 3, evaluated at tick 4, logged at tick 5
    late = Schedule(num_batches=3, max_staleness=1, eval_every=2, eval_delay=4, eval_last=True)
    assert not any(late.evaluates(v) for v in range(5)) and late.total_ticks == 4


def test_evaluations_with_several_passes_per_batch_count_optimizer_steps():
    # num_iterations=2, 6 steps = 3 batches, s=1, eval every 2 steps: versions 2, 4, 6 end batches 1, 2, 3. Version 6
    # is made at tick 3 (batch 3 trained at tick 2 + s), reaches the generator at tick 4, is logged at tick 5
    s = Schedule.of_steps(6, max_staleness=1, iterations=2, eval_every=2, eval_last=True)
    assert s.num_batches == 3 and [v for v in range(8) if s.evaluates(v)] == [2, 4, 6]
    assert s.num_ticks == 4 and s.total_ticks == 6
    # 5 steps = batches of 2, 2, 1 passes; eval every 4: versions 4 and (the last) 5
    s = Schedule.of_steps(5, max_staleness=0, iterations=2, eval_every=4, eval_last=True)
    assert [v for v in range(8) if s.evaluates(v)] == [4, 5] and s.total_ticks == 4
