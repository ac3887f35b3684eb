"""Trainer replica groups sharing one generator pool (`trainer_replica_shared_generators`): group 0's generators
sample every group's share of each global batch, group 0's trainer scores them and hands each present group its
share in the step (`replica_exchange`); group 1 starts no generator.

The drill (slow): 2 trainer replicas (two groups of one trainer process) + 1 generator (group 0's), the tiny model,
100 steps. Group 1 freezes (SIGSTOP) at the end of its 8th step for 6 s, then is let go (SIGCONT); later it
SIGKILLs itself at the end of its 30th step and is started again by hand; 10 steps after it is back, it is frozen
from outside for 15 s, longer than group 0's collective_timeout_s (12 s), at whatever point of its step. Group 0 leaves it out at each failure and
trains its share itself (it holds it: nothing is sampled again), group 1 rejoins by copying the policy from group 0
and trains what it is handed from its first step back; at the end both hold the same weights bit for bit, every
global step trained each prompt of its batch once, and the weights equal an independent replay of the same rows in
one process (`test_replica_groups._check_final_weights`).
"""

import json
import os
import signal
import time

import pytest
from conftest import prompts_log, prompts_log_runs
from test_replica_groups import _check_final_weights, _ended, _group, _stop

SHARED = {"trainer_replica_shared_generators": True}


def test_a_share_goes_between_groups_as_json_with_versions_in_each_groups_own_count():
    """`replica_exchange`: a share's completions, advantages and rewards (an unscored one stays unscored) cross as
    JSON; the versions that sampled each token go as global steps and come back in the receiving group's count."""
    import math

    import torch

    from hfllamarl.runtime.loop.rollout import Rollout
    from hfllamarl.runtime.training.replica_exchange import decode_share, encode_share

    rollouts = [Rollout(prompt="p", prompt_ids=[1, 2], completion_ids=[3, 4, 5], behavior_logprobs=[-0.5, -1.25, -2.0],
                        versions=[7, 7, 8], finish_reason="length", completion_text="x y z", row_index=11,
                        columns={"answer": "3"}, env_mask=[1, 0, 1]),
                Rollout(prompt="p", prompt_ids=[1, 2], completion_ids=[6], behavior_logprobs=[-0.1], versions=[8],
                        finish_reason="stop", completion_text="w", row_index=11)]
    data = encode_share(rollouts, torch.tensor([0.25, -0.25]), [1.0, math.nan], offset=5)  # (held at step + 5)
    got, advantages, rewards = decode_share(data, offset=2)  # (the receiver is 2 steps past its own count)
    assert [r.versions for r in got] == [[10, 10, 11], [11]]
    assert advantages.tolist() == [0.25, -0.25] and rewards[0] == 1.0 and math.isnan(rewards[1])
    for a, b in zip(got, rollouts):
        assert (a.prompt_ids, a.completion_ids, a.behavior_logprobs, a.finish_reason, a.row_index, a.env_mask) == \
            (b.prompt_ids, b.completion_ids, b.behavior_logprobs, b.finish_reason, b.row_index, b.env_mask)
    assert json.loads(data)[0]["versions"] == [12, 12, 13]
    with pytest.raises(ValueError, match="malformed"):
        decode_share(b'[{"prompt_ids": [1]}]')
    with pytest.raises(ValueError, match="malformed"):
        decode_share(b"\x80\x04K\x01.")  # (a pickle is not read)


@pytest.mark.parametrize("kw,match", [
    ({"trainer_replica_shared_generators": True}, "trainer_replica_groups is 1"),
])
def test_shared_generators_without_groups_are_refused(kw, match):
    from hfllamarl import AsyncAIPOConfig

    with pytest.raises(ValueError, match=match):
        AsyncAIPOConfig(output_dir="/tmp/hfllamarl-test-config", report_to="none", **kw)


def test_a_group_sharing_group_0s_generators_has_none_of_its_own():
    from hfllamarl import AsyncAIPOConfig

    kw = dict(output_dir="/tmp/hfllamarl-test-config", report_to="none", trainer_replica_groups=2,
              torchft_lighthouse="http://h:1", trainer_replica_shared_generators=True)
    one = AsyncAIPOConfig(trainer_replica_group=1, **kw)
    assert one.trainer_only and one._topology.num_generators == 0
    zero = AsyncAIPOConfig(trainer_replica_group=0, **kw)
    assert not zero.trainer_only and zero._topology.num_generators == 1


MISMATCH = """
import os, sys, torch
from hfllamarl.runtime.training.replica_group import ReplicaGroup
from hfllamarl.runtime.training.replica_quorum import group_store

group, shared, lighthouse = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
model = torch.nn.Linear(4, 4)
store, host, port = group_store()
g = ReplicaGroup(group, 2, lighthouse, model, torch.optim.AdamW(model.parameters()), None, collective_timeout_s=20.0,
                 device="cpu", store=(host, port), rank=0, world_size=1, peer_wait_s=30.0, shared_generators=shared)
q = g.begin(0)
try:
    g.step_tokens({group: 10.0})
    print("COUNTED", sorted(g.members), flush=True)
except RuntimeError as e:
    print("REFUSED", e, flush=True)
os._exit(0)  # (torchft's server threads would hold the interpreter's exit)
"""


def test_groups_that_disagree_on_sharing_group_0s_generators_stop_with_what_to_do():
    """Group 0 shares its generators, group 1 was started without the setting (it would sample its own share with its
    own generators, and group 0 would sample it too): at the first step both stop with an error that names the
    groups and the setting; started alike, they count the step together."""
    import subprocess
    import sys

    from hfllamarl.runtime.training.replica_quorum import start_lighthouse

    for flags, want in (((1, 0), "REFUSED"), ((1, 1), "COUNTED")):
        lighthouse = start_lighthouse(min_replicas=2, heartbeat_timeout_s=2.0, join_timeout_s=5.0)
        try:
            procs = [subprocess.Popen([sys.executable, "-c", MISMATCH, str(g), str(flag), lighthouse.address()],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=dict(os.environ, RUST_LOG="warn")) for g, flag in enumerate(flags)]
            outs = [p.communicate(timeout=120) for p in procs]
        finally:
            lighthouse.shutdown()
        for out, err in outs:
            line = out.strip().splitlines()[-1] if out.strip() else err[-2000:]
            assert line.startswith(want), line
            if want == "REFUSED":
                assert "trainer replica groups [0] share group 0's generators" in line and "groups [1] do not" in line \
                    and "set trainer_replica_shared_generators alike in every group's config" in line, line
            else:
                assert line == "COUNTED [0, 1]", line


def _wait_for_steps(path, steps, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not (path.exists() and len(prompts_log(path)) >= steps):
        assert time.monotonic() < deadline and proc.poll() is None, f"no step {steps} in {path}"
        time.sleep(0.05)


@pytest.mark.slow
def test_two_trainer_replicas_share_one_generator_and_survive_a_freeze_and_a_kill(tmp_path, tiny_model):
    from hfllamarl.runtime.training.replica_quorum import start_lighthouse

    lighthouse = start_lighthouse(min_replicas=1, heartbeat_timeout_s=2.0, join_timeout_s=1.0)
    out0, out1 = tmp_path / "g0", tmp_path / "g1"
    log_path = out1 / "trained_prompts-group1-rank0.jsonl"
    procs = []
    try:
        procs.append(_group(tiny_model, out0, 0, lighthouse.address(), "--steps", "100", "--timeout", "12",
                            config=SHARED))
        first = _group(tiny_model, out1, 1, lighthouse.address(), "--steps", "100", "--timeout", "60",
                       "--freeze-at-step", "8", "--kill-at-step", "30", config=SHARED)
        procs.append(first)
        _wait_for_steps(log_path, 8, first)  # (it SIGSTOPs itself once its 8th step's lines are written)
        deadline = time.monotonic() + 60
        while not (out1 / "killed_at").exists():
            assert time.monotonic() < deadline, "group 1 did not freeze"
            time.sleep(0.05)
        time.sleep(0.2)
        stopped_at = float((out1 / "killed_at").read_text())
        time.sleep(max(0.0, stopped_at + 6.0 - time.time()))
        os.kill(first.pid, signal.SIGCONT)
        first.wait(timeout=300)
        assert first.returncode == -signal.SIGKILL, os.path.basename(first.log_path)
        killed_at = float((out1 / "killed_at").read_text())
        again = _group(tiny_model, out1, 1, lighthouse.address(), "--steps", "100", "--timeout", "60", config=SHARED)
        procs.append(again)
        # a freeze from outside, longer than group 0's collective_timeout_s (12 s), wherever it lands: in the step's
        # quorum (group 0 leaves group 1 out after the heartbeat timeout), in one of its collectives (after a third of
        # collective_timeout_s) or in group 1's own work
        log_lines = len(prompts_log(log_path))
        _wait_for_steps(log_path, log_lines + 10, again)
        os.kill(again.pid, signal.SIGSTOP)
        held_at = time.time()
        time.sleep(15.0)
        os.kill(again.pid, signal.SIGCONT)
        again.wait(timeout=300)
        procs[0].wait(timeout=300)
    finally:
        _stop(procs, lighthouse)
    err0, err1, log0, log1 = _ended(procs[0], again, out0, out1)
    err1_first = open(first.log_path).read()
    assert [e["global_step"] for e in log0] == list(range(1, 101))  # group 0 trained every global step
    assert all(len(e["rows"]) in (4, 8) for e in log0)  # (8: group 1's share too, while it was away)
    # nothing was sampled again: group 0 held group 1's share whenever group 1 was away, and group 1 trained what
    # it was handed from its first step back
    for text in (err0, err1, err1_first):
        assert "samples the share of group" not in text, text[-3000:]
    before, after = prompts_log_runs(log1)

    def gaps(run):
        return [(a, b) for a, b in zip(run, run[1:]) if b["global_step"] > a["global_step"] + 1]

    assert len(gaps(before)) == 1 and len(gaps(after)) == 1, [e["global_step"] for e in before + after]
    (frozen, thawed), killed, (held, let_go) = gaps(before)[0], before[-1], gaps(after)[0]
    rejoined = after[0]["global_step"]
    assert killed["global_step"] + 1 < rejoined and after[-1]["global_step"] == 100
    assert all(len(e["rows"]) == 4 for e in before + after)  # (its share, handed by group 0, every step it was in)
    assert err0.count("left: [1]") == 3, err0[-3000:]
    for left, back in ((frozen, thawed), (killed, after[0]), (held, let_go)):
        assert f"rejoined: 1 (absent for global steps {left['global_step'] + 1}-{back['global_step'] - 1}" in err0
    # group 0 never waited a whole collective_timeout_s (12 s) for the group frozen from outside: it left it out
    # after a third of it (inside a collective) or the heartbeat timeout (in the quorum), and its generator, which
    # waits for its trainer up to 12 s, did not give up on it (with torchft's waits at collective_timeout_s, a group
    # frozen inside a collective for longer ended the other group's generator first, and so that group)
    times = {e["global_step"]: e["time"] for e in log0}
    longest = max(times[s + 1] - times[s] for s in range(held["global_step"], let_go["global_step"]))
    assert longest < 8.0, longest
    assert "copied the weights, optimizer and schedule from a peer" in err1
    assert "GENERATORS []" in err1 and "GENERATORS []" not in err0  # (group 1 started no generator process)
    # (the counters group 0 logs: the prompts it handed group 1, and those of group 1's share it kept and trained
    # while group 1 was away; never one made up)
    last0 = json.loads(err0.split("LOG_HISTORY ", 1)[1].splitlines()[0])[-2]
    away = 100 - len(before + after)  # (the global steps group 1 did not train: its three absences, and on a loaded
    # machine the first steps, when it was up after group 0 had started the run)
    assert sum(len(e["rows"]) == 8 for e in log0) == away
    assert last0["replicas/trainer_prompts_kept"] == 4 * away and last0["replicas/trainer_prompts_made_up"] == 0
    assert last0["replicas/trainer_prompts_handed"] == 4 * len(before + after), last0
    print(f"drill (2 trainer replicas + 1 generator): SIGSTOP group 1 after global step {frozen['global_step']} for "
          f"6 s: group 0's next step +{times[frozen['global_step'] + 1] - stopped_at:.1f} s, group 1 back in global "
          f"step {thawed['global_step']} at +{thawed['time'] - stopped_at:.1f} s; SIGKILL group 1 after global step "
          f"{killed['global_step']}: group 0's next step +{times[killed['global_step'] + 1] - killed_at:.1f} s, group "
          f"1 (restarted) back in global step {rejoined} at +{after[0]['time'] - killed_at:.1f} s; SIGSTOP from "
          f"outside for 15 s after global step {held['global_step']}: group 0's longest step gap {longest:.1f} s, group "
          f"1 back in global step {let_go['global_step']} at +{let_go['time'] - held_at:.1f} s; prompts lost or "
          f"sampled again: 0")
    _check_final_weights(tiny_model, out0, out1, log0 + log1, 100)
