"""`hfllamarl bench weight-sync` runs end to end (small model) and reports what it promises."""

import json
import os
import subprocess
import sys

import pytest

from conftest import SIDE_BY_SIDE_ENV, popen_script
from hfllamarl.runtime.generation.preflight import cpu_has_bf16
from hfllamarl.commands.bench_rank import llama_config_for

pytestmark = pytest.mark.slow

KEYS = {"params", "trainer_ranks", "generator_ranks", "ddma_s", "broadcast_s", "disk_s", "bound_s", "bitwise_equal",
        "ddma_peak_rss_mb", "broadcast_peak_rss_mb"}


def test_config_size():
    from transformers import LlamaForCausalLM

    import torch

    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(llama_config_for(1.1e8)).parameters())
    assert 1.0e8 <= n <= 1.3e8


def test_bench_weight_sync_small():
    proc = subprocess.run([sys.executable, "-m", "hfllamarl.cli", "bench", "weight-sync", "--params", "5e7",
                           "--repeats", "1", "--bucket-mb", "4"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert KEYS <= set(summary)
    assert summary["bitwise_equal"] is True
    assert summary["trainer_ranks"] == 2 and summary["generator_ranks"] == 1
    assert "broadcast / ddma" in proc.stdout


def test_bench_learning_and_vs_trl_smoke(tmp_path, tool_model):
    """The commands run end to end, side by side (each is mostly process start-up): `bench learning` with one
    variant for a few steps writes its plot and reports the final reward; `bench vs-trl` on a tiny model runs TRL's
    GRPOTrainer and ours for the same steps (prompts with a 60-token instruction before them, where the trainer shares
    each group's prompt; gradient checkpointing on, as TRL's default has it) and reports both times, their ratio and
    the profile; `bench multi-turn` runs the synchronous and the asynchronous tool-calling job and reports their throughput ratio (the training runs
    themselves are tested in test_train_e2e.py and test_agentic.py)."""
    precision = "bf16" if cpu_has_bf16() else "fp32"  # the default: bf16 on both sides where the CPU has it
    env = dict(os.environ, **SIDE_BY_SIDE_ENV)
    multi_turn = popen_script(["-m", "hfllamarl.cli", "bench", "multi-turn", "--steps", "3", "--variants", "sync,async",
                               "--tool-latency", "0.05", "--model", tool_model, "--output-dir",
                               str(tmp_path / "multi_turn")], env)
    learning = popen_script(["-m", "hfllamarl.cli", "bench", "learning", "--runtime", "--tasks", "successor",
                             "--staleness", "4", "--steps", "3", "--seeds", "0", "--output-dir",
                             str(tmp_path / "learning")], env)
    vs_trl = popen_script(["-m", "hfllamarl.cli", "bench", "vs-trl", "--steps", "2", "--hidden-size", "64", "--layers",
                           "1", "--max-completion-length", "8", "--prompt-tokens", "60", "--profile",
                           "--gradient-checkpointing",  # (TRL's default: a bf16 step under it once failed here)
                           "--output-dir",
                           str(tmp_path / "vs"),
                           "--variant", 'lookahead={"sampler_lookahead": "adamw", "verify_weight_sync": true, '
                                        '"max_steps": 3, "bootstrap_generation": false}'],
                          env)  # (its sides drop OMP_NUM_THREADS: each times its own setting)
    out, err = learning.communicate(timeout=600)
    assert learning.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    # the runtime itself (a vLLM generator child per run): the synchronous run and AIPO's default at staleness 4
    assert summary["cells"] == 2 and all(0.0 <= v <= 1.0 for v in summary["final"].values())
    assert summary["figures"] and all(os.path.isfile(p) for p in summary["figures"])
    runs = [json.loads(line) for line in open(tmp_path / "learning" / "runs.jsonl")]
    stale = next(r for r in runs if r["staleness"] == 4)
    # Staleness 4 with 3 steps: batches 0..2 are all sampled by the initial policy.
    assert stale["series"]["staleness/mean"] == [0, 1, 2]

    out, err = vs_trl.communicate(timeout=600)
    assert vs_trl.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    trl, ours = summary["trl"], summary["hfllamarl"]
    assert summary["ratio"] == round(trl["seconds"] / ours["seconds"], 3) and summary["steps"] == 2
    assert summary["prompt_tokens"] == 60
    assert summary["precision"] == precision
    for side in (trl, ours):
        assert side["seconds"] > 0 and 0.0 <= side["final_reward"] <= 1.0
        # the whole process holds the trainer's construction and train()
        assert 0 < side["init_seconds"] and side["init_seconds"] + side["seconds"] < side["process_seconds"]
    assert summary["ratio_init_and_train"] == round((trl["init_seconds"] + trl["seconds"])
                                                    / (ours["init_seconds"] + ours["seconds"]), 3)
    assert summary["ratio_process"] == round(trl["process_seconds"] / ours["process_seconds"], 3)
    profile = summary["profile_hfllamarl"]
    assert profile["forward + backward"] > 0 and profile["generation (generator core)"] > 0
    for key in ("flat groups, share", "rows run forward only, share", "rows skipped, share"):
        assert 0.0 <= profile[key] <= 1.0, (key, profile)
    if "step (wall) / bound" in profile:  # (steps after the generator took over: the bound, and the larger one)
        assert profile["work: busiest generator process, core-s"] == profile["work: generator processes, core-s"]
        assert 0 < profile["step (wall) / larger bound"] <= profile["step (wall) / bound"], profile
    assert summary["profile_trl"]["generation"] > 0 and summary["profile_trl"]["forward + backward"] > 0
    # Each side's log history: the same steps, rewards from the same reward function.
    for name, steps in (("trl", 2), ("hfllamarl", 2), ("hfllamarl-lookahead", 3)):
        result = json.load(open(tmp_path / "vs" / f"{name}.json"))
        assert result["steps"] == steps and len(result["rewards"]) == steps
    # the variant (3 steps, every batch from vLLM: at max_staleness 1, batch 3 is the first sampled after an optimizer
    # step, and the last one trained after the trainer's own first batches is sampled on-policy): its own row and
    # ratio; the generator sampled batch 3 with weights moved one step ahead, and held exactly what was sent
    # (verify_weight_sync reloads the sent weights with vLLM's loader and compares)
    assert summary["ratio_hfllamarl-lookahead"] == round(trl["seconds"] / summary["hfllamarl-lookahead"]["seconds"], 3)
    assert [h.get("weight_sync/lookahead_steps") for h in result["history"]][-1] == 1.0, result["history"]
    # ours logs each step's CPU time on both sides (what the profile's bound is made of); a batch the trainer sampled
    # itself has no generator time
    history = json.load(open(tmp_path / "vs" / "hfllamarl.json"))["history"]
    assert all(h["time/cpu_seconds"] > 0 and h["generation/cpu_seconds"] >= 0 for h in history), history
    # one generator process: the busiest one's work is all the generators' work
    assert all(h["generation/busiest_cpu_seconds"] == h["generation/cpu_seconds"] for h in history), history
    # 64-token prompts, 4 completions of at most 8 tokens: the trainer computed each prompt once (at least 3 of the
    # 4 copies of a prompt are 3 x 64 of at most 4 x 72 tokens)
    assert all(h["shared_prompts/tokens_saved_frac"] >= 3 * 64 / (4 * 72) - 1e-6 for h in history), history

    out, err = multi_turn.communicate(timeout=600)
    assert multi_turn.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["ratio_async"] == round(
        summary["async"]["completions_per_s"] / summary["sync"]["completions_per_s"], 3)
    for variant in ("sync", "async"):
        assert summary[variant]["step_s"] > 0 and 0.0 <= summary[variant]["final_reward"] <= 1.0
        assert len(json.load(open(tmp_path / "multi_turn" / f"{variant}.json"))["history"]) == 3


def test_a_variant_names_only_fields_the_config_has():
    """`bench vs-trl --variant` refuses a field AsyncAIPOConfig does not have before any side runs (the nearest
    names in the message); fields it has pass through as given."""
    from hfllamarl.commands.bench_vs_trl import _variants

    assert _variants(['lookahead={"sampler_lookahead": "adamw"}']) == {
        "hfllamarl-lookahead": {"sampler_lookahead": "adamw"}}
    with pytest.raises(SystemExit, match="no field 'max_stalenes'.*did you mean max_staleness"):
        _variants(['sync={"max_stalenes": 0}'])
    with pytest.raises(SystemExit, match="give NAME="):
        _variants(['=[1]'])


def test_the_vs_trl_bench_compares_each_seed_with_trls_own(capsys):
    """Over seeds, each side's mean and final reward minus TRL's and TRL's time over its, mean and 95 % interval
    (Student's t, 1 degree of freedom: 12.706), against hand values."""
    from hfllamarl.commands.bench_vs_trl import paired_against_trl

    by_seed = {0: {"trl": {"rewards": [0.0, 1.0], "seconds": 10.0}, "ours": {"rewards": [1.0, 1.0], "seconds": 5.0}},
               1: {"trl": {"rewards": [0.0, 0.0], "seconds": 20.0}, "ours": {"rewards": [0.0, 1.0], "seconds": 5.0}}}
    out = paired_against_trl(by_seed, [0, 1], ["ours"], final=lambda r: r["rewards"][-1])
    assert out["mean_reward_diff_ours"] == {"mean": 0.5, "ci95": 0.0, "per_seed": [0.5, 0.5]}
    assert out["final_reward_diff_ours"] == {"mean": 0.5, "ci95": round(12.706 * 0.5 ** 0.5 / 2 ** 0.5, 4),
                                             "per_seed": [0.0, 1.0]}
    assert out["speed_ratio_ours"] == {"mean": 3.0, "ci95": 12.706, "per_seed": [2.0, 4.0]}
    assert "ours against TRL, seed by seed (2 seeds" in capsys.readouterr().out
