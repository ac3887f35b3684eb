"""Tests of the built-in reward plugins: math_sympy, gsm8k, boxed_format, length."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfllamarl.sandbox import client as _sandbox
from hfllamarl.plugins.rewards.format import boxed_format, length, length_penalty
from hfllamarl.plugins.rewards.gsm8k import gsm8k
from hfllamarl.plugins.rewards.math_sympy import extract_answer, math_sympy, normalize_answer

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
REWARDS_DIR = Path(sys.modules["hfllamarl.plugins.rewards"].__file__).parent


@pytest.fixture(scope="module", autouse=True)
def _warm_worker():
    math_sympy.warmup()  # the one-time worker start is outside every call's budget
    yield


def score(gold, pred_text, fn=math_sympy):
    return fn(prompts=["q"], completions=[pred_text], answer=[gold])[0]


def _read_jsonl(name: str, n: int) -> list[dict]:
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{path} not found")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


# ----------------------------------------------------------------------------- extraction

@pytest.mark.parametrize("text, expected", [
    (r"First \boxed{2}, then \boxed{3}. So \boxed{4}.", "4"),  # last box wins
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),  # nested braces
    (r"the set is \boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces
    (r"\fbox{7}", "7"),
    (r"so it is $\boxed 5$.", "5"),
    (r"\boxed{3} and at last \boxed{\frac{1}{2", None),  # truncated last box
    (r"\boxed{5}<|im_end|>", "5"),
    (r"\boxed{5}</s>", "5"),
    (r"\bo<eos>xed{6}", "6"),
    ("We get 3 apples.\nThe final answer is 12.", "12"),
    ("**Answer:** $\\frac{3}{4}$", r"\frac{3}{4}"),
    ("Answer: 3.5.", "3.5"),
    (r"Then $x=2$ and finally $y = 7$ holds", "y = 7"),  # last $...$
    ("no answer here", None),
    (r"The roots are \boxed{1}, \boxed{2}.", "1, 2"),  # boxes side by side: one answer
    (r"So $x=\boxed{1}$ or $x=\boxed{-2}$.", "1, -2"),
    (r"First \boxed{1}. Checking again, \boxed{2}", "2"),  # a restatement: the last box
    ("The total is $1,000.99.", "1,000.99"),  # an amount, not a math delimiter
    ("The answer is $5 each.", "5 each"),
    (r"Adding them gives $5+7=12$", "5+7=12"),
    (r"\frac{1}{2}", r"\frac{1}{2}"),  # a completion that is only an answer
    ("28 percent", "28 percent"),
    ("So 11 marbles, and 12 with the last one.", "12"),  # the last number
    ("1" * 5000 + " words here", None),  # a number too far from the end
    ("Final Answer: The largest $n$ is 34.", "34"),  # what follows the last "is"
    ("Final Answer: The final answer is $10$. I hope it is correct.", "10"),
    (r"$$\boxed{(2, 2)} \quad \text{and} \quad \boxed{(6, 2)}$$", "(2, 2), (6, 2)"),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_builtin_grader_suite_agrees_with_its_hand_verdicts():
    from hfllamarl.commands import bench_grader

    cases = bench_grader.load_cases([], builtin=True)
    table = bench_grader.score(cases)["hfllamarl"]
    wrong = [(c["gold"], c["prediction"]) for c in cases if c["ours"] != c["expected"]]
    assert table["cases"] == len(cases) >= 40 and not wrong, wrong


def test_grader_suite_files_are_checked(tmp_path):
    from hfllamarl.commands import bench_grader

    good = tmp_path / "suite.jsonl"
    good.write_text(json.dumps({"gold": "1", "prediction": "0.5", "expected": False, "input_kind": "answer"}) + "\n")
    (case,) = bench_grader.load_cases([str(tmp_path)], builtin=False)
    assert case["suite"] == "suite" and bench_grader.grade_ours(case) is False
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"gold": "1", "prediction": "1", "expected": "yes"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        bench_grader.load_cases([str(bad)], builtin=False)


def test_chat_message_completions():
    msgs = [{"role": "user", "content": r"\boxed{1}"}, {"role": "assistant", "content": r"so \boxed{2}"}]
    parts = [{"role": "assistant", "content": [{"type": "text", "text": r"\boxed{2}"}]}]
    assert math_sympy(prompts=None, completions=[msgs, parts, msgs], answer=["2", "2", "1"]) == [1.0, 1.0, 0.0]


def test_truncated_box_scores_zero():
    assert score("4", r"\boxed{4} but wait, \boxed{\frac{8}{2") == 0.0


# -------------------------------------------------------------------------- normalisation

@pytest.mark.parametrize("raw, expected", [
    (r"\dfrac{14}{3}", r"\frac{14}{3}"), (r"\tfrac12", r"\frac{1}{2}"), ("3/4", r"\frac{3}{4}"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"), (r"x \in [-2,7]", "[-2,7]"),
    ("1,234", "1234"), (r"1{,}234", "1234"), (r"1,\!234", "1234"), ("50\\%", "50"), ("50%", "50"),
    (r"90^\circ", "90"), (r"90^{\circ}", "90"), (r"\$18.90", "18.90"), ("x = 3", "3"),
    (r"864 \mbox{ inches}^2", "864"), (r"15\mbox{ cm}^2", "15"), (r"5\text{ cm}", "5"),
    (r"\text{(C)}", "C"), ("(C)", "C"), (r"\textbf{(C)}", "C"), (r"\text{Evelyn}", "evelyn"),
    (r"10\sqrt2", r"10\sqrt{2}"), (r"\pi r^2", r"\pi r^2"), ("a=1, b=2", "a=1,b=2"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


# ---------------------------------------------------------------------------- equivalence

EQUIVALENT = [
    (r"\frac{14}{3}", r"\dfrac{14}{3}"), (r"\frac{14}{3}", "14/3"), (r"\frac{14}{3}", "4.666667"),
    ("0.5", r"\frac{1}{2}"), (r"\frac12", ".5"), ("18", "18.00"), (r"-\frac{1}{2}", r"\frac{-1}{2}"),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}"), (r"10\sqrt{2}", r"\sqrt{200}"),
    (r"10\sqrt{2}", "14.1421356"), (r"2\pi", "6.283185307"), ("2^{10}", "1024"), ("5!", "120"),
    ("2x+1", "1+2x"), ("(x+1)^2", "x^2+2x+1"), ("2*x+1", "1+2x"), ("x^2", "x**2"),
    (r"x \in [-2,7]", "[-2,7]"), (r"-2 \le x \le 7", r"[-2,7]"), (r"(-\infty, 3)", r"(-\infty,3)"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3, \pi/2)"),
    (r"\{1,2,3\}", r"\{3,1,2\}"), ("1, 2, 3", "3, 2, 1"),
    (r"\begin{pmatrix} 1/2 & 0 \\ 0 & 1 \end{pmatrix}", r"\begin{pmatrix}0.5&0\\0&1\end{pmatrix}"),
    (r"\text{Evelyn}", "Evelyn"), (r"\text{(C)}", "(C)"), (r"\text{(C)}", "C"), ("C", r"\text{(C)}"),
    ("3", "x=3"), ("x = 3", "3"), ("y = 2x+3", "2x+3"), (r"90^\circ", "90"),
    (r"90^\circ", r"90 \text{ degrees}"), ("1,234", "1234"), (r"\$1,234.50", "1234.5"),
    (r"864 \mbox{ inches}^2", "864"), ("a=1,b=2", "a = 1, b = 2"), ("1+i", "i+1"),
    ("1000.99", "1000,99"), ("0.111", "0,111"),
    ("We find it. " * 20 + r"Therefore $\boxed{14{,}916}$ is our answer.", "14916"),  # a worked solution as gold
]
NOT_EQUIVALENT = [
    (r"\frac{14}{3}", "4.67"), (r"\frac{\sqrt{2}}{2}", r"\frac{\sqrt{3}}{2}"), ("2x+1", "2x-1"),
    (r"x \in [-2,7]", "[-2,7)"), (r"\left( 3, \frac{\pi}{2} \right)", r"(\frac{\pi}{2}, 3)"),
    ("1, 2, 3", "1, 2"), (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix} 2 \\ 1 \end{pmatrix}"),
    (r"\text{Evelyn}", "Evenly"), (r"\text{(C)}", "D"), ("1,234", "1,235"), ("-3", "3"),
    ("5", ""), (r"\frac{\pi}{3}", r"60^\circ"), ("1048576", "1048575"), ("2^{20}", "1048575"),
    ("1000000", "1000001.0"), ("1,2", "1.2"),
    (r"[-2,7]", r"-2 \le x \le 7"),  # an interval as gold wants an interval (Math-Verify's rule)
]


@pytest.mark.parametrize("gold, pred", EQUIVALENT)
def test_equivalent_answers(gold, pred):
    assert score(gold, rf"The answer is \boxed{{{pred}}}.") == 1.0


@pytest.mark.parametrize("gold, pred", NOT_EQUIVALENT)
def test_wrong_answers_score_zero(gold, pred):
    assert score(gold, rf"The answer is \boxed{{{pred}}}.") == 0.0


def test_missing_gold_gives_none_and_extra_kwargs_are_ignored():
    out = math_sympy(prompts=["a"] * 4, completions=[r"\boxed{1}"] * 4, answer=[None, "", "1", "  "],
                     trainer_state=object(), level=[1, 2, 3, 4], unique_id=["a", "b", "c", "d"])
    assert out == [None, None, 1.0, None]


def test_missing_answer_column_raises():
    with pytest.raises(ValueError, match="answer"):
        math_sympy(prompts=["a"], completions=[r"\boxed{1}"], solution=["1"])
    with pytest.raises(ValueError, match="answer"):
        gsm8k(prompts=["a"], completions=["1"])


def test_batch_of_64_is_fast_and_counted():
    golds = [r"\frac{1}{2}", r"\sqrt{2}", "(1,2)", r"x^2+1", "7", r"\{1,3\}", r"\pi/4", "12"] * 8
    preds = [r"0.5", r"\sqrt{3}", "(2,1)", r"1+x^2", "8", r"\{3,1\}", r"\frac{\pi}{4}", "12.0"] * 8
    before = math_sympy.stats()
    start = time.monotonic()
    out = math_sympy(prompts=None, completions=[rf"\boxed{{{p}}}" for p in preds], answer=golds)
    assert time.monotonic() - start < 2.0  # (1 s on an idle machine; two test workers may share its cores)
    assert out == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0] * 8
    after = math_sympy.stats()
    assert after["calls"] == before["calls"] + 1 and after["samples"] == before["samples"] + 64
    assert after["timeouts"] == before["timeouts"]


# ----------------------------------------------------------------------- hostile inputs

HOSTILE = [
    r"\boxed{10^{10^{10}}}", r"\boxed{1000000!}", r"\boxed{9^{9^{9^9}}}", r"\boxed{(7^{7^{8}})!}",
    r"\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}", "\\boxed{" * 10_000,
    "x" * 1_000_000 + r"\boxed{5}", "1 " * 500_000, r"\boxed{" + "1+" * 400 + "1}",
]


def call_bound(checks: int) -> float:
    """What math_sympy's docstring promises for a call with ``checks`` checks, plus 0.5 s."""
    settings = math_sympy.configure()
    return settings["sample_budget_s"] * checks / settings["workers"] + settings["sample_timeout_s"] + 0.5


@pytest.mark.parametrize("completion", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_input_returns_in_time(completion):
    for fn in (math_sympy, gsm8k, boxed_format):
        start = time.monotonic()
        fn(prompts=None, completions=[completion], answer=["5"])
        assert time.monotonic() - start < call_bound(1), fn.__name__


SLOW = [r"\boxed{\sum_{k=1}^{9999} k^{k^{2}}}", r"\boxed{\sum_{k=1}^{99999} k^{k}}"]  # within the structure rules


def test_hostile_batch_respects_call_budget_and_recovers():
    """Answers no check should evaluate are wrong at once, in this process; answers within those rules whose
    check runs past its time are unscored; the worker answers afterwards."""
    before = math_sympy.stats()
    start = time.monotonic()
    out = math_sympy(prompts=None, completions=HOSTILE[:4] * 2 + SLOW + [r"\boxed{\sqrt{25}}"], answer=["5"] * 11)
    assert time.monotonic() - start < call_bound(3)  # the 2 slow checks run out of time: unscored
    assert out == [0.0] * 8 + [None, None, 1.0]
    after = math_sympy.stats()
    assert after["excessive"] - before["excessive"] == 8 and after["timeouts"] - before["timeouts"] == 2
    assert score("5", r"\boxed{\sqrt{25}}") == 1.0  # the worker still answers afterwards


def test_concurrent_calls_each_keep_their_budget():
    import threading

    results = {}

    def run(key):
        start = time.monotonic()
        out = math_sympy(prompts=None, completions=SLOW + [r"\boxed{\sqrt{25}}"], answer=["5"] * 3)
        results[key] = (out, time.monotonic() - start)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(elapsed < call_bound(3) and out[:2] == [None, None] for out, elapsed in results.values())
    assert score("5", r"\boxed{\sqrt{25}}") == 1.0


PAYLOADS = [
    r"\boxed{__import__('os').system('touch {f}')}",
    r"\boxed{\text{__import__('os').system('touch {f}')}}",
    r"\boxed{\mathrm{exec}(\text{__import__('os').system('touch {f}')})}",
    r"The final answer is __import__('os').system('touch {f}')",
    r"$eval(\"__import__('os').system('touch {f}')\")$",
    r"\boxed{().__class__.__base__.__subclasses__()[0]('touch {f}')} #### __import__('os')",
]


@pytest.mark.filterwarnings("ignore:gsm8k")
@pytest.mark.parametrize("payload", PAYLOADS, ids=range(len(PAYLOADS)))
def test_model_text_is_never_executed(payload, tmp_path):
    target = tmp_path / "pwned_X"
    text = payload.replace("{f}", str(target))
    for fn in (math_sympy, gsm8k, boxed_format, length):
        fn(prompts=None, completions=[text, text], answer=["5", text])
    time.sleep(0.2)
    assert not target.exists()


def test_only_numeric_tokens_reach_sympys_string_parser(monkeypatch):
    """latex2sympy2_extended turns NUMBER tokens into sympy via ``sympy.Number(text)``, which
    goes through ``parse_expr`` (and ``eval``). The ANTLR lexer admits only digits, ``.``,
    ``,`` and an exponent there, so no model text with names can get evaluated."""
    from sympy.parsing import sympy_parser

    from hfllamarl.plugins.rewards import math_sympy as module

    module._worker_warmup()  # library imports sympify constant strings of their own
    seen = []
    original = sympy_parser.parse_expr

    def spy(text, *args, **kwargs):
        seen.append(text)
        return original(text, *args, **kwargs)

    monkeypatch.setattr(sympy_parser, "parse_expr", spy)
    texts = [extract_answer(p.replace("{f}", "/nonexistent/pwned")) for p in PAYLOADS]
    pairs = EQUIVALENT + [("5", t) for t in texts if t] + [(t, "5") for t in texts if t]
    for gold, pred in pairs:  # in this process, so the spy sees every parse
        module._worker_equivalent(normalize_answer(gold), normalize_answer(pred), gold, pred)
    assert seen  # the spy is in the path
    assert all(re.fullmatch(r"[0-9.,]+(?:E[-+]?[0-9]+)?", text) for text in seen), set(seen)


def test_sources_do_not_call_evaluating_parsers():
    pattern = re.compile(r"\b(eval|exec|sympify|parse_expr|ExprExtractionConfig)\s*\(")
    for path in REWARDS_DIR.glob("*.py"):
        assert not pattern.search(path.read_text()), path.name


# ------------------------------------------------------------------------------ sandbox

def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sandbox_kills_a_call_stuck_in_c_at_its_deadline():
    # pbkdf2_hmac runs in C without checking for signals, like sympy stuck in a big power: only a kill stops it.
    worker = _sandbox.Sandbox("sandbox_targets:pbkdf2")
    try:
        assert worker.wait_ready(30)
        expected = hashlib.pbkdf2_hmac("sha256", b"x", b"y", 1).hex()
        assert worker.call(1, timeout=5) == expected
        server = worker.pid
        start = time.monotonic()
        with pytest.raises(_sandbox.SandboxTimeout):
            worker.call(10**9, timeout=0.5)
        assert time.monotonic() - start < 1.5
        assert worker.pid == server and worker.starts == 1  # the call's process died, the server did not
        assert worker.call(1, timeout=30) == expected
    finally:
        worker.close()
    assert worker.pid is None and not _alive(server)


def _orphan_worker_pid(script: str) -> int:
    """Runs ``script`` (which prints its worker's pid) in a process, kills that process,
    and returns the now orphaned worker's pid."""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        worker_pid = int(parent.stdout.readline())
        time.sleep(0.3)
        assert _alive(worker_pid)
    finally:
        parent.kill()
        parent.wait()
    return worker_pid


def _wait_dead(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_idle_worker_exits_when_its_parent_dies():
    pid = _orphan_worker_pid(
        "from hfllamarl.plugins.rewards.math_sympy import math_sympy, _WORKERS\n"
        "math_sympy.warmup()\n"
        "print(_WORKERS[0].pid, flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    assert _wait_dead(pid, 10)


@pytest.mark.slow  # a CPU-time limit: seconds of wall time on a loaded machine
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_busy_worker_exits_when_its_parent_dies():
    pid = _orphan_worker_pid(  # the worker is stuck in C when its parent dies
        "import hashlib, threading\n"
        "from hfllamarl.sandbox.client import Sandbox\n"
        "w = Sandbox('sandbox_targets:pbkdf2')\n"
        "w.wait_ready(30)\n"
        "print(w.pid, flush=True)\n"
        "w.call(10**9, timeout=60)\n"
    )
    assert _wait_dead(pid, 10)  # its parent-death signal ends it, and its call's with it


# -------------------------------------------------------------------------------- gsm8k

@pytest.mark.parametrize("gold, completion, expected", [
    ("He pays 9 * 2 = <<9*2=18>>18.\n#### 18", r"So she makes \boxed{18} dollars.", 1.0),
    ("#### 1,234", r"\boxed{1234}", 1.0),
    ("1234", r"\boxed{1,234}", 1.0),
    ("18", r"\boxed{\$18.00}", 1.0),
    ("18", r"\boxed{18 \text{ eggs}}", 1.0),
    ("18", r"\boxed{x = 18}", 1.0),
    ("18", "Total: 9 * 2 = 18\n#### 18.0", 1.0),
    ("18", "so 3 + 15 = 18. She earns $18 a day.", 1.0),
    ("50", "That is 50% of it.", 1.0),
    ("70000", "The profit is $70,000.", 1.0),
    ("-3", "The change is -3.", 1.0),
    ("18", r"\boxed{17}", 0.0),
    ("1000000", r"\boxed{1,000,001}", 0.0),  # integers compare exactly
    ("18", r"18 is close, so \boxed{19}", 0.0),  # the box wins over other numbers
    ("18", r"It is \boxed{18", 0.0),  # truncated box
    ("18", "no number", 0.0),
    ("18", [{"role": "assistant", "content": "#### 18"}], 1.0),
])
def test_gsm8k(gold, completion, expected):
    assert score(gold, completion, fn=gsm8k) == expected


def test_gsm8k_missing_gold_and_extra_kwargs():
    out = gsm8k(prompts=None, completions=["18", "18", "18"], answer=[None, "", "18"], trainer_state=None)
    assert out == [None, None, 1.0]


# ------------------------------------------------------------------------------- format

def test_boxed_format():
    completions = [r"\boxed{5}", r"\boxed{ }", r"\boxed{5", "none", r"\boxed{1} then \boxed{2",
                   [{"role": "assistant", "content": r"\fbox{x}<|im_end|>"}]]
    assert boxed_format(prompts=None, completions=completions, trainer_state=None) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_length_penalty_formula():
    ids = [[0] * n for n in (100, 768, 896, 1024, 1025)]
    assert length(prompts=None, completions=[""] * 5, completion_ids=ids) == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert length(prompts=None, completions=["a" * 4 * 896]) == [-0.5]  # 4 characters ~ 1 token
    short = length_penalty(max_length=10, soft_cache=5)
    assert short.__name__ == "length"
    assert short(prompts=None, completions=["x"], completion_ids=[[0] * 8]) == [-0.6]
    with pytest.raises(ValueError):
        length_penalty(max_length=10, soft_cache=0)


# --------------------------------------------------------------------------- real data

def test_math500_gold_answers_score_one_and_shuffled_zero():
    rows = _read_jsonl("math500_test.jsonl", 100)
    golds = [r["answer"] for r in rows]
    assert math_sympy(prompts=None, completions=[rf"So the answer is $\boxed{{{g}}}$." for g in golds],
                      answer=golds) == [1.0] * 100
    assert math_sympy(prompts=None, completions=[r["solution"] for r in rows], answer=golds) == [1.0] * 100
    shuffled = golds[:]
    random.Random(0).shuffle(shuffled)
    wrong = [(g, p) for g, p in zip(golds, shuffled) if normalize_answer(g) != normalize_answer(p)]
    out = math_sympy(prompts=None, completions=[rf"\boxed{{{p}}}" for _, p in wrong], answer=[g for g, _ in wrong])
    assert sum(out) <= 0.03 * len(wrong)


def test_gsm8k_gold_answers_score_one_and_shuffled_zero():
    rows = _read_jsonl("gsm8k_test.jsonl", 100)
    golds = [r["answer"] for r in rows]
    finals = [g.rsplit("####", 1)[1].strip() for g in golds]
    assert gsm8k(prompts=None, completions=golds, answer=golds) == [1.0] * 100
    assert gsm8k(prompts=None, completions=[rf"\boxed{{{f}}}" for f in finals], answer=golds) == [1.0] * 100
    assert gsm8k(prompts=None, completions=finals, answer=finals) == [1.0] * 100
    shuffled = finals[:]
    random.Random(0).shuffle(shuffled)
    out = gsm8k(prompts=None, completions=[rf"\boxed{{{s}}}" for s in shuffled], answer=golds)
    assert sum(out) == sum(a.replace(",", "") == b.replace(",", "") for a, b in zip(finals, shuffled))


def test_entry_points_name_these_functions():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="hfllamarl.rewards")}
    if not eps:
        pytest.skip("hfllamarl is not installed with its entry points")
    expected = {"math_sympy": math_sympy, "gsm8k": gsm8k, "boxed_format": boxed_format, "length": length}
    for name, fn in expected.items():
        assert eps[name].load() is fn
