"""`hfllamarl eval`: generate with vLLM on a JSONL data set and score with a reward plugin."""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True)


def run(args) -> int:
    raise SystemExit("hfllamarl eval is not implemented yet")
