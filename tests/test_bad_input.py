"""Bad input gets a clear error before any process starts."""

import os
import subprocess
import sys

import pytest
from datasets import Dataset

from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
from hfllamarl.registry import PluginError
from hfllamarl.testing.tiny import successor_rows

from conftest import REPO


@pytest.fixture
def config(tmp_path):
    return AsyncAIPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                           max_completion_length=4, report_to="none", max_steps=2)


@pytest.fixture
def data():
    return Dataset.from_list(successor_rows(16))


def test_unknown_reward_plugin_lists_installed(tiny_model, config, data):
    with pytest.raises(PluginError, match="No rewards plugin named 'mathh'.*Installed rewards plugins: .*math_sympy"):
        AsyncAIPOTrainer(tiny_model, reward_funcs="mathh", args=config, train_dataset=data)


def test_unknown_algorithm_and_weight_sync(tiny_model, tmp_path, data):
    for kw, match in [({"algorithm": "ppo2"}, "No algorithms plugin named 'ppo2'"),
                      ({"weight_sync_backend": "carrier_pigeon"}, r"No weight_sync plugin named 'carrier_pigeon'\. "
                                                                  "Installed"),  # (nothing close: no guess)
                      ({"weight_sync_backend": "NCCL-DDMA"}, "No weight_sync plugin named 'NCCL-DDMA'. Did you mean "
                                                             "nccl_ddma\\? Installed weight_sync plugins: ")]:
        with pytest.raises(PluginError, match=match):  # refused with the config, before anything starts
            AsyncAIPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                            report_to="none", **kw)


def test_dataset_without_prompt_column(tiny_model, config):
    ds = Dataset.from_dict({"question": ["1+1="], "answer": ["2"]})
    with pytest.raises(ValueError, match="needs a `prompt` column.*rename_column"):
        AsyncAIPOTrainer(tiny_model, reward_funcs="math_sympy", args=config, train_dataset=ds)


def test_a_streamed_dataset_is_explained(tiny_model, config, data):
    with pytest.raises(ValueError, match="IterableDataset .streamed., which is not supported.*without streaming=True"):
        AsyncAIPOTrainer(tiny_model, reward_funcs="math_sympy", args=config, train_dataset=data.to_iterable_dataset())


def test_prompt_longer_than_context(tiny_model, config):
    ds = Dataset.from_dict({"prompt": ["1+1=", "9" * 200], "answer": ["2", "0"]})
    with pytest.raises(ValueError, match="Row 1 .*exceeds the model's context of 128"):
        AsyncAIPOTrainer(tiny_model, reward_funcs="math_sympy", args=config, train_dataset=ds)


def test_model_path_that_does_not_exist(config, data, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AsyncAIPOTrainer(str(tmp_path / "no_model"), reward_funcs="math_sympy", args=config, train_dataset=data)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        AsyncAIPOTrainer(str(tmp_path / "empty"), reward_funcs="math_sympy", args=config, train_dataset=data)


def test_unsupported_trainer_arguments(tiny_model, config, data):
    with pytest.raises(ValueError, match="eval_dataset"):
        AsyncAIPOTrainer(tiny_model, reward_funcs="math_sympy", args=config, train_dataset=data, eval_dataset=data)
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        AsyncAIPOTrainer(tiny_model, reward_funcs="math_sympy", args=config)
    with pytest.raises(TypeError, match="must be an AsyncAIPOConfig"):
        from trl import GRPOConfig

        AsyncAIPOTrainer(tiny_model, reward_funcs="math_sympy", train_dataset=data,
                         args=GRPOConfig(output_dir="/tmp/x", use_cpu=True, report_to="none"))


def test_an_evaluation_metric_that_does_not_exist_here_is_refused(tiny_model, tmp_path, data):
    config = AsyncAIPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                             max_completion_length=4, report_to="none", max_steps=2, eval_strategy="steps",
                             eval_steps=1, metric_for_best_model="eval_loss")
    with pytest.raises(ValueError, match="metric_for_best_model='eval_loss': an evaluation here .* with no loss"):
        AsyncAIPOTrainer(tiny_model, reward_funcs="math_sympy", args=config, train_dataset=data, eval_dataset=data)
    ds = Dataset.from_list([dict(r, image=None) for r in successor_rows(16)])
    with pytest.raises(ValueError, match="'image' column: image prompts"):
        AsyncAIPOTrainer(tiny_model, reward_funcs="math_sympy", args=AsyncAIPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
            report_to="none", max_steps=2), train_dataset=ds)


def test_single_process_accelerate_launch_is_detected(tmp_path):
    """`accelerate launch --num_processes 2` without a GPU starts one process: say how to launch instead."""
    script = tmp_path / "s.py"
    script.write_text("from hfllamarl import AsyncAIPOConfig\nAsyncAIPOConfig(output_dir='/tmp/x', report_to='none')\n")
    # The parent's command line is what accelerate's simple launcher leaves behind.
    parent = ("import subprocess, sys; sys.exit(subprocess.call([sys.executable, sys.argv[1]]))")
    env = dict(os.environ, ACCELERATE_USE_CPU="False")
    proc = subprocess.run([sys.executable, "-c", parent, str(script), "--num_processes", "2"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=str(REPO))
    assert proc.returncode != 0
    assert "started a single process" in proc.stderr and "--multi_gpu --num_processes 2" in proc.stderr
