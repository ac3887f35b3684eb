"""The job's clock, by hand: which batch each side works on at each tick (hfllamarl.runtime.schedule)."""

from hfllamarl.runtime.schedule import Schedule, ticks_per_batch


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
