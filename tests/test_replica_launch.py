"""`hfllamarl train` with `trainer_replica_groups: 2` and no group named: one command starts both replica groups and
a lighthouse, and restarts a group that fails while the other trains on (`hfllamarl.commands.replica_launch`)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import kill_processes, prompts_log, prompts_log_runs

from hfllamarl.commands import replica_launch as rl
from hfllamarl.runtime.data.prompts import batch_rows

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "examples" / "recipes" / "tiny_cpu.yaml"


def test_which_commands_start_the_groups_themselves(tmp_path, monkeypatch):
    """Groups > 1 and no group named, without a launcher: start them (hand cases, the recipe file and the flags)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(rl.ENV_GROUP_LAUNCH, raising=False)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer_replica_groups: 3\nmax_steps: 2\n")
    assert rl.groups_to_start(["--config", str(recipe)]) == 3
    assert rl.groups_to_start(["--config", str(recipe), "--trainer_replica_groups", "1"]) == 0  # (flags win)
    assert rl.groups_to_start(["--config", str(recipe), "--trainer_replica_group=1"]) == 0  # one group of a run
    assert rl.groups_to_start(["--trainer-replica-groups", "2", "--check"]) == 2
    assert rl.groups_to_start(["--max_steps", "2"]) == 0
    assert rl.groups_to_start(["--trainer_replica_groups", "two"]) == 0  # (the recipe's own check refuses it)
    monkeypatch.setenv("WORLD_SIZE", "2")  # under a launcher: this process is one rank of one group
    assert rl.groups_to_start(["--config", str(recipe)]) == 0
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv(rl.ENV_GROUP_LAUNCH, "1")  # a group this module started
    assert rl.groups_to_start(["--config", str(recipe)]) == 0


def test_each_group_gets_its_group_its_output_and_its_share_of_the_machine():
    argv = ["--config", "r.yaml", "--max_restarts", "3"]
    zero = rl.group_argv(argv, 0, "http://h:9", "out", several=False)
    one = rl.group_argv(argv, 1, "http://h:9", "out", several=True)
    assert zero[:3] == argv[:3] and zero[zero.index("--trainer_replica_group") + 1] == "0"
    assert zero[zero.index("--output_dir") + 1] == "out" and one[one.index("--output_dir") + 1] == "out/replica-group-1"
    # (later flags win: the group itself does not restart, this module does; a one-process group takes no port)
    assert zero[len(zero) - 1 - zero[::-1].index("--max_restarts") + 1] == "0"
    assert zero[-2:] == ["--main_process_port", "0"] and int(one[one.index("--main_process_port") + 1]) > 0
    assert "--disable_tqdm" in one and "--disable_tqdm" not in zero  # (one progress bar: group 0's)
    assert rl.shares([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]] and rl.shares([0], 2) == []
    assert rl.restarts_asked(argv) == 3
    with pytest.raises(Exception, match="max_restarts='-1'"):
        rl.restarts_asked(["--max_restarts", "-1"])


def test_each_group_gets_its_share_of_the_gpus_this_process_may_use(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert rl.shares(rl.visible_gpus(4), 2) == [["0", "1"], ["2", "3"]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # (a restricted list stays restricted: 4-7, not 0-3)
    assert rl.shares(rl.visible_gpus(4), 2) == [["4", "5"], ["6", "7"]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b")
    assert rl.shares(rl.visible_gpus(2), 2) == [["GPU-a"], ["GPU-b"]]


def test_groups_sharing_group_0s_generators_get_shares_by_their_processes(monkeypatch):
    """trainer_replica_shared_generators: group 0 (its trainer and generators) gets a share of the machine for each of
    its processes, every other group (one trainer process, started without a launcher) one; hand cases."""
    assert rl.shares(list(range(6)), [2, 1]) == [[0, 1, 2, 3], [4, 5]]
    assert rl.shares(list(range(2)), [2, 1]) == [[0], [1]]  # (each at least one)
    assert rl.shares(list(range(8)), [3, 1, 1]) == [[0, 1, 2, 3, 4, 5], [6], [7]]  # (what is left over: group 0's)
    assert rl.shares(list(range(5)), [3, 1, 1]) == [[0, 1, 2], [3], [4]] and rl.shares([0, 1], [2, 1, 1]) == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sup = rl.Supervisor([], 2, 1, "out", several=True, grace_s=1.0, lighthouse="x", gpus_per_group=2, shared=True,
                        processes_per_group=2)
    assert sup._gpus == [["0", "1"], ["2"]] and sup._several(0) and not sup._several(1)
    assert sup.standby_after is not None  # (group 1 is one process: it has a standby; group 0, launched, none)
    one = rl.group_argv(["--config", "r.yaml"], 1, "http://h:9", "out", several=sup._several(1))
    assert one[one.index("--main_process_port") + 1] == "0"


def test_when_a_groups_standby_starts(monkeypatch):
    """Its delay after the group's start (seconds, default 20) or none ("off"), and a clear error for a bad value."""
    monkeypatch.delenv(rl.ENV_STANDBY_AFTER, raising=False)
    assert rl.standby_after_s() == 20.0
    for value, expected in (("3", 3.0), (" 0.5 ", 0.5), ("-1", 0.0), ("off", None), ("OFF", None), ("none", None)):
        monkeypatch.setenv(rl.ENV_STANDBY_AFTER, value)
        assert rl.standby_after_s() == expected, value
    monkeypatch.setenv(rl.ENV_STANDBY_AFTER, "soon")
    with pytest.raises(SystemExit, match="HFLLAMARL_STANDBY_AFTER_S='soon': give seconds"):
        rl.standby_after_s()
    # (no standby for a group of several processes, nor without restarts)
    monkeypatch.setenv(rl.ENV_STANDBY_AFTER, "3")
    assert rl.Supervisor([], 2, 0, "out", several=False, grace_s=1.0, lighthouse="x").standby_after is None
    assert rl.Supervisor([], 2, 1, "out", several=True, grace_s=1.0, lighthouse="x").standby_after is None
    assert rl.Supervisor([], 2, 1, "out", several=False, grace_s=1.0, lighthouse="x").standby_after == 3.0


def _data(tmp_path, rows=40):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+1=?", "answer": f"#### {a + 1}"}) + "\n" for a in range(rows)))
    return data


def test_a_groups_progress_bar_stays_one_line_and_the_commands_own_lines_start_after_it(monkeypatch):
    """What tqdm writes (each redraw after a carriage return, a line clear of spaces, the newline that ends it) comes
    out as one bar redrawn in place with the group's prefix, not as a prefixed line per redraw and empty prefixed
    lines; a line of the command's own written while the bar is open starts on a line of its own."""
    import io

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    bar = "\r  0%|          | 0/2 [00:00<?, ?it/s]\r 50%|#####     | 1/2 [00:00<00:00, 9.1it/s]"
    rl._copy(io.BytesIO(bar.encode()), err, ["[g0] "])
    rl.say("replica group 1 ended")
    rl._copy(io.BytesIO(("\r100%|##########| 2/2\r" + " " * 12 + "\r\nok \u2713\n").encode()), err, ["[g0] "])
    assert err.getvalue() == (
        "\r[g0]   0%|          | 0/2 [00:00<?, ?it/s]\r[g0]  50%|#####     | 1/2 [00:00<00:00, 9.1it/s]"
        "\nhfllamarl train: replica group 1 ended\n"
        "\r[g0] 100%|##########| 2/2\r" + " " * 12 + "\r\n[g0] ok \u2713\n")


def test_check_names_the_groups_and_starts_nothing(tmp_path, tiny_model):
    exe = os.path.join(os.path.dirname(sys.executable), "hfllamarl")
    proc = subprocess.run([exe, "train", "--config", str(RECIPE), "--model_name_or_path", tiny_model,
                           "--dataset_name", str(_data(tmp_path)), "--output_dir", str(tmp_path / "out"),
                           "--num_processes", "0", "--trainer_replica_groups", "2", "--max_restarts", "2", "--check"],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recipe OK" in proc.stdout and "2 trainer replica groups started here, each as above, restarted up to 2 " \
        "time(s) each; lighthouse started here" in proc.stdout, proc.stdout
    assert not (tmp_path / "out").exists()
    shared = subprocess.run(proc.args + ["--trainer_replica_shared_generators", "true"], cwd=str(tmp_path),
                            capture_output=True, text=True, timeout=300)
    assert shared.returncode == 0, shared.stderr[-3000:]
    assert "group 0 as above, its generators sampling every group's share, and the other 1 as one trainer process " \
        "each, without generators" in shared.stdout, shared.stdout


SLOW_REWARD = '''
import os, time

def digits(prompts, completions, **kwargs):
    """A share of digits; slow (0.5 s a batch) while the drill's flag file exists, so that the survivor outlasts the
    other group's restart on a loaded machine."""
    if os.path.exists(os.environ["DRILL_SLOW_FLAG"]):
        time.sleep(0.5)
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
'''


def _standbys(text):
    """The pids of the standbys the command's output shows waiting (ready, not taken over)."""
    ready = set(re.findall(r"standby of replica group \d+ ready \(process (\d+)", text))
    return {int(pid) for pid in ready - set(re.findall(r"restarted from its standby \(process (\d+)", text))}


def _trainer_of(proc, group, log):
    """The process of replica group `group` the command started (its trainer: the group's first process), not its
    standby."""
    import psutil

    waiting = _standbys(log.read_text())
    found = [p for p in psutil.Process(proc.pid).children(recursive=True)
             if "--trainer_replica_group" in p.cmdline() and p.pid not in waiting
             and p.cmdline()[p.cmdline().index("--trainer_replica_group") + 1] == str(group)]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
def test_one_command_restarts_a_frozen_group_then_a_killed_one_while_the_other_trains_on(tmp_path, tiny_model):
    """Two groups of one trainer and one generator each, started by one `hfllamarl train` with `max_restarts: 1`
    and a checkpoint every 10 steps, each group's standby started 3 s after it. Group 1's trainer is frozen
    (SIGSTOP) once it has trained 5 steps and both standbys are ready: the command ends it after 5 s stopped and
    hands the group to its standby, which copies the policy from group 0 and rejoins. Then group 0's trainer (the
    one that writes checkpoints) is SIGKILLed: its standby takes over, resumes from the newest checkpoint and copies
    the policy of group 1, which is ahead. The command ends with 0 (no standby left running); every global step
    trained each prompt of its batch once over both groups, no group trained a step twice, only group 0 wrote
    checkpoints, and both groups hold the same weights, bit for bit.

    A drill of two whole groups on a loaded 2-core machine, with kills at moments the test does not control: a failed
    attempt is printed and run once more in a fresh directory (both attempts must fail for the test to fail).
    """
    try:
        _drill(tmp_path / "attempt1", tiny_model)
    except AssertionError as exc:
        print(f"drill attempt 1 failed, run once more: {str(exc)[-2000:]}")
        _drill(tmp_path / "attempt2", tiny_model)


def _drill(tmp_path, tiny_model, shared=False):
    """One run of the drill above, in `tmp_path` (made here); `shared`: the groups share group 0's generator."""
    tmp_path.mkdir(parents=True)
    import psutil
    from safetensors.torch import load_file

    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    flag = tmp_path / "slow"
    out, steps = tmp_path / "out", 100
    log = open(tmp_path / "run.log", "w")
    exe = os.path.join(os.path.dirname(sys.executable), "hfllamarl")
    proc = subprocess.Popen(
        [exe, "train", "--config", str(RECIPE), "--model_name_or_path", tiny_model, "--dataset_name",
         str(_data(tmp_path)), "--output_dir", str(out), "--num_processes", "0", "--reward_funcs", "slow_reward:digits",
         "--trainer_replica_groups", "2", "--max_restarts", "1", "--max_steps", str(steps), "--save_steps", "10",
         "--logging_steps", "10", "--collective_timeout_s", "60"]
        + (["--trainer_replica_shared_generators", "true"] if shared else []),
        cwd=str(tmp_path), stdout=log, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, DRILL_SLOW_FLAG=str(flag), RUST_LOG="warn", HFLLAMARL_STANDBY_AFTER_S="3"))
    logs = {0: out / "trained_prompts-group0-rank0.jsonl", 1: out / "replica-group-1" / "trained_prompts-group1-rank0.jsonl"}
    deadline = time.monotonic() + 600

    def wait_for(what, ok):
        while not ok():
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"{what}: " + (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.1)

    def runs(g):
        return prompts_log_runs(prompts_log(logs[g])) if logs[g].exists() else [[]]

    try:
        wait_for("group 1 trains", lambda: len(runs(1)[0]) >= 5)
        wait_for("both standbys ready", lambda: len(_standbys((tmp_path / "run.log").read_text())) == 2)
        flag.write_text("")  # (every step takes 0.5 s more while a group is away: the other outlasts its restart)
        _trainer_of(proc, 1, tmp_path / "run.log").send_signal(signal.SIGSTOP)
        stopped_at = time.time()
        wait_for("group 1 back", lambda: len(runs(1)) == 2 and len(runs(1)[1]) >= 2)
        back1 = time.time()
        flag.unlink()
        wait_for("a checkpoint of group 0", lambda: any(out.glob("checkpoint-*")))
        flag.write_text("")
        _trainer_of(proc, 0, tmp_path / "run.log").send_signal(signal.SIGKILL)
        killed_at = time.time()
        wait_for("group 0 back", lambda: len(runs(0)) == 2 and len(runs(0)[1]) >= 2)
        back0 = time.time()
        flag.unlink()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            kill_processes(psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)])
        log.close()
    text = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "replica group 1: its process" in text and "has been stopped for 5 s (SIGSTOP); ending it" in text
    for g in (1, 0):
        assert f"replica group {g} ended (killed by SIGKILL)" in text, text[-4000:]
    assert text.count("starting it again (restart 1 of 1)") == 2 and "restart 1 of the launcher: resuming from" in text
    assert "left: [1]" in text and "rejoined: 1" in text and "left: [0]" in text and "rejoined: 0" in text
    assert f"run finished; model saved to {out}" in text and "[g0] " in text and "[g1] " in text
    for g in (1, 0):  # (each restart was its standby's: no new process imported and prepared the recipe)
        assert re.search(rf"\[g{g}\] hfllamarl train: replica group {g} restarted from its standby", text), text[-4000:]
    left = [pid for pid in _standbys(text) if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not left, f"standbys left running: {left}"
    rows = {}
    for g in (0, 1):
        (first, second) = runs(g)
        trained = [e["global_step"] for e in first + second]
        assert trained == sorted(set(trained)), (g, trained)  # (no step twice; a group left out may skip some)
        assert second[-1]["global_step"] == steps and any(e["rows"] for e in second)
        for e in first + second:
            rows.setdefault(e["global_step"], []).extend(e["rows"])
    # The step after a group's last logged one before it was stopped may lack that group's share in the logs: a kill
    # or a freeze between that step's commit (both groups' gradients) and the group's log line (CI 55: group 0 killed,
    # global step 52 logged by group 1 only; CI 56: group 1 frozen, step 11 logged by group 0 only).
    unlogged = {runs(g)[0][-1]["global_step"] + 1 for g in (0, 1)}
    for step in range(1, steps + 1):  # each global step trained every prompt of its batch once (2 groups x 2 prompts)
        expected = sorted(batch_rows(40, 4, step - 1, 42))
        if step in unlogged and len(rows[step]) == 2:
            assert len(set(rows[step])) == 2 and set(rows[step]) < set(expected), (step, rows[step])
            continue
        assert sorted(rows[step]) == expected, (step, rows[step])
    # group 0 writes the checkpoints, group 1 none (its generator too: it would wait for its trainer in the barrier)
    assert list(out.glob("checkpoint-*")) and not list((out / "replica-group-1").glob("*checkpoint-*"))
    a, b = load_file(out / "model.safetensors"), load_file(out / "replica-group-1" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    print(f"drill (one command{', shared generators' if shared else ''}): group 1 frozen, back (its second run's first steps) {back1 - stopped_at:.1f} s later; "
          f"group 0 killed, back {back0 - killed_at:.1f} s later")


@pytest.mark.slow
def test_one_command_with_shared_generators_restarts_a_frozen_group_then_the_generators_group(tmp_path, tiny_model):
    """The same drill with the groups sharing group 0's generator (`trainer_replica_shared_generators`): group 1 is
    one trainer process. Frozen, it is ended and handed to its standby, which copies the policy and is handed its
    share by group 0 again; group 0 killed (its generator goes with it), group 1 samples both shares itself until
    group 0's standby is back from its checkpoint with group 1's policy and its generator samples again."""
    try:
        _drill(tmp_path / "attempt1", tiny_model, shared=True)
    except AssertionError as exc:
        print(f"drill attempt 1 failed, run once more: {str(exc)[-2000:]}")
        _drill(tmp_path / "attempt2", tiny_model, shared=True)
