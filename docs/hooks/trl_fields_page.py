"""The TRL fields page: what each `GRPOConfig` / `TrainingArguments` field means here, from `config_fields.py`.

The page is made from the same three tables `tests/test_config.py` checks against the installed TRL (every field
in exactly one), so a field a new TRL adds fails that test until it is placed, and then appears here.
`config_fields.py` imports nothing, so it is loaded by path: the docs build never imports TRL.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TABLES = ("READ_HERE", "UNSUPPORTED", "NOT_READ_HERE")


def load_tables(path: Path) -> ModuleType:
    """The `config_fields` module, loaded from its file without importing its package.

    Raises:
        LookupError: The file lacks one of the three tables.
    """
    spec = importlib.util.spec_from_file_location("_docs_config_fields", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    absent = [name for name in TABLES if not isinstance(getattr(module, name, None), dict)]
    if absent:
        raise LookupError(f"{path} has no {', '.join(absent)} table (a dict of field name -> text); the TRL fields "
                          "page is generated from them")
    return module


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render(tables: ModuleType) -> str:
    """The TRL fields page in markdown.

    Args:
        tables: The loaded `config_fields` module (`READ_HERE`: field -> what it tunes; `UNSUPPORTED` and
            `NOT_READ_HERE`: field -> reason).

    Returns:
        The page's markdown.
    """
    read, refused, not_read = (getattr(tables, name) for name in TABLES)
    lines = [
        "# TRL fields",
        "",
        "`AsyncAIPOConfig` subclasses TRL's `GRPOConfig`, so every field of `GRPOConfig` and of transformers'",
        "`TrainingArguments` is accepted under its own name. Each one is in exactly one of three groups:",
        "",
        f"- **Honoured** ({len(read)} fields): read here with TRL's meaning.",
        f"- **Unsupported** ({len(refused)} fields): this runtime does it differently; set to anything but its",
        "  default, the field is refused with the reason below and what to do instead. Never silently ignored.",
        f"- **Not read here** ({len(not_read)} fields): nothing in this runtime reads it, because transformers'",
        "  own code does, or because what it tunes does not exist here; leaving it set has no effect on the run.",
        "",
        "The fields `AsyncAIPOConfig` adds are on the [configuration reference](configuration.md).",
        "",
        '!!! note "Generated"',
        "    This page is generated from the tables in `trainers/config_fields.py` when the site is built. A test",
        "    checks that every field of the installed TRL's `GRPOConfig` is in exactly one of them.",
        "",
        "## Honoured",
        "",
    ]
    topics: dict[str, list[str]] = {}
    for name, topic in read.items():
        topics.setdefault(topic, []).append(name)
    lines += ["| What it tunes | Fields |", "| --- | --- |"]
    for topic, names in topics.items():
        lines.append(f"| {_cell(topic[:1].upper() + topic[1:])} | {', '.join(f'`{n}`' for n in sorted(names))} |")
    for title, table in (("Unsupported", refused), ("Not read here", not_read)):
        lines += ["", f"## {title}", "", "| Field | Why |", "| --- | --- |"]
        lines += [f"| `{name}` | {_cell(why)} |" for name, why in sorted(table.items())]
    return "\n".join(lines) + "\n"
