"""Hand-written cases for each rule of the math grader (``math_sympy``): where a completion's
answer is read, how gold answers are read, normalisation, numeric equality; and hostile inputs."""

from __future__ import annotations

import json
import re
import time
from fractions import Fraction
from pathlib import Path

import pytest

from hfllamarl.plugins.rewards._normalize import normalize_answer, unescape_commands
from hfllamarl.plugins.rewards._numbers import base_number_verdict, numbers_close, rounded_to_own_digits
from hfllamarl.plugins.rewards.math_sympy import extract_answer, gold_text, math_sympy


@pytest.fixture(scope="module", autouse=True)
def _warm_worker():
    math_sympy.warmup()
    yield


def score(gold: str, completion: str) -> float | None:
    return math_sympy(prompts=None, completions=[completion], answer=[gold])[0]


# ------------------------------------------------------------- the answer a completion commits to

@pytest.mark.parametrize("text, expected", [
    # an answer statement after the last box overrides it; a statement without math does not
    (r"So \boxed{255} is the interest. She has $10,200 + $255 = $10,455. Final Answer: The final answer "
     r"is $10,455$. I hope it is correct.", "10,455"),
    (r"\boxed{12}. The answer is correct.", "12"),
    (r"The answer is 7, so \boxed{7}", "7"),
    # an answer sentence in words with one number: that number
    ("Final Answer: Jane started growing Sphere 3 hours ago. I hope it is correct.", "3"),
    ("Final Answer: between 3 and 4 hours", "between 3 and 4 hours"),  # two numbers: kept whole
    # an answer given as several math spans: one list; quotes around it go
    ('Final Answer: The final answer is "$12$ and $13$". I hope it is correct.', "12, 13"),
    (r'The answer is \"$5$\".', "5"),
    # the last standalone expression: the last math span or the last number, whichever is later
    (r"So $d = \frac{90}{n}$ for each divisor. Therefore, there are 12 distinct sequences. I hope it "
     r"is correct.", "12"),
    (r"We had 3 cases, so $x = 5$", "x = 5"),
    ("$$\\frac{2}{1}.$$ Therefore, the error increases by 100%.", "100"),
    # a unit glued to the number; a decimal comma in prose
    ("not it's not 10 it's 1,000.99m²", "1,000.99"),
    ("Soucis : 2,74 $ a..", "2.74"),
    ("So (1,2) is the pair", None),  # inside a tuple: no standalone number (and no decimal comma)
    # a completion that is only an answer: one line not led by words; one LaTeX environment
    ("\\begin{bmatrix}\n 1 & 2 \\\\\n 3 & 4\n\\end{bmatrix}", "\\begin{bmatrix}\n 1 & 2 \\\\\n 3 & 4\n\\end{bmatrix}"),
    ("x^2 + y^2 + 4x - 6y + 13", "x^2 + y^2 + 4x - 6y + 13"),
    ("\\begin{bmatrix} 1 \\end{bmatrix}\nand then \\begin{bmatrix} 2 \\end{bmatrix}", "2"),  # two: the last number
    # boxes made one answer by a few words ending in "and"/"or"; other words between keep the last
    (r"$$\boxed{(3, 3)} \text{ for part (a) and } \boxed{(1, 1)}$$", "(3, 3), (1, 1)"),
    (r"\boxed{1} papers and \boxed{2} bins", "1, 2"),
    (r"\boxed{1} no no no \boxed{2}", "2"),
    (r"\boxed{1} ++ \boxed{2}", "2"),  # signs join boxes only in a gold answer
])
def test_extract_answer_rules(text, expected):
    assert extract_answer(text) == expected


# ------------------------------------------------------------------------------ gold answers

@pytest.mark.parametrize("gold, expected", [
    (r"\boxed{35 cm} ++++++ \boxed{4}", "35 cm, 4"),  # only signs between a gold's boxes: one answer
    (r"\boxed{1} papers and \boxed{2} bins", "1, 2"),
    (r"\boxed{1} no no no \boxed{2}", "2"),
    (r"\boxed{W(n) = 1 \text{ and } W(n) = -1", r"W(n) = 1 \text{ and } W(n) = -1"),  # an open box
    (r"\\boxed{7}", "7"),  # backslashes doubled by one more escaping
    (r"\frac{1}{2}", r"\frac{1}{2}"),
    ("We compute. " * 20 + "Final Answer: The final answer is $28 \\%$. I hope it is correct. Note: wrong.",
     "28 \\%"),  # a worked solution without a box: the answer it states
])
def test_gold_text(gold, expected):
    assert gold_text(gold) == expected


# ---------------------------------------------------------------------------- normalisation

@pytest.mark.parametrize("raw, expected", [
    ("32, 349", "32, 349"),  # a pair: the space after the comma stays
    ("32,349", "32349"), (r"32,\! 349", "32349"), (r"11,\! 111,\! 111,\! 100", "11111111100"),
    ("19, 46, and 82", "19, 46, 82"), (r"12\text{ and }13", "12, 13"), ("1 or 2", "1, 2"),
    ("(11,7)or(7,11)", "(11,7),(7,11)"),  # "or" glued between answers
    ("x = 1, x = -2", "1, -2"), ("W(x)=1orW(x)=-1", "1, -1"),  # one left side given several values
    ("a=1, b=2", "a=1,b=2"),  # different left sides: kept
    (r"\\dfrac{1}{2} +\frac{1}{72}", r"\frac{1}{2}+\frac{1}{72}"),  # a doubled backslash before a command
])
def test_normalize_rules(raw, expected):
    assert normalize_answer(raw) == expected


def test_unescape_keeps_line_breaks():
    assert unescape_commands(r"\begin{pmatrix}1\\2\end{pmatrix}") == r"\begin{pmatrix}1\\2\end{pmatrix}"
    assert unescape_commands(r"a \\ b") == r"a \\ b"
    assert unescape_commands(r"\\sqrt{2}") == r"\sqrt{2}"


# ------------------------------------------------------------------------------ numbers

@pytest.mark.parametrize("a, b, a_dec, b_dec, irrational, expected", [
    (Fraction(2010012, 2010013), Fraction(2010012, 2010014), False, False, False, False),  # exact: exactly
    (Fraction(1048576), Fraction(1048575), False, False, False, False),
    (Fraction("16386.16"), Fraction("16386.17"), True, True, False, False),  # two decimals: exactly
    (Fraction(18), Fraction("18.00"), False, True, False, True),
    (Fraction(1, 4), Fraction("0.2500001"), False, True, False, False),  # 1/4 has a finite decimal form
    (Fraction(1, 3), Fraction("0.333333"), False, True, False, True),  # 1/3 has none: tolerance
    (Fraction("1.41421356237309504880"), Fraction("1.414214"), False, True, True, True),  # sqrt(2)
    (Fraction("1.41421356237309504880"), Fraction("1.4143"), False, True, True, False),
])
def test_numbers_close(a, b, a_dec, b_dec, irrational, expected):
    assert numbers_close(a, b, a_dec, b_dec, irrational) is expected


@pytest.mark.parametrize("gold, pred, irrational, expected", [
    (Fraction(1, 3), "0.3333", False, True), (Fraction(1, 3), "0.33333", False, True),
    (Fraction(1, 3), "0.33", False, False),  # 2 significant digits: too few
    (Fraction(2, 3), "0.6667", False, True), (Fraction(2, 3), "0.6666", False, False),  # truncated
    (Fraction(8, 3), "2.6667", False, True), (Fraction(5), "5.001", False, False),
    (Fraction("16386.17"), "16386.2", False, False),  # a finite decimal needs its own digits
    (Fraction("3.14159265358979323846"), "3.1416", True, True), (Fraction("3.14159265358979323846"), "3.14", True, False),
])
def test_rounded_to_own_digits(gold, pred, irrational, expected):
    assert rounded_to_own_digits(gold, pred, irrational) is expected


@pytest.mark.parametrize("gold, pred, expected", [
    ("204_5", "204_5", True), ("204_5", "204_{5}", True), ("204_5", "204", True),
    ("204_5", "204_6", False), ("204_5", "54", False), ("4210_{7}", "4210_8", False),
    ("1", "1", None), ("x_1", "x_2", None),  # not numbers in a base
])
def test_base_numbers(gold, pred, expected):
    assert base_number_verdict(gold, pred) is expected


# ------------------------------------------------------------------ end to end (the worker)

@pytest.mark.parametrize("gold, completion, expected", [
    (r"\frac{1}{2004!}", r"\boxed{\frac{1}{2005!}}", 0.0),  # tiny numbers are not all 0
    (r"-\frac{2010012}{2010013}", r"\boxed{-\frac{2010012}{2010014}}", 0.0),
    (r"\$16,\!386.16", r"\boxed{\$16,\!386.17}", 0.0),
    (r"\frac{\sqrt{2}}{2}", r"\boxed{0.7071}", 1.0), (r"\frac{\sqrt{2}}{2}", r"\boxed{0.707}", 0.0),
    (r"\frac{1}{3}", "The answer is 0.3333", 1.0),
    (r"(\frac{3}{5},\frac{8}{3}]", r"\boxed{(0.6,2.6667]}", 1.0),  # elementwise, in order
    (r"(\frac{3}{5},\frac{8}{3}]", r"\boxed{(0.6,2.67]}", 0.0),
    (r"(\frac{3}{5},\frac{8}{3}]", r"\boxed{[0.6,2.6667]}", 0.0),  # another interval
    (r"\sqrt{200}", r"\boxed{10\sqrt{2}}", 1.0),
    ("204_5", r"\boxed{204_6}", 0.0), ("204_5", r"\boxed{204_5}", 1.0),
    ("32349", r"is $\boxed{32, 349}$", 0.0), ("32349", r"is $\boxed{32,\! 349}$", 1.0),
    (r"-2 \le x \le 7", r"\boxed{x \in [-2,7]}", 1.0), (r"x \in [-2,7]", r"\boxed{-2 \le x \le 7}", 0.0),
    ("1, -2", r"So $x = \boxed{1}$ or $x = \boxed{-2}$.", 1.0), ("1, -2", r"\boxed{x = -2 \text{ or } x = 1}", 1.0),
    (r"\\boxed{W(n) = 1 \\text{ and } W(n) = -1", r"\boxed{W(x)=1orW(x)=-1}", 1.0),
    (r"\\boxed{W(n) = 1 \\text{ and } W(n) = -1", r"\boxed{W(x)=1orW(x)=2}", 0.0),
    ("\\begin{pmatrix}\n -7 & 6 \\\\\n 11 & -9\n \\end{pmatrix}", "\\begin{bmatrix}\n -7 & 6 \\\\\n 11 & -9 \n \\end{bmatrix}", 1.0),
    ("\\begin{pmatrix}\n -7 & 6 \\\\\n 11 & -9\n \\end{pmatrix}", "\\begin{bmatrix}\n -7 & 6 \\\\\n 11 & 9 \n \\end{bmatrix}", 0.0),
    ("185", r"\boxed{185\ }", 1.0),
])
def test_graded_end_to_end(gold, completion, expected):
    assert score(gold, completion) == expected


def test_math500_near_misses_score_zero():
    """Every MATH-500 gold with its last digit changed (outside a unit's exponent) is a different
    value, so it must score 0 against the gold: the false positives a reward trains on."""
    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "math500_test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not found")
    golds = [json.loads(line)["answer"] for line in path.open(encoding="utf-8")]
    pairs = []
    for gold in golds:
        digits = [m.start() for m in re.finditer(r"\d", gold)]
        if digits and not _UNIT_POWER_RE.search(gold):
            k = digits[-1]
            pairs.append((gold, gold[:k] + str((int(gold[k]) + 1) % 10) + gold[k + 1 :]))
    out = math_sympy(prompts=None, completions=[rf"The answer is $\boxed{{{p}}}$." for _, p in pairs],
                     answer=[g for g, _ in pairs])
    assert len(pairs) > 450 and [pair for pair, s in zip(pairs, out) if s == 1.0] == []
    # None: a check that did not finish in time (a loaded machine), unscored rather than a verdict
    assert out.count(None) <= 0.1 * len(pairs)


_UNIT_POWER_RE = re.compile(r"\\(?:text|mbox)\{[^{}]*\}\^")


# ------------------------------------------------------------------------- hostile inputs

HOSTILE_EXTRACTION = [
    "The answer is " + "$1$ and " * 100_000,  # one sentence of many math spans
    r"\boxed{1} and " * 100_000,  # many boxes side by side
    r"\boxed{1} papers and " * 100_000,
    "word 12 " * 150_000,  # 1.2 MB of prose with numbers
    "Final Answer: " * 100_000 + "12",
    "$" * 1_000_000, "1," * 500_000, "2,74 " * 200_000,
    "\\begin{pmatrix}" * 50_000 + "\n" + "\\end{pmatrix}" * 50_000,
    "answer is " + "{" * 100_000 + "}" * 100_000,
]


@pytest.mark.parametrize("text", HOSTILE_EXTRACTION, ids=range(len(HOSTILE_EXTRACTION)))
def test_extraction_is_fast_on_hostile_text(text):
    start = time.process_time()  # this process's CPU time: what a backtracking pattern burns, whatever else runs
    extract_answer(text)
    gold_text(text)
    assert time.process_time() - start < 1.0


HOSTILE_GRADING = [
    ("1", r"\boxed{0." + "3" * 5000 + "}"),  # a long decimal
    (r"\frac{1}{3}", "0." + "3" * 900),
    ("204_5", r"\boxed{" + "1" * 900 + "_5}"),
    ("1, 2", r"\boxed{" + "x=1," * 240 + "x=2}"),
    ("12", "The answer is " + "12 and " * 140 + "12"),
    (r"\frac{1}{2}", r"\boxed{" + r"\\frac{1}{2}+" * 80 + "1}"),
    ("10", r"\boxed{10^{10^{10}}-10^{10^{10}}+10}"),
]


@pytest.mark.parametrize("gold, completion", HOSTILE_GRADING, ids=range(len(HOSTILE_GRADING)))
def test_grading_is_bounded_on_hostile_answers(gold, completion):
    start = time.monotonic()
    out = math_sympy(prompts=None, completions=[completion], answer=[gold])
    settings = math_sympy.configure()
    bound = settings["sample_budget_s"] / settings["workers"] + settings["sample_timeout_s"] + 0.5
    assert time.monotonic() - start < bound and out[0] in (0.0, 1.0, None)  # None: ran out of time, unscored


# ------------------------------------------------------------- answers no check should evaluate

EXCESSIVE = [  # (wrong answer, what makes it too costly), gold 5
    ("(" * 300 + "3" + ")" * 300, "brackets nested 300 deep"),
    (r"\sqrt{" * 20 + "3" + "}" * 20, "brackets nested 20 deep"),
    (r"10^{10^{10}}", "an exponent or bound near 10^10"),
    (r"9^{9^{9^{9}}}", "an exponent or bound near 10^"),
    (r"2^{100000000}", "an exponent or bound near 10^8"),
    (r"\sum_{k=1}^{10^{8}} k", "an exponent or bound near 10^8"),
    (r"1000000!", "a factorial of a number near 10^6"),
    (r"(10^{7})!", "a factorial of a number near 10^7"),
    (r"(300)!!", "2 factorials in a row"),
    (r"x^{x^{x^{x^{x}}}}", "a power tower of 5 levels"),
]


@pytest.mark.parametrize("answer, why", EXCESSIVE, ids=range(len(EXCESSIVE)))
def test_answers_no_check_should_evaluate_are_wrong_at_once(answer, why):
    """A deep or towering wrong answer is graded 0.0 in the trusted process, with no check: not the unscored pass
    (advantage 0) a timed-out check would give it. The reason is counted."""
    from hfllamarl.plugins.rewards._structure import excessive

    assert why in (excessive(normalize_answer(answer), "5") or "")
    before = math_sympy.stats()
    start = time.monotonic()
    assert math_sympy(prompts=None, completions=[rf"The answer is $\boxed{{{answer}}}$."], answer=["5"]) == [0.0]
    after = math_sympy.stats()
    assert after["excessive"] == before["excessive"] + 1 and after["timeouts"] == before["timeouts"]
    assert time.monotonic() - start < 1.0


def test_answers_within_the_limits_or_the_golds_own_are_still_checked():
    """Powers of small numbers, symbols in towers, a factorial the gold also has: checked as before (by value,
    2^{3^{4}} = 2^{81}); a gold that itself towers admits an answer as tall."""
    cases = [
        ("2^{81}", r"2^{3^{4}}", 1.0), ("16", r"2^{2^{2}}", 1.0), ("2^{4950}", r"2^{4950}", 1.0),
        (r"\frac{1}{2004!}", r"\frac{1}{2004!}", 1.0), ("3628800", "10!", 1.0), ("6", r"((((((1+2))))))+3", 1.0),
        (r"2^{2^{2^{2^{2}}}}", r"2^{2^{2^{2^{2}}}}", 1.0), (r"2^{2^{2^{2^{2}}}}", r"4^{2^{2^{2^{2}}}/2}", 1.0),
        ("7", r"2^{3^{4}}", 0.0),
    ]
    completions = [rf"\boxed{{{pred}}}" for _, pred, _ in cases]
    out = math_sympy(prompts=None, completions=completions, answer=[gold for gold, _, _ in cases])
    assert out == [want for _, _, want in cases]


def test_every_public_gold_answer_is_within_the_structure_limits():
    """MATH, MATH-500 and GSM8K's gold answers, checked against themselves: none is refused for its structure (the
    limits sit well above what answers need)."""
    from hfllamarl.plugins.rewards._structure import excessive

    data = Path(__file__).resolve().parents[2] / "shared" / "data"
    files = [data / f"{name}.jsonl" for name in ("math_train", "math_test", "math500_test", "gsm8k_test")]
    if not all(f.exists() for f in files):
        pytest.skip(f"the public data sets are not in {data}")
    golds = [normalize_answer(gold_text(row["answer"])) for f in files for row in map(json.loads, f.open())
             if row.get("answer") is not None]
    assert len(golds) > 15000
    assert [g for g in golds if excessive(g, "0")] == []
