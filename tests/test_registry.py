"""The plugin registry: built-ins load through entry points; bad names list what is installed."""

import re
from pathlib import Path

import pytest

from hfllamarl import load_plugin
from hfllamarl.registry import GROUPS, PluginError, installed, list_plugins

SETUP = (Path(__file__).resolve().parents[1] / "setup.py").read_text()


def declared_entry_points():
    out = []
    for group in GROUPS.values():
        block = re.search(rf'"{re.escape(group)}": \[(.*?)\]', SETUP, re.S).group(1)
        out += [(group, name) for name in re.findall(r'"(\w+) = ', block)]
    return out


@pytest.mark.parametrize("group,name", declared_entry_points())
def test_every_declared_builtin_is_installed_and_loads(group, name):
    short = {v: k for k, v in GROUPS.items()}[group]
    assert name in installed(short)
    assert load_plugin(short, name) is not None


def test_unknown_name_lists_installed_names():
    with pytest.raises(PluginError) as err:
        load_plugin("rewards", "no_such_reward")
    msg = str(err.value)
    assert "no_such_reward" in msg and "math_sympy" in msg and "gsm8k" in msg


def test_unknown_group():
    with pytest.raises(PluginError, match="groups are"):
        load_plugin("optimizers", "adam")


def test_list_plugins_names_distribution_without_import():
    rows = list_plugins()
    aipo = [r for r in rows if r["group"] == "algorithms" and r["name"] == "aipo"]
    assert aipo and aipo[0]["distribution"] == "hfllamarl" and aipo[0]["version"]
    assert {r["group"] for r in rows} == set(GROUPS)


def test_plugin_whose_import_fails_names_itself_and_its_distribution(monkeypatch):
    from importlib.metadata import EntryPoint

    from hfllamarl import registry

    broken = EntryPoint(name="broken_reward", value="hfllamarl_no_such_module_xyz:fn", group="hfllamarl.rewards")
    monkeypatch.setattr(registry, "installed", lambda group: {"broken_reward": broken})
    registry.load_plugin.cache_clear()
    try:
        with pytest.raises(PluginError, match="'broken_reward' .*hfllamarl_no_such_module_xyz:fn.*failed to import: "
                                              "ModuleNotFoundError"):
            registry.load_plugin("rewards", "broken_reward")
    finally:
        registry.load_plugin.cache_clear()
