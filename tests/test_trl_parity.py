"""The same TRL user script under TRL's GRPOTrainer and AsyncAIPOTrainer: what TRL logs, hfllamarl logs too."""

import json
import threading

import pandas as pd
import pytest

from conftest import SCRIPTS, SIDE_BY_SIDE_ENV, run_script, step_logs, tail

# What TRL logs that does not apply to the default algorithm, and why: AIPO does not clip pi/pi_old (its
# clipped_frac counts the tokens whose pi/mu weight reached aipo_rho); algorithm="grpo" logs these.
NOT_FOR_AIPO = {"clip_ratio/high_max", "clip_ratio/high_mean", "clip_ratio/low_mean", "clip_ratio/low_min",
                "clip_ratio/region_mean"}


@pytest.mark.slow
def test_a_trl_script_logs_what_trl_logs(tiny_model, tmp_path):
    procs = {}

    def run(side):
        procs[side] = run_script([str(SCRIPTS / "trl_user_script.py"), tiny_model, str(tmp_path / side),
                                  "--trainer", side] + (["--push"] if side == "hfllamarl" else []), timeout=400,
                                 env={"HF_HUB_OFFLINE": "1", **SIDE_BY_SIDE_ENV})

    threads = [threading.Thread(target=run, args=(side,)) for side in ("trl", "hfllamarl")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for side, proc in procs.items():
        assert proc.returncode == 0, (side, tail(proc))
    for proc in procs.values():  # accelerator.print once for the whole job; save_model and end() as in TRL's scripts
        assert proc.stdout.count("TRAINING DONE") == 1, proc.stdout[-2000:]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "hfllamarl")  # save_model wrote a loadable model
    # open-r1's tail after train(): the files TRL's trainer writes, written here too, with TRL's metric names
    results = {side: json.load(open(tmp_path / side / "train_results.json")) for side in procs}
    assert set(results["trl"]) - {"total_flos"} <= set(results["hfllamarl"]), (results["trl"], results["hfllamarl"])
    assert json.load(open(tmp_path / "hfllamarl" / "all_results.json")) == results["hfllamarl"]
    assert results["hfllamarl"]["train_samples"] == 40 and results["hfllamarl"]["train_loss"] == pytest.approx(
        sum(h["loss"] for h in step_logs(procs["hfllamarl"].stdout)) / 2)
    assert "***** train metrics *****" in procs["hfllamarl"].stdout
    # the callback's stop after step 2 of 4, obeyed by both trainers
    for side in procs:
        state = json.load(open(tmp_path / side / "trainer_state.json"))
        assert state["global_step"] == 2 and [h["step"] for h in state["log_history"] if "reward" in h] == [1, 2]
    card = (tmp_path / "hfllamarl" / "README.md").read_text()
    assert "AsyncAIPOTrainer" in card and "digits" in card and "- test" in card, card
    saved = json.load(open(tmp_path / "hfllamarl" / "config.json"))
    assert saved["use_cache"] is True
    assert "PUSH_FAILED OfflineModeIsEnabled repo=hfllamarl" in procs["hfllamarl"].stdout  # it got to the upload
    trl, ours = step_logs(procs["trl"].stdout), step_logs(procs["hfllamarl"].stdout)
    assert len(trl) == len(ours) == 2
    for theirs, mine in zip(trl, ours):
        missing = set(theirs) - NOT_FOR_AIPO - set(mine)
        assert not missing, sorted(missing)
        assert mine["epoch"] == pytest.approx(theirs["epoch"])  # 2 prompts per step of 40: 0.05, 0.1
        assert 0.0 <= mine["digits/any"] <= 1.0 and 0.0 <= mine["frac_reward_zero_std"] <= 1.0
        assert mine["completions/min_length"] <= mine["completions/mean_length"] <= mine["completions/max_length"] <= 6
    assert ours[1]["num_tokens"] > ours[0]["num_tokens"] > 0  # cumulative, as TRL's
    table = pd.read_parquet(tmp_path / "hfllamarl" / "completions" / "completions_00002.parquet")
    counts = [sum(ch.isdigit() for ch in c) for c in table["completion"]]
    assert list(table["digit_count"]) == counts  # log_extra's column, row by row
