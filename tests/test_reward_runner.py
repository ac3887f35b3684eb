"""TRL's reward contract as the trainer runs it."""

import asyncio
import threading
import time

import pytest

from hfllamarl.runtime.data.rewards import RewardFunctionError, RewardRunner, resolve_reward_funcs


def call(runner, prompts, completions, **columns):
    return runner(prompts, completions, [[1, 2]] * len(completions), columns, trainer_state="STATE")


def test_kwargs_columns_and_weights():
    seen = {}

    def exact(prompts, completions, completion_ids, trainer_state, answer, level, **kw):
        seen.update(prompts=prompts, ids=completion_ids, state=trainer_state, level=level)
        return [float(c == a) for c, a in zip(completions, answer)]

    def half(completions, **kw):
        return [0.5] * len(completions)

    runner = RewardRunner([exact, half], weights=[2.0, 1.0])
    total, per = call(runner, ["p1", "p2"], ["4", "5"], answer=["4", "6"], level=[1, 2])
    assert total == [2.5, 0.5]
    assert per == {"exact": [1.0, 0.0], "half": [0.5, 0.5]}
    assert seen == {"prompts": ["p1", "p2"], "ids": [[1, 2], [1, 2]], "state": "STATE", "level": [1, 2]}


def test_log_metric_and_log_extra_as_trl_passes_them():
    """TRL 1.16 gives every reward function `log_metric(name, value)` and `log_extra(column, values)`; what they log
    is drained once per step (then forgotten): each metric's sum and count, each column fitted to the completions."""
    def scored(completions, log_metric, log_extra, **kw):
        log_metric("judge/calls", 2.0)
        log_extra("verdict", ["yes", "no"])
        return [1.0, 0.0]

    runner = RewardRunner([scored])
    call(runner, ["p1", "p2"], ["a", "b"])
    call(runner, ["p1", "p2"], ["a", "b"])
    assert runner.drain(4) == ({"judge/calls": (4.0, 2)}, {"verdict": ["yes", "no", "yes", "no"]})
    assert runner.drain(2) == ({}, {})


def test_multi_turn_completions_stay_message_lists():
    seen = []
    runner = RewardRunner([lambda completions, **kw: seen.extend(completions) or [0.0] * len(completions)])
    chat = [{"role": "user", "content": "q"}]
    turns = [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "name": "t", "content": "1"},
             {"role": "assistant", "content": "done"}]
    call(runner, [chat, chat], [turns, "plain"])
    assert seen == [turns, [{"role": "assistant", "content": "plain"}]]


def test_none_skips_a_function_for_a_sample_and_nan_is_none():
    def sparse(completions, **kw):
        return [None, 1.0, float("nan")]

    def one(completions, **kw):
        return [1.0, 1.0, 1.0]

    runner = RewardRunner([sparse, one])
    total, per = call(runner, ["a"] * 3, ["x"] * 3)
    assert total == [1.0, 2.0, 1.0]
    assert per["sparse"] == [None, 1.0, None]
    assert runner.counters()["reward_nonfinite"] == 1.0


def test_chat_prompts_get_chat_completions():
    got = []

    def f(prompts, completions, **kw):
        got.append(completions)
        return [0.0] * len(completions)

    call(RewardRunner([f]), [[{"role": "user", "content": "hi"}]], ["yo"])
    assert got == [[[{"role": "assistant", "content": "yo"}]]]


def test_async_functions_run_concurrently():
    async def slow(completions, **kw):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def slow2(completions, **kw):
        await asyncio.sleep(0.3)
        return [2.0] * len(completions)

    start = time.perf_counter()
    total, _ = call(RewardRunner([slow, slow2]), ["a"], ["b"])
    assert total == [3.0]
    assert time.perf_counter() - start < 0.55  # concurrent, not 0.6 s in a row


def test_raising_function_is_named_or_zeroed():
    def broken(completions, **kw):
        raise KeyError("boom")

    with pytest.raises(RewardFunctionError, match="'broken' raised KeyError.*first prompt: 'the prompt'"):
        call(RewardRunner([broken]), ["the prompt"], ["c"])
    runner = RewardRunner([broken], on_error="zero")
    assert call(runner, ["p", "p"], ["c", "d"])[0] == [0.0, 0.0]
    assert runner.error_count == 1


def test_raising_function_names_the_failing_sample():
    calls = []

    def picky(prompts, completions, completion_ids, trainer_state, answer, **kw):
        calls.append(len(completions))
        assert trainer_state == "STATE" and len(prompts) == len(completion_ids) == len(answer) == len(completions)
        if "bad" in completions:
            raise ValueError("cannot parse")
        return [1.0] * len(completions)

    completions = ["ok0", "ok1", "bad", "ok3"]
    with pytest.raises(RewardFunctionError) as err:
        call(RewardRunner([picky]), [f"prompt {i}" for i in range(4)], completions, answer=["1", "2", "3", "4"])
    msg = str(err.value)
    assert "'picky' raised ValueError: cannot parse" in msg
    assert "sample 2 (ValueError: cannot parse): prompt 'prompt 2', completion 'bad'" in msg
    assert "reward_errors='zero'" in msg
    assert calls == [4, 1, 1, 1]  # the batch, then samples 0..2 alone: the search stops at the first failure


def test_failing_sample_search_is_bounded_and_truncates():
    def batch_only(completions, **kw):
        if len(completions) > 1:
            raise RuntimeError("needs one at a time")
        return [0.0]

    with pytest.raises(RewardFunctionError, match="all 3 samples.*no single sample raised"):
        call(RewardRunner([batch_only]), ["p"] * 3, ["c"] * 3)

    seen = []

    def always(completions, **kw):
        seen.append(len(completions))
        raise RuntimeError("x")

    long = "y" * 1000
    with pytest.raises(RewardFunctionError) as err:
        call(RewardRunner([always]), [long] * 100, [long] * 100)
    assert "sample 0" in str(err.value) and len(str(err.value)) < 1200

    runner = RewardRunner([batch_only])
    with pytest.raises(RewardFunctionError, match="the first 64 of 100 samples"):
        call(runner, ["p"] * 100, ["c"] * 100)

    zero = RewardRunner([always], on_error="zero")
    seen.clear()
    assert call(zero, ["p"] * 5, ["c"] * 5)[0] == [0.0] * 5
    assert seen == [5] and zero.error_count == 1  # zero mode does not re-run the function per sample


@pytest.mark.parametrize("bad,match", [
    (lambda completions, **kw: [1.0], "returned 1 values for 2 completions"),
    (lambda completions, **kw: 1.0, "must return a list"),
    (lambda completions, **kw: ["x", 1.0], "returned 'x' for completion 0"),
])
def test_wrong_outputs_are_explained(bad, match):
    with pytest.raises(RewardFunctionError, match=match):
        call(RewardRunner([bad]), ["p", "p"], ["a", "b"])


def test_resolution_of_names_and_callables():
    def mine(completions, **kw):
        return [0.0] * len(completions)

    funcs = resolve_reward_funcs(["math_sympy", mine])
    assert funcs[1] is mine and callable(funcs[0])
    with pytest.raises(ValueError, match="No rewards plugin named 'nope'"):
        resolve_reward_funcs("nope")
    with pytest.raises(ValueError):
        resolve_reward_funcs([])
    with pytest.raises(ValueError, match="reward_weights has 1 entries"):
        RewardRunner([mine, mine], weights=[1.0])


def test_async_inside_running_loop():
    async def f(completions, **kw):
        return [1.0] * len(completions)

    out = {}

    async def main():
        out["v"] = call(RewardRunner([f]), ["p"], ["c"])[0]

    t = threading.Thread(target=lambda: asyncio.run(main()))
    t.start()
    t.join(10)
    assert out["v"] == [1.0]


def test_partials_are_named_and_awaited_as_trl_does():
    """TRL names a `functools.partial` after the function it wraps (`rewards/<name>/mean`) and awaits a partial of
    an async function."""
    import functools

    from trl.trainer.utils import get_callable_name

    def scaled(completions, scale, **kw):
        return [scale * len(c) for c in completions]

    async def later(completions, offset, **kw):
        await asyncio.sleep(0)
        return [offset + len(c) for c in completions]

    funcs = [functools.partial(scaled, scale=2.0), functools.partial(functools.partial(later), offset=1.0)]
    runner = RewardRunner(funcs)
    assert runner.names == [get_callable_name(f) for f in funcs] == ["scaled", "later"]
    total, per = call(runner, ["p"], ["abc"])
    assert per == {"scaled": [6.0], "later": [4.0]} and total == [10.0]


def test_a_completion_no_function_scores_moves_no_baseline_and_gets_no_advantage():
    """TRL: such a completion's reward is NaN, left out of its group's mean (nanmean), its advantage 0. By hand:
    group 1 scores [1, -, 0, -]: its baseline is 0.5 and the advantages [0.5, 0, -0.5, 0]; group 2 has no score."""
    import torch

    from hfllamarl.plugins.algorithms.aipo import AIPO

    def sometimes(completions, **kw):
        return [None if c == "?" else float(c) for c in completions]

    def never(completions, **kw):
        return [None] * len(completions)

    runner = RewardRunner([sometimes, never])
    completions = ["1", "?", "0", "?", "?", "?", "?", "?"]
    total, per = call(runner, ["p"] * 8, completions)
    assert total == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # (the combined scores, without groups)
    marked, _ = runner(["p"] * 8, completions, [[1, 2]] * 8, {}, group_sizes=[4, 4])
    nan = float("nan")  # TRL's NaN for an unscored completion: out of the group's mean, advantage 0
    assert str(marked) == str([1.0, nan, 0.0, nan, nan, nan, nan, nan])
    advantages = AIPO(rho=4.0).advantages(torch.tensor(marked), 4)
    assert advantages.tolist() == [0.5, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert runner.counters()["reward_unscored"] == 6.0
    # decided on every function's own scores: a second function of the same name (None) hides no score
    never.__name__ = "sometimes"
    twins = RewardRunner([sometimes, never])
    assert twins(["p"] * 2, ["1", "0"], [[1]] * 2, {}, group_sizes=[2])[0] == [1.0, 0.0]
