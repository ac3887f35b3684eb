"""The extension points are written down: every entry-point group, every method of each contract and every
built-in plugin is documented on the docs site's plugins page (a plugin author reads that, not the code), and
every built-in plugin follows its contract."""

import inspect
import re
from importlib.metadata import entry_points

import pytest

from conftest import REPO
from hfllamarl import contracts, load_plugin
from hfllamarl.registry import GROUPS

CONTRACTS = {"rewards": contracts.RewardFunction, "algorithms": contracts.Algorithm,
             "weight_sync": contracts.WeightSyncBackend, "environments": contracts.Environment,
             "corrections": contracts.OffPolicyCorrection}


def plugins_section() -> str:
    """The plugins page up to its "Publishing" section: the contracts and the built-ins."""
    page = (REPO / "docs" / "guides" / "plugins.md").read_text()
    return re.search(r"^# Plugins\n(.*?)^## Publishing", page, re.S | re.M).group(1)


def built_ins(group: str) -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUPS[group]) if ep.value.startswith("hfllamarl."))


def public_members(cls) -> list[str]:
    return [name for name, member in vars(cls).items()
            if not name.startswith("_") and (callable(member) or isinstance(member, property))]


def test_every_group_has_a_contract_and_is_documented():
    section = plugins_section()
    assert set(CONTRACTS) == set(GROUPS)
    for group, cls in CONTRACTS.items():
        assert f"`{GROUPS[group]}`" in section, group
        assert f"**`{cls.__name__}`**" in section, cls.__name__


@pytest.mark.parametrize("group", sorted(CONTRACTS))
def test_every_contract_method_is_documented(group):
    section = plugins_section()
    members = public_members(CONTRACTS[group])
    if group == "rewards":
        assert "fn(prompts, completions" in section and "stats()" in section
    elif group == "corrections":  # (a callable: its one method is __call__)
        assert "`correction(old_logprobs, behavior_logprobs, mask, staleness)`" in section and "`level`" in section
    else:
        assert members
    for name in members:
        assert f"`{name}(" in section or f"`{name}`" in section, f"{CONTRACTS[group].__name__}.{name}"


def test_every_algorithm_option_is_documented():
    section = plugins_section()
    for option, field in contracts.ALGORITHM_OPTIONS.items():
        assert f"`{option}`" in section, option
        assert option == field or f"`{field}`" in section, field


@pytest.mark.parametrize("group", sorted(CONTRACTS))
def test_every_built_in_plugin_is_documented_and_follows_its_contract(group):
    section = plugins_section()
    names = built_ins(group)
    assert names, group
    for name in names:
        assert f"`{name}`" in section, f"{group}: {name}"
        plugin = load_plugin(group, name)
        if group == "algorithms":
            assert isinstance(plugin(), contracts.Algorithm), name
            assert "ref_logprobs" in inspect.signature(plugin.loss).parameters, name
            assert not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(plugin).parameters.values()), \
                f"{name} swallows options it does not use"
        elif group == "weight_sync":
            assert issubclass(plugin, contracts.WeightSyncBackend), name
        elif group == "environments":
            assert isinstance(plugin(), contracts.Environment), name
            assert "get_reward" in section
        elif group == "corrections":
            assert isinstance(plugin(), contracts.OffPolicyCorrection), name
            assert plugin().level in ("token", "sequence") and "step_scale(" in section
        else:
            assert isinstance(plugin, contracts.RewardFunction), name
