"""Public graders' own test cases, converted to the JSON Lines suites `hfllamarl bench grader` reads.

    hfllamarl bench grader --convert REPO_DIR [REPO_DIR ...] --out DIR

Each REPO_DIR is a clone of one of the repositories below (a work tree, or a bare git directory, whose
``HEAD`` is read). The suite a directory holds is recognised by its files; each case gets a ``source``
naming the repository, the commit, the file and the line of the case::

    {"suite": "nemo_skills", "gold": "\\\\frac{1}{2}", "prediction": "0.5", "expected": true,
     "input_kind": "answer", "source": "NVIDIA/NeMo-Skills@0b012df...:tests/test_math_equal.py:26"}

| suite | repository | cases read from |
|---|---|---|
| ``math_verify`` | huggingface/Math-Verify | ``tests/*.py``: every ``compare_strings`` / ``verify(parse(..), parse(..))`` verdict |
| ``nemo_skills`` | NVIDIA/NeMo-Skills | ``tests/test_math_equal.py`` (both argument orders, as the tests check) |
| ``verl`` | volcengine/verl | ``tests/utils/reward_score/test_sandbox_on_cpu.py`` (the prime_math cases) |
| ``hendrycks_math`` | hendrycks/math | ``modeling/math_equivalence_test.py`` (``is_equiv(output, answer)``) |
| ``simple_evals`` | openai/simple-evals | ``common.py``: the worked examples of ``EQUALITY_TEMPLATE`` |

The repositories' files are read, never run: Python files are parsed with :mod:`ast` and only literal
values are taken (strings, numbers, tuples, arithmetic on numbers, f-strings of ``math`` functions).
A case that is not literal is skipped and reported.

Where a case's verdict rests on a setting its suite passes for that case (Math-Verify's
``precision`` / ``strict`` / ``allow_set_relation_comp`` / ``match_types`` arguments; the simple-evals
judge's "trivial simplifications only" rule), the case carries ``settings`` (what the suite passed,
only values that differ from that suite's defaults) and, for a rule stated in words, ``note``. The bench
runs both graders with their fixed defaults and reports those cases apart (see :mod:`.bench_grader`).
"""

from __future__ import annotations

import ast
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["SUITES", "convert", "convert_repo", "detect_suite"]


# ------------------------------------------------------------------------- reading a repository

class Repo:
    """Read-only view of a repository at its ``HEAD``: a work tree, or a bare git directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"--convert {path}: no such directory.")
        self.sha = self._git("rev-parse", "HEAD").strip() if self._is_git() else "unknown"

    def _is_git(self) -> bool:
        try:
            self._git("rev-parse", "--git-dir")
            return True
        except (OSError, subprocess.CalledProcessError):
            return False

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.path), *args], check=True, capture_output=True,
                              text=True, timeout=60).stdout

    def exists(self, rel: str) -> bool:
        if (self.path / rel).is_file():
            return True
        if self.sha == "unknown":
            return False
        try:
            self._git("cat-file", "-e", f"HEAD:{rel}")
            return True
        except subprocess.CalledProcessError:
            return False

    def read(self, rel: str) -> str:
        if (self.path / rel).is_file():
            return (self.path / rel).read_text(encoding="utf-8")
        return self._git("show", f"HEAD:{rel}")

    def list(self, folder: str, suffix: str) -> list[str]:
        if (self.path / folder).is_dir():
            return sorted(str(p.relative_to(self.path)) for p in (self.path / folder).glob(f"*{suffix}"))
        names = self._git("ls-tree", "--name-only", "HEAD", folder.rstrip("/") + "/").split("\n")
        return sorted(n for n in names if n.endswith(suffix))


# ------------------------------------------------------------------------ literal values only

class NotLiteral(ValueError):
    """A test value that is not a literal (it would need the repository's code to run)."""


_MATH_FUNCTIONS = {"sqrt": math.sqrt, "exp": math.exp, "log": math.log, "pi": math.pi, "e": math.e}
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b}


def literal(node: ast.AST, names: dict[str, Any] | None = None) -> Any:
    """The value of a literal expression: constants, tuples, lists, signs and + - * / on numbers,
    f-strings, ``math.sqrt(...)``-style calls on literals, and names bound in ``names``.

    Raises:
        NotLiteral: Anything else (a call of the repository's code, an attribute, ...).
    """
    names = names or {}
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return [literal(e, names) for e in node.elts]
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand, names)
        if isinstance(value, (int, float)):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = literal(node.left, names), literal(node.right, names)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (left, right)):
            return _arithmetic(_BINARY[type(node.op)], left, right)
    if isinstance(node, ast.JoinedStr):
        return "".join(literal(v, names) for v in node.values)
    if isinstance(node, ast.FormattedValue) and node.conversion == -1:
        spec = literal(node.format_spec, names) if node.format_spec else ""
        return format(literal(node.value, names), spec)
    if isinstance(node, ast.Attribute) and _is_math(node.value) and isinstance(_MATH_FUNCTIONS.get(node.attr), float):
        return _MATH_FUNCTIONS[node.attr]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_math(node.func.value)
            and callable(_MATH_FUNCTIONS.get(node.func.attr)) and not node.keywords):
        return _arithmetic(_MATH_FUNCTIONS[node.func.attr], *(literal(a, names) for a in node.args))
    raise NotLiteral(ast.dump(node)[:80])


def _arithmetic(fn: Callable, *args: Any) -> Any:
    try:
        return fn(*args)
    except (ArithmeticError, ValueError, TypeError) as exc:  # 1 / 0, math.sqrt(-1), math.exp(1e9)
        raise NotLiteral(f"{type(exc).__name__}: {exc}") from exc


def _is_math(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "math"


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name):
            return node.func.id
        if isinstance(node.func, ast.Attribute):
            return node.func.attr
    return None


def _calls(node: ast.AST, name: str) -> Iterator[ast.Call]:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and _call_name(sub) == name:
            yield sub


def _parametrize(fn: ast.FunctionDef) -> tuple[list[str], list[ast.AST]] | None:
    """``@pytest.mark.parametrize("a, b", [rows])``: the argument names and the row nodes."""
    for deco in fn.decorator_list:
        if _call_name(deco) == "parametrize" and len(deco.args) >= 2:
            names = literal(deco.args[0])
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
            rows = deco.args[1]
            if isinstance(rows, (ast.List, ast.Tuple)):
                return names, list(rows.elts)
    return None


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            yield node


# ------------------------------------------------------------------------------ the suites

class _Sink:
    """Collects the cases and skipped cases of one suite."""

    def __init__(self, suite: str, repo: Repo, origin: str) -> None:
        self.suite, self.repo, self.origin = suite, repo, origin
        self.cases: list[dict] = []
        self.skipped: list[str] = []

    def source(self, rel: str, line: int) -> str:
        return f"{self.origin}@{self.repo.sha}:{rel}:{line}"

    def add(self, gold: Any, prediction: Any, expected: Any, input_kind: str, rel: str, line: int,
            settings: dict | None = None, note: str | None = None) -> None:
        where = self.source(rel, line)
        if gold is None or prediction is None:
            self.skipped.append(f"{where}: a None value (no text to grade)")
            return
        if isinstance(expected, bool) or expected in (0, 1):
            case = {"suite": self.suite, "gold": str(gold), "prediction": str(prediction),
                    "expected": bool(expected), "input_kind": input_kind, "source": where}
            if settings:
                case["settings"] = settings
            if note:
                case["note"] = note
            self.cases.append(case)
        else:
            self.skipped.append(f"{where}: the expected value {expected!r} is not a verdict")


# Math-Verify: compare_strings(gold, pred, match_types, precision, strict, allow_set_relation_comp)
_MV_PARAMS = ("gold", "pred", "match_types", "precision", "strict", "allow_set_relation_comp")
_MV_DEFAULTS = {"match_types": ["latex", "expr"], "precision": 6, "strict": True, "allow_set_relation_comp": False}


def _mv_call_args(call: ast.Call, names: dict[str, Any]) -> dict[str, Any]:
    """Arguments of one ``compare_strings(...)`` or ``verify(parse(g), parse(p))`` call."""
    if _call_name(call) == "verify":  # verify(parse(gold), parse(pred)): Math-Verify's defaults
        parsed = [literal(a.args[0], names) for a in call.args[:2] if _call_name(a) == "parse" and len(a.args) == 1]
        if len(parsed) != 2:
            raise NotLiteral("verify() of something other than parse(text)")
        return {"gold": parsed[0], "pred": parsed[1]}
    args = {name: literal(a, names) for name, a in zip(_MV_PARAMS, call.args)}
    args.update({k.arg: literal(k.value, names) for k in call.keywords if k.arg})
    return args


def _mv_settings(args: dict[str, Any]) -> dict[str, Any]:
    return {k: args[k] for k in _MV_DEFAULTS if k in args and args[k] != _MV_DEFAULTS[k]}


def _mv_grading_call(fn: ast.FunctionDef) -> ast.Call | None:
    for name in ("compare_strings", "verify"):
        for call in _calls(fn, name):
            if name == "compare_strings" or any(_call_name(a) == "parse" for a in call.args):
                return call
    return None


def _convert_math_verify(sink: _Sink) -> None:
    for rel in sink.repo.list("tests", ".py"):
        tree = ast.parse(sink.repo.read(rel))
        for fn in _functions(tree):
            call = _mv_grading_call(fn)
            if call is None:
                continue
            spec = _parametrize(fn)
            if spec is None:  # plain asserts: assert compare_strings("a", "b", ...) == 1
                for node in ast.walk(fn):
                    if (isinstance(node, ast.Compare) and _call_name(node.left) in ("compare_strings", "verify")
                            and isinstance(node.ops[0], ast.Eq)):
                        try:
                            args = _mv_call_args(node.left, {})
                            expected = literal(node.comparators[0])
                        except NotLiteral as exc:
                            sink.skipped.append(f"{sink.source(rel, node.lineno)}: not literal ({exc})")
                            continue
                        sink.add(args["gold"], args["pred"], expected, "output", rel, node.lineno, _mv_settings(args))
                continue
            argnames, rows = spec
            verdict = next((n for n in ("expected", "result") if n in argnames), None)
            if verdict is None or "gold" not in argnames or "pred" not in argnames:
                continue
            for row in rows:
                try:
                    values = dict(zip(argnames, literal(row)))
                    args = _mv_call_args(call, values)
                except NotLiteral as exc:
                    sink.skipped.append(f"{sink.source(rel, row.lineno)}: not literal ({exc})")
                    continue
                sink.add(args["gold"], args["pred"], values[verdict], "output", rel, row.lineno, _mv_settings(args))


def _convert_nemo_skills(sink: _Sink) -> None:
    """``math_equal(gt_answer, predicted_answer)`` checked in both orders per pair."""
    rel = "tests/test_math_equal.py"
    tree = ast.parse(sink.repo.read(rel))
    for fn in _functions(tree):
        spec = _parametrize(fn)
        if spec is None or len(spec[0]) != 1:
            continue
        pair_name = spec[0][0]
        checks = []  # (gold index, prediction index, expected) in the order the test makes them
        body = list(fn.body)
        for stmt, after in zip(body, body[1:]):
            call = stmt.value if isinstance(stmt, ast.Assign) else None
            if _call_name(call) != "math_equal" or not isinstance(after, ast.Assert):
                continue
            test = after.test
            if isinstance(test, ast.Compare) and isinstance(test.ops[0], (ast.Is, ast.Eq)):
                idx = [a.slice.value for a in call.args[:2]
                       if isinstance(a, ast.Subscript) and isinstance(a.value, ast.Name) and a.value.id == pair_name
                       and isinstance(a.slice, ast.Constant) and isinstance(a.slice.value, int)]
                if len(idx) == 2:
                    checks.append((idx[0], idx[1], literal(test.comparators[0])))
        for row in spec[1]:
            try:
                pair = literal(row)
            except NotLiteral as exc:
                sink.skipped.append(f"{sink.source(rel, row.lineno)}: not literal ({exc})")
                continue
            for gi, pi, expected in checks:
                sink.add(pair[gi], pair[pi], expected, "answer", rel, row.lineno)


def _convert_verl(sink: _Sink) -> None:
    """``default_compute_score(data_source, completion, ground_truth)`` over zipped lists."""
    rel = "tests/utils/reward_score/test_sandbox_on_cpu.py"
    tree = ast.parse(sink.repo.read(rel))
    lists = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name) and isinstance(node.value, ast.List)}
    for fn in _functions(tree):
        if not any(_call_name(c) == "default_compute_score" for c in ast.walk(fn)):
            continue
        for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For) and _call_name(n.iter) == "zip"):
            sources = [a.id for a in loop.iter.args if isinstance(a, ast.Name)]
            asserts = [n for n in ast.walk(loop) if isinstance(n, ast.Assert) and isinstance(n.test, ast.Compare)]
            if len(sources) != 2 or not all(s in lists for s in sources) or len(asserts) != 1:
                continue
            expected = literal(asserts[0].test.comparators[0]) == 1.0
            for completion, gold in zip(lists[sources[0]].elts, lists[sources[1]].elts):
                # the whole completion is graded: verl's test passes these strings as model output
                sink.add(literal(gold), literal(completion), expected, "output", rel, completion.lineno)


def _convert_hendrycks(sink: _Sink) -> None:
    """``self.assertTrue/False(is_equiv(test_in, test_out))``; ``is_equiv(output, answer)``."""
    rel = "modeling/math_equivalence_test.py"
    tree = ast.parse(sink.repo.read(rel))
    for fn in _functions(tree):
        names: dict[str, Any] = {}
        for stmt in fn.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                try:
                    names[stmt.targets[0].id] = literal(stmt.value)
                except NotLiteral:
                    names.pop(stmt.targets[0].id, None)  # not a literal: a case using it is skipped
            call = stmt.value if isinstance(stmt, ast.Expr) else None
            if (_call_name(call) in ("assertTrue", "assertFalse") and call.args
                    and _call_name(call.args[0]) == "is_equiv" and len(call.args[0].args) >= 2):
                try:
                    output, answer = (literal(a, names) for a in call.args[0].args[:2])
                except NotLiteral as exc:
                    sink.skipped.append(f"{sink.source(rel, stmt.lineno)}: not literal ({exc})")
                    continue
                expected = _call_name(call) == "assertTrue"
                reordered = not expected and _same_list_reordered(output, answer)
                sink.add(answer, output, expected, "answer", rel, stmt.lineno,
                         {"comma_list": "ordered"} if reordered else None,
                         "is_equiv compares normalised strings: the order of a comma list counts" if reordered else None)


def _same_list_reordered(a: str, b: str) -> bool:
    """Both are comma lists of the same numbers (or strings) in another order."""
    def items(text: str) -> list:
        out = []
        for item in text.split(","):
            try:
                out.append(float(item))
            except ValueError:
                out.append(item.strip())
        return out

    x, y = items(a), items(b)
    return len(x) > 1 and x != y and sorted(map(str, x)) == sorted(map(str, y))


_SIMPLE_EVALS_EXAMPLE = re.compile(
    r"Expression 1: (?P<e1>.*)\n\s*Expression 2: (?P<e2>.*)\n\s*\n(?P<verdict>Yes|No)\n?(?:\((?P<note>[^)]*)\))?")


def _convert_simple_evals(sink: _Sink) -> None:
    """The worked examples of the equality checker's prompt; ``check_equality(answer, extracted)``."""
    rel = "common.py"
    source = sink.repo.read(rel)
    tree = ast.parse(source)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EQUALITY_TEMPLATE"
                                                  for t in node.targets)):
            template = literal(node.value.func.value if _call_name(node.value) == "strip" else node.value)
            examples = template.split("YOUR TASK")[0]
            for m in _SIMPLE_EVALS_EXAMPLE.finditer(examples):
                line = node.lineno + examples.count("\n", 0, m.start())
                note = m.group("note")
                settings = ({"simplification": "trivial only"}
                            if note and "nontrivial simplification" in note else None)
                sink.add(m.group("e1").strip(), m.group("e2").strip(), m.group("verdict") == "Yes", "answer",
                         rel, line, settings, note.strip() if note else None)


# suite name -> (GitHub origin, a file that identifies the repository, converter)
SUITES: dict[str, tuple[str, str, Callable[[_Sink], None]]] = {
    "math_verify": ("huggingface/Math-Verify", "tests/test_all.py", _convert_math_verify),
    "nemo_skills": ("NVIDIA/NeMo-Skills", "tests/test_math_equal.py", _convert_nemo_skills),
    "verl": ("volcengine/verl", "tests/utils/reward_score/test_sandbox_on_cpu.py", _convert_verl),
    "hendrycks_math": ("hendrycks/math", "modeling/math_equivalence_test.py", _convert_hendrycks),
    "simple_evals": ("openai/simple-evals", "common.py", _convert_simple_evals),
}


def detect_suite(repo: Repo) -> str:
    """Which suite a repository holds, by its identifying file.

    Raises:
        ValueError: None of the known repositories.
    """
    for name, (_, marker, _) in SUITES.items():
        if repo.exists(marker) and (name != "simple_evals" or "EQUALITY_TEMPLATE" in repo.read(marker)):
            return name
    known = ", ".join(origin for origin, _, _ in SUITES.values())
    raise ValueError(f"{repo.path}: not a clone of a known grader repository ({known}).")


def convert_repo(path: str | Path) -> tuple[str, list[dict], list[str]]:
    """Cases of one repository: (suite name, cases, skipped-case notes)."""
    repo = Repo(path)
    suite = detect_suite(repo)
    origin, _, converter = SUITES[suite]
    sink = _Sink(suite, repo, origin)
    try:
        converter(sink)
    except (SyntaxError, NotLiteral) as exc:  # a file laid out unlike the commit this reads
        raise ValueError(f"{path}: the {origin} test files could not be read as expected ({exc}); "
                         f"check out the commit named in docs/guides/rewards.md.") from exc
    return suite, sink.cases, sink.skipped


def convert(paths: list[str], out_dir: str | Path) -> dict[str, int]:
    """Writes ``OUT/<suite>.jsonl`` for each repository; prints what it read and skipped.

    Returns:
        Cases written per suite.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for path in paths:
        suite, cases, skipped = convert_repo(path)
        target = out / f"{suite}.jsonl"
        with target.open("w", encoding="utf-8") as f:
            for case in cases:
                f.write(json.dumps(case, ensure_ascii=False) + "\n")
        written[suite] = len(cases)
        settled = sum("settings" in c for c in cases)
        print(f"{suite}: {len(cases)} cases ({settled} with a per-case setting) from {path} -> {target}")
        for note in skipped:
            print(f"  skipped {note}")
    return written
