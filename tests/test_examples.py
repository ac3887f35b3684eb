"""Every shipped example config loads and is valid; the CLI lists plugins; `accelerate launch` works."""

import glob
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, popen_script, run_script, tail

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
    alone = subprocess.run([sys.executable, "-m", "hfllamarl.cli", "plugins"], capture_output=True, text=True,
                           check=True).stdout  # (`plugins` alone lists them too)
    assert alone == out


# the GPU-layout recipes (demo_cpu.yaml builds its own model and data: tests/test_recipe.py runs it)
RECIPES = sorted(p for p in glob.glob(str(REPO / "examples" / "recipes" / "*.yaml")) if "demo_cpu" not in p)
LAUNCHERS = sorted(glob.glob(str(REPO / "examples" / "launch" / "*.sh")))


def start_recipe_check(path, model, data, *extra) -> subprocess.Popen:
    """The recipe checked with the tiny model and a few MATH/GSM8K-shaped rows in place of the cluster's files."""
    return popen_script([str(REPO / "examples" / "train_math.py"), "--config", path, "--check", "--model_name_or_path",
                         model, "--dataset_name", data, *extra])


def shared_copy(recipe: dict) -> str | None:
    """The public copy of the recipe's data file in ../shared/data (MATH, GSM8K), which the docs' data section
    describes: the recipe's prompt and rewards are checked on its real rows (None: no copy here)."""
    from conftest import SHARED_DATA

    path = SHARED_DATA / str(recipe.get("dataset_name", "")).rsplit("/", 1)[-1]
    return str(path) if path.is_file() else None


def test_every_recipe_is_valid_and_fp8_is_refused_without_a_gpu(tmp_path, tiny_model):
    """Each shipped recipe parses into AsyncAIPOConfig (TRL's --config) and passes the layout checks, on the public
    MATH or GSM8K copy it names where ../shared/data has it (its prompt built, row 0 scored by its rewards); one that
    asks for an fp8 generator cannot run here and says so, and passes without that one setting; a quantization
    the generator does not take (awq) is refused with the reason. (The checks run side by side: each is a fresh
    process, mostly imports.)"""
    import json

    import torch

    rows = str(tmp_path / "rows.jsonl")
    with open(rows, "w") as fh:  # both data sets' columns: problem/solution/answer (MATH), question/answer (GSM8K)
        for a in range(4):
            fh.write(json.dumps({"problem": f"{a}+1?", "question": f"{a}+1?", "solution": f"\\boxed{{{a + 1}}}",
                                 "answer": f"{a} plus 1.\n#### {a + 1}"}) + "\n")
    cases = {}
    for path in RECIPES:
        data = yaml.safe_load(open(path))
        name = path.rsplit("/", 1)[-1]
        cases[name] = (path, data)
        if data.get("generator_quantization") and not torch.cuda.is_available():
            without = dict(data)
            without.pop("generator_quantization")
            stripped = str(tmp_path / f"without_fp8-{name}")
            yaml.safe_dump(without, open(stripped, "w"))
            cases[name + " without fp8"] = (stripped, without)
    # The stand-in for the recipes' models has heads enough for their tensor-parallel sizes (8), as the real ones do:
    # --check now refuses a model whose heads do not split over them.
    from hfllamarl.testing.tiny import build_tiny_model

    wide = build_tiny_model(str(tmp_path / "wide"), hidden_size=256, num_heads=8, intermediate_size=256)
    procs = {name: start_recipe_check(path, wide, shared_copy(data) or rows) for name, (path, data) in cases.items()}
    bad_quantization = start_recipe_check(str(REPO / "examples" / "recipes" / "tiny_cpu.yaml"), tiny_model, rows,
                                          "--generator_quantization", "awq")
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        data = cases[name][1]
        if data.get("generator_quantization") and not torch.cuda.is_available():
            assert proc.returncode != 0, name
            assert "generator_quantization='fp8' needs CUDA GPUs" in err, (name, err[-2000:])
            continue
        assert proc.returncode == 0, (name, err[-3000:])
        copy = shared_copy(data)
        assert copy is None or f"data:    {copy} [train]" in out, (name, out[-2000:])
        trainers = data["num_processes"] - data["num_generator_processes"]
        assert f"{data['num_processes']} processes = {trainers} trainer + {data['num_generator_processes']} generator" \
            in out, name
    assert any("without fp8" in name for name in cases) or torch.cuda.is_available()
    _, err = bad_quantization.communicate(timeout=240)
    assert bad_quantization.returncode != 0 and "generator_quantization='awq' is not supported" in err, err[-2000:]


@pytest.mark.parametrize("script", LAUNCHERS, ids=lambda p: p.rsplit("/", 1)[-1])
def test_launch_scripts_pair_a_recipe_with_a_matching_accelerate_config(script):
    import re

    from accelerate.commands.config.config_args import load_config_from_file

    text = open(script).read()
    config = re.search(r"--config_file (\S+)", text).group(1)
    recipe = re.search(r"--config (\S+)", text).group(1)
    acc = load_config_from_file(str(REPO / config))
    data = yaml.safe_load(open(REPO / recipe))
    assert acc.num_processes == data["num_processes"]
    assert data["num_generator_processes"] < acc.num_processes
    assert acc.num_processes % acc.num_machines == 0
    subprocess.run(["bash", "-n", script], check=True)  # the script parses


@pytest.mark.slow
def test_a_small_plans_launch_settings_run_on_the_cpu(tiny_model, tmp_path, capsys):
    """`hfllamarl plan` for the tiny model on 3 "GPUs" recommends two vLLM replicas beside one trainer; the cluster
    script, unchanged, runs exactly the launch settings the plan prints (processes, num_generator_processes,
    generator_tensor_parallel_size) on this machine: the CPU recipe, a GSM8K-shaped JSONL, torchrun."""
    import json

    from hfllamarl import cli

    assert cli.main(["plan", "--model-config", tiny_model, "--gpus", "3", "--gpus-per-node", "3", "--global-batch", "8",
                     "--group-size", "4", "--prompt-length", "8", "--completion-length", "8"]) == 0
    out = capsys.readouterr().out
    launch = json.loads(out.strip().splitlines()[-1])["launch"]
    assert (launch["nodes"], launch["replicas"]) == (1, 2), out
    assert f"--num_generator_processes {launch['num_generator_processes']} --generator_tensor_parallel_size " \
           f"{launch['generator_tensor_parallel_size']}" in out
    data = tmp_path / "gsm8k.jsonl"
    with open(data, "w") as fh:
        for a in range(20):
            fh.write(json.dumps({"question": f"{a}+1=?", "answer": f"{a} plus 1.\n#### {a + 1}"}) + "\n")
    out = tmp_path / "out"
    proc = run_script([str(REPO / "examples" / "train_math.py"), "--config", str(REPO / "examples" / "recipes" /
                       "tiny_cpu.yaml"), "--model_name_or_path", tiny_model, "--dataset_name", str(data),
                       "--output_dir", str(out), "--num_generator_processes", str(launch["num_generator_processes"]),
                       "--generator_tensor_parallel_size", str(launch["generator_tensor_parallel_size"])],
                      nproc=launch["nproc_per_node"], timeout=400, launcher="torchrun")
    assert proc.returncode == 0, tail(proc)
    assert (out / "model.safetensors").exists()  # save_model at the end
    assert "'replicas/live': '2'" in proc.stdout + proc.stderr, tail(proc)  # the step logs: both replicas sampled
