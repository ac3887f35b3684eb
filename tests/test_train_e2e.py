"""`AsyncAIPOTrainer.train()` end to end on the CPU: plain python and torchrun, async and sync."""

import glob
import json
import math
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from conftest import (SCRIPTS, SIDE_BY_SIDE_ENV, assert_on_policy, beside, job_processes, kill_processes, orphans,
                      run_script, step_logs, tail, trained_rows)

pytestmark = pytest.mark.slow

STEP_KEYS = {"reward", "reward_std", "rewards/math_sympy/mean", "is_ratio/mean", "is_ratio/max", "clipped_frac",
             "staleness/mean", "staleness/max", "generation/tokens_per_s", "weight_sync_seconds",
             "train_step_seconds", "loss", "learning_rate"}


def notebook_run(tiny_model: str, out: str) -> subprocess.CompletedProcess:
    """`python script.py`, train() run twice as in a notebook, with evaluation during training (see
    `check_notebook_run`). Its generators are prestarted and spawned, as a user's job without a preload server."""
    evaluation = {"eval_strategy": "steps", "eval_steps": 1, "eval_on_start": True, "num_generations_eval": 2}
    return run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, out, "--steps", "6", "--repeat", "2",
                       "--max-staleness", "3", "--beta", "0.04", "--eval-rows", "6",
                       "--extra", json.dumps(evaluation)], timeout=400,
                      env={**SIDE_BY_SIDE_ENV, "HFLLAMARL_PRELOAD": "0"})


def check_notebook_run(proc: subprocess.CompletedProcess, out: str) -> None:
    """The generator is a child process; train() runs twice. With max_staleness=3 the generator runs up to 3
    versions ahead and no further, and every batch is trained. Evaluation during training (eval_steps=1,
    eval_on_start): every version due by the last step (0 to 6) is evaluated, the last ones in the ticks after the last
    step, before train() returns, and the eval_* metrics reach log_history, on_evaluate and TensorBoard."""
    from hfllamarl.runtime.data.prompts import batch_rows

    assert proc.returncode == 0, tail(proc)
    assert proc.stdout.count("TRAINED global_step=6") == 2
    # Each trainer starts its generator child when it is built (vLLM's import overlaps its set-up), and that child
    # runs the job of its train().
    prestarted = [line for line in proc.stdout.splitlines() if line.startswith("PRESTARTED ")]
    running = [line for line in proc.stdout.splitlines() if line.startswith("GENERATORS ")]
    assert len(prestarted) == len(running) == 2 and len(set(prestarted)) == 2, (prestarted, running)
    assert [p.split(" ", 1)[1] for p in prestarted] == [r.split(" ", 1)[1] for r in running], (prestarted, running)
    steps = step_logs(proc.stdout)
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5, 6]
    for h in steps:
        assert STEP_KEYS <= set(h), STEP_KEYS - set(h)
        assert 0.0 <= h["reward"] <= 1.0 and h["generation/tokens_per_s"] > 0
    # Batch b is sampled by policy max(0, b - 3) and trained at version b.
    assert [h["staleness/max"] for h in steps] == [0, 1, 2, 3, 3, 3]
    assert [h["staleness/mean"] for h in steps] == [0, 1, 2, 3, 3, 3]  # whole batches: one version each
    rows = trained_rows(out)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for step in rows:  # 16 completions / 4 per prompt = 4 prompts per step, none skipped
        assert rows[step] == batch_rows(64, 4, step - 1, seed=0)
    # beta > 0: KL to the reference (the starting policy) is 0 while the policy is still the start, then grows.
    assert steps[0]["kl"] < 1e-6 and all(h["kl"] > 0 for h in steps[1:]), [h["kl"] for h in steps]
    assert glob.glob(os.path.join(out, "runs", "*", "events.out.tfevents.*")), "no TensorBoard log"
    assert not orphans(out)
    line = [l for l in proc.stdout.splitlines() if l.startswith("LOG_HISTORY ")][-1]
    evals = [h for h in json.loads(line[len("LOG_HISTORY "):]) if "eval_reward" in h]
    assert [h["eval_policy_version"] for h in evals] == [0, 1, 2, 3, 4, 5, 6], evals
    # version v is held from tick v + 3 and logged by the trainer at the next tick (its step v + 1, at most the last
    # step 6; v=0: step 0)
    assert [h["step"] for h in evals] == [0, 2, 3, 4, 5, 6, 6], evals
    for h in evals:
        assert h["eval_samples"] == 12 and 0 < h["eval_completions/mean_length"] <= 4, h
        assert 0.0 <= h["eval_rewards/math_sympy/mean"] == h["eval_reward"] <= 1.0, h
    assert proc.stdout.count("ON_EVALUATE") == 14, proc.stdout.count("ON_EVALUATE")  # 7 in each train()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in glob.glob(os.path.join(out, "runs", "*", "events.out.tfevents.*")):
        tags |= set(EventAccumulator(events).Reload().Tags()["scalars"])
    assert {"eval/reward", "eval/rewards/math_sympy/mean"} <= tags, sorted(tags)


def test_more_generators_than_processes_is_explained(tiny_model, tmp_path):
    proc = run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, str(tmp_path / "x"), "--num-generators", "2"],
                      nproc=2, timeout=120)
    assert proc.returncode != 0
    assert "num_generator_processes=2 but the launcher started 2 processes" in proc.stderr, tail(proc)


def test_kill_inside_a_checkpoint_and_resume_beside_a_notebook_run(tiny_model, tmp_path):
    """Single process, LoRA, on-policy: SIGKILL the whole job while checkpoint 4 is half-written. A resume with
    other settings is refused; the resume drops the half-written checkpoint, restores the adapters (trainer) and
    the merged policy (generator): were either missing, pi/mu would leave 1 after the resume. It trains exactly
    the prompts of the data schedule (which an uninterrupted run follows: `check_notebook_run`), and resuming the
    finished run returns at once, as transformers' Trainer does. (Several trainer ranks, full weights and
    staleness 1: test_two_trainers_power_cut_and_resume.) Beside it, unpinned, an uninterrupted run whose train()
    is called twice, as in a notebook, with evaluation during training (`check_notebook_run`)."""
    from safetensors.torch import load_file

    from hfllamarl.runtime.data.prompts import batch_rows

    notebook_out = str(tmp_path / "run")
    notebook = beside(notebook_run, tiny_model, notebook_out)
    common = ["--lora", "--steps", "6", "--save-steps", "2", "--learning-rate", "2e-2", "--report-to", "none",
              "--extra", '{"lora_sync": "adapter"}', "--max-staleness", "0"]  # (a resumed engine: base + adapters)
    cut = str(tmp_path / "cut")
    proc = run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, cut, *common, "--kill-in-checkpoint", "4"],
                      timeout=400, env=SIDE_BY_SIDE_ENV)
    assert proc.returncode == -9, tail(proc)  # SIGKILL
    time.sleep(2)
    assert not orphans(cut), "the generator outlived its killed parent"
    names = set(os.listdir(cut))
    assert "checkpoint-2" in names and "checkpoint-4" not in names and ".checkpoint-4.partial" in names, names

    with ThreadPoolExecutor(2) as pool:  # the refused resume only reads the checkpoint: run it beside the resume
        refused = pool.submit(run_script, [str(SCRIPTS / "train_tiny.py"), tiny_model, cut, *common[:-1], "1",
                                           "--resume"], timeout=200, env=SIDE_BY_SIDE_ENV)
        resumed = pool.submit(run_script, [str(SCRIPTS / "train_tiny.py"), tiny_model, cut, *common, "--resume"],
                              timeout=400, env=SIDE_BY_SIDE_ENV)
        proc = refused.result()
        assert proc.returncode != 0 and "max_staleness: 0 -> 1" in proc.stderr, tail(proc)
        proc = resumed.result()
    assert proc.returncode == 0, tail(proc)
    assert "TRAINED global_step=6" in proc.stdout
    steps = step_logs(proc.stdout)
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5, 6]  # the checkpoint's history, then the step counter goes on
    assert [h["staleness/max"] for h in steps] == [0] * 6
    for h in steps[2:]:
        assert_on_policy(h)
    rows = trained_rows(cut)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for step in rows:  # no prompt skipped or trained twice
        assert rows[step] == batch_rows(64, 4, step - 1, seed=0)
    assert {"checkpoint-4", "checkpoint-6"} <= set(os.listdir(cut))
    assert not any(name.startswith(".checkpoint-") for name in os.listdir(cut)), "a partial checkpoint was left"
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(load_file(os.path.join(tiny_model, "model.safetensors"))[key],
                           load_file(os.path.join(cut, "checkpoint-6", "model.safetensors"))[key])

    started = time.monotonic()
    proc = run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, cut, *common, "--resume"], timeout=200,
                      env=SIDE_BY_SIDE_ENV)
    assert proc.returncode == 0 and "TRAINED global_step=6" in proc.stdout, tail(proc)
    assert [h["step"] for h in step_logs(proc.stdout)] == [1, 2, 3, 4, 5, 6]
    assert "hfllamarl.runtime.generation.generator_child" not in proc.stderr and "Loading safetensors" not in proc.stderr
    assert time.monotonic() - started < 60
    check_notebook_run(notebook.result(), notebook_out)


def _wait_for_first_step(out, proc, timeout=240, steps=1, ranks=1):
    logs = [os.path.join(out, f"trained_prompts-rank{r}.jsonl") for r in range(ranks)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if all(os.path.exists(log) and open(log).read().count("\n") >= steps for log in logs):
            return
        time.sleep(0.2)
    raise AssertionError(f"the run never finished step {steps}")


def test_two_trainers_power_cut_and_resume(tiny_model, tmp_path):
    """torchrun, 2 FSDP2 trainer ranks + 1 generator: SIGKILL every process of the job (launcher, ranks,
    vLLM) after checkpoint 2, resume, and check every step trains exactly the rows of the data schedule."""
    import subprocess
    import sys

    from conftest import free_port
    from hfllamarl.runtime.data.prompts import batch_rows

    out = str(tmp_path / "two")
    common = ["--steps", "5", "--save-steps", "2", "--report-to", "none", "--eval-rows", "3",
              "--extra", json.dumps({"eval_strategy": "steps", "eval_steps": 1, "num_generations_eval": 2})]
    # The cut falls between checkpoints 2 and 4 however fast the steps go: at the end of step 3 trainer rank 0 freezes
    # the generator (rank 2), so no rank can pass the next tick's channels; the cut follows both trainers' step 3.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", str(free_port()),
           str(SCRIPTS / "train_tiny.py"), tiny_model, out, *common, "--signal-rank-at", "3:2:SIGSTOP"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_first_step(out, proc, steps=3, ranks=2)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "victim.pid")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert os.path.exists(os.path.join(out, "victim.pid")), "trainer rank 0 never froze the generator"
    finally:
        kill_processes(job_processes(proc, out))
        proc.communicate(timeout=60)
    time.sleep(1)
    assert not orphans(out)
    assert "checkpoint-2" in os.listdir(out)

    with ThreadPoolExecutor(2) as pool:  # the refused resume only reads the checkpoint: run it beside the resume
        refused = pool.submit(run_script, [str(SCRIPTS / "train_tiny.py"), tiny_model, out, *common, "--resume"],
                              nproc=2, timeout=200)
        resumed = pool.submit(run_script, [str(SCRIPTS / "train_tiny.py"), tiny_model, out, *common, "--resume"],
                              nproc=3, timeout=400)
        proc = refused.result()
        assert proc.returncode != 0 and "was written by 3 processes with 1 generator(s); this job has 2" in \
            proc.stderr, tail(proc)
        proc = resumed.result()
    assert proc.returncode == 0, tail(proc)
    assert "TRAINED global_step=5" in proc.stdout
    assert [h["step"] for h in step_logs(proc.stdout)] == [1, 2, 3, 4, 5]
    # As transformers' Trainer, the last step is checkpointed too (5: not a multiple of save_steps).
    assert {"checkpoint-2", "checkpoint-4", "checkpoint-5"} <= set(os.listdir(out)), os.listdir(out)
    # Evaluations split over both trainer ranks (3 prompts x 2), every version as in an uninterrupted run: version
    # 1's, carried in checkpoint 2 with the generator's unsent output; version 2, the checkpoint's own (evaluated after
    # it was written), evaluated again by the resume; 3 to 5, the last ones after the last step.
    line = [l for l in proc.stdout.splitlines() if l.startswith("LOG_HISTORY ")][-1]
    evals = [h for h in json.loads(line[len("LOG_HISTORY "):]) if "eval_reward" in h]
    assert [(h["eval_policy_version"], h["eval_samples"]) for h in evals] == [(v, 6) for v in range(1, 6)], evals
    ranks = [trained_rows(out, 0), trained_rows(out, 1)]
    for step in range(1, 6):
        # 2 ranks x 16 completions / 4 per prompt = 8 prompts per step, from 64 rows with seed 0.
        expected = batch_rows(64, 8, step - 1, seed=0)
        assert sorted(ranks[0][step] + ranks[1][step]) == sorted(expected), step
    # Steps 1-2 came from the checkpoint (trained once); step 3 was trained before the cut and again after.
    logged = [json.loads(line)["step"] for line in open(os.path.join(out, "trained_prompts-rank1.jsonl"))]
    assert logged.count(1) == logged.count(2) == 1 and logged.count(3) == 2, logged

    # The finished run, resumed with a larger max_steps as under transformers' Trainer: from checkpoint-5, the last
    # step, whose generator never sampled the batch a longer run holds in flight there (max_staleness=1); it is
    # sampled first, under the checkpoint's policy (on-policy, staleness 0), and the data schedule goes on. A
    # callback on both trainer ranks ends this 8-step run at step 7: every rank leaves after it.
    more = [*common[:1], "8", *common[2:], "--resume", "--stop-at-step", "7"]
    proc = run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, out, *more], nproc=3, timeout=400)
    assert proc.returncode == 0 and "TRAINED global_step=7" in proc.stdout, tail(proc)
    steps = step_logs(proc.stdout)
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5, 6, 7]
    assert steps[5]["staleness/max"] == 0 and steps[6]["staleness/max"] == 1, steps[5:]
    assert_on_policy(steps[5])  # (step 7 trains a batch sampled one version behind, as in any run)
    ranks = [trained_rows(out, 0), trained_rows(out, 1)]
    for step in (6, 7):
        assert sorted(ranks[0][step] + ranks[1][step]) == sorted(batch_rows(64, 8, step - 1, seed=0)), step
    # as transformers' Trainer: no checkpoint for an early stop between save steps
    assert "checkpoint-6" in os.listdir(out) and not {"checkpoint-7", "checkpoint-8"} & set(os.listdir(out))
    assert not orphans(out)


def sequence_classifier(causal_lm: str, directory) -> str:
    """A reward model: the tiny causal LM's body with a fresh one-logit head, saved with its tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=1)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(causal_lm).save_pretrained(directory)
    return str(directory)


def score_alone(path: str, prompts: list[str], completions: list[str]) -> list[float]:
    """The reference: each prompt + completion through the classifier alone (no padding, no batch)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.inference_mode():
        return [model(**tokenizer(p + c, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                for p, c in zip(prompts, completions)]


def test_trls_loss_settings_train_from_plain_python(tiny_model, family_model, tmp_path):
    """TRL's loss settings in a user script (`python script.py`), three jobs side by side, 3 steps each with
    samples up to 2 versions stale: every loss finite, and each setting's own metrics logged. With
    mask_truncated_completions on a random model (whose 4-token completions are all cut off) a step whose
    completions are all truncated has no gradient at all. Beside them, load_best_model_at_end (`check_best_model`)."""
    import threading

    reward_model = sequence_classifier(tiny_model, tmp_path / "reward_model")
    jobs = {
        "grpo_cispo": (tiny_model, ["--algorithm", "grpo", "--beta", "0.04", "--extra", json.dumps({
            "loss_type": "cispo", "epsilon_high": 5.0, "importance_sampling_level": "sequence",
            "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0,
            "off_policy_mask_threshold": 0.5})]),
        "grpo_sapo": (tiny_model, ["--algorithm", "grpo", "--reward-model", reward_model, "--extra", json.dumps({
            "loss_type": "sapo", "vllm_importance_sampling_mode": "sequence_mask", "delta": 1.5,
            "log_completions": True, "num_completions_to_print": 2})]),
        "aipo_dr_grpo": (family_model("llama"), ["--extra", json.dumps({
            "loss_type": "dr_grpo", "importance_sampling_level": "sequence", "off_policy_mask_threshold": 0.5,
            "mask_truncated_completions": True})]),
        "best_model": (tiny_model, ["--steps", "4", "--max-staleness", "0", "--eval-rows", "6", "--save-steps", "1",
                                    "--reward", "digits",  # (a reward a random policy earns unevenly: it moves)
                                    "--learning-rate", "2e-2", "--save-model", str(tmp_path / "best_model" / "final"),
                                    "--extra", json.dumps({"eval_strategy": "steps", "eval_steps": 1,
                                                           "save_total_limit": 1, "metric_for_best_model": "reward",
                                                           "load_best_model_at_end": True})]),
    }
    procs = {}

    def run(name, model, extra):
        procs[name] = run_script([str(SCRIPTS / "train_tiny.py"), model, str(tmp_path / name), "--steps", "3",
                                  "--max-staleness", "2", "--report-to", "none", "--no-bootstrap", *extra],
                                 timeout=400, env=SIDE_BY_SIDE_ENV)  # (stale samples from the first steps on)

    threads = [threading.Thread(target=run, args=(name, *job)) for name, job in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, tail(proc))
        if name == "best_model":
            check_best_model(proc, tmp_path / name)
            continue
        steps = step_logs(proc.stdout)
        assert [h["step"] for h in steps] == [1, 2, 3], name
        assert max(h["staleness/max"] for h in steps) == 2, name
        for h in steps:
            assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]), (name, h)
            assert "off_policy_mask/dropped_frac" in h or name == "grpo_sapo", (name, h)
            if name.startswith("grpo"):
                assert 0.0 <= h["sampling/importance_sampling_ratio/min"] <= h["sampling/importance_sampling_ratio/max"]
        if name == "grpo_cispo":
            assert all(h["kl"] >= 0 for h in steps) and "cispo_clip_ratio" in steps[0]
        if name == "grpo_sapo":  # TRL's log_completions: a table per logged step, printed and in parquet files
            import pandas as pd

            table = pd.read_parquet(tmp_path / name / "completions" / "completions_00003.parquet")
            assert list(table.columns) == ["step", "prompt", "completion", "reward_model", "math_sympy", "advantage"]
            # the reward model scored on the generator as TRL would: one unpadded forward of prompt + completion
            expected = score_alone(reward_model, list(table["prompt"]), list(table["completion"]))
            assert np.allclose(table["reward_model"], expected, atol=1e-4), (list(table["reward_model"]), expected)
            assert all(math.isfinite(h["rewards/reward_model/mean"]) for h in steps)
            assert len(table) == 16 and set(table["step"]) == {3}
            assert sorted(os.listdir(tmp_path / name / "completions")) == [f"completions_0000{i}.parquet" for i in (1, 2, 3)]
            assert proc.stdout.count("Step 3") >= 1, proc.stdout[-3000:]
        if name == "aipo_dr_grpo":
            cut = [h for h in steps if h["completions/truncated_frac"] == 1.0]
            assert cut, [h["completions/truncated_frac"] for h in steps]
            assert all(h["grad_norm"] == 0.0 and h["loss"] == 0.0 for h in cut), cut


def check_best_model(proc, out) -> None:
    """load_best_model_at_end with metric_for_best_model="reward": the best evaluated version (versions 1-4 are
    evaluated on-policy; the first of the highest eval_reward, as transformers' strict comparison picks) is
    state.best_global_step; its checkpoint survives save_total_limit=1 beside the newest; the model save_model()
    writes after train() holds that checkpoint's weights, not the final policy's."""
    from safetensors.torch import load_file

    line = [l for l in proc.stdout.splitlines() if l.startswith("LOG_HISTORY ")][-1]
    evals = [h for h in json.loads(line[len("LOG_HISTORY "):]) if "eval_reward" in h]
    assert [h["eval_policy_version"] for h in evals] == [1, 2, 3, 4], evals
    best = int(max(evals, key=lambda h: (h["eval_reward"], -h["eval_policy_version"]))["eval_policy_version"])
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["best_global_step"] == best and state["best_metric"] == max(h["eval_reward"] for h in evals)
    assert state["best_model_checkpoint"] == str(out / f"checkpoint-{best}")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted({f"checkpoint-{best}", "checkpoint-4"})
    saved = load_file(str(out / "final" / "model.safetensors"))
    chosen = load_file(str(out / f"checkpoint-{best}" / "model.safetensors"))
    final = load_file(str(out / "checkpoint-4" / "model.safetensors"))
    assert saved.keys() == chosen.keys()
    assert all(torch.equal(saved[k], chosen[k]) for k in saved)
    assert any(not torch.equal(saved[k], final[k]) for k in saved)  # (the final policy differs: not vacuous)
