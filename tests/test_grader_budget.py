"""math_sympy's time budget: a check that did not finish is unscored (None), never 0.0; the budget scales
with the batch; a warning when more than 1 % of a call is unscored."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from hfllamarl.plugins.algorithms.aipo import AIPO
from hfllamarl.plugins.rewards import math_sympy as module
from hfllamarl.plugins.rewards.math_sympy import math_sympy
from hfllamarl.runtime.data.rewards import RewardRunner
from hfllamarl.commands.grader_batch import math_batch, math_verify_verdicts, read_rows

MATH_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "math_test.jsonl"
SLOW = r"So the answer is $\boxed{\sum_{k=1}^{9999} k^{k^{2}}}$."  # within the structure rules, past any timeout
LOGGER = "hfllamarl.plugins.rewards.math_sympy"


@pytest.fixture(autouse=True)
def _settings():
    """Each test starts from the defaults with ready workers and leaves them as it found them."""
    saved = module.configure()
    math_sympy.warmup()
    yield
    module.configure(**saved)


def _delta(before: dict) -> dict:
    after = math_sympy.stats()
    return {key: after[key] - before[key] for key in after}


@pytest.mark.timing  # (the default budget on this machine's cores, not on what another test leaves of them)
def test_several_hundred_math_completions_in_one_call_against_math_verify():
    """A batch of ~1000 completions (~320 need the sandbox), graded in one call. Against Math-Verify's own
    verdicts: no pair it calls correct is scored 0.0 for lack of time. A 0.0 on such a pair is accepted only
    when the pair graded alone, with ten times the time, is 0.0 too (a rule, not the clock). With the old
    fixed 2 s per call, 103 of these completions ran out of time and 46 Math-Verify-correct ones scored 0.0."""
    if not MATH_TEST.exists():
        pytest.skip(f"{MATH_TEST} not found")
    completions, golds = math_batch(read_rows(MATH_TEST, 300))
    assert len(completions) > 900
    before = math_sympy.stats()
    scores = math_sympy(prompts=None, completions=completions, answer=golds)
    counted = _delta(before)
    unscored = [i for i, s in enumerate(scores) if s is None]
    assert counted["unscored"] == counted["timeouts"] + counted["worker_errors"] == len(unscored)
    assert len(unscored) <= 0.005 * len(completions), [completions[i] for i in unscored]

    reference = math_verify_verdicts(completions, golds)
    assert sum(reference) > 400 and sum(not v for v in reference) > 300  # both kinds, plenty of each
    zero_but_correct = [i for i, (s, v) in enumerate(zip(scores, reference)) if v and s == 0.0]
    module.configure(sample_timeout_s=20.0, sample_budget_s=20.0)
    alone = [math_sympy(prompts=None, completions=[completions[i]], answer=[golds[i]])[0] for i in zero_but_correct]
    assert alone == [0.0] * len(zero_but_correct)  # verdicts of the grader's rules, not of the clock
    assert len(zero_but_correct) <= 0.01 * sum(reference)
    agree = sum((s == 1.0) == v for s, v in zip(scores, reference) if s is not None)
    assert agree >= 0.99 * (len(scores) - len(unscored))


@pytest.mark.timing  # (the sandboxed check of sqrt(25) must finish within sample_timeout_s)
def test_a_check_that_times_out_is_unscored_and_its_group_keeps_its_scores():
    """Groups of 4 (gold 5): right cheaply, right through the sandbox, a sum that cannot be checked in time,
    wrong. The sum scores None (never 0.0), the others keep their verdicts; through the trainer's RewardRunner
    the sum moves no baseline and gets advantage 0 (TRL's NaN rule),
    and the counts reach the step's metrics."""
    group = [r"\boxed{5}", r"The answer is $\boxed{\sqrt{25}}$.", SLOW, r"\boxed{6}"]
    other = [r"\boxed{\frac{6}{2}}", r"\boxed{3}", r"\boxed{2+2}", r"\boxed{1}"]
    before = math_sympy.stats()
    scores = math_sympy(prompts=None, completions=group + other, answer=["5"] * 4 + ["3"] * 4)
    assert scores == [1.0, 1.0, None, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert _delta(before)["timeouts"] == _delta(before)["unscored"] == 1

    runner = RewardRunner([math_sympy])
    rewards, per_func = runner(["q"] * 8, group + other, [[1]] * 8, {"answer": ["5"] * 4 + ["3"] * 4},
                               group_sizes=[4, 4])
    assert per_func["math_sympy"] == scores
    assert rewards == pytest.approx([1.0, 1.0, float("nan"), 0.0, 1.0, 1.0, 0.0, 0.0], nan_ok=True)  # TRL's NaN
    advantages = AIPO(rho=4.0).advantages(torch.tensor(rewards), 4).tolist()
    # by hand: group 1's scored rewards 1, 1, 0 have mean 2/3; the unscored one gets exactly 0
    assert advantages[:4] == pytest.approx([1 / 3, 1 / 3, 0.0, -2 / 3], abs=1e-6)
    assert advantages[4:] == pytest.approx([0.5, 0.5, -0.5, -0.5], abs=1e-6)
    counters = runner.counters()
    assert counters["reward_unscored"] == 1.0 and counters["rewards/math_sympy/unscored"] >= 2.0


@pytest.mark.timing  # (some checks must finish in 0.3 s: CI 28 saw none on a worker beside a drill)
def test_the_budget_scales_with_the_batch_and_a_spent_budget_leaves_completions_unscored():
    """A budget far too small for the batch: the checks it could not run are None (counted as timeouts),
    never 0.0, the call ends near its budget, and what finished keeps its verdict."""
    module.configure(sample_budget_s=0.001, sample_timeout_s=0.3)
    n = 300
    completions = [rf"\boxed{{({k})+1}}" for k in range(n)]  # each needs the sandbox; (k)+1 = k+1
    golds = [str(k + 1 if k % 2 else k + 2) for k in range(n)]  # even k: wrong
    scores = math_sympy(prompts=None, completions=completions, answer=golds)
    # Some checks finished, some did not. (How many finish in 0.3 s depends on the machine's load: on a loaded CI
    # machine one did, a right answer, so the 0.0 verdicts are checked with the budget that fits, below.)
    finished = [(k, s) for k, s in enumerate(scores) if s is not None]
    assert finished and None in scores
    assert all(s == (1.0 if k % 2 else 0.0) for k, s in finished)
    # the same batch with a budget that fits it: every check finishes (1 s a check: the default 0.25 s ran out on a
    # CI machine loaded by side-by-side drills, which is the budget working, not what this test compares)
    module.configure(sample_budget_s=1.0, sample_timeout_s=2.0)
    scores = math_sympy(prompts=None, completions=completions, answer=golds)
    assert scores == [1.0 if k % 2 else 0.0 for k in range(n)]


def test_more_than_one_percent_unscored_is_one_warning_naming_the_setting(caplog):
    module.configure(sample_budget_s=1.0)  # (only the two slow ones may run out, also on a loaded machine)
    fine = [rf"\boxed{{{k}}}" for k in range(98)]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        math_sympy(prompts=None, completions=fine + [SLOW, SLOW], answer=[str(k) for k in range(98)] + ["1", "2"])
    warned = [r for r in caplog.records if r.name == LOGGER]
    assert len(warned) == 1  # once for the call, not once per completion
    message = warned[0].getMessage()
    assert "2 of 100 completions (2.0 %) are unscored" in message
    assert "did not finish in time" in message and "sample_timeout_s" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):  # 1 of 100: not more than 1 %
        math_sympy(prompts=None, completions=fine + [SLOW, r"\boxed{1}"], answer=[str(k) for k in range(98)] + ["1", "1"])
    assert [r for r in caplog.records if r.name == LOGGER] == []


def test_a_spent_budget_warning_names_sample_budget_s(caplog):
    module.configure(sample_budget_s=0.001, sample_timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        math_sympy(prompts=None, completions=[rf"\boxed{{({k})+1}}" for k in range(200)],
                   answer=[str(k + 1) for k in range(200)])
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert "time budget ran out" in record.getMessage() and "sample_budget_s" in record.getMessage()


@pytest.mark.parametrize("kwargs, match", [
    ({"workers": 0}, "workers must be a positive integer"),
    ({"workers": 1.5}, "workers must be a positive integer"),
    ({"sample_timeout_s": 0}, "sample_timeout_s must be a positive number"),
    ({"sample_budget_s": float("inf")}, "sample_budget_s must be a positive number"),
    ({"sample_budget_s": "1"}, "sample_budget_s must be a positive number"),
])
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        module.configure(**kwargs)


@pytest.mark.timing  # (40 sandboxed checks within 2 s each: CI 30 saw 3 run out on a worker beside a drill)
def test_one_worker_and_several_give_the_same_scores():
    completions = [rf"\boxed{{({k})+1}}" for k in range(40)] + [SLOW]
    golds = [str(k + 1 if k % 3 else k) for k in range(40)] + ["1"]
    # (a call's budget of 2 s a check: on a loaded machine the default 0.25 s ran out before the last checks, which
    # is the budget working, not what this test compares; the slow one still ends at sample_timeout_s)
    module.configure(workers=1, sample_budget_s=2.0)
    one = math_sympy(prompts=None, completions=completions, answer=golds)
    module.configure(workers=3, sample_budget_s=2.0)
    three = math_sympy(prompts=None, completions=completions, answer=golds)
    assert one == three == [1.0 if k % 3 else 0.0 for k in range(40)] + [None]


def test_unscored_totals_reach_the_log_as_the_newest_total():
    """counters() reports running totals; a log line covering several steps shows the newest, not a mean."""
    from hfllamarl.runtime.training.reporting import _mean_of

    rows = [{"rewards/math_sympy/unscored": 1.0, "reward_unscored": 1.0, "loss": 1.0},
            {"rewards/math_sympy/unscored": 4.0, "reward_unscored": 2.0, "loss": 3.0}]
    assert _mean_of(rows) == {"rewards/math_sympy/unscored": 4.0, "reward_unscored": 2.0, "loss": 2.0}


def test_a_check_that_raises_is_wrong_not_unscored():
    """Unscored (advantage 0) beats wrong (a negative advantage): only a check that could not finish may give it.
    A check that raised finished; the answer was not shown equal (too large or too deep stays unscored)."""
    assert module._worker_equivalent("x+1", None, "x+1", None) is False  # raises TypeError inside: finished, wrong
    assert module._worker_equivalent("x+1", "x+1", "x+1", "x+1") is True
