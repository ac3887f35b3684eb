"""`hfllamarl eval`: data shapes, prompts, scoring, and end-to-end runs with a tiny model on vLLM (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SIDE_BY_SIDE_ENV

from hfllamarl import load_plugin
from hfllamarl.commands.eval_data import (INSTRUCTION, EvalDataError, build_prompt, check_rows, columns_of, default_reward,
                                 detect_shape, gold_answer, read_jsonl, score_completions)
from hfllamarl.commands.evaluate import request_seed, summarize
from hfllamarl.testing.tiny import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MATH500 = DATA / "math500_test.jsonl"
GSM8K = DATA / "gsm8k_test.jsonl"

needs_math500 = pytest.mark.skipif(not MATH500.exists(), reason=f"{MATH500} is not there")
needs_gsm8k = pytest.mark.skipif(not GSM8K.exists(), reason=f"{GSM8K} is not there")


def write_jsonl(path: Path, lines: list) -> str:
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return str(path)


# ------------------------------------------------------------------------------------------ reading, shapes
def test_shapes_from_columns(tmp_path):
    math = write_jsonl(tmp_path / "m.jsonl", [{"problem": "1+1?", "solution": "s", "answer": "2", "level": 1}])
    gsm = write_jsonl(tmp_path / "g.jsonl", [{"question": "1+1?", "answer": "One and one.\n#### 2"}])
    generic = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    assert detect_shape(columns_of(read_jsonl(math))) == "math"
    assert detect_shape(columns_of(read_jsonl(gsm))) == "gsm8k"
    assert detect_shape(columns_of(read_jsonl(generic))) == "prompt"
    # An explicit prompt column wins over the question columns.
    assert detect_shape(["prompt", "problem", "answer"]) == "prompt"


@needs_math500
@needs_gsm8k
def test_shapes_of_the_shared_files():
    assert detect_shape(columns_of(read_jsonl(str(MATH500), limit=5))) == "math"
    assert detect_shape(columns_of(read_jsonl(str(GSM8K), limit=5))) == "gsm8k"
    assert len(read_jsonl(str(MATH500), limit=7)) == 7


def test_unknown_shape_lists_the_columns():
    with pytest.raises(EvalDataError, match=r"\['label', 'text'\]"):
        detect_shape(["text", "label"])
    with pytest.raises(EvalDataError, match="problem"):  # a `problem` without an `answer` is no MATH row
        detect_shape(["problem", "solution"])


def test_bad_json_line_is_named(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "a", "answer": "1"}, "", '{"problem": oops}'])
    with pytest.raises(EvalDataError, match="line 3: not valid JSON"):
        read_jsonl(path)
    assert len(read_jsonl(path, limit=1)) == 1  # lines past --limit are not read
    path = write_jsonl(tmp_path / "list.jsonl", [{"prompt": "a"}, [1, 2]])
    with pytest.raises(EvalDataError, match="line 2: expected a JSON object"):
        read_jsonl(path)


def test_empty_missing_and_incomplete_files(tmp_path):
    with pytest.raises(EvalDataError, match="no rows"):
        read_jsonl(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(EvalDataError, match="Cannot read"):
        read_jsonl(str(tmp_path / "absent.jsonl"))
    with pytest.raises(EvalDataError, match="Row 1 has no `problem`"):
        check_rows([{"problem": "p", "answer": "1"}, {"answer": "2"}], "math")


def test_default_rewards():
    assert default_reward("math", []) == "math_sympy"
    assert default_reward("gsm8k", []) == "gsm8k"
    assert default_reward("prompt", [{"prompt": "a", "answer": "\\frac12"}]) == "math_sympy"
    assert default_reward("prompt", [{"prompt": "a", "answer": "so\n#### 4"}]) == "gsm8k"
    with pytest.raises(EvalDataError, match="--reward"):
        default_reward("prompt", [{"prompt": "a"}])


def test_gold_answer_shown():
    assert gold_answer({"answer": "Two eggs.\n#### 1,234"}) == "1,234"
    assert gold_answer({"answer": "\\frac{1}{2}"}) == "\\frac{1}{2}"
    assert gold_answer({"prompt": "x"}) is None


# ------------------------------------------------------------------------------------------ prompts
@pytest.fixture(scope="module")
def plain_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tok


def test_plain_text_prompt(plain_tokenizer):
    reward_prompt, text = build_prompt({"problem": "What is 1+1?", "answer": "2"}, "math", plain_tokenizer)
    assert text == f"What is 1+1?\n\n{INSTRUCTION}\nSolution:"
    assert reward_prompt == text
    assert "\\boxed{}" in INSTRUCTION
    _, text = build_prompt({"question": " Eggs? ", "answer": "#### 3"}, "gsm8k", plain_tokenizer)
    assert text.startswith("Eggs?\n\n" + INSTRUCTION)
    # A `prompt` column is used verbatim.
    assert build_prompt({"prompt": "3+1="}, "prompt", plain_tokenizer) == ("3+1=", "3+1=")


def test_chat_template_prompt_is_a_user_message(chat_tokenizer):
    messages, text = build_prompt({"problem": "What is 1+1?", "answer": "2"}, "math", chat_tokenizer)
    assert messages == [{"role": "user", "content": f"What is 1+1?\n\n{INSTRUCTION}"}]
    assert text == f"<user>What is 1+1?\n\n{INSTRUCTION}\n<assistant>"
    messages, text = build_prompt({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
                                  "prompt", chat_tokenizer)
    assert text == "<system>s\n<user>u\n<assistant>" and len(messages) == 2
    # A text prompt is used as training uses it: verbatim, no chat template (as TRL).
    assert build_prompt({"prompt": "3+1="}, "prompt", chat_tokenizer) == ("3+1=", "3+1=")


def test_chat_messages_need_a_chat_template(plain_tokenizer):
    with pytest.raises(EvalDataError, match="chat template"):
        build_prompt({"prompt": [{"role": "user", "content": "u"}]}, "prompt", plain_tokenizer)


# ------------------------------------------------------------------------------------------ scoring, summary
def test_gold_completions_score_one_through_the_command_scoring():
    rows = [{"problem": "p1", "answer": "\\frac{1}{2}"}, {"problem": "p2", "answer": "(3, \\frac{\\pi}{2})"}]
    prompts = ["p1", "p2"]
    completions = [[f"So the answer is \\boxed{{{r['answer']}}}.", "\\boxed{7}"] for r in rows]
    rewards = score_completions(load_plugin("rewards", "math_sympy"), rows, prompts, completions)
    assert rewards == [[1.0, 0.0], [1.0, 0.0]]
    gsm = [{"question": "q", "answer": "Janet sells 9 eggs.\n#### 18"}]
    assert score_completions(load_plugin("rewards", "gsm8k"), gsm, ["q"], [[gsm[0]["answer"], "#### 17"]]) \
        == [[1.0, 0.0]]


@needs_math500
def test_math500_gold_answers_score_one():
    rows = read_jsonl(str(MATH500), limit=20)
    prompts = [build_prompt(r, "math", build_tokenizer())[0] for r in rows]
    completions = [[f"The final answer is $\\boxed{{{r['answer']}}}$."] for r in rows]
    rewards = score_completions(load_plugin("rewards", "math_sympy"), rows, prompts, completions)
    assert rewards == [[1.0]] * 20


@needs_gsm8k
def test_gsm8k_gold_solutions_score_one():
    rows = read_jsonl(str(GSM8K), limit=20)
    rewards = score_completions(load_plugin("rewards", "gsm8k"), rows, [r["question"] for r in rows],
                                [[r["answer"], f"\\boxed{{{gold_answer(r)}}}"] for r in rows])
    assert rewards == [[1.0, 1.0]] * 20


def test_rewards_get_columns_and_chat_completions():
    seen = {}

    def spy(prompts, completions, completion_ids=None, **columns):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, columns=columns)
        return [0.5] * len(completions)

    chat_prompt = [{"role": "user", "content": "q"}]
    out = score_completions(spy, [{"prompt": "ignored", "answer": "2", "level": 3}], [chat_prompt], [["a", "b"]],
                            [[[1, 2], [3]]])
    assert out == [[0.5, 0.5]]
    assert seen["prompts"] == [chat_prompt, chat_prompt]
    assert seen["completions"] == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    assert seen["completion_ids"] == [[1, 2], [3]]
    # TRL passes trainer_state, log_metric and log_extra besides the row's columns
    assert {k: v for k, v in seen["columns"].items() if k not in ("log_metric", "log_extra")} == {
        "answer": ["2", "2"], "level": [3, 3], "trainer_state": None}
    assert callable(seen["columns"]["log_metric"]) and callable(seen["columns"]["log_extra"])


def test_summary_accuracy_and_any_correct():
    s = summarize([[1.0, 0.0], [0.0, 0.0], [1.0, None]], samples=2)
    assert s["accuracy"] == pytest.approx(0.4) and s["pass@1"] == s["accuracy"]
    assert s["any_correct"] == pytest.approx(2 / 3) and s["unscored"] == 1
    assert summarize([[1.0], [0.0]], samples=1)["any_correct"] is None
    assert summarize([], samples=1)["accuracy"] is None


def test_every_completion_gets_its_own_seed():
    seeds = {request_seed(0, i, 4) + j for i in range(100) for j in range(4)}
    assert len(seeds) == 400
    assert request_seed(1, 0, 4) != request_seed(0, 0, 4)


def test_cli_errors_exit_2_without_loading_a_model(tmp_path, capsys):
    from hfllamarl.cli import main

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "answer": "#### 1"}, "{nope"])
    assert main(["eval", "--model", "unused", "--data", bad]) == 2
    assert "line 2" in capsys.readouterr().err
    unknown = write_jsonl(tmp_path / "u.jsonl", [{"text": "q"}])
    assert main(["eval", "--model", "unused", "--data", unknown]) == 2
    assert "['text']" in capsys.readouterr().err
    good = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "#### 1"}])
    assert main(["eval", "--model", "unused", "--data", good, "--reward", "no_such_reward"]) == 2
    assert "math_sympy" in capsys.readouterr().err  # the installed rewards are listed


# ------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_long_model(tmp_path_factory) -> str:
    from hfllamarl.testing.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_eval") / "model"), max_position_embeddings=2048)


def run_eval(model: str, data: Path, out: Path, *extra: str) -> tuple[dict, list[dict], str]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false", **SIDE_BY_SIDE_ENV)
    cmd = [sys.executable, "-m", "hfllamarl.cli", "eval", "--model", model, "--data", str(data),
           "--output", str(out), *extra]
    proc = subprocess.run(cmd, cwd=str(out.parent), env=env, capture_output=True, text=True, timeout=600)
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    items = [json.loads(line) for line in out.read_text().splitlines()]
    return summary, items, proc.stdout


def check_items(items: list[dict], summary: dict, samples: int) -> None:
    assert len(items) == summary["problems"] + summary["skipped"]
    assert [it["index"] for it in items] == list(range(len(items)))
    for it in items:
        assert {"index", "prompt", "gold", "completions", "skipped"} <= set(it)
        assert isinstance(it["prompt"], str) and it["prompt"] and it["gold"] not in (None, "")
        if not it["skipped"]:
            assert len(it["completions"]) == samples
            for c in it["completions"]:
                # (None: unscored, e.g. the grader's time budget ran out on a loaded machine; counted, never a score)
                assert isinstance(c["text"], str) and c["reward"] in (0.0, 1.0, None) and 0 < c["tokens"] <= 16
    rewards = [c["reward"] for it in items if not it["skipped"] for c in it["completions"]]
    assert summary["unscored"] == rewards.count(None) <= len(rewards) // 4, (summary, rewards)


@pytest.mark.slow
def test_eval_math500_and_gsm8k_with_a_tiny_model(tiny_long_model, tmp_path):
    """`hfllamarl eval` on MATH-500 (20 problems) and on GSM8K (5 problems, 2 samples each), side by side
    (each run is mostly start-up); a data set that is not there is left out."""
    from concurrent.futures import ThreadPoolExecutor

    runs = {"math": (MATH500, "--limit", "20", "--max-tokens", "16"),
            "gsm": (GSM8K, "--limit", "5", "--max-tokens", "16", "--samples", "2")}
    runs = {name: args for name, args in runs.items() if args[0].exists()}
    if not runs:
        pytest.skip(f"neither {MATH500} nor {GSM8K} is there")
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(run_eval, tiny_long_model, data, tmp_path / f"{name}.jsonl", *extra)
                   for name, (data, *extra) in runs.items()}
        results = {name: future.result() for name, future in futures.items()}

    if "math" in results:
        summary, items, stdout = results["math"]
        assert summary["problems"] + summary["skipped"] == 20 and summary["problems"] > 0
        assert summary["completions"] == summary["problems"]
        assert 0.0 <= summary["accuracy"] <= 1.0
        assert summary["seconds"] > 0 and summary["reward"] == "math_sympy" and summary["shape"] == "math"
        for label in ("problems", "completions", "skipped", "accuracy", "any correct", "seconds", "tokens/s"):
            assert label in stdout
        check_items(items, summary, samples=1)
        assert items[0]["gold"] == read_jsonl(str(MATH500), limit=1)[0]["answer"]
        assert items[0]["prompt"].endswith(INSTRUCTION + "\nSolution:")

    if "gsm" in results:
        summary, items, _ = results["gsm"]
        assert summary["problems"] + summary["skipped"] == 5 and summary["problems"] > 0
        assert summary["completions"] == 2 * summary["problems"]
        assert 0.0 <= summary["accuracy"] <= 1.0 and 0.0 <= summary["any_correct"] <= 1.0
        assert summary["accuracy"] <= summary["any_correct"]  # a problem with a correct sample counts once
        assert summary["reward"] == "gsm8k"
        check_items(items, summary, samples=2)
        assert items[0]["gold"] == "18"
