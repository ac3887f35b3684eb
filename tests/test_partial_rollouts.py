"""Partial rollouts: a completion longer than the per-tick budget is carried over ticks and continued
under newer weights, every token keeping the behaviour log-prob and the policy version that sampled it."""

import json
import os
import pickle
import time

import pytest

from conftest import (SCRIPTS, SIDE_BY_SIDE_ENV, assert_on_policy, beside, orphans, run_script, step_logs, tail,
                      trained_rows)

from hfllamarl import AsyncAIPOConfig


def make(**kw):
    kw.setdefault("output_dir", "/tmp/hfllamarl-test-config")
    kw.setdefault("report_to", "none")
    kw.setdefault("max_completion_length", 8)
    return AsyncAIPOConfig(**kw)


@pytest.mark.parametrize("kw,match", [
    ({"partial_rollout_tokens": 4, "max_staleness": 1}, "Raise max_staleness to >= 2 or partial_rollout_tokens to >= 8"),
    ({"partial_rollout_tokens": 2, "max_staleness": 3}, "up to 4 ticks"),
    ({"partial_rollout_tokens": 4, "max_staleness": 0}, "partial rollouts need an asynchronous job"),
    ({"partial_rollout_tokens": 0, "max_staleness": 2}, "whole number of tokens >= 1"),
    ({"partial_rollout_tokens": 4, "max_staleness": 2, "generation_kwargs": {"stop": ["\n"]}}, "use stop_token_ids"),
    ({"partial_rollout_tokens": 4, "max_staleness": 2, "generation_kwargs": {"frequency_penalty": 0.5}},
     "frequency_penalty"),
])
def test_a_budget_the_staleness_bound_cannot_hold_is_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_budget_sets_the_ticks_a_batch_spans():
    assert make(partial_rollout_tokens=4, max_staleness=2).generation_ticks == 2
    assert make(partial_rollout_tokens=3, max_staleness=3).generation_ticks == 3  # ceil(8 / 3)
    assert make(partial_rollout_tokens=8, max_staleness=0).generation_ticks == 1  # budget >= length: nothing carried
    assert make().generation_ticks == 1


@pytest.mark.slow
def test_carried_tokens_keep_the_logprob_and_version_they_were_sampled_under(tmp_path):
    """Real vLLM, 3 weight versions: each token's mu must be the log-prob under its own version's weights."""
    proc = run_script([str(SCRIPTS / "generator_checks.py"), "partial", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, tail(proc)
    res = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    # 12 tokens at 4 per tick: batch 0 (ticks 0-2) and batch 1 (ticks 1-3) each leave after 3 ticks.
    assert res["finished_at"] == {"0": 2, "1": 3}
    assert res["carried_after"][1] and res["carried_after"][-1] == []
    assert res["multi_segment"] >= 6 and 3 in res["segments"]
    assert res["lengths_ok"] and res["finish_ok"] and res["segments_ok"] and res["text_ok"]
    engine_text, text, decoded = res["undetokenized"]  # generation_kwargs={"detokenize": False}: no text from vLLM
    assert engine_text == "" and text == decoded and text.strip(), res["undetokenized"]
    assert res["bad_versions"] == 0  # token t of batch b: version of tick b + t // 4
    assert res["max_error"] < 1e-4, res  # mu == pi under the weights of the token's own version
    assert res["wrong_version_mean_gap"] > 1e-2, res  # and the versions differ enough for that to mean something
    # Eager on the CPU means nothing compiled, the sampler's token ranks included (inductor would build C++ for
    # them in every generator's first batch).
    assert res["compiled_frames"] == 0, res


@pytest.mark.slow
def test_partial_rollouts_survive_a_kill_and_run_through_a_tensor_parallel_generator(tiny_model, tmp_path):
    """Staleness 2, completions of 4 tokens at 2 per tick. Plain python: SIGKILL after step 3 (checkpoint 2 holds a
    batch mid-generation), resume; the carried tokens keep their versions, the bound holds, no prompt is lost.
    Beside it, torchrun with 3 processes: one trainer and one generator engine sharded over 2 ranks (TP=2); the
    continued completions are sampled by the sharded engine under each new set of weights, each token still scored
    against the version it came from. (The jobs run side by side: much of each is start-up.)"""
    from hfllamarl.runtime.data.prompts import batch_rows

    tp_out = str(tmp_path / "tp")
    tp_job = beside(run_script, [str(SCRIPTS / "train_tiny.py"), tiny_model, tp_out, "--steps", "4", "--max-staleness",
                                 "2", "--partial-rollout-tokens", "2", "--num-generators", "2", "--generator-tp", "2",
                                 "--report-to", "none"], nproc=3, timeout=400, env=SIDE_BY_SIDE_ENV)

    out = str(tmp_path / "partial")
    common = ["--steps", "6", "--save-steps", "2", "--report-to", "none", "--max-staleness", "2",
              "--partial-rollout-tokens", "2"]
    proc = run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, out, *common, "--kill-at-step", "3"], timeout=400,
                      env=SIDE_BY_SIDE_ENV)
    assert proc.returncode == -9, tail(proc)
    time.sleep(2)
    assert not orphans(out), "the generator outlived its killed parent"
    # Step 2 ends at tick 3: batch 2 is finished but not sent, batch 3 has its first 2 tokens per completion,
    # sampled at tick 3 under version 1 (the trainer's first step).
    with open(os.path.join(out, "checkpoint-2", "hfllamarl", "generator.pt"), "rb") as fh:
        saved = pickle.load(fh)
    assert {g.batch_index for g in saved["pending"]} == {2}
    assert [f.batch_index for f in saved["in_flight"]] == [3]
    carried = saved["in_flight"][0].unfinished()
    assert carried and all(r.versions == [1, 1] and len(r.behavior_logprobs) == 2 for r in carried)

    proc = run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, out, *common, "--resume"], timeout=400,
                      env=SIDE_BY_SIDE_ENV)
    assert proc.returncode == 0, tail(proc)
    steps = step_logs(proc.stdout)
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5, 6]
    assert [h["staleness/max"] for h in steps] == [0, 1, 2, 2, 2, 2]
    assert all(h["partial_rollouts/count"] > 0 for h in steps), [h["partial_rollouts/count"] for h in steps]
    # Batch 0's two ticks both ran under version 0, the version that trains it: the continued tokens'
    # mu matches pi exactly, so none was shifted, dropped or mis-scored.
    assert_on_policy(steps[0])
    # From step 3 on, a completion's second half was sampled one version later than its first.
    assert all(h["staleness/token_mean"] < 2 for h in steps[2:]), [h["staleness/token_mean"] for h in steps]
    rows = trained_rows(out)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for step in rows:
        assert rows[step] == batch_rows(64, 4, step - 1, seed=0)

    proc = tp_job.result()
    assert proc.returncode == 0, tail(proc)
    steps = step_logs(proc.stdout)
    assert [h["staleness/max"] for h in steps] == [0, 1, 2, 2]
    assert all(h["partial_rollouts/count"] > 0 for h in steps)
    assert_on_policy(steps[0])  # the TP engine's mu on version 0 equals the trainer's pi
    assert all(h["staleness/token_mean"] < 2 for h in steps[2:]), [h["staleness/token_mean"] for h in steps]
    rows = trained_rows(tp_out)
    assert sorted(rows) == [1, 2, 3, 4]
    assert all(rows[step] == batch_rows(64, 4, step - 1, seed=0) for step in rows)
    assert not orphans(tp_out)
