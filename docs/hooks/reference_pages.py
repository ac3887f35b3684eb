"""mkdocs hook: generate the reference pages from the code when the site is built.

    reference/configuration.md   AsyncAIPOConfig's own fields and their help (trainers/config.py, read with ast)
    reference/trl-fields.md      every GRPOConfig field's status (the tables of trainers/config_fields.py)
    reference/cli.md             `hfllamarl` and its sub-commands' --help (hfllamarl/cli.py's parser)

None of them imports torch, vLLM, transformers or TRL. A generator that fails (a field without help text, a
sub-command whose parser imports torch) fails the build with its message.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))  # the generators beside this file (mkdocs loads a hook by path, not as a package)

import cli_page  # noqa: E402
import config_page  # noqa: E402
import trl_fields_page  # noqa: E402

CONFIG = ROOT / "trainers" / "config.py"
TABLES = ROOT / "trainers" / "config_fields.py"


def pages() -> dict[str, str]:
    """Each generated page's path under docs/ and its markdown."""
    tables = trl_fields_page.load_tables(TABLES)
    grpo_fields = {name for table in trl_fields_page.TABLES for name in getattr(tables, table)}
    config_fields = config_page.read_fields(CONFIG.read_text(), str(CONFIG.relative_to(ROOT)))
    return {
        "reference/configuration.md": config_page.render(config_fields, inherited=grpo_fields),
        "reference/trl-fields.md": trl_fields_page.render(tables),
        "reference/cli.md": cli_page.render(cli_page.build_parser()),
    }


def on_files(files, config):
    """Add the generated pages to the site (they exist only in memory: nothing is written under docs/)."""
    for path, markdown in pages().items():
        if files.get_file_from_path(path) is not None:
            raise RuntimeError(f"docs/{path} is generated at build time; delete the file from docs/")
        files.append(File.generated(config, path, content=markdown))
    return files
