"""Trainer replica groups (`trainer_replica_groups`): whole jobs joined per step by torchft's quorum.

The drills (slow): two groups of one trainer and one generator each, on the tiny model; group 1 is SIGKILLed at the
end of its 8th step and started again by hand, as its launcher would. Group 0 trains every global step; group 1
rejoins by copying the policy from group 0 and trains its share of the later steps; at the end both groups hold the
same weights, bit for bit, and no dataset row is trained twice.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hfllamarl.runtime.data.prompts import batch_rows, group_batch_rows

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "train_tiny.py"


def make(**kw):
    from hfllamarl import AsyncAIPOConfig

    kw.setdefault("output_dir", "/tmp/hfllamarl-test-config")
    kw.setdefault("report_to", "none")
    return AsyncAIPOConfig(**kw)


def test_group_shares_cut_the_larger_batch_in_order():
    """Group g of G trains the g-th of G consecutive shares of the batch of G x P prompts (hand check on an
    unshuffled data set: batch b of 2 x 4 prompts is rows 8b .. 8b+7)."""
    assert group_batch_rows(64, 4, 1, seed=0, shuffle=False, group=0, groups=2) == [8, 9, 10, 11]
    assert group_batch_rows(64, 4, 1, seed=0, shuffle=False, group=1, groups=2) == [12, 13, 14, 15]
    both = group_batch_rows(64, 4, 5, 3, True, 0, 2) + group_batch_rows(64, 4, 5, 3, True, 1, 2)
    assert both == batch_rows(64, 8, 5, 3, True) and len(set(both)) == 8


@pytest.mark.parametrize("kw,match", [
    ({"trainer_replica_groups": 2}, "needs the torchft lighthouse"),
    ({"trainer_replica_groups": 0}, "trainer_replica_groups=0; it must be a whole number >= 1"),
    ({"trainer_replica_group": 1}, "trainer_replica_groups is 1"),
    ({"trainer_replica_groups": 2, "trainer_replica_group": 2, "torchft_lighthouse": "http://h:1"},
     r"one of 0 \.\. 1"),
    ({"trainer_replica_groups": 2, "torchft_lighthouse": "http://h:1", "loss_type": "grpo"},
     "loss_type='grpo' normalises per sequence"),
    ({"trainer_replica_groups": 2, "torchft_lighthouse": "http://h:1", "scale_rewards": "batch"},
     "scale_rewards='batch'"),
    ({"trainer_replica_groups": 2, "torchft_lighthouse": "http://h:1", "drop_zero_variance_groups": True},
     "dynamic sampling"),
])
def test_replica_group_settings_that_cannot_work_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_a_valid_replica_group_config():
    c = make(trainer_replica_groups=2, trainer_replica_group=1, torchft_lighthouse="http://h:1")
    assert (c.trainer_replica_groups, c.trainer_replica_group) == (2, 1)


def _group(model, out, group, lighthouse, *extra, launcher=()):
    """One group's job, its output in OUT/../g<group>-<n>.log (a file: a pipe nobody reads would fill and stop it)."""
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.parent.glob(f"g{group}-*.log")))
    log = open(out.parent / f"g{group}-{n}.log", "w")
    cmd = [sys.executable, *launcher, str(SCRIPT), model, str(out), "--steps", "80", "--step-sleep", "0.5", "--reward", "digits",
           "--no-bootstrap", "--timeout", "30", "--save-model", str(out / "final"),
           "--extra", json.dumps({"trainer_replica_groups": 2, "trainer_replica_group": group,
                                  "torchft_lighthouse": lighthouse, "save_strategy": "no"}), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_path = log.name
    log.close()
    return proc


def _log(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _runs(log):
    """A group's prompts log cut where its own step count starts again (a new process of the group)."""
    runs = [[]]
    for e in log:
        if runs[-1] and e["step"] <= runs[-1][-1]["step"]:
            runs.append([])
        runs[-1].append(e)
    return runs


@pytest.mark.slow
def test_a_killed_group_is_left_out_and_rejoins_from_its_peer(tmp_path, tiny_model):
    from safetensors.torch import load_file

    from hfllamarl.runtime.training.replica_quorum import start_lighthouse

    lighthouse = start_lighthouse(min_replicas=1, heartbeat_timeout_s=2.0, join_timeout_s=1.0)
    out0, out1 = tmp_path / "g0", tmp_path / "g1"
    procs = []
    try:
        procs.append(_group(tiny_model, out0, 0, lighthouse.address()))
        first = _group(tiny_model, out1, 1, lighthouse.address(), "--kill-at-step", "8")
        procs.append(first)
        first.wait(timeout=300)
        assert first.returncode == -signal.SIGKILL
        killed_at = float((out1 / "killed_at").read_text())
        again = _group(tiny_model, out1, 1, lighthouse.address())
        procs.append(again)
        again.wait(timeout=300)
        procs[0].wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    err0, err1 = Path(procs[0].log_path).read_text(), Path(again.log_path).read_text()
    assert procs[0].returncode == 0, err0[-3000:]
    assert again.returncode == 0, err1[-3000:]

    log0 = _log(out0 / "trained_prompts-group0-rank0.jsonl")
    log1 = _log(out1 / "trained_prompts-group1-rank0.jsonl")
    steps0 = [e["global_step"] for e in log0]  # the survivor trained every step, each once (from the step it joined:
    assert steps0 == list(range(steps0[0], 81)) and steps0[0] < 8  # the group that starts second copies the first)
    assert all(len(e["rows"]) == 4 for e in log0[2:]) and all(len(e["rows"]) in (0, 4) for e in log0[:2])
    before, after = _runs(log1)
    killed = before[-1]["global_step"]  # (its 8th step: the 8th global one, unless it started second and healed)
    rejoined = after[0]["global_step"]
    assert killed + 1 < rejoined and [e["global_step"] for e in after] == list(range(rejoined, 81))
    assert any(e["rows"] for e in after), "the restarted group never trained its share"
    # every row a share of its global step (the batch of 8 prompts a single job would sample), none twice a step
    for e0 in log0:
        step = e0["global_step"]
        e1 = [e for e in log1 if e["global_step"] == step]
        rows = e0["rows"] + (e1[0]["rows"] if e1 else [])
        assert set(rows) <= set(batch_rows(64, 8, step - 1, 0)) and len(rows) == len(set(rows))
    # the recovery, as the survivor logged it
    assert "left: [1]" in err0 and f"rejoined: 1 (absent for global steps {killed + 1}-{rejoined - 1}" in err0, \
        err0[-3000:]
    assert "copied the weights, optimizer and schedule from a peer" in err1
    step_times = {e["global_step"]: e["time"] for e in log0}
    print(f"drill: killed after global step {killed} at t=0; survivor's next step at "
          f"+{step_times[killed + 1] - killed_at:.1f} s; "
          f"group 1 back in global step {rejoined} at +{step_times[rejoined] - killed_at:.1f} s")
    a, b = load_file(out0 / "final" / "model.safetensors"), load_file(out1 / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # one policy, bit for bit


@pytest.mark.slow
def test_a_frozen_group_is_left_out_and_its_launcher_restarts_it(tmp_path, tiny_model):
    """Group 1 under `torchrun --max-restarts 1` (its trainer and its generator as two ranks); its trainer rank is
    SIGSTOPped once both groups train together. Group 0 leaves it out and trains on; group 1's generator gives up
    on its frozen trainer after collective_timeout_s, torchrun restarts the group, and it rejoins from group 0."""
    import psutil
    from safetensors.torch import load_file

    from conftest import free_port
    from hfllamarl.runtime.training.replica_quorum import start_lighthouse

    lighthouse = start_lighthouse(min_replicas=1, heartbeat_timeout_s=2.0, join_timeout_s=1.0)
    out0, out1 = tmp_path / "g0", tmp_path / "g1"
    procs = []
    try:
        procs.append(_group(tiny_model, out0, 0, lighthouse.address(), "--steps", "100"))
        procs.append(_group(tiny_model, out1, 1, lighthouse.address(), "--steps", "100",
                            launcher=["-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                                      "--master-port", str(free_port())]))
        deadline = time.monotonic() + 300
        log0 = out0 / "trained_prompts-group0-rank0.jsonl"
        while not (log0.exists() and len(_log(log0)) >= 8 and (out1 / "trained_prompts-group1-rank0.jsonl").exists()
                   and _log(out1 / "trained_prompts-group1-rank0.jsonl")[-1]["global_step"] >= 8):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the groups did not start"
            time.sleep(0.2)
        trainer = [p for p in psutil.Process(procs[1].pid).children(recursive=True)
                   if "train_tiny.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == "0"]
        assert len(trainer) == 1, trainer
        trainer[0].send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        for p in procs:
            p.wait(timeout=400)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    err0, err1 = Path(procs[0].log_path).read_text(), Path(procs[1].log_path).read_text()
    assert procs[0].returncode == 0, err0[-3000:]
    assert procs[1].returncode == 0, err1[-3000:]
    log0, log1 = _log(out0 / "trained_prompts-group0-rank0.jsonl"), _log(out1 / "trained_prompts-group1-rank0.jsonl")
    steps0 = [e["global_step"] for e in log0]  # (the group that starts second copies the first one's policy)
    assert steps0 == list(range(steps0[0], 101)) and steps0[0] < 14
    runs = _runs(log1)
    assert len(runs) == 2, "group 1 did not come back"
    frozen_at, after = runs[0][-1]["global_step"], runs[1]
    assert after[-1]["global_step"] == 100 and any(e["rows"] for e in after), "group 1 never came back"
    rejoined = after[0]["global_step"]
    assert "left: [1]" in err0 and f"rejoined: 1 (absent for global steps {frozen_at + 1}-{rejoined - 1}" in err0
    assert "copied the weights, optimizer and schedule from a peer" in err1
    times = {e["global_step"]: e["time"] for e in log0}
    print(f"drill: SIGSTOP after global step {frozen_at}; survivor's next step +{times[frozen_at + 1] - stopped_at:.1f} s; "
          f"group 1 back (restarted by torchrun) in global step {rejoined} at +{times[rejoined] - stopped_at:.1f} s")
    a, b = load_file(out0 / "final" / "model.safetensors"), load_file(out1 / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
