"""The launcher's own restart: a job under `torchrun --max-restarts` whose trainer rank is killed resumes by itself
from its last checkpoint and trains exactly what an uninterrupted run trains."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, SCRIPTS, SIDE_BY_SIDE_ENV, free_port, orphans, tail

pytestmark = pytest.mark.slow


def trained(out: str) -> list[dict]:
    with open(os.path.join(out, "trained_prompts-rank0.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_a_killed_trainer_rank_under_torchrun_max_restarts_resumes_by_itself(tiny_model, tmp_path):
    """torchrun --max-restarts 1, 1 trainer + 1 generator, a checkpoint every 2 steps: trainer rank 0 SIGKILLs itself
    at the end of step 3. The generator rank stops (the peer is lost), torchrun restarts both, and `train()`, called
    as before without resume_from_checkpoint, resumes from checkpoint-2 by itself, logs what the failure cost (1
    step to train again) and finishes the 6 steps with exit code 0. Every step's rows (the last line per step) are
    those of the data schedule, which an uninterrupted run trains (tests/test_train_e2e.py); the time from the kill
    to the next step's end is printed."""
    from hfllamarl.runtime.data.prompts import batch_rows

    common = ["--steps", "6", "--save-steps", "2", "--max-staleness", "0", "--report-to", "none"]
    out = str(tmp_path / "restarted")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(SIDE_BY_SIDE_ENV)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts",
                           "1", "--monitor-interval", "0.5", "--master_addr", "127.0.0.1", "--master_port",
                           str(free_port()), str(SCRIPTS / "train_tiny.py"), tiny_model, out, *common,
                           "--kill-at-step", "3"], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "TRAINED global_step=6" in proc.stdout, tail(proc)
    assert "restart 1 of the launcher: resuming from" in proc.stderr and "checkpoint-2 (step 2)" in proc.stderr
    assert "trained to step 3: 1 step(s) to train again" in proc.stderr, tail(proc)

    lines = trained(out)
    assert [h["step"] for h in lines] == [1, 2, 3, 3, 4, 5, 6]  # step 3 trained, lost with the kill, trained again
    assert lines[2]["rows"] == lines[3]["rows"]  # (train_tiny: 64 rows, 4 prompts a step, seed 0)
    assert {h["step"]: h["rows"] for h in lines} == {step: batch_rows(64, 4, step - 1, seed=0) for step in range(1, 7)}
    with open(os.path.join(out, "killed_at")) as fh:
        killed = float(fh.read())
    recovered = lines[3]["time"] - killed
    print(f"kill at the end of step 3 -> step 3 trained again {recovered:.1f} s later (torchrun's restart, imports, "
          "vLLM's start, the checkpoint's load and one step)")
    assert 0 < recovered < 120
    assert not orphans(out)
