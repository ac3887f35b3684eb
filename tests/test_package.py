"""The package surface: light import, public names."""

import subprocess
import sys


def test_import_is_light_and_public_names_exist():
    code = ("import sys, hfllamarl; assert 'vllm' not in sys.modules and 'transformers' not in sys.modules;"
            "from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer, load_plugin;"
            "assert 'vllm' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_only_hfllamarl_is_a_top_level_name(tmp_path):
    code = ("import importlib.util as u;"
            "assert u.find_spec('hfllamarl.plugins.rewards.math_sympy') and u.find_spec('hfllamarl.trainers.config');"
            "assert u.find_spec('plugins') is None and u.find_spec('trainers') is None; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
