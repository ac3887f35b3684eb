"""The documentation site: the generated reference pages are complete, and the site builds with --strict."""

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ROOT / "docs" / "hooks"


def _load(name):
    """A generator module from docs/hooks/ (it is not a package: mkdocs loads the hook by path)."""
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", HOOKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


config_page = _load("config_page")
trl_fields_page = _load("trl_fields_page")


def _sections(markdown):
    """{level-2 heading: its text} of a page."""
    parts = re.split(r"^## (.+)$", markdown, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_configuration_page_lists_every_field_the_config_adds_with_its_help():
    from trl import GRPOConfig

    from hfllamarl import AsyncAIPOConfig

    source = (ROOT / "trainers" / "config.py").read_text()
    page = config_page.render(config_page.read_fields(source))
    own = [f for f in dataclasses.fields(AsyncAIPOConfig)
           if f.name not in {g.name for g in dataclasses.fields(GRPOConfig)}
           or f.default != {g.name: g for g in dataclasses.fields(GRPOConfig)}[f.name].default]
    assert len(own) >= 20  # the reference: what the imported class declares beyond (or unlike) GRPOConfig
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| .*? \| `(.*?)` \| ", page, flags=re.M)}
    for f in own:
        assert f.name in rows, f"{f.name} missing from the configuration page"
        assert rows[f.name] == repr(f.default), (f.name, rows[f.name])
        help_text = " ".join(f.metadata["help"].split()).replace("|", "\\|")
        assert help_text in page, f"{f.name}'s help text is not on the page"


def test_trl_fields_page_gives_every_grpo_config_field_one_status():
    from trl import GRPOConfig

    page = trl_fields_page.render(trl_fields_page.load_tables(ROOT / "trainers" / "config_fields.py"))
    sections = _sections(page)
    statuses = ("Honoured", "Unsupported", "Not read here")
    assert set(statuses) <= set(sections)
    # The fields each status names: Honoured lists them in its second column, the others one per row in the first
    # (their reasons may name other fields).
    named = {"Honoured": set(re.findall(r"`(\w+)`", "".join(re.findall(r"^\|[^|`]*\|(.*)\|$", sections["Honoured"],
                                                                         flags=re.M))))}
    named.update({s: set(re.findall(r"^\| `(\w+)` \|", sections[s], flags=re.M)) for s in statuses[1:]})
    for f in dataclasses.fields(GRPOConfig):
        found = [s for s in statuses if f.name in named[s]]
        assert len(found) == 1, f"GRPOConfig.{f.name} has status {found or 'none'} on the TRL fields page"


def test_unsupported_fields_carry_their_reason_on_the_page():
    page = trl_fields_page.render(trl_fields_page.load_tables(ROOT / "trainers" / "config_fields.py"))
    # A reason written by hand here, as config_fields.py states it for vllm_mode.
    assert ("| `vllm_mode` | generator ranks embed vLLM in-process (num_generator_processes); there is no vLLM "
            "server or colocate mode |") in _sections(page)["Unsupported"]


SYNTHETIC = '''
from dataclasses import dataclass, field

@dataclass
class AsyncAIPOConfig(GRPOConfig):
    """Docstring."""

    documented: int = field(default=3, metadata={"help": "A  documented | field."})
    undocumented: float = field(default=0.5)
    plain: bool = False
'''


def test_a_field_without_help_fails_the_generator_naming_it():
    with pytest.raises(config_page.MissingHelpError) as error:
        config_page.read_fields(SYNTHETIC, "config.py")
    message = str(error.value)
    assert "undocumented (config.py:9)" in message and "plain (config.py:10)" in message
    assert "documented (" not in message.replace("undocumented (", "")


def test_a_documented_synthetic_field_renders_with_type_default_and_help():
    fields = config_page.read_fields(SYNTHETIC.replace("    undocumented: float = field(default=0.5)\n", "")
                                     .replace("    plain: bool = False\n", ""))
    page = config_page.render(fields)
    assert "| `documented` | `int` | `3` | A documented \\| field. |" in page
    assert "## Other settings" in page  # a field no group names is still listed


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
                    reason="mkdocs is not installed here (pip install -r docs/requirements.txt)")
def test_site_builds_strict_without_importing_torch_or_vllm(tmp_path):
    # In a fresh interpreter: the build must pass --strict and must not have imported the heavy stack.
    script = (
        "import sys\n"
        "from mkdocs.commands.build import build\n"
        "from mkdocs.config import load_config\n"
        f"config = load_config(config_file={str(ROOT / 'mkdocs.yml')!r}, strict=True, site_dir={str(tmp_path)!r})\n"
        "build(config)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers', 'trl'))\n"
        "assert not heavy, f'the docs build imported {heavy[:5]}'\n"
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "reference" / "configuration" / "index.html").is_file()
    html = (tmp_path / "reference" / "trl-fields" / "index.html").read_text()
    assert "vllm_server_base_url" in html
    # Offline: no page loads a script, a style sheet or a font from the network; formulas are MathML, diagrams SVG.
    import re

    for page in tmp_path.rglob("*.html"):
        text = page.read_text()
        remote = re.findall(r'<(?:script|link)[^>]*(?:src|href)="(?:https?:)?//[^"]*"', text)
        assert not [r for r in remote if "rel=\"canonical\"" not in r], (page, remote[:3])
        assert "sequenceDiagram" not in text and "flowchart LR" not in text, page
    algorithms = (tmp_path / "guides" / "algorithms" / "index.html").read_text()
    assert algorithms.count("<math") > 20 and "\\(" not in algorithms and "$$" not in algorithms
    concepts = (tmp_path / "concepts" / "index.html").read_text()
    assert "img/loop-tick.svg" in concepts and (tmp_path / "img" / "loop-tick.svg").is_file()


def test_the_diagrams_on_the_pages_are_what_their_script_draws(tmp_path):
    diagrams = _load("diagrams")
    diagrams.main(str(tmp_path))
    for name in diagrams.DIAGRAMS:
        assert (tmp_path / name).read_text() == (ROOT / "docs" / "img" / name).read_text(), (
            f"docs/img/{name} is not what docs/hooks/diagrams.py draws: run python docs/hooks/diagrams.py")
