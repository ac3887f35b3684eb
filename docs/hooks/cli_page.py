"""The command-line reference: the `--help` of `hfllamarl` and of every sub-command it registers.

`hfllamarl/cli.py` builds its argparse parser inside `main()` and imports only light modules while doing so (the
commands import torch or vLLM inside their `run()`), so the parser is built for real and caught just before it
parses: whatever sub-commands `main()` registers appear here, with no list to keep in step.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from unittest import mock

HEAVY = ("torch", "vllm", "transformers", "trl")
WIDTH = "100"  # argparse wraps help at $COLUMNS: fixed, so the page does not depend on the terminal


class _Built(Exception):
    """Carries the parser out of `main()` before it parses anything."""


def build_parser(module: str = "hfllamarl.cli") -> argparse.ArgumentParser:
    """The top-level parser `module.main()` builds, without running any command.

    Raises:
        RuntimeError: Building the parser imported torch, vLLM, transformers or TRL (the docs build must not),
            or `main()` returned without parsing.
    """
    before = set(sys.modules)

    def caught(self, *args, **kwargs):
        raise _Built(self)

    with mock.patch.dict(os.environ, {"COLUMNS": WIDTH}), \
            mock.patch.object(argparse.ArgumentParser, "parse_args", caught), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", caught):
        try:
            importlib.import_module(module).main([])
        except _Built as built:
            parser = built.args[0]
        else:
            raise RuntimeError(f"{module}.main() returned without parsing its arguments; update docs/hooks/cli_page.py")
    heavy = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in HEAVY)
    if heavy:
        raise RuntimeError(f"building {module}'s parser imported {', '.join(heavy[:5])}; move those imports into "
                           "the command's run() so that `hfllamarl --help` and the docs build stay light")
    return parser


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Yield (command words, parser) for the parser and every sub-parser below it, in registration order."""
    yield path, parser
    for action in parser._actions:  # argparse keeps sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, path + (name,))


def render(parser: argparse.ArgumentParser) -> str:
    """The CLI reference page in markdown: one section per command, its `--help` verbatim."""
    lines = [
        "# Command line",
        "",
        "Installing the package puts one command on the path, `hfllamarl`; `python -m hfllamarl.cli` is the same.",
        "",
        '!!! note "Generated"',
        "    This page is the `--help` of every sub-command, generated from `hfllamarl/cli.py` when the site is built.",
        "",
    ]
    with mock.patch.dict(os.environ, {"COLUMNS": WIDTH}):
        for words, sub in walk(parser):
            title = " ".join(("hfllamarl",) + words)
            lines += [f"## `{title}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(lines)
