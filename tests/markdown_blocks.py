"""pytest plugin: the docs' Python code blocks are tests, run by pytest-markdown-docs (tests/requirements.txt).

Registered by tests/conftest.py (`pytest_plugins`); pytest.ini's testpaths has pytest collect docs/ with tests/.
Every ```python block of a page under docs/ runs in a fresh namespace and a temporary working directory; a block
marked ```python notest (it needs a model hub, a GPU, a cluster or a whole training job) does not run, and
tests/test_docs_code.py still parses it and checks its imports. ```python continuation runs after the page's
previous block, in its namespace.

Only the pages under docs/ are collected (not README.md or CHANGELOG.md). The plugin's own --markdown-docs flag is
not used: it would also import every .py file for the code blocks of its docstrings. (Not a docs/conftest.py: the
test modules import tests/conftest.py as `conftest`, and a second conftest module would take that name.)
"""

import os
import tempfile
from pathlib import Path

import pytest
from pytest_markdown_docs.plugin import MarkdownInlinePythonItem, MarkdownTextFile

DOCS = Path(__file__).resolve().parents[1] / "docs"


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".md" and DOCS in file_path.parents and not parent.config.option.markdowndocs:
        return MarkdownTextFile.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A block that writes `out/` or a data file writes it in a directory of its own."""
    if not isinstance(item, MarkdownInlinePythonItem):
        return (yield)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="docs-block-") as scratch:
        os.chdir(scratch)
        try:
            return (yield)
        finally:
            os.chdir(cwd)
