"""A large batch of MATH completions for ``math_sympy``, and its wall time per worker count.

    python -m hfllamarl.commands.grader_batch [--data math_test.jsonl] [--problems 200] [--workers 1 2]

:func:`math_batch` turns MATH problems into completions as a model writes them: per problem, the gold
answer boxed at the end of a sentence, an equivalent rewrite where one is easy (an integer as
``(n-1)+1``, a fraction as ``a \\cdot \\frac{1}{b}``, an expression as ``1 \\cdot (e)``: these need the
sandboxed worker), another problem's gold (wrong), and for an integer gold ``(n)+1`` (wrong, and needs the worker too).
:func:`math_verify_verdicts` grades the same pairs with Math-Verify's own ``parse``/``verify``
(default extraction, as its README shows), the reference the tests compare with.

The command grades one such batch in one reward call with each worker count in turn, side by side in
one run (the load of the machine changes between runs), and prints the wall times, the checks that
needed a worker, the unscored count and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import subprocess
import time
from pathlib import Path

__all__ = ["math_batch", "math_verify_verdicts", "main"]

_INTEGER = re.compile(r"-?\d+")
_FRACTION = re.compile(r"(-?)\\frac\{(\d+)\}\{(\d+)\}")
# golds that are one expression (no tuple, set, interval, text, unit, equation, choice letter)
_EXPRESSION = re.compile(r"[0-9a-z\\{}^+\-*/() .]*\\(sqrt|pi|frac)[0-9a-z\\{}^+\-*/() .]*")


def _rewrite(gold: str) -> str | None:
    """An equivalent form of ``gold`` that string and number rules cannot decide, or None."""
    if _INTEGER.fullmatch(gold):
        n = int(gold)
        return f"({n - 1})+1"
    frac = _FRACTION.fullmatch(gold)
    if frac:
        sign, a, b = frac.groups()
        return f"{sign}{a} \\cdot \\frac{{1}}{{{b}}}"
    if _EXPRESSION.fullmatch(gold) and "," not in gold:
        return f"1 \\cdot ({gold})"
    return None


def math_batch(rows: list[dict], seed: int = 0) -> tuple[list[str], list[str]]:
    """(completions, gold answers) for ``rows`` of MATH (each with ``answer``), several per problem."""
    rng = random.Random(seed)
    others = [r["answer"] for r in rows]
    completions, golds = [], []

    def add(gold: str, answer: str, lead: str) -> None:
        completions.append(f"{lead} Putting the steps together, the answer is $\\boxed{{{answer}}}$.")
        golds.append(gold)

    for row in rows:
        gold = row["answer"]
        add(gold, gold, "We simplify first.")
        rewrite = _rewrite(gold)
        if rewrite is not None:
            add(gold, rewrite, "Rewriting the result,")
        other = rng.choice(others)
        if other != gold:
            add(gold, other, "Let us check the cases.")
        if _INTEGER.fullmatch(gold):
            add(gold, f"({gold})+1", "Counting again,")
    return completions, golds


def math_verify_verdicts(completions: list[str], golds: list[str]) -> list[bool]:
    """Math-Verify's verdict on each (gold, completion) pair, with its default settings."""
    from math_verify import parse, verify

    gold_parsed: dict[str, list] = {}
    verdicts = []
    for completion, gold in zip(completions, golds):
        if gold not in gold_parsed:
            gold_parsed[gold] = parse(f"${gold}$")
        verdicts.append(bool(verify(gold_parsed[gold], parse(completion))))
    return verdicts


def read_rows(path: Path, problems: int, seed: int = 0) -> list[dict]:
    """``problems`` rows of a MATH JSON Lines file, drawn at random with ``seed``."""
    with Path(path).open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return random.Random(seed).sample(rows, min(problems, len(rows)))


def cpu_model() -> str:
    """The CPU model as ``lscpu`` names it (the platform's processor name where there is no lscpu)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def time_workers(completions: list[str], golds: list[str], worker_counts: list[int]) -> list[dict]:
    """Grades the batch once per worker count (workers started first, outside the timing)."""
    from hfllamarl.plugins.rewards import math_sympy as module

    rows = []
    for n in worker_counts:
        module.configure(workers=n)
        module.warmup()
        before = module.stats()
        start = time.perf_counter()
        scores = module.math_sympy(prompts=None, completions=completions, answer=golds)
        seconds = time.perf_counter() - start
        after = module.stats()
        rows.append({"workers": n, "seconds": round(seconds, 2), "completions": len(completions),
                     "unscored": scores.count(None), "timeouts": after["timeouts"] - before["timeouts"],
                     "correct": scores.count(1.0)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[3] / "shared" / "data"
                        / "math_test.jsonl", help="a MATH JSON Lines file with an 'answer' column")
    parser.add_argument("--problems", type=int, default=300)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=1, help="rounds of all worker counts, interleaved")
    args = parser.parse_args(argv)
    if not args.data.exists():
        parser.error(f"{args.data} not found: pass a MATH JSON Lines file with --data.")
    completions, golds = math_batch(read_rows(args.data, args.problems))
    print(f"CPU: {cpu_model()}; batch of {len(completions)} completions from {args.problems} problems")
    for _ in range(args.repeat):
        for row in time_workers(completions, golds, args.workers):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
