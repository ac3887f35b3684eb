"""The package surface: light import, public names."""

import subprocess
import sys


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
from hfllamarl.runtime.collector import collector_paused

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
