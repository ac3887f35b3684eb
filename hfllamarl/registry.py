"""Plugin registry: every extension point is a Python entry-point group.

Built-ins register through `setup.py` exactly like third-party plugins, so `load_plugin`
treats both the same way. Loading happens in every process that needs a plugin (the trainer
and the generator processes each call it), and is cached per process.
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points

#: Entry-point group of each extension point, by the short name `load_plugin` takes.
GROUPS = {
    "rewards": "hfllamarl.rewards",
    "algorithms": "hfllamarl.algorithms",
    "weight_sync": "hfllamarl.weight_sync",
    "environments": "hfllamarl.environments",
    "corrections": "hfllamarl.corrections",
}


class PluginError(ValueError):
    """A plugin name that is not installed, or a plugin that failed to import."""


def _group(group: str) -> str:
    if group not in GROUPS:
        raise PluginError(f"Unknown plugin group {group!r}; the groups are {sorted(GROUPS)}.")
    return GROUPS[group]


def installed(group: str) -> dict[str, EntryPoint]:
    """Entry points installed in `group` ("rewards", "algorithms", "weight_sync", "environments",
    "corrections"), by name."""
    return {ep.name: ep for ep in entry_points(group=_group(group))}


def _distribution(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"], dist.version


def list_plugins() -> list[dict[str, str]]:
    """Every installed plugin as `{group, name, value, distribution, version}`, without importing it."""
    rows = []
    for short in GROUPS:
        for name, ep in sorted(installed(short).items()):
            dist, version = _distribution(ep)
            rows.append(
                {"group": short, "name": name, "value": ep.value, "distribution": dist, "version": version}
            )
    return rows


def did_you_mean(name: str, choices, n: int = 2) -> str:
    """` Did you mean a or b?` for the choices closest to a misspelt `name` (case and `-`/`_` ignored), or ''."""
    import difflib

    def norm(text: str) -> str:
        return text.lower().replace("-", "_")

    by_norm = {norm(c): c for c in sorted(choices)}
    close = difflib.get_close_matches(norm(name), list(by_norm), n=n, cutoff=0.6)
    return f" Did you mean {' or '.join(by_norm[c] for c in close)}?" if close else ""


@functools.lru_cache(maxsize=None)
def load_plugin(group: str, name: str):
    """Return the object the entry point `name` in group `hfllamarl.<group>` names.

    Args:
        group: "rewards", "algorithms", "weight_sync", "environments" or "corrections".
        name: the entry-point name, e.g. "math_sympy" or "aipo".

    Raises:
        PluginError: `name` is not installed (the message lists the installed names), or the
            plugin's module failed to import (the message names the plugin and its distribution).
    """
    eps = installed(group)
    if name not in eps:
        names = ", ".join(sorted(eps)) or "(none)"
        raise PluginError(
            f"No {group} plugin named {name!r}.{did_you_mean(name, eps)} Installed {group} plugins: {names}. "
            f"Install the distribution that provides it (`pip install ...`) or fix the name; "
            f"`hfllamarl plugins list` shows everything installed."
        )
    ep = eps[name]
    try:
        return ep.load()
    except Exception as exc:  # one broken plugin must say who it is
        dist, version = _distribution(ep)
        raise PluginError(
            f"The {group} plugin {name!r} ({ep.value}, from distribution {dist} {version}) "
            f"failed to import: {type(exc).__name__}: {exc}"
        ) from exc
