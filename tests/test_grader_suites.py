"""`hfllamarl bench grader --convert`: public graders' test files turned into suite cases, and how
the bench counts cases whose verdict rests on a per-case setting. The repositories here are small
hand-written copies of each one's test-file layout; the expected cases are written out by hand."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from hfllamarl.commands import bench_grader
from hfllamarl.commands import grader_suites

MATH_VERIFY_TEST = '''
import math
import pytest
from math_verify import parse, verify


def compare_strings(gold, pred, match_types=["latex", "expr"], precision=6, strict=True,
                    allow_set_relation_comp=False):
    return 1


@pytest.mark.parametrize(
    "gold,pred,expected",
    [
        ("$1/2$", "$0.5$", 1),
        ("$2$", "$3$", 0),
    ],
)
def test_plain(gold, pred, expected):
    assert compare_strings(gold, pred, match_types=["latex"]) == expected


@pytest.mark.parametrize(
    "gold,pred,expected,precision",
    [
        ("$\\\\frac{1}{3}$", "$0.33$", 1, 2),
        (f"{math.sqrt(16):.2f}", "$4$", 1, 6),
    ],
)
def test_precision(gold, pred, expected, precision):
    assert compare_strings(gold, pred, match_types=["latex", "expr"], precision=precision) == expected


def test_direct():
    assert compare_strings("$1$", "1.0$", precision=4) == 1


@pytest.mark.parametrize("gold, pred, result", [("$x$", "$x$", 1), (some_name, "$1$", 0)])
def test_verify_parse(gold, pred, result):
    assert int(verify(parse(gold), parse(pred))) == result


@pytest.mark.parametrize("pred,expected", [("A", ["a"])])
def test_not_a_verdict(pred, expected):
    assert parse(pred) == expected
'''

NEMO_TEST = '''
import pytest
from nemo_skills.evaluation.math_grader import math_equal


@pytest.mark.parametrize("output_pair", [(5, 5.0), ("1/2", 0.5), (5 / 2, "\\\\frac{5}{2}")], ids=str)
def test_correct_examples(output_pair):
    output = math_equal(output_pair[0], output_pair[1])
    assert output is True
    output = math_equal(output_pair[1], output_pair[0])
    assert output is True


@pytest.mark.parametrize("output_pair", [(5, 5.001), (0, None)], ids=str)
def test_incorrect_examples(output_pair):
    output = math_equal(output_pair[0], output_pair[1])
    assert output is False
    output = math_equal(output_pair[1], output_pair[0])
    assert output is False
'''

VERL_TEST = '''
from verl.utils.reward_score import default_compute_score

prime_math_answers = [
    """\\\\frac{1}{2}""",
    """x + 1""",
]
prime_math_gts = [
    """0.5""",
    """1 + x""",
]


def test_prime_math():
    data_source = "numina_aops_forum"
    for completion, ground_truth in zip(prime_math_answers, prime_math_gts, strict=True):
        score = default_compute_score(data_source, completion, ground_truth)
        assert float(score) == 1.0
'''

HENDRYCKS_TEST = '''
from .math_equivalence import is_equiv
import unittest


class TestIsEquiv(unittest.TestCase):

\tdef test_order(self):
\t\ttest_in = "10, 4, -2"
\t\ttest_out = "4, 10, -2"
\t\tself.assertFalse(is_equiv(test_in, test_out))

\tdef test_dollars(self):
\t\ttest_in = "10"
\t\ttest_out = "\\\\$10"
\t\tself.assertTrue(is_equiv(test_in, test_out))

\tdef test_other(self):
\t\ttest_in = "10, 4, 2"
\t\ttest_out = "4, 12, 2"
\t\tself.assertFalse(is_equiv(test_in, test_out))
'''

SIMPLE_EVALS_COMMON = '''
EQUALITY_TEMPLATE = r"""
Look at the following two expressions.

Examples:

    Expression 1: $2x+3$
    Expression 2: $3+2x$

Yes

    Expression 1: 3245/5
    Expression 2: 649

No
(these are actually equal, don't mark them equivalent if you need to do nontrivial simplifications)

---

YOUR TASK

    Expression 1: %(expression1)s
    Expression 2: %(expression2)s
""".strip()
'''


def _repo(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _strip(cases: list[dict]) -> list[tuple]:
    """(gold, prediction, expected, input_kind, line, settings) of each case."""
    return [(c["gold"], c["prediction"], c["expected"], c["input_kind"], int(c["source"].rsplit(":", 1)[1]),
             c.get("settings")) for c in cases]


def test_math_verify_cases_and_their_settings(tmp_path):
    repo = _repo(tmp_path, {"tests/test_all.py": MATH_VERIFY_TEST})
    suite, cases, skipped = grader_suites.convert_repo(repo)
    assert suite == "math_verify"
    assert _strip(cases) == [
        ("$1/2$", "$0.5$", True, "output", 15, {"match_types": ["latex"]}),
        ("$2$", "$3$", False, "output", 16, {"match_types": ["latex"]}),
        ("$\\frac{1}{3}$", "$0.33$", True, "output", 26, {"precision": 2}),
        ("4.00", "$4$", True, "output", 27, None),  # an f-string of math.sqrt, evaluated
        ("$1$", "1.0$", True, "output", 35, {"precision": 4}),
        ("$x$", "$x$", True, "output", 38, None),
    ]
    assert len(skipped) == 1 and "test_all.py:38" in skipped[0] and "not literal" in skipped[0]
    assert all(c["source"].startswith("huggingface/Math-Verify@unknown:tests/test_all.py:") for c in cases)


def test_nemo_skills_pairs_in_both_orders(tmp_path):
    repo = _repo(tmp_path, {"tests/test_math_equal.py": NEMO_TEST})
    suite, cases, skipped = grader_suites.convert_repo(repo)
    assert suite == "nemo_skills"
    assert [(c["gold"], c["prediction"], c["expected"]) for c in cases] == [
        ("5", "5.0", True), ("5.0", "5", True), ("1/2", "0.5", True), ("0.5", "1/2", True),
        ("2.5", "\\frac{5}{2}", True), ("\\frac{5}{2}", "2.5", True),
        ("5", "5.001", False), ("5.001", "5", False),
    ]
    assert {c["input_kind"] for c in cases} == {"answer"}
    assert len(skipped) == 2 and all("None" in s for s in skipped)


def test_verl_hendrycks_and_simple_evals(tmp_path):
    verl = _repo(tmp_path / "verl", {"tests/utils/reward_score/test_sandbox_on_cpu.py": VERL_TEST})
    assert _strip(grader_suites.convert_repo(verl)[1]) == [
        ("0.5", "\\frac{1}{2}", True, "output", 5, None), ("1 + x", "x + 1", True, "output", 6, None)]
    hendrycks = _repo(tmp_path / "math", {"modeling/math_equivalence_test.py": HENDRYCKS_TEST})
    suite, cases, _ = grader_suites.convert_repo(hendrycks)
    assert suite == "hendrycks_math"
    # is_equiv(output, answer): test_in is the output, test_out the gold
    assert _strip(cases) == [
        ("4, 10, -2", "10, 4, -2", False, "answer", 11, {"comma_list": "ordered"}),
        ("\\$10", "10", True, "answer", 16, None),
        ("4, 12, 2", "10, 4, 2", False, "answer", 21, None),  # other numbers: no setting needed
    ]
    simple = _repo(tmp_path / "se", {"common.py": SIMPLE_EVALS_COMMON})
    suite, cases, _ = grader_suites.convert_repo(simple)
    assert suite == "simple_evals"
    assert _strip(cases) == [
        ("$2x+3$", "$3+2x$", True, "answer", 7, None),
        ("3245/5", "649", False, "answer", 12, {"simplification": "trivial only"}),
    ]
    assert "nontrivial simplifications" in cases[1]["note"]


def test_a_bare_git_clone_is_read_at_head_with_its_commit(tmp_path):
    work = _repo(tmp_path / "work", {"tests/test_math_equal.py": NEMO_TEST})
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(work)]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "x"], check=True)
    sha = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True)
    suite, cases, _ = grader_suites.convert_repo(bare)
    assert suite == "nemo_skills" and len(cases) == 8
    assert cases[0]["source"] == f"NVIDIA/NeMo-Skills@{sha}:tests/test_math_equal.py:6"


def test_convert_writes_suites_and_refuses_unknown_repos(tmp_path, capsys):
    repo = _repo(tmp_path / "se", {"common.py": SIMPLE_EVALS_COMMON})
    out = tmp_path / "suites"
    assert grader_suites.convert([str(repo)], out) == {"simple_evals": 2}
    lines = (out / "simple_evals.jsonl").read_text().splitlines()
    assert [json.loads(x)["expected"] for x in lines] == [True, False]
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="not a clone of a known grader repository"):
        grader_suites.convert([str(tmp_path / "other")], out)
    args = type("A", (), {"convert": [str(repo)], "out": None})()
    assert bench_grader.run(args) == 2 and "--out" in capsys.readouterr().err


def test_bench_counts_cases_resting_on_a_setting(tmp_path):
    suite = tmp_path / "s.jsonl"
    rows = [
        # Math-Verify gives True only with the suite's 2-digit rounding: rests on the setting
        {"gold": "$\\frac{1}{3}$", "prediction": "$0.33$", "expected": True, "settings": {"precision": 2}},
        # a setting that does not change Math-Verify's verdict: does not rest on it
        {"gold": "$2$", "prediction": "$3$", "expected": False, "settings": {"match_types": ["latex"]}},
        # a rule stated in words: rests on it
        {"gold": "3245/5", "prediction": "649", "expected": False, "input_kind": "answer",
         "settings": {"simplification": "trivial only"}, "note": "trivial simplifications only"},
        {"gold": "2", "prediction": "$2$", "expected": True},
    ]
    suite.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cases = bench_grader.load_cases([str(suite)], builtin=False)
    row = bench_grader.score(cases)["s"]
    assert [c["rests"] for c in cases] == [True, False, True, False]
    assert [c["as_set"] for c in cases] == [True, False, None, None]
    assert row["set"] == 2 and row["replayed"] == 2 and row["replay_agrees"] == 2
    assert (row["ours_right"], row["ours_false_pos"], row["ours_false_pos_on_set"]) == (2, 1, 1)
    assert (row["ours_false_neg"], row["ours_false_neg_on_set"]) == (1, 1)


def test_bench_refuses_malformed_settings(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"gold": "1", "prediction": "1", "expected": True, "settings": [1]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        bench_grader.load_cases([str(bad)], builtin=False)
    bad.write_text(json.dumps({"gold": "1", "prediction": "1", "expected": True, "input_kind": "text"}) + "\n")
    with pytest.raises(ValueError, match="input_kind"):
        bench_grader.load_cases([str(bad)], builtin=False)


def test_literal_evaluates_only_literals():
    import ast

    assert grader_suites.literal(ast.parse('f"{math.sqrt(2):.3f}"', mode="eval").body) == "1.414"
    assert grader_suites.literal(ast.parse("(5 / 2, -1, 'a')", mode="eval").body) == [2.5, -1, "a"]
    for text in ("open('x')", "__import__('os')", "math.system(1)", "x.y", "[i for i in y]", "1 if a else 2"):
        with pytest.raises(grader_suites.NotLiteral):
            grader_suites.literal(ast.parse(text, mode="eval").body)


def test_the_test_layouts_above_parse():
    for text in (MATH_VERIFY_TEST, NEMO_TEST, VERL_TEST, HENDRYCKS_TEST, SIMPLE_EVALS_COMMON):
        compile(textwrap.dedent(text), "<test>", "exec")


def test_unreadable_cases_are_skipped_or_refused_with_the_reason(tmp_path):
    odd = HENDRYCKS_TEST.replace('test_in = "10"', "test_in = make_answer()").replace('"4, 12, 2"', "1 / 0")
    repo = _repo(tmp_path / "math", {"modeling/math_equivalence_test.py": odd})
    _, cases, skipped = grader_suites.convert_repo(repo)
    assert [c["gold"] for c in cases] == ["4, 10, -2"]  # the two others are not literal
    assert len(skipped) == 2 and all("not literal" in s for s in skipped)
    broken = _repo(tmp_path / "nemo", {"tests/test_math_equal.py": "def test_x(:\n"})
    with pytest.raises(ValueError, match="could not be read as expected.*check out the commit"):
        grader_suites.convert_repo(broken)
