"""The configuration reference: every field `AsyncAIPOConfig` adds to `GRPOConfig`, read from its source with `ast`.

Reading the source (not importing it) keeps the docs build free of torch, transformers and TRL. A field without
`metadata={"help": ...}` stops the build with its name: the page is the field's only documentation.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

CLASS_NAME = "AsyncAIPOConfig"

# Sections of the page, in order. A field not named here is still listed, under "Other settings", so that a new
# field never breaks the build for want of a section (only for want of help text).
GROUPS: dict[str, tuple[str, ...]] = {
    "Processes and generator replicas": (
        "num_generator_processes", "generator_tensor_parallel_size", "vllm_data_parallel_size", "generator_failure"),
    "Off-policy training and the algorithm": (
        "algorithm", "max_staleness", "partial_rollout_tokens", "aipo_rho", "scale_rewards"),
    "The generator's vLLM engine": (
        "generator_dtype", "generator_quantization", "generator_kv_cache_bytes", "generator_enforce_eager"),
    "Weight sync": ("weight_sync_backend", "verify_weight_sync"),
    "Batches": ("drop_zero_variance_groups", "dynamic_sampling_extra_prompts", "padding_free",
                "share_prompts", "skip_flat_backward", "skip_flat_rows"),
    "Tool calls and agentic rollouts": ("tool_call_timeout_s", "max_tool_calls_per_turn", "rollout_time_budget_s"),
    "Failures and timeouts": ("collective_timeout_s", "reward_errors"),
}
OTHER = "Other settings"


class MissingHelpError(ValueError):
    """A config field has no help text, so the configuration reference cannot document it."""


@dataclass(frozen=True)
class ConfigField:
    """One dataclass field as written in the source."""

    name: str
    type: str
    default: str
    help: str
    line: int


def _field_call(value: ast.expr | None) -> ast.Call | None:
    """The `field(...)` call a dataclass attribute is assigned, if it is one."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) == "field":
        return value
    return None


def _help_of(call: ast.Call | None) -> str | None:
    """The constant string under metadata={"help": ...}, or None."""
    for kw in call.keywords if call else ():
        if kw.arg == "metadata" and isinstance(kw.value, ast.Dict):
            for key, value in zip(kw.value.keys, kw.value.values):
                if isinstance(key, ast.Constant) and key.value == "help":
                    if isinstance(value, ast.Constant) and isinstance(value.value, str):
                        return " ".join(value.value.split())
    return None


def _default_of(assign: ast.AnnAssign, call: ast.Call | None) -> str:
    """The default as written: `default=`, `default_factory=` (shown as a call) or the plain value."""
    if call is None:
        return ast.unparse(assign.value) if assign.value is not None else "(required)"
    for kw in call.keywords:
        if kw.arg == "default":
            return ast.unparse(kw.value)
        if kw.arg == "default_factory":
            return f"{ast.unparse(kw.value)}()"
    return "(required)"


def read_fields(source: str, path: str = "trainers/config.py", class_name: str = CLASS_NAME) -> list[ConfigField]:
    """The fields a dataclass declares in its own body, in source order.

    Args:
        source: Python source holding the class.
        path: Where the source lives, for error messages.
        class_name: The dataclass to read.

    Returns:
        One `ConfigField` per annotated attribute of the class body.

    Raises:
        MissingHelpError: A field has no `metadata={"help": "..."}` (the message names every such field).
        LookupError: The class is not in the source.
    """
    tree = ast.parse(source, filename=path)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise LookupError(f"class {class_name} not found in {path}; update docs/hooks/config_page.py if it moved")
    found, missing = [], []
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        if "ClassVar" in ast.unparse(node.annotation):
            continue
        call = _field_call(node.value)
        text = _help_of(call)
        if not text:
            missing.append(f"{node.target.id} ({path}:{node.lineno})")
            continue
        found.append(ConfigField(node.target.id, ast.unparse(node.annotation), _default_of(node, call), text,
                                 node.lineno))
    if missing:
        raise MissingHelpError(
            f"{class_name} fields without help text: {', '.join(missing)}. Give each one "
            f'field(default=..., metadata={{"help": "what it does, its units, what None means"}}): the '
            "configuration reference is generated from it.")
    return found


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def render(fields: list[ConfigField], inherited: set[str] = frozenset()) -> str:
    """The configuration reference page in markdown.

    Args:
        fields: The fields, as `read_fields` returns them.
        inherited: Names that redefine a `GRPOConfig` field (marked so on the page).

    Returns:
        The page's markdown.
    """
    by_name = {f.name: f for f in fields}
    grouped = {title: [by_name[n] for n in names if n in by_name] for title, names in GROUPS.items()}
    placed = {f.name for group in grouped.values() for f in group}
    grouped[OTHER] = [f for f in fields if f.name not in placed]
    lines = [
        "# Configuration reference",
        "",
        "`AsyncAIPOConfig` is TRL's `GRPOConfig` plus the settings of an asynchronous job. Every `GRPOConfig` field",
        "keeps its name and meaning; what this runtime does with each one is on the",
        "[TRL fields](trl-fields.md) page. The fields it adds are below.",
        "",
        '!!! note "Generated"',
        "    This page is generated from `trainers/config.py` (each field's `metadata[\"help\"]`) when the site is",
        "    built. A field without help text fails the build.",
        "",
    ]
    for title, group in grouped.items():
        if not group:
            continue
        lines += [f"## {title}", "", "| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
        for f in group:
            note = " *(redefines GRPOConfig's field with another default)*" if f.name in inherited else ""
            lines.append(f"| `{f.name}` | `{_cell(f.type)}` | `{_cell(f.default)}` | {_cell(f.help)}{note} |")
        lines.append("")
    return "\n".join(lines)
