"""A short run under TRL's GRPOTrainer and AsyncAIPOTrainer, same config (`tests/scripts/trl_short_run.py`):
what `log_history` holds, which evaluations are logged, and which chat template the generator renders with."""

import json

import pytest

from conftest import SCRIPTS, SIDE_BY_SIDE_ENV, run_script, tail

# What TRL logs that does not apply to the default algorithm (see test_trl_parity.py)
NOT_FOR_AIPO = {"clip_ratio/high_max", "clip_ratio/high_mean", "clip_ratio/low_mean", "clip_ratio/low_min",
                "clip_ratio/region_mean"}


def rendered_length(model: str, custom: bool) -> int:
    """Prompt tokens of the script's prompt under the custom template (or the model directory's own; 0: none)."""
    import sys

    sys.path.insert(0, str(SCRIPTS))
    from trl_short_run import PROMPT, tokenizer
    from transformers import AutoTokenizer

    tok = tokenizer(model) if custom else AutoTokenizer.from_pretrained(model)
    if tok.chat_template is None:  # (the model directory has none: a generator using it could not render the prompt)
        return 0
    return len(tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def check_prompt_tokens(entry: dict, steps: int, custom_length: int) -> None:
    """num_tokens counts prompt + completion tokens (as TRL): with 8 completions a step of 1..4 tokens each, the
    prompt part is custom_length per completion only if the generator rendered with the custom template."""
    completion_tokens = entry["num_tokens"] - steps * 8 * custom_length
    assert steps * 8 <= completion_tokens <= steps * 8 * 4, (entry["num_tokens"], custom_length)


def training(history: list[dict]) -> list[dict]:
    return [h for h in history if not any(k.startswith("eval_") for k in h)]


@pytest.mark.slow
def test_short_runs_log_as_trl_evaluate_on_time_and_render_with_the_users_template(tiny_model, tmp_path):
    proc = run_script([str(SCRIPTS / "trl_short_run.py"), tiny_model, str(tmp_path)], timeout=1200,
                      env={"HF_HUB_OFFLINE": "1", **SIDE_BY_SIDE_ENV})
    assert proc.returncode == 0, tail(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    runs = json.loads(line[len("RESULT "):])

    # log_history: with logging_steps (10) past max_steps (3), TRL's only training entry is train()'s. Without
    # evaluation it holds the metrics gathered over the run (TRL's log() merges them in); after an evaluation of the
    # last step it does not (TRL's log() merges the model's mode's metrics: eval, already logged). Ours: the same keys.
    for kind in ("plain", "eval"):
        theirs, mine = training(runs[f"trl_{kind}"]), training(runs[f"ours_{kind}"])
        assert len(theirs) == len(mine) == 1, (kind, theirs, mine)
        theirs, mine = theirs[0], mine[0]
        assert mine["step"] == theirs["step"] == 3
        assert ({"reward", "rewards/short/mean"} <= set(theirs)) == (kind == "plain"), sorted(theirs)
        assert set(theirs) - NOT_FOR_AIPO - {"total_flos"} <= set(mine), sorted(set(theirs) - set(mine))
        assert not {"loss", "grad_norm", "learning_rate"} & set(mine), sorted(mine)  # per-step logs, as TRL: not here
        if kind == "eval":
            assert set(mine) - {"total_flos"} == set(theirs) - {"total_flos"}, (sorted(mine), sorted(theirs))

    # evaluations: eval_steps=2 in a 3-step run evaluates versions 2 and 3, as TRL evaluates at steps 2 and 3 (the
    # last); all logged before train() returned; the run resumed from checkpoint 2 evaluates that checkpoint's own
    # version too: the same versions as the uninterrupted run
    assert [h["step"] for h in runs["trl_eval"] if "eval_reward" in h] == [2, 3]
    assert [h["eval_policy_version"] for h in runs["ours_eval"] if "eval_reward" in h] == [2, 3], runs["ours_eval"]
    assert [h["eval_policy_version"] for h in runs["resumed_eval"] if "eval_reward" in h] == [2, 3], \
        runs["resumed_eval"]
    assert not any("eval_reward" in h for h in runs["ours_plain"] + runs["resumed_plain"])

    # the generator rendered the prompts with processing_class's template, before and after the resume
    custom, own = rendered_length(tiny_model, True), rendered_length(tiny_model, False)
    assert custom - own >= 8, (custom, own)  # (the test could tell them apart)
    check_prompt_tokens(training(runs["ours_plain"])[0], 3, custom)
    check_prompt_tokens(training(runs["resumed_plain"])[0], 3, custom)
