"""The package surface: light import, public names."""

import subprocess
import sys
from pathlib import Path


def test_import_is_light_and_public_names_exist():
    # (the collector, paused while the trainer's modules are imported, is left as the user had it: on, or off)
    code = ("import gc, sys, hfllamarl; assert 'vllm' not in sys.modules and 'transformers' not in sys.modules;"
            "from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer, load_plugin;"
            "assert 'vllm' not in sys.modules and gc.isenabled(); gc.disable();"
            "from hfllamarl import AsyncAIPOConfig; assert not gc.isenabled(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_only_hfllamarl_is_a_top_level_name(tmp_path):
    code = ("import importlib.util as u;"
            "assert u.find_spec('hfllamarl.plugins.rewards.math_sympy') and u.find_spec('hfllamarl.trainers.config');"
            "assert u.find_spec('plugins') is None and u.find_spec('trainers') is None; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_collector_paused_while_a_generator_starts_is_restored_and_its_garbage_collected():
    code = """
import gc, weakref
from hfllamarl.runtime.world.collector import collector_paused

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

for enabled in (True, False):
    gc.enable() if enabled else gc.disable()
    with collector_paused():
        assert not gc.isenabled()
        ref = cycle()
        gc.collect(0)  # (an explicit collection still runs: only the automatic ones are paused)
        ref = cycle()
    assert ref() is None and gc.isenabled() is enabled and gc.get_freeze_count() > 0
    frozen = gc.get_freeze_count()
    with collector_paused(freeze=False):  # (the user's process: paused, nothing frozen)
        assert not gc.isenabled()
        ref, kept = cycle(), [Node() for _ in range(100)]
    assert gc.isenabled() is enabled and gc.get_freeze_count() <= frozen  # (a frozen object may die meanwhile)
    gc.collect()
    assert ref() is None
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# The runtime's layers, bottom first, as ARCHITECTURE.md draws them; the two sides never import each other.
LAYERS = ["world", "loop", "weights", "data", "agents", "generation", "training"]
PUBLIC = {"hfllamarl", "hfllamarl.contracts", "hfllamarl.corrections", "hfllamarl.losses", "hfllamarl.policy_loss",
          "hfllamarl.registry",
          "hfllamarl.weight_sync", "hfllamarl.sandbox"}
ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path, relative_allowed: bool = True):
    """Every module a file imports (module level and inside functions), as absolute dotted names."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 or relative_allowed, f"{path.relative_to(ROOT)}: relative import"
            if node.level == 0 and node.module:
                out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_each_runtime_layer_imports_only_the_layers_below_it():
    runtime = ROOT / "hfllamarl" / "runtime"
    wrong = []
    for layer in LAYERS:
        for path in sorted((runtime / layer).glob("*.py")):
            where = path.relative_to(ROOT)
            for module in _imports(path, relative_allowed=False):
                parts = module.split(".")
                if parts[0] != "hfllamarl" or len(parts) < 2:
                    continue
                if parts[1] in ("commands", "testing", "trainers", "plugins", "cli"):
                    wrong.append(f"{where} imports {module} (the runtime never imports what sits around it)")
                elif parts[1] == "runtime" and len(parts) > 2 and parts[2] in LAYERS:
                    other = parts[2]
                    if LAYERS.index(other) > LAYERS.index(layer) or {layer, other} == {"generation", "training"}:
                        wrong.append(f"{where} ({layer}) imports {module} ({other})")
    assert not wrong, "\n".join(wrong)
    assert sorted(d.name for d in runtime.iterdir() if not d.name.startswith(("_", "."))) == sorted(LAYERS)


def test_plugins_import_only_the_public_core():
    wrong = []
    for path in sorted((ROOT / "plugins").rglob("*.py")):
        for module in _imports(path):
            if module.startswith("hfllamarl.") and not module.startswith("hfllamarl.plugins") and not any(
                    module == p or module.startswith(p + ".") and p != "hfllamarl" for p in PUBLIC):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)
