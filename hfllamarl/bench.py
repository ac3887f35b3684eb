"""`hfllamarl bench weight-sync`: the weight-sync backends timed side by side in one run."""

from __future__ import annotations


def add_weight_sync_arguments(parser) -> None:
    parser.add_argument("--params", type=float, default=100e6)


def run_weight_sync(args) -> int:
    raise SystemExit("hfllamarl bench weight-sync is not implemented yet")
