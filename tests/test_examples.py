"""Every shipped example config loads and is valid; the CLI lists plugins; `accelerate launch` works."""

import glob
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, SCRIPTS, run_script, tail

CONFIGS = sorted(glob.glob(str(REPO / "examples" / "accelerate" / "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS)
def test_accelerate_configs_are_valid(path):
    from accelerate.commands.config.config_args import load_config_from_file

    data = yaml.safe_load(open(path))
    cfg = load_config_from_file(path)  # accelerate's own loader and checks
    assert cfg.num_processes >= 2  # at least one trainer and one generator
    if data["distributed_type"] == "FSDP":
        assert str(data["fsdp_config"]["fsdp_version"]) == "2"


def test_cli_plugins_list():
    out = subprocess.run([sys.executable, "-m", "hfllamarl.cli", "plugins", "list"], capture_output=True, text=True,
                         check=True).stdout
    assert "algorithms" in out and "aipo" in out and "math_sympy" in out and "broadcast" in out
    assert "hfllamarl" in out  # the distribution column


@pytest.mark.slow
def test_accelerate_launch_fsdp2_config_two_trainers(tiny_model, tmp_path):
    """The FSDP2 config: 3 processes, 2 trainer ranks sharding the policy, 1 generator."""
    proc = run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, str(tmp_path / "acc"), "--steps", "2",
                       "--report-to", "none"], nproc=3, timeout=400,
                      launcher=f"accelerate --config_file {REPO / 'examples' / 'accelerate' / 'fsdp2.yaml'}")
    assert proc.returncode == 0, tail(proc)
    assert "TRAINED global_step=2" in proc.stdout
