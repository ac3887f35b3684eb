"""A short run under TRL's GRPOTrainer and AsyncAIPOTrainer, same config (`tests/scripts/trl_short_run.py`):
what `log_history` holds, which evaluations are logged, and which chat template the generator renders with."""

import json

import pytest

from conftest import SCRIPTS, SIDE_BY_SIDE_ENV, run_script, tail

# What TRL logs that does not apply to the default algorithm (see test_trl_parity.py)
NOT_FOR_AIPO = {"clip_ratio/high_max", "clip_ratio/high_mean", "clip_ratio/low_mean", "clip_ratio/low_min",
                "clip_ratio/region_mean"}


def rendered_length(model: str, custom: bool) -> int:
    """Prompt tokens of the script's prompt under the custom template (or the model directory's own)."""
    import sys

    sys.path.insert(0, str(SCRIPTS))
    from trl_short_run import PROMPT, tokenizer
    from transformers import AutoTokenizer

    tok = tokenizer(model) if custom else AutoTokenizer.from_pretrained(model)
    return len(tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def check_prompt_tokens(entry: dict, steps: int, custom_length: int) -> None:
    """num_tokens counts prompt + completion tokens (as TRL): with 8 completions a step of 1..4 tokens each, the
    prompt part is custom_length per completion only if the generator rendered with the custom template."""
    completion_tokens = entry["num_tokens"] - steps * 8 * custom_length
    assert steps * 8 <= completion_tokens <= steps * 8 * 4, (entry["num_tokens"], custom_length)


@pytest.mark.slow
def test_short_run_logs_as_trl_evaluates_on_time_and_renders_with_the_users_template(tiny_model, tmp_path):
    proc = run_script([str(SCRIPTS / "trl_short_run.py"), tiny_model, str(tmp_path)], timeout=900,
                      env={"HF_HUB_OFFLINE": "1", **SIDE_BY_SIDE_ENV})
    assert proc.returncode == 0, tail(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    trl, ours, resumed = result["trl"], result["ours"], result["resumed"]

    # log_history: with logging_steps (10) past max_steps (3), TRL's only training entry is train()'s, and it holds
    # the metrics gathered over the run (TRL's log() merges them in); ours the same, keys included
    def training(history):
        return [h for h in history if not any(k.startswith("eval_") for k in h)]

    assert len(training(trl)) == len(training(ours)) == 1, (training(trl), training(ours))
    theirs, mine = training(trl)[0], training(ours)[0]
    assert {"reward", "rewards/short/mean", "train_runtime", "train_loss"} <= set(theirs), sorted(theirs)
    missing = set(theirs) - NOT_FOR_AIPO - {"total_flos"} - set(mine)
    assert not missing, sorted(missing)
    assert not {"loss", "grad_norm", "learning_rate"} & set(mine), sorted(mine)  # (per-step logs, as TRL: not here)
    assert mine["step"] == theirs["step"] == 3

    # evaluations: eval_steps=2 in a 3-step run evaluates version 2, as TRL evaluates at step 2; logged before
    # train() returned, and the run resumed from checkpoint 2 evaluates that checkpoint's own version too
    assert [h["step"] for h in trl if "eval_reward" in h] == [2]
    assert [h["eval_policy_version"] for h in ours if "eval_reward" in h] == [2], ours
    assert [h["eval_policy_version"] for h in resumed if "eval_reward" in h] == [2], resumed
    assert training(resumed)[0]["step"] == 3 and "reward" in training(resumed)[0]

    # the generator rendered the prompts with processing_class's template, before and after the resume
    custom, own = rendered_length(tiny_model, True), rendered_length(tiny_model, False)
    assert custom - own >= 8, (custom, own)  # (the test could tell them apart)
    check_prompt_tokens(mine, 3, custom)
    check_prompt_tokens(training(resumed)[0], 3, custom)
