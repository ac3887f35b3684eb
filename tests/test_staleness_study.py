"""The staleness study (`hfllamarl bench learning`): its statistics against hand values, a 20-step smoke run of every
correction with staleness held exactly, and the command end to end (outputs, resume). The grid itself is a
benchmark, not a test."""

import json
import math
import os
import subprocess
import sys

import pytest

from hfllamarl.study.stats import final_reward, mean_ci, ratio_ci
from hfllamarl.study.tasks import boxed_content, digit_credit, exact_boxed


def test_statistics_against_hand_values():
    # mean 2, sample sd 1, n 3: t(2) = 4.303 -> half-width 4.303 / sqrt(3)
    mean, half = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert mean_ci([0.5]) == (0.5, math.inf)
    assert final_reward([0.0] * 90 + [1.0] * 10) == 1.0  # the last tenth, at least 10 steps
    assert final_reward(list(range(200))) == pytest.approx(sum(range(180, 200)) / 20)
    ratio, low, high = ratio_ci([0.8, 0.9, 1.0], [0.9, 0.9, 0.9])
    assert ratio == pytest.approx(1.0) and low < 1.0 < high and (low, high) == ratio_ci([0.8, 0.9, 1.0], [0.9] * 3)[1:]


def test_task_rewards():
    assert boxed_content("x \\boxed{1{2}} \\boxed{42}") == "42" and boxed_content("\\boxed{4") is None
    assert exact_boxed(["\\boxed{7}", "\\boxed{7", "7", "\\boxed{ 7 }"], ["7"] * 4) == [1.0, 0.0, 0.0, 1.0]
    # digits right, aligned from the units, over the longer of the two
    assert digit_credit(["\\boxed{47}", "\\boxed{46}", "\\boxed{147}", "\\boxed{4x}", "47"], ["47"] * 5) == [
        1.0, 0.5, pytest.approx(2 / 3), 0.0, 0.0]


SMOKE = r"""
import json, sys, torch
torch.set_num_threads(1)
from hfllamarl.study.grid import CORRECTIONS
from hfllamarl.study.lockstep import run
from hfllamarl.study.tasks import TASKS
task = TASKS["successor"]
model = task.prepare_model(sys.argv[1] + "/model")
out = {}
# aipo twice: the same seed gives the same run; GSPO as TRL's docs configure it with the mask around the sampler
gspo = dict(algorithm="grpo", loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)
runs = [(name, name, {}) for name in CORRECTIONS] + [("aipo_again", "aipo", {}),
                                                    ("gspo_sampler_trust", "token_truncate+sampler_trust", gspo)]
for key, name, extra in runs:
    config = dict(output_dir=sys.argv[1] + "/run", max_steps=20, per_device_train_batch_size=16, num_generations=4,
                  max_completion_length=4, learning_rate=5e-3, seed=3, max_staleness=4, off_policy_correction=name,
                  **extra)
    out[key] = run(model, task.rows(), task.reward, config)["series"]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_correction_trains_20_steps_with_staleness_held_exactly(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SMOKE, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    series = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, s in series.items():
        assert len(s["reward"]) == 20, name
        for metric, values in s.items():
            assert all(v is None or math.isfinite(v) for v in values), (name, metric)
        # batch b is sampled by version max(0, b - 4) and trained at version b: exactly 4 from the fifth batch on
        assert s["staleness/mean"] == [float(min(b, 4)) for b in range(20)], name
    assert series["aipo_again"] == series["aipo"]
    assert "correction/masked_frac" in series["m2po"] and "correction/masked_frac" in series["a3po"]
    assert all(0 < v <= 1 for v in series["ess"]["correction/step_scale"])
    # past the bootstrap some stale sequences leave the region around the sampler, never all of them
    masked = series["gspo_sampler_trust"]["correction/trust_masked_frac"]
    assert masked[0] == 0 and 0 < max(masked) < 1
    assert max(series["ess"]["correction/ess"]) <= 1.0
    # the corrections differ: after 20 steps at staleness 4 the policies took different paths
    assert len({json.dumps(s["reward"]) for s in series.values()}) > 3


@pytest.mark.slow
def test_bench_learning_quick_writes_its_outputs_and_resumes(tmp_path):
    out = tmp_path / "study"
    command = [sys.executable, "-m", "hfllamarl.cli", "bench", "learning", "--quick", "--steps", "12", "--seeds",
               "0,1", "--output-dir", str(out)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    # successor: AIPO and GRPO synchronous and at staleness 4 with their defaults, AIPO without correction at 4
    assert summary["cells"] == 5 and summary["runs"] == 10
    cells = [json.loads(line) for line in open(out / "cells.jsonl")]
    assert {c["staleness"] for c in cells} == {0, 4}
    none = next(c for c in cells if c["correction"] == "none")
    assert none["final_ci"] >= 0 and none["of_sync"] is not None and none["seeds"] == [0, 1]
    assert "| successor | aipo |" in open(out / "table.md").read()
    assert summary["figures"] and all(os.path.isfile(p) for p in summary["figures"])
    # a second call finds every run done: nothing is trained again, the same summary comes out
    again = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "10 run(s)" in again.stdout and "0 to go" in again.stdout
    assert json.loads(again.stdout.strip().splitlines()[-1])["final"] == summary["final"]
