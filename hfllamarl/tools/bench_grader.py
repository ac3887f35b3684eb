"""`hfllamarl bench grader`: how often `math_sympy` agrees with graders' test suites, Math-Verify side by side.

    hfllamarl bench grader [--suites PATH ...] [--show 20]

Suites: the built-in one (:mod:`hfllamarl.tools.grader_cases`, whole completions) and JSON Lines
files given with ``--suites`` (a file, or a directory of ``*.jsonl``), one case per line::

    {"suite": "math_verify", "gold": "\\\\frac{1}{2}", "prediction": "$0.5$", "expected": true,
     "input_kind": "answer", "source": "owner/repo@sha:path:line"}

``expected`` is the suite's own verdict. ``input_kind`` is "output" (a whole completion, the
default) or "answer" (an answer already extracted: both graders get it as the answer, in
``\\boxed{}`` for math_sympy and in ``$...$`` for Math-Verify, unless it is delimited already).

For each suite it prints the cases, how many each grader gets right, and their false positives
(the suite says wrong, the grader says right) and false negatives; ``--show N`` lists up to N cases
math_sympy gets wrong. The last line is one JSON object with the same figures.

Math-Verify runs here with its default extraction (LaTeX and plain expressions), which parses with
sympy's evaluating parser: this bench feeds it suite files only, never model output. math_sympy runs
as in training (its sandboxed worker, its time budget).
"""

from __future__ import annotations

import json
import logging
import sys
from collections import defaultdict
from pathlib import Path

_DELIMITED = ("$", "\\(", "\\[", "\\boxed", "\\fbox")


def add_arguments(parser) -> None:
    parser.add_argument("--suites", nargs="*", default=[],
                        help="JSONL files or directories of them (keys: gold, prediction, expected; "
                             "optional suite, input_kind, source)")
    parser.add_argument("--show", type=int, default=20, help="list up to this many cases math_sympy gets wrong")
    parser.add_argument("--no-builtin", action="store_true", help="leave out the built-in suite")


def load_cases(paths: list[str], builtin: bool = True) -> list[dict]:
    """Every case: the built-in suite, then each JSONL file in ``paths`` (directories: their
    ``*.jsonl``, sorted). Raises ValueError naming the file and line of a malformed case."""
    cases = []
    if builtin:
        from .grader_cases import CASES

        cases += [{"suite": "hfllamarl", "gold": g, "prediction": p, "expected": e, "input_kind": "output",
                   "source": f"hfllamarl.tools.grader_cases:{i}"} for i, (g, p, e) in enumerate(CASES)]
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(path.glob("*.jsonl"))
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"--suites {raw}: no such file or directory.")
    for path in files:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    case = json.loads(line)
                    ok = (isinstance(case, dict) and isinstance(case.get("gold"), str)
                          and isinstance(case.get("prediction"), str) and isinstance(case.get("expected"), bool))
                except json.JSONDecodeError:
                    ok = False
                if not ok:
                    raise ValueError(f"{path}:{number}: each line must be a JSON object with string `gold` and "
                                     f"`prediction` and boolean `expected`.")
                case.setdefault("suite", path.stem)
                case.setdefault("input_kind", "output")
                case.setdefault("source", f"{path}:{number}")
                cases.append(case)
    return cases


def _delimited(text: str) -> bool:
    return any(d in text for d in _DELIMITED)


def grade_ours(case: dict) -> bool:
    from hfllamarl.plugins.rewards.math_sympy import math_sympy

    text = case["prediction"]
    if case["input_kind"] == "answer" and not _delimited(text):
        text = "\\boxed{" + text + "}"
    return math_sympy(prompts=None, completions=[text], answer=[case["gold"]])[0] == 1.0


def grade_math_verify(case: dict) -> bool:
    """Math-Verify alone, as its README uses it: ``verify(parse(gold), parse(prediction))``."""
    from math_verify import parse, verify

    def parsed(text: str, wrap: bool):
        first = parse("$" + text + "$") if wrap and not _delimited(text) else []
        return first or parse(text)

    try:
        gold = parsed(case["gold"], wrap=True)
        pred = parsed(case["prediction"], wrap=case["input_kind"] == "answer")
        return bool(gold and pred and verify(gold, pred))
    except Exception:  # noqa: BLE001 - a grader error is a "no" here, as in training
        return False


def score(cases: list[dict]) -> dict[str, dict]:
    """Per suite: cases, right, false positives and negatives for each grader; adds the verdicts
    to each case (``ours``, ``math_verify``)."""
    table: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    for case in cases:
        row = table[case["suite"]]
        row["cases"] += 1
        for name, grade in (("ours", grade_ours), ("math_verify", grade_math_verify)):
            verdict = case[name] = grade(case)
            row[f"{name}_right"] += verdict == case["expected"]
            row[f"{name}_false_pos"] += verdict and not case["expected"]
            row[f"{name}_false_neg"] += case["expected"] and not verdict
    return {suite: dict(row) for suite, row in table.items()}


def _print_table(table: dict[str, dict]) -> None:
    header = f"{'suite':<16} {'cases':>6}  {'math_sympy':>16} {'FP':>4} {'FN':>4}  {'Math-Verify':>16} {'FP':>4} {'FN':>4}"
    print(header)
    print("-" * len(header))
    rows = list(table.items())
    if len(rows) > 1:
        total: dict[str, int] = defaultdict(int)
        for _, row in rows:
            for key, value in row.items():
                total[key] += value
        rows.append(("all", dict(total)))
    for suite, row in rows:
        n = row["cases"]
        cells = []
        for name in ("ours", "math_verify"):
            right = row[f"{name}_right"]
            cells.append(f"{right:>5}/{n:<5} {100 * right / n:5.1f}% {row[f'{name}_false_pos']:>4} "
                         f"{row[f'{name}_false_neg']:>4}")
        print(f"{suite:<16} {n:>6}  {cells[0]}  {cells[1]}")


def run(args) -> int:
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    from hfllamarl.plugins.rewards.math_sympy import math_sympy, stats

    try:
        cases = load_cases(args.suites, builtin=not args.no_builtin)
    except ValueError as exc:
        print(f"hfllamarl bench grader: {exc}", file=sys.stderr)
        return 2
    if not cases:
        print("hfllamarl bench grader: no cases (give --suites or keep the built-in suite).", file=sys.stderr)
        return 2
    math_sympy.warmup()
    table = score(cases)
    print(f"math_sympy vs Math-Verify on {len(cases)} cases (right = agrees with the suite's verdict; "
          f"FP = graded right where the suite says wrong)\n")
    _print_table(table)
    wrong = [c for c in cases if c["ours"] != c["expected"]]
    if wrong and args.show:
        print(f"\nmath_sympy disagrees with the suite on {len(wrong)} cases; the first {min(args.show, len(wrong))}:")
        for case in wrong[: args.show]:
            print(f"  [{case['suite']}] expected {case['expected']}, math_sympy {case['ours']}, "
                  f"Math-Verify {case['math_verify']}: gold {case['gold']!r}, prediction {case['prediction'][-160:]!r}"
                  f"  ({case['source']})")
    counters = stats()
    print(json.dumps({"suites": table, "math_sympy_timeouts": counters["timeouts"],
                      "math_sympy_worker_errors": counters["worker_errors"]}))
    return 0
