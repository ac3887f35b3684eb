"""Every Python code block of the docs parses, and the names it imports from hfllamarl, trl, peft, datasets and
transformers exist in the installed packages (a renamed class or a moved function fails here, not in a reader's
terminal). The blocks that can run here also run, under pytest-markdown-docs (tests/markdown_blocks.py); this check covers
the ones marked ```python notest too (they need a model hub, a GPU, a cluster or a whole training job)."""

import ast
import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"^```python(?: [^\n]*)?\n(.*?)^```", re.S | re.M)  # ```python, ```python notest, ...
CHECKED = ("hfllamarl", "trl", "peft", "datasets", "transformers")


def blocks():
    for page in sorted(DOCS.rglob("*.md")):
        for k, match in enumerate(FENCE.finditer(page.read_text())):
            yield pytest.param(match.group(1), id=f"{page.relative_to(DOCS)}#{k}")


@pytest.mark.parametrize("code", list(blocks()))
def test_a_python_block_parses_and_its_imports_exist(code):
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in CHECKED:
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if a.name != "*" and not hasattr(module, a.name)
                       and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            assert not missing, f"from {node.module} import {missing}: no such name"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in CHECKED:
                    importlib.import_module(alias.name)


def test_the_migration_page_shows_each_script_shape_before_and_after():
    page = (DOCS / "getting-started" / "migrating-from-trl.md").read_text()
    code = "\n".join(m.group(1) for m in FENCE.finditer(page))
    assert code.count("GRPOTrainer(") >= 4 and code.count("AsyncAIPOTrainer(") >= 4
    for shape in ("peft_config=", "tools=[", "environment_factory=", "accuracy_reward"):
        assert shape in code, shape
    assert "accelerate launch --num_machines" in page and "trl vllm-serve" in page
