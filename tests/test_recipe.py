"""`hfllamarl train --config`: --check names each kind of bad input (in-process, nothing started); the demo recipe
trains end to end from the command line."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, tail

from hfllamarl import cli


@pytest.fixture
def job(tmp_path, tiny_model):
    """A valid recipe (YAML) over a small GSM8K-shaped JSONL, and a runner of `hfllamarl train ... --check`."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{a}+1?", "answer": f"#### {a + 1}"}) + "\n" for a in range(4)))
    recipe = {"model_name_or_path": tiny_model, "dataset_name": str(rows), "prompt_column": "question",
              "reward_funcs": ["gsm8k"], "output_dir": str(tmp_path / "out"), "learning_rate": "1e-3"}

    def check(*flags, **changes):
        data = {**recipe, **changes}
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump({k: v for k, v in data.items() if v is not None}))
        return cli.main(["train", "--config", str(path), "--check", *flags])

    return check


def test_a_valid_recipe_passes_and_yaml_values_get_their_field_types(job, capsys):
    assert job() == 0
    out = capsys.readouterr().out
    assert "recipe OK" in out and "4 rows" in out and "rewards: gsm8k" in out
    assert "'0+1?'" in out  # row 0's question is the prompt, as text


@pytest.mark.parametrize("flags, changes, expected", [
    ((), {"learnin_rate": 0.1}, "'learnin_rate' is not a recipe field. Did you mean learning_rate"),
    (("--num_generatons", "2"), {}, "'num_generatons' is not a recipe field. Did you mean num_generations"),
    ((), {"learning_rate": "fast"}, "learning_rate: 'fast' is not a valid float"),
    ((), {"max_steps": 2.5}, "max_steps: expected a whole number, got 2.5"),
    ((), {"lr_scheduler_type": "cosine_wobble"}, "lr_scheduler_type: 'cosine_wobble' is not one of"),
    (("--per_device_train_batch_size", "many"), {}, "per-device-train-batch-size: invalid int value: 'many'"),
    ((), {"prompt_column": "problem"}, "prompt_column is ['problem'], not a column of the data set"),
    ((), {"prompt_column": None, "prompt_template": "{question} in {units}"},
     "prompt_template reads ['units'], not a column"),
    ((), {"reward_funcs": ["gsm8kk"]}, "no reward plugin named 'gsm8kk'. Did you mean gsm8k? Installed reward "
                                       "plugins: boxed_format, gsm8k, length, math_sympy"),
    ((), {"dataset_name": "no/such/file.jsonl"}, "dataset_name 'no/such/file.jsonl': no such file or directory"),
    ((), {"model_name_or_path": "./missing-model"}, "model_name_or_path './missing-model': not a model directory"),
    ((), {"dataset_train_split": "validation"}, "dataset_train_split='validation'"),
    ((), {"reward_funcs": ["os.path:no_such_function"]}, "module 'os.path' has no 'no_such_function'"),
    ((), {"trainer_tensor_parallel_size": 3, "num_processes": 4}, "attention heads do not split evenly over 3 ranks"),
    ((), {"num_generator_processes": 8, "num_processes": 9}, "which do not split over generator_tensor_parallel_size=8"),
])
def test_check_names_each_bad_input(job, capsys, flags, changes, expected):
    assert job(*flags, **changes) == 2
    err = capsys.readouterr().err
    assert expected in err, err


def test_a_missing_reward_column_is_named(job, capsys, tmp_path):
    """math_sympy reads the gold from an `answer` column: renamed away, --check says so (the plugin's own words)."""
    assert job(rename_columns={"answer": "gold"}, reward_funcs=["math_sympy"]) == 2
    err = capsys.readouterr().err
    assert "reward function 'math_sympy' fails on row 0" in err and "needs an `answer` column" in err, err


def test_prompt_template_and_chat_build_the_messages(job, capsys):
    assert job(prompt_column=None, prompt_template="Q: {question} \\boxed{}", chat=True, system_prompt="Be brief.") == 0
    out = capsys.readouterr().out
    assert "[{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Q: 0+1? \\\\boxed{}'}]" in out, out


def test_demo_recipe_trains_end_to_end(tmp_path):
    """The one-command demo: `hfllamarl train --config examples/recipes/demo_cpu.yaml`, 2 steps, from an empty
    directory (the recipe's builder makes the model and the data there)."""
    exe = os.path.join(os.path.dirname(sys.executable), "hfllamarl")
    proc = subprocess.run([exe, "train", "--config", str(REPO / "examples" / "recipes" / "demo_cpu.yaml"),
                           "--max_steps", "2"], cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc)
    steps = [line for line in proc.stdout.splitlines() if line.startswith("{'reward'")]
    assert len(steps) == 2, tail(proc)  # one log line per optimizer step (logging_steps: 1)
    out = tmp_path / "outputs" / "demo_cpu"
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert (tmp_path / "outputs" / "demo_cpu-data" / "successor.jsonl").exists()


def test_a_recipe_written_for_trls_cli_checks_here(job, capsys, tmp_path):
    """TRL's `datasets:` mixture (loaded by TRL's own get_dataset: two local files, fractions) and the reward names
    `trl grpo` takes without a path: --check loads 4 rows (2 of each, as the fractions say) and scores row 0 with
    TRL's functions."""
    for name, count in (("a", 4), ("b", 2)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(
            {"prompt": [{"role": "user", "content": f"{name}{k}: 1+1?"}], "solution": "$2$"}) + "\n"
            for k in range(count)))
    mixture = [{"path": "json", "data_files": str(tmp_path / f"{n}.jsonl"), "fraction": 0.5} for n in ("a", "b")]
    assert job(dataset_name=None, prompt_column=None, datasets=mixture,
               reward_funcs=["think_format_reward", "get_soft_overlong_punishment"]) == 0
    out = capsys.readouterr().out
    assert "recipe OK" in out and "4 rows" in out and "think_format_reward" in out, out
    assert job(dataset_name=None, prompt_column=None, datasets=mixture, streaming=True) == 2
    assert "streaming: true" in capsys.readouterr().err
    assert job(reward_funcs=["accuracy_rewad"]) == 2
    assert "TRL's, as `trl grpo` names them: accuracy_reward" in capsys.readouterr().err


@pytest.mark.parametrize("config, expected", [
    ("zero2", "it asks for DeepSpeed"), ("zero3", "it asks for DeepSpeed"), ("fsdp1", "FSDP version 1"),
    ("single_gpu", "starts one process (distributed_type NO) but num_processes is 2"),
    ("fsdp9", "neither a file nor one of TRL's accelerate configs")])
def test_an_accelerate_config_the_trainer_cannot_honour_is_refused(job, capsys, config, expected):
    """`accelerate_config` as `trl grpo` takes it, by TRL's names (TRL's own files, read here) or a path."""
    assert job(accelerate_config=config, num_processes=2) == 2
    assert expected in capsys.readouterr().err


def test_an_accelerate_config_file_is_read_and_its_process_count_checked(job, capsys, tmp_path):
    """A file of the user's: its offloading is refused; its num_processes fills the recipe's and the layout is
    checked against it; --check prints the launch `hfllamarl train` would start."""
    base = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}, "mixed_precision": "bf16"}
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump({**base, "fsdp_config": {"fsdp_version": 2, "fsdp_offload_params": True}}))
    assert job(accelerate_config=str(path)) == 2
    assert "fsdp_offload_params" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({**base, "num_processes": 1}))
    assert job(accelerate_config=str(path), num_generator_processes=1) == 2
    assert "num_processes=1 leaves no trainer rank" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({**base, "num_processes": 3}))
    assert job(accelerate_config=str(path), main_process_port=29555, max_restarts=2) == 0
    out = capsys.readouterr().out
    assert (f"launch:  accelerate launch --config_file {path} --num_processes 3 --main_process_port 29555 "
            "--max_restarts 2 -m hfllamarl.cli train") in out, out
    assert job(max_restarts=-1) == 2 and "max_restarts=-1" in capsys.readouterr().err
    assert job(max_restarts=2) == 2 and "set num_processes >= 2" in capsys.readouterr().err  # (nothing to restart)
    assert job(accelerate_config="single_gpu") == 0  # TRL's single_gpu: one process (its file says 8: not started)
    assert "launch:" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_trl_cli_recipe_with_num_processes_is_launched_as_trl_grpo_launches_it(tmp_path, tiny_model):
    """`hfllamarl train --config tiny_cpu.yaml --accelerate_config fsdp2` (num_processes: 2) started without a launcher
    starts its 2 processes under `accelerate launch` with TRL's own `fsdp2` config file; they train the 2 steps and the
    model is saved. (The launch without a config file, `--multi_gpu`, is the restart test's below.)"""
    from conftest import free_port

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+1=?", "answer": f"{a} plus 1.\n#### {a + 1}"}) + "\n"
                            for a in range(20)))
    exe = os.path.join(os.path.dirname(sys.executable), "hfllamarl")
    for extra in (["--accelerate_config", "fsdp2"],):
        out = tmp_path / ("out" + "-".join(extra))
        proc = subprocess.run([exe, "train", "--config", str(REPO / "examples" / "recipes" / "tiny_cpu.yaml"),
                               "--model_name_or_path", tiny_model, "--dataset_name", str(data), "--output_dir",
                               str(out), "--main_process_port", str(free_port()), *extra],
                              cwd=str(tmp_path), capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, tail(proc)
        assert "hfllamarl train: starting 2 processes: accelerate launch" in proc.stderr, tail(proc)
        assert "trl/accelerate_configs/fsdp2.yaml --num_processes 2" in proc.stderr, tail(proc)
        assert len([line for line in proc.stdout.splitlines() if line.startswith("{'reward'")]) == 2, tail(proc)
        assert (out / "model.safetensors").exists()


@pytest.mark.slow
def test_a_recipe_with_max_restarts_survives_a_killed_trainer_rank(tmp_path, tiny_model):
    """`max_restarts: 1` (with num_processes: 2, a checkpoint every 4 steps): the trainer rank is SIGKILLed once a
    checkpoint exists; accelerate's launcher restarts both ranks, the job resumes from its newest checkpoint by itself
    and finishes every step."""
    import signal
    import time

    import psutil

    from conftest import free_port

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+1=?", "answer": f"#### {a + 1}"}) + "\n" for a in range(20)))
    out = tmp_path / "out"
    exe = os.path.join(os.path.dirname(sys.executable), "hfllamarl")
    proc = subprocess.Popen([exe, "train", "--config", str(REPO / "examples" / "recipes" / "tiny_cpu.yaml"),
                             "--model_name_or_path", tiny_model, "--dataset_name", str(data), "--output_dir", str(out),
                             "--main_process_port", str(free_port()), "--max_restarts", "1", "--save_steps", "4",
                             "--max_steps", "60"], cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint-4").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint-4"
            time.sleep(0.2)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if p.cmdline()[1:4] == ["-u", "-m", "hfllamarl.cli"] and p.environ().get("LOCAL_RANK") == "0"]
        assert ranks, "the trainer rank was not found"
        ranks[0].send_signal(signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "hfllamarl train: starting 2 processes: accelerate launch --multi_gpu --num_processes 2" in stderr
    assert "were not passed to `accelerate launch`" in stderr  # (accelerate's own notice: it ran the launch)
    assert "restart 1 of the launcher: resuming from" in stderr and "step(s) to train again" in stderr, stderr[-3000:]
    with open(out / "trained_prompts-rank0.jsonl") as fh:
        steps = [json.loads(line)["step"] for line in fh if line.strip()]
    assert steps[-1] == 60 and set(steps) == set(range(1, 61))  # every step trained, the lost ones again
    assert (out / "model.safetensors").exists()


def test_train_help_is_a_page_that_starts_with_the_config_and_help_all_has_every_field(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    short = capsys.readouterr().out
    assert short.startswith("usage: hfllamarl train --config recipe.yaml") and len(short.splitlines()) < 80
    assert "--prompt_template" in short and "--help-all" in short
    with pytest.raises(SystemExit):
        cli.main(["train", "--help-all"])
    every = capsys.readouterr().out
    assert "--learning_rate" in every and "--model_name_or_path" in every and "--datasets" in every


def test_check_without_any_recipe_says_there_is_none(capsys):
    assert cli.main(["train", "--check"]) == 2
    err = capsys.readouterr().err
    assert "no recipe: give one as a YAML file, `hfllamarl train --config recipe.yaml`" in err, err


def test_under_a_launcher_the_launch_keys_are_the_launchers_and_a_warning_says_so(monkeypatch, capsys):
    """Started by a launcher of the user's, the recipe's accelerate_config / main_process_port / max_restarts are not
    read (the launcher's flags decide): a warning on rank 0 says so; none in the processes hfllamarl train started."""
    from types import SimpleNamespace

    from hfllamarl.commands.recipe_launch import ENV_OWN_LAUNCH, resolve

    script = SimpleNamespace(accelerate_config="fsdp2", main_process_port=0, max_restarts=3, num_processes=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(ENV_OWN_LAUNCH, raising=False)
    assert resolve(script, launched=True) is None
    assert "accelerate_config, max_restarts are read when hfllamarl train starts" in capsys.readouterr().err
    monkeypatch.setenv(ENV_OWN_LAUNCH, "1")
    assert resolve(script, launched=True) is None and capsys.readouterr().err == ""
