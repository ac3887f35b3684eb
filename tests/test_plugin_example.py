"""A third-party plugin distribution (examples/plugin: a reward and an algorithm): pip-installed, listed, loaded and
trained with by name."""

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO, SCRIPTS, run_script, step_logs, tail
from hfllamarl import load_plugin
from hfllamarl.registry import PluginError

EXAMPLE = REPO / "examples" / "plugin"
DIST = "hfllamarl-plugin-example"
PIP_ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def example_module():
    """The example package imported from its source folder, without installing it."""
    spec = importlib.util.spec_from_file_location(
        "hfllamarl_plugin_example_src", EXAMPLE / "hfllamarl_plugin_example" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_declares_its_entry_point_without_dependencies():
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    assert project["name"] == DIST and project["version"] == "0.1.0"
    assert not project.get("dependencies")
    assert project["entry-points"]["hfllamarl.rewards"] == {"last_digit": "hfllamarl_plugin_example:last_digit"}
    assert project["entry-points"]["hfllamarl.algorithms"] == {
        "aipo_seq_mean": "hfllamarl_plugin_example.algorithm:SequenceMeanAIPO"}
    assert project["entry-points"]["hfllamarl.environments"] == {
        "guess_number": "hfllamarl_plugin_example.environment:GuessNumber"}


def test_example_environment_keeps_state_and_scores_itself():
    """TRL's environment contract, with hand values: reset takes the row, the tool answers, get_reward pays."""
    from hfllamarl.contracts import Environment
    from hfllamarl.runtime.agents.environments import probe

    spec = importlib.util.spec_from_file_location("example_environment", EXAMPLE / "hfllamarl_plugin_example" /
                                                  "environment.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env = module.GuessNumber()
    assert isinstance(env, Environment)
    assert env.reset(prompt=[{"role": "user", "content": "go"}], secret=42).startswith(" Find the number")
    assert [env.guess(50), env.guess(25), env.guess(42), env.guess(1)] == ["lower", "higher", "correct",
                                                                           "already found"]
    assert env.get_reward() == pytest.approx(0.8)
    env.reset(prompt="x")
    assert env.get_reward() == 0.0 and 1 <= env.secret <= 100
    kinds, _ = probe({None: module.GuessNumber})
    assert kinds[None].tool_names == ["guess"] and kinds[None].has_reward


def test_example_last_digit_scores_strings_chat_and_none():
    last_digit = example_module().last_digit
    chat = [[{"role": "assistant", "content": "so it is 7"}], [{"role": "assistant", "content": "\\boxed{3}"}]]
    assert last_digit(["p", "p"], chat, answer=["7", "4"]) == [1.0, 0.0]
    assert last_digit(["p"] * 4, ["\\boxed{5}", "no digit", "12", "9"], [[1]] * 4, trainer_state=None,
                      answer=["5", "1", "2", None]) == [1.0, 0.0, 1.0, None]


def test_example_algorithm_follows_the_contract_with_hand_values():
    """Per-sequence mean: sample 0 has 2 tokens, sample 1 has 1; each completion weighs the same."""
    import math

    import torch

    from hfllamarl.contracts import Algorithm

    spec = importlib.util.spec_from_file_location("example_algorithm", EXAMPLE / "hfllamarl_plugin_example" /
                                                  "algorithm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    algo = module.SequenceMeanAIPO(rho=2.0)
    assert isinstance(algo, Algorithm)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -9.0]], requires_grad=True)
    mu = torch.tensor([[-1.0, -3.0], [-0.5, -9.0]])  # ratios 1, e (clipped to 2), 1
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, m = algo.loss(logp, mu, adv, mask)
    expected = -((1.0 * -1.0 + 2.0 * -2.0) / 2 + (-2.0 * 1.0 * -0.5) / 1) / 2
    assert loss.item() == pytest.approx(expected)
    assert m["seq_mean/weight_mean"] == pytest.approx((1 + 2 + 1) / 3) and m["is_ratio/max"] == pytest.approx(math.e)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.5], [1.0, 0.0]]))


def test_unknown_plugin_says_how_to_fix_it():
    # test_registry.py checks that the installed names are listed; this checks the way out is named too.
    with pytest.raises(PluginError) as err:
        load_plugin("rewards", "surely_not_installed")
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "'surely_not_installed'" in msg and "Installed rewards plugins: " in msg and "math_sympy" in msg
    assert "pip install" in msg and "hfllamarl plugins list" in msg


def _installed(name: str) -> bool:
    """Whether distribution `name` is installed, asked in a new process (this one caches metadata)."""
    probe = "import importlib.metadata, sys; importlib.metadata.version(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", probe, name], capture_output=True).returncode == 0


@pytest.mark.slow
def test_pip_installed_plugin_is_listed_loaded_and_trains_by_name(tiny_model, tmp_path):
    # Install from a copy, so the build leaves nothing (build/, *.egg-info) in the repository.
    src = tmp_path / "plugin"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    was_installed = _installed(DIST)
    try:
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", str(src)],
                             capture_output=True, text=True, env=PIP_ENV, timeout=300)
        assert pip.returncode == 0, tail(pip)

        # New processes: entry points are read at start-up and load_plugin caches per process.
        listed = subprocess.run([sys.executable, "-m", "hfllamarl.cli", "plugins", "list"], capture_output=True,
                                text=True, timeout=120)
        assert listed.returncode == 0, tail(listed)
        rows = [line.split() for line in listed.stdout.splitlines()]
        assert ["rewards", "last_digit", DIST, "0.1.0", "hfllamarl_plugin_example:last_digit"] in rows, listed.stdout
        assert ["algorithms", "aipo_seq_mean", DIST, "0.1.0", "hfllamarl_plugin_example.algorithm:SequenceMeanAIPO"] \
            in rows, listed.stdout
        assert ["environments", "guess_number", DIST, "0.1.0", "hfllamarl_plugin_example.environment:GuessNumber"] \
            in rows, listed.stdout

        load = subprocess.run([sys.executable, "-c", (
            "from hfllamarl import load_plugin\n"
            "f = load_plugin('rewards', 'last_digit')\n"
            "print(f.__module__, f.__name__, f(['p'], ['\\\\boxed{4}'], answer=['4']))\n"
            "env = load_plugin('environments', 'guess_number')()\n"
            "env.reset(secret=3)\n"
            "print(type(env).__name__, env.guess(3), env.get_reward())")],
            capture_output=True, text=True, timeout=120)
        assert load.returncode == 0, tail(load)
        assert "hfllamarl_plugin_example last_digit [1.0]" in load.stdout.splitlines(), tail(load)
        assert "GuessNumber correct 1.0" in load.stdout.splitlines(), tail(load)

        proc = run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, str(tmp_path / "run"), "--steps", "2",
                           "--reward", "last_digit", "--algorithm", "aipo_seq_mean", "--report-to", "none"],
                          timeout=400)
        assert proc.returncode == 0, tail(proc)
        assert "TRAINED global_step=2" in proc.stdout
        steps = step_logs(proc.stdout)
        assert len(steps) == 2
        for h in steps:
            assert "rewards/last_digit/mean" in h and "rewards/math_sympy/mean" not in h, h
            assert 0.0 <= h["rewards/last_digit/mean"] <= 1.0
            # the algorithm's own metric reaches the logs untouched, next to the core's
            assert 0 < h["seq_mean/weight_mean"] <= 4.0 and "is_ratio/mean" in h, h  # rho = 4
    finally:
        if not was_installed:
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", DIST], capture_output=True, env=PIP_ENV,
                           timeout=300)
    assert _installed(DIST) == was_installed
