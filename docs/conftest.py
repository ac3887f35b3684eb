"""The docs' Python code blocks are tests (pytest-markdown-docs, pinned in tests/requirements.txt).

pytest collects this directory with tests/ (pytest.ini's testpaths). Every ```python block of a page here runs, in a
fresh namespace, in a temporary working directory; a block marked ```python notest (it needs a model hub, a GPU, a
cluster or a whole training job) does not run, and tests/test_docs_code.py still parses it and checks its imports.
```python continuation runs after the page's previous block, in its namespace.

Only the pages under docs/ are collected (not README.md or CHANGELOG.md), and only here: the plugin's own
--markdown-docs flag would also import every .py file for the code blocks of its docstrings.
"""

import os

import pytest
from pytest_markdown_docs.plugin import MarkdownTextFile

# The blocks run as a reader's script would, with no hub (a block needing one is marked notest).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".md" and not parent.config.option.markdowndocs:
        return MarkdownTextFile.from_parent(parent, path=file_path)
    return None


@pytest.fixture(autouse=True)
def _in_a_scratch_directory(tmp_path, monkeypatch):
    """A block that writes `out/` or a data file writes it in a directory of its own."""
    monkeypatch.chdir(tmp_path)
