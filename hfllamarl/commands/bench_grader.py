"""`hfllamarl bench grader`: how often `math_sympy` agrees with graders' test suites, Math-Verify side by side.

    hfllamarl bench grader --convert REPO_DIR [REPO_DIR ...] --out DIR   # public suites -> DIR/*.jsonl
    hfllamarl bench grader [--suites PATH ...] [--show 20]

``--convert`` turns public graders' own test cases into suite files (:mod:`.grader_suites` says which
repositories and files). Suites: the built-in one (:mod:`hfllamarl.commands.grader_cases`, whole
completions) and JSON Lines files given with ``--suites`` (a file, or a directory of ``*.jsonl``), one
case per line::

    {"suite": "math_verify", "gold": "\\\\frac{1}{2}", "prediction": "$0.5$", "expected": true,
     "input_kind": "answer", "source": "owner/repo@sha:path:line", "settings": {"precision": 2}}

``expected`` is the suite's own verdict. ``input_kind`` is "output" (a whole completion, the
default) or "answer" (an answer already extracted: both graders get it as the answer, in
``\\boxed{}`` for math_sympy and in ``$...$`` for Math-Verify, unless it is delimited already).

For each suite it prints the cases, how many each grader gets right, and their false positives
(the suite says wrong, the grader says right) and false negatives; ``--show N`` lists up to N cases
math_sympy gets wrong. The last line is one JSON object with the same figures.

Settings: both graders always run with their own fixed defaults, as in training. Some suites pass a
setting for one case (Math-Verify's tests: ``precision=2``, ``strict=False``, ``match_types=["latex"]``,
``allow_set_relation_comp=True``; simple-evals: "trivial simplifications only"), recorded in the case's
``settings``. A case *rests on its setting* when its verdict is not what the grader's defaults give:
for Math-Verify's settings the bench checks this by running Math-Verify both ways (with the case's
settings, as the suite does, and with its defaults); a rule stated in words always counts. Those
cases stay in every figure and are also counted apart (column ``set``; FP/FN ``on set``), and each one
is listed. Running Math-Verify with the case's settings also checks the conversion: it must agree with
the suite's verdict on those cases.

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
_MV_SETTINGS = ("match_types", "precision", "strict", "allow_set_relation_comp")


def add_arguments(parser) -> None:
    parser.add_argument("--suites", nargs="*", default=[],
                        help="JSONL files or directories of them (keys: gold, prediction, expected; "
                             "optional suite, input_kind, source, settings, note)")
    parser.add_argument("--show", type=int, default=20, help="list up to this many cases math_sympy gets wrong")
    parser.add_argument("--no-builtin", action="store_true", help="leave out the built-in suite")
    parser.add_argument("--convert", nargs="+", metavar="REPO_DIR",
                        help="write the test cases of these grader repositories' clones as suites to --out, "
                             "then stop (Math-Verify, NeMo-Skills, verl, hendrycks/math, simple-evals)")
    parser.add_argument("--out", help="directory for --convert's <suite>.jsonl files")


def load_cases(paths: list[str], builtin: bool = True) -> list[dict]:
    """Every case: the built-in suite, then each JSONL file in ``paths`` (directories: their
    ``*.jsonl``, sorted). Raises ValueError naming the file and line of a malformed case."""
    cases = []
    if builtin:
        from .grader_cases import CASES

        cases += [{"suite": "hfllamarl", "gold": g, "prediction": p, "expected": e, "input_kind": "output",
                   "source": f"hfllamarl.commands.grader_cases:{i}"} for i, (g, p, e) in enumerate(CASES)]
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
                          and isinstance(case.get("prediction"), str) and isinstance(case.get("expected"), bool)
                          and isinstance(case.get("settings", {}), dict)
                          and case.get("input_kind", "output") in ("output", "answer"))
                except json.JSONDecodeError:
                    ok = False
                if not ok:
                    raise ValueError(f"{path}:{number}: each line must be a JSON object with string `gold` and "
                                     f"`prediction`, boolean `expected`, `input_kind` \"output\" or \"answer\" "
                                     f"and `settings` (if any) an object.")
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
        # a trailing backslash ("185\\") would escape the box's closing brace: a space keeps it apart
        text = "\\boxed{" + text + (" }" if text.endswith("\\") else "}")
    return math_sympy(prompts=None, completions=[text], answer=[case["gold"]])[0] == 1.0


def math_sympy_timeouts() -> int:
    from hfllamarl.plugins.rewards.math_sympy import stats

    return stats()["timeouts"]


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


def grade_math_verify_as_set(case: dict) -> bool | None:
    """Math-Verify with the case's own Math-Verify settings, as its suite calls it (its tests'
    ``compare_strings``), or None when the case has no such settings."""
    settings = case.get("settings") or {}
    if not set(settings) & set(_MV_SETTINGS):
        return None
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    targets = [LatexExtractionConfig(boxed_match_priority=0) if t == "latex" else ExprExtractionConfig()
               for t in settings.get("match_types", ["latex", "expr"])]
    try:
        return bool(verify(parse(case["gold"], targets), parse(case["prediction"], targets),
                           float_rounding=settings.get("precision", 6), strict=settings.get("strict", True),
                           allow_set_relation_comp=settings.get("allow_set_relation_comp", False)))
    except Exception:  # noqa: BLE001
        return False


def _rests_on_setting(case: dict) -> bool:
    """Whether the suite's verdict is not what a grader's defaults give, because of its setting."""
    if not case.get("settings"):
        return False
    if case["as_set"] is None:  # a rule stated in words: it decides the verdict
        return True
    return case["as_set"] == case["expected"] != case["math_verify"]


def score(cases: list[dict]) -> dict[str, dict]:
    """Per suite: cases, cases resting on a per-case setting (``set``), and for each grader right,
    false positives and negatives, in all and on the ``set`` cases; adds the verdicts to each case
    (``ours``, ``math_verify``, ``as_set``, ``rests``, ``timed_out``)."""
    table: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    for case in cases:
        row = table[case["suite"]]
        row["cases"] += 1
        timeouts = math_sympy_timeouts()
        case["ours"], case["math_verify"] = grade_ours(case), grade_math_verify(case)
        case["timed_out"] = math_sympy_timeouts() > timeouts
        case["as_set"] = grade_math_verify_as_set(case)
        case["rests"] = _rests_on_setting(case)
        row["set"] += case["rests"]
        if case["as_set"] is not None:
            row["replayed"] += 1
            row["replay_agrees"] += case["as_set"] == case["expected"]
        for name in ("ours", "math_verify"):
            verdict = case[name]
            fp, fn = verdict and not case["expected"], case["expected"] and not verdict
            row[f"{name}_right"] += verdict == case["expected"]
            row[f"{name}_false_pos"] += fp
            row[f"{name}_false_neg"] += fn
            row[f"{name}_false_pos_on_set"] += fp and case["rests"]
            row[f"{name}_false_neg_on_set"] += fn and case["rests"]
    return {suite: dict(row) for suite, row in table.items()}


def _print_table(table: dict[str, dict]) -> None:
    header = (f"{'suite':<15} {'cases':>5} {'set':>4}  {'math_sympy right':>17} {'FP':>3} {'FN':>3}  "
              f"{'Math-Verify right':>17} {'FP':>3} {'FN':>3}")
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
            cells.append(f"{right:>4}/{n:<4} {100 * right / n:6.1f}% {row[f'{name}_false_pos']:>3} "
                         f"{row[f'{name}_false_neg']:>3}")
        print(f"{suite:<15} {n:>5} {row.get('set', 0):>4}  {cells[0]}  {cells[1]}")
    total = rows[-1][1]
    off_set = {name: total[f"{name}_false_pos"] - total[f"{name}_false_pos_on_set"] for name in ("ours", "math_verify")}
    print(f"\nfalse positives on cases that do not rest on a per-case setting: math_sympy {off_set['ours']}, "
          f"Math-Verify {off_set['math_verify']}")


def _print_set_cases(cases: list[dict], table: dict[str, dict]) -> None:
    rests = [c for c in cases if c["rests"]]
    if rests:
        print(f"\n{len(rests)} cases rest on a setting their suite passes (both graders run with their defaults):")
        for c in rests:
            what = c.get("note") or ", ".join(f"{k}={v}" for k, v in c["settings"].items())
            print(f"  [{c['suite']}] expected {c['expected']}, math_sympy {c['ours']}, Math-Verify "
                  f"{c['math_verify']} ({what}): gold {c['gold'][-60:]!r}, prediction {c['prediction'][-60:]!r}")
    for suite, row in table.items():
        if row.get("replayed"):
            print(f"[{suite}] Math-Verify with each case's own settings, as the suite runs it, agrees with the "
                  f"suite on {row['replay_agrees']}/{row['replayed']} of the cases that have settings")


def _convert(args) -> int:
    from .grader_suites import convert

    if not args.out:
        print("hfllamarl bench grader: --convert needs --out DIR (where to write the suites).", file=sys.stderr)
        return 2
    try:
        convert(args.convert, args.out)
    except ValueError as exc:
        print(f"hfllamarl bench grader: {exc}", file=sys.stderr)
        return 2
    print(f"Now: hfllamarl bench grader --suites {args.out}")
    return 0


def run(args) -> int:
    if args.convert:
        return _convert(args)
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
          f"FP = graded right where the suite says wrong; set = the verdict rests on a per-case setting)\n")
    _print_table(table)
    _print_set_cases(cases, table)
    timed_out = [c for c in cases if c["timed_out"]]
    if timed_out:
        print(f"\nmath_sympy ran out of time (scored 0.0) on {len(timed_out)} cases (the machine's load counts):")
        for case in timed_out:
            print(f"  [{case['suite']}] expected {case['expected']}: gold {case['gold'][-60:]!r}  ({case['source']})")
    wrong = [c for c in cases if c["ours"] != c["expected"]]
    if wrong and args.show:
        print(f"\nmath_sympy disagrees with the suite on {len(wrong)} cases; the first {min(args.show, len(wrong))}:")
        for case in wrong[: args.show]:
            print(f"  [{case['suite']}] expected {case['expected']}, math_sympy {case['ours']}, "
                  f"Math-Verify {case['math_verify']}: gold {case['gold'][-80:]!r}, prediction "
                  f"{case['prediction'][-160:]!r}  ({case['source']})")
    counters = stats()
    print(json.dumps({"suites": table, "math_sympy_timeouts": counters["timeouts"],
                      "math_sympy_worker_errors": counters["worker_errors"]}))
    return 0
