"""`hfllamarl bench weight-sync` runs end to end (small model) and reports what it promises."""

import json
import subprocess
import sys

import pytest

from hfllamarl.tools.bench_rank import llama_config_for

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


def test_bench_learning_smoke(tmp_path):
    """One variant, a few steps: the command runs, writes its plot and reports the final reward (each variant is
    one training run; the runs themselves are tested in test_train_e2e.py)."""
    proc = subprocess.run([sys.executable, "-m", "hfllamarl.cli", "bench", "learning", "--steps", "3",
                           "--variants", "aipo_staleness_4", "--seeds", "0", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) >= {"aipo_staleness_4", "steps"}
    assert 0.0 <= summary["aipo_staleness_4"] <= 1.0
    assert (tmp_path / "learning.png").stat().st_size > 0
    history = json.load(open(tmp_path / "aipo_staleness_4-seed0.json"))
    # Staleness 4 with 3 steps: batches 0..2 are all sampled by the initial policy.
    assert [h["staleness/max"] for h in history if "reward" in h] == [0, 1, 2]
