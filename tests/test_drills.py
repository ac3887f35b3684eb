"""Drills: every rank of a running job killed (SIGKILL) or frozen (SIGSTOP: alive, answering nothing), under
torchrun and under plain `python`; and a generator that fails while it starts. Every survivor ends within
`collective_timeout_s + 30 s` of the signal, naming the rank, and nothing is left behind.

Jobs of one kind run side by side (most of a drill is waiting), each with collective_timeout_s=60 (a frozen
rank is found by its missing heartbeat after 15 s of silence, whatever the timeout), and without pinning
processes to cores (OMP_NUM_THREADS=1), so that side-by-side jobs share both cores.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import (REPO, SCRIPTS, assert_on_policy, free_port, job_processes, launch_bare, orphans, popen_script,
                      step_logs, trained_rows)

pytestmark = [pytest.mark.slow, pytest.mark.drill]

TIMEOUT_S = 60  # collective_timeout_s of the drilled jobs (start-ups side by side on 2 cores are slow)
BOUND_S = TIMEOUT_S + 30
NAMES = {**{f"trainer{k}": f"rank {k} (trainer {k})" for k in range(4)}, "generator": "generator 0)"}
# The torchrun drills' trainer ranks are one tensor-parallel group (trainer_tensor_parallel_size=2): a killed or frozen
# rank stops its peer inside the layers' all-reduces as well as FSDP2's collectives. HFLLAMARL_ALL_LAYOUTS=1 adds the
# full 2-D mesh (4 trainer ranks as TP 2 x FSDP 2, every rank drilled).
TP = ["--extra", json.dumps({"trainer_tensor_parallel_size": 2, "per_device_train_batch_size": 8})]


def start(model: str, out: str, launch: str, extra=(), nproc: int = 3) -> subprocess.Popen:
    """`launch`: "torchrun", "accelerate" (accelerate launch), "python" (the trainer bootstraps: its first steps come while the generator starts), or
    "python-mid" (python without bootstrap: the first step is the generator's, the job is in its loop)."""
    if launch == "python-mid":
        launch, extra = "python", [*extra, "--no-bootstrap"]
    args = [str(SCRIPTS / "train_tiny.py"), model, out, "--steps", "200", "--report-to", "none",
            "--timeout", str(TIMEOUT_S), *extra]
    if launch == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *args]
    elif launch == "accelerate":
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "examples" / "accelerate" / "multi_process.yaml"), "--num_processes", str(nproc),
               "--main_process_port", str(free_port()), *args]
    else:
        cmd = [sys.executable, *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    if launch == "python":  # (forked from the session's preload server, as a script run from its shell would be)
        return popen_script(args, env)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def ranks_of(proc: subprocess.Popen, launch: str, out: str) -> dict[str, psutil.Process]:
    """The job's processes by role."""
    if launch.startswith("python"):
        kids = [p for p in job_processes(proc, out)
                if "hfllamarl.runtime.generation.generator_child" in " ".join(cmdline(p))]
        return {"trainer0": psutil.Process(proc.pid), "generator": kids[0]}
    out, ranks = {}, psutil.Process(proc.pid).children()
    ranks = [p for p in ranks if "train_tiny.py" in " ".join(cmdline(p))]
    for p in ranks:
        local = int(p.environ()["LOCAL_RANK"])
        out["generator" if local == len(ranks) - 1 else f"trainer{local}"] = p
    return out


def wait_first_step(out: str, proc: subprocess.Popen, timeout: float = 400) -> None:
    log = os.path.join(out, "trained_prompts-rank0.jsonl")
    deadline = time.monotonic() + timeout
    while not (os.path.exists(log) and os.path.getsize(log)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job never finished its first step"
        time.sleep(0.5)


def cmdline(p: psutil.Process) -> list[str]:
    """A process's command line; empty once it has ended (a zombie has none)."""
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def belongs_to(p: psutil.Process, out: str) -> bool:
    """Whether `p` is a process of the job writing to `out` (its argument, or a file under it). A job's directory
    can be a prefix of another's name ("python-killed", "python-killed-stop"): compare whole paths."""
    return any(arg == out or arg.startswith(out + os.sep) for arg in cmdline(p))


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def drill(model: str, out: str, launch: str, victim: str, sig: str, results: dict, extra=(), nproc: int = 3) -> None:
    """Start a job, signal `victim` after the first step; record how the survivors ended."""
    proc = start(model, out, launch, extra, nproc)
    try:
        wait_first_step(out, proc)
        time.sleep(1.0)  # somewhere inside a later step
        ranks = ranks_of(proc, launch, out)
        survivors = [p for role, p in ranks.items() if role != victim]
        where = int(ranks[victim].environ().get("LOCAL_RANK", "0")) if launch == "torchrun" else 0
        signalled = time.monotonic()
        ranks[victim].send_signal(getattr(signal, sig))
        if launch.startswith("python") and victim == "trainer0":  # (the parent is the victim; its children survive)
            while any(alive(p) for p in survivors) and time.monotonic() - signalled < BOUND_S + 30:
                time.sleep(0.2)
            ended = time.monotonic() - signalled
            proc.kill()
            _, err = proc.communicate(timeout=60)
            code = 1
        else:
            _, err = proc.communicate(timeout=BOUND_S + 60)
            ended, code = time.monotonic() - signalled, proc.returncode
        results[(launch, victim, sig)] = {"seconds": ended, "code": code, "err": err, "rank": where,
                                          "left": [p.pid for p in survivors if alive(p)]}
    finally:
        end_job(proc, out)


def end_job(proc: subprocess.Popen, out) -> None:
    """Kills whatever of the job in ``out`` is left (a drill that failed leaves its ranks behind)."""
    for p in psutil.Process(os.getpid()).children(recursive=True) + job_processes(proc, out):
        if belongs_to(p, out) and alive(p):
            p.kill()
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def run_side_by_side(model, tmp_path, cases, extra=(), nproc: int = 3) -> dict:
    results: dict = {}
    threads = [threading.Thread(target=drill, args=(model, str(tmp_path / "-".join(c)), *c, results, extra, nproc))
               for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def check(results: dict, case: tuple) -> None:
    launch, victim, sig = case
    r = results.get(case)
    assert r is not None, f"{case}: the drill itself failed"
    tail = "\n".join(r["err"].strip().splitlines()[-12:])
    assert r["seconds"] < BOUND_S, (case, r["seconds"], tail)
    assert r["code"] != 0 and not r["left"], (case, r, tail)
    if launch == "torchrun" and sig == "SIGKILL":  # torchrun itself sees the death and names the rank
        assert f"rank      : {r['rank']}" in tail and "Signal 9" in tail, (case, tail)
    elif launch == "python" and victim == "trainer0":  # the generator child tells why it left
        assert ("rank 0 (trainer 0)" in tail and ("stopped answering" in tail or "is gone" in tail)), (case, tail)
    else:  # the last lines name the lost rank
        assert NAMES[victim] in tail and ("stopped answering" in tail or "killed by signal 9" in tail), (case, tail)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_every_rank_under_torchrun(family_model, tmp_path, sig):
    cases = [("torchrun", victim, sig) for victim in ("trainer0", "trainer1", "generator")]
    results = run_side_by_side(family_model("llama"), tmp_path, cases, TP)
    for case in cases:
        check(results, case)
        assert not orphans(str(tmp_path / "-".join(case)))


@pytest.mark.skipif(not os.environ.get("HFLLAMARL_ALL_LAYOUTS"), reason="HFLLAMARL_ALL_LAYOUTS=1: 5 jobs of 5 ranks")
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_every_rank_of_a_2d_trainer_mesh(family_model, tmp_path, sig):
    """4 trainer ranks as TP 2 x FSDP 2 + a generator: each trainer rank (tensor-parallel peers and data-parallel
    peers) and the generator killed or frozen after the first step."""
    cases = [("torchrun", victim, sig) for victim in ("trainer0", "trainer1", "trainer2", "trainer3", "generator")]
    results = run_side_by_side(family_model("llama"), tmp_path, cases, TP, nproc=5)
    for case in cases:
        check(results, case)
        assert not orphans(str(tmp_path / "-".join(case)))


def test_every_rank_under_plain_python_and_a_rank_that_fails(family_model, tmp_path):
    """Plain `python`: the trainer (the parent) and the generator child, killed and frozen while the child starts and
    the trainer trains on its own samples (bootstrap), and the child again in the loop. Side by side, four
    jobs whose rank fails on its own: vLLM cannot start (a KV cache too small for one sequence; under python and
    torchrun), a reward function raises, or the start-up budget (vllm_server_timeout, 1 s) runs out before the
    engine is up; each ends with that rank's own exception as its last lines, not with a lost heartbeat. (The
    drilled jobs' engines start side by side, slower than their collective timeout: start-up has its own budget.)"""
    model = family_model("llama")
    failing = {"python": ["--kv-cache-bytes", "4096", "--steps", "2"],
               "torchrun": ["--kv-cache-bytes", "4096", "--steps", "2"],
               "reward": ["--bad-reward", "raise", "--steps", "2"],
               # (the trainer waits from the start: bootstrapping, it would train while the budget is not spent)
               "startup": ["--startup-timeout", "1", "--steps", "2", "--no-bootstrap"]}
    started = time.monotonic()
    procs = {name: start(model, str(tmp_path / f"fails-{name}"), "torchrun" if name == "torchrun" else "python",
                         extra=extra) for name, extra in failing.items()}
    # Signalled 1 s after the first step: under "python" the trainer is still bootstrapping (its own first batches)
    # while the generator child starts; under "python-mid" the job is in its loop (a child killed there:
    # test_a_lost_generator_replica_is_survived_or_named).
    cases = [("python", victim, sig) for victim in ("trainer0", "generator") for sig in ("SIGKILL", "SIGSTOP")]
    cases += [("python-mid", "generator", "SIGSTOP")]
    results = run_side_by_side(model, tmp_path, cases)
    for case in cases:
        check(results, case)
        assert not orphans(str(tmp_path / "-".join(case)))
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode != 0, name
        last = "\n".join(err.strip().splitlines()[-6:])
        if name == "reward":
            assert "reward function 'broken' raised RuntimeError" in last, err[-4000:]
        elif name == "startup":
            # (the child joining, or its engine, is what the budget ran out on: either names it)
            assert "rank 1 (generator 0) did not" in last and "within 1 s (vllm_server_timeout" in last, err[-4000:]
        else:
            assert "ValueError: No available memory for the cache blocks" in last, (name, err[-4000:])
            assert "generator 0)" in err and "no heartbeat" not in last, (name, err[-4000:])
        assert not orphans(str(tmp_path / f"fails-{name}"))
    assert time.monotonic() - started < 400


def bare_drill(model: str, out: str, victim: int, sig: str, results: dict) -> None:
    procs = launch_bare(3, [str(SCRIPTS / "train_tiny.py"), model, out, "--steps", "200", "--report-to", "none",
                            "--timeout", str(TIMEOUT_S)], env={"OMP_NUM_THREADS": "1"})
    try:
        wait_first_step(out, procs[0])
        time.sleep(1.0)
        signalled = time.monotonic()
        procs[victim].send_signal(getattr(signal, sig))
        errs = {}
        for rank in {0, 1, 2} - {victim}:
            _, errs[rank] = procs[rank].communicate(timeout=BOUND_S + 30)
        seconds = time.monotonic() - signalled
        try:
            procs[victim].wait(timeout=30)  # a frozen rank is killed by a survivor
            victim_gone = True
        except subprocess.TimeoutExpired:
            victim_gone = False
        results[victim] = {"seconds": seconds, "codes": {r: procs[r].returncode for r in errs}, "errs": errs,
                           "victim_gone": victim_gone}
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate(timeout=60)


def test_under_a_bare_launch_the_store_host_frozen_or_a_rank_killed(family_model, tmp_path):
    """Ranks started bare (as mpirun or a batch scheduler would: nobody stops the survivors for them), rank 0
    hosting the job's store. Frozen, rank 0 answers nothing, store included: the others end naming it, and kill
    it (nobody else would). Killed, trainer 1 is named by the others, as soon as they see its process gone. Two
    jobs side by side."""
    results: dict = {}
    threads = [threading.Thread(target=bare_drill, args=(family_model("llama"), str(tmp_path / f"bare{v}"), v, sig,
                                                         results)) for v, sig in ((0, "SIGSTOP"), (1, "SIGKILL"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    frozen, killed = results[0], results[1]
    for r in (frozen, killed):
        assert r["seconds"] < BOUND_S and all(code not in (0, None) for code in r["codes"].values()), r["codes"]
    for err in frozen["errs"].values():
        assert "rank 0 (trainer 0), which hosts the job's store, stopped answering" in err, err[-3000:]
    assert frozen["victim_gone"], "the frozen store host was left behind"
    for err in killed["errs"].values():  # (named at once: its process is seen gone on this machine)
        assert "rank 1 (trainer 1) is gone (its process, pid" in err, err[-3000:]
    for v in (0, 1):
        assert not orphans(str(tmp_path / f"bare{v}"))


# ---------------------------------------------------------------------------- a lost generator replica
REPLICA_JOBS = {  # name: (launch, processes, generator_failure, what happens to replica 1 after the first steps)
    "python-killed": ("python", 3, "continue", "SIGKILL"),
    "python-killed-stop": ("python", 3, "stop", "SIGKILL"),
    "bare-frozen": ("bare", 4, "continue", "SIGSTOP"),
    "torchrun-raises": ("torchrun", 4, "continue", "raise"),
}
ROWS, EPOCH = 32, 8  # 32 rows / 4 prompts per step: every prompt once


def replica_job(model: str, out: str, name: str, results: dict) -> None:
    """Run one job with two generator replicas (1 or 2 trainers) and do `REPLICA_JOBS[name]` to replica 1."""
    launch, n, failure, what = REPLICA_JOBS[name]
    args = [str(SCRIPTS / "train_tiny.py"), model, out, "--steps", str(EPOCH), "--rows", str(ROWS),
            "--report-to", "none",
            "--timeout", str(TIMEOUT_S), "--num-generators", "2", "--generator-tp", "1", "--max-staleness", "0",
            "--extra", json.dumps({"generator_failure": failure})]
    if what == "raise":
        args += ["--generator-raises", "4:1"]
    else:  # trainer rank 0 signals replica 1's rank (its last) at the end of step 2
        args += ["--signal-rank-at", f"2:{n - 1}:{what}"]
    env = dict({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, OMP_NUM_THREADS="1")
    if launch == "bare":
        procs = launch_bare(n, args, env={"OMP_NUM_THREADS": "1"})
    else:
        if launch == "python":
            procs = [popen_script(args, env)]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr",
                   "127.0.0.1", "--master_port", str(free_port()), *args]
            procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)]
    try:
        watched = procs[:-1] if launch == "bare" else procs
        outs = [p.communicate(timeout=600) for p in watched]
        ended = time.time()
        victim, signalled = None, None
        if what != "raise":
            marker = os.path.join(out, "victim.pid")
            assert os.path.exists(marker), (name, outs[0][1][-3000:])
            signalled, pid = os.path.getmtime(marker), int(open(marker).read())
            victim = psutil.Process(pid) if psutil.pid_exists(pid) else None
        results[name] = {"seconds": ended - signalled if signalled else 0.0, "codes": [p.returncode for p in watched],
                         "stdout": outs[0][0], "stderr": outs[0][1],
                         "victim_gone": victim is None or not alive(victim)}
    finally:
        for p in psutil.Process(os.getpid()).children(recursive=True):
            if belongs_to(p, out):
                p.kill()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def test_a_lost_generator_replica_is_survived_or_named(tiny_model, tmp_path):
    """Two vLLM replicas, on-policy, one epoch. With generator_failure="continue" a replica SIGKILLed (plain python),
    frozen (SIGSTOP, ranks started bare: a survivor ends it) or failing on its own (under torchrun, whose agent would
    stop every rank on a non-zero exit) is survived: the job finishes every step with the other replica, the loss is
    logged and counted, every prompt of the epoch is trained exactly once and every step is on-policy (the prompts
    the lost replica owed are generated again under the current weights). With "stop" the job ends naming it.
    Four jobs side by side."""
    from hfllamarl.runtime.data.prompts import batch_rows

    results: dict = {}
    threads = [threading.Thread(target=replica_job, args=(tiny_model, str(tmp_path / name), name, results))
               for name in REPLICA_JOBS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stopped = results["python-killed-stop"]
    last = "\n".join(stopped["stderr"].strip().splitlines()[-6:])
    assert stopped["codes"] != [0] and stopped["seconds"] < BOUND_S, stopped["codes"]
    assert "rank 2 (generator 1, replica 1) was killed by signal 9" in last, last
    for name in ("python-killed", "bare-frozen", "torchrun-raises"):
        r = results[name]
        assert r["codes"] == [0] * len(r["codes"]) and r["victim_gone"], (name, r["codes"], r["stderr"][-3000:])
        assert "generator replica 1 (rank " in r["stderr"] and "is lost at tick" in r["stderr"], (name, r["stderr"][-3000:])
        steps = step_logs(r["stdout"])
        assert [h["step"] for h in steps] == list(range(1, EPOCH + 1)), name
        for h in steps:
            assert h["staleness/max"] == 0
            assert_on_policy(h)
        assert steps[0]["replicas/live"] == 2 and steps[-1]["replicas/live"] == 1 and steps[-1]["replicas/lost"] == 1
        assert steps[-1]["replicas/regenerated_prompts"] >= 1, name
        trainers = 1 if name == "python-killed" else 2
        rows = [trained_rows(str(tmp_path / name), rank) for rank in range(trainers)]
        epoch = []
        for step in range(1, EPOCH + 1):
            got = [row for rank in range(trainers) for row in rows[rank][step]]
            assert got == batch_rows(ROWS, 4 * trainers, step - 1, seed=0), (name, step)
            epoch += got
        if trainers == 1:
            assert sorted(epoch) == list(range(ROWS)), name  # one epoch: every prompt exactly once
        assert not orphans(str(tmp_path / name)), name


# ---------------------------------------------------------------------------- a rank frozen after the last step
EXIT_STEPS = 2  # the last step is checkpointed (checkpoint.due): the freeze comes right after that checkpoint


def exit_drill(model: str, out: str, launch: str, victim: int, results: dict, past_end: bool = False) -> None:
    """Run a 2-step job (1 trainer + 1 generator) whose rank `victim` is SIGSTOPped right after the last checkpoint
    is committed (`past_end`: right after it passed the end-of-job rendezvous); record how long the job took to end
    after that and what it printed last."""
    stop = ["--stop-after-end", str(victim)] if past_end else ["--stop-after-checkpoint", f"{EXIT_STEPS}:{victim}"]
    proc = start(model, out, launch, extra=["--steps", str(EXIT_STEPS), *stop, "--num-generators", "1"], nproc=2)
    marker = os.path.join(out, "victim.pid")
    try:
        deadline = time.monotonic() + 600
        while not os.path.exists(marker) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert os.path.exists(marker), (launch, victim, proc.communicate(timeout=60)[1][-3000:] if proc.poll() is not
                                        None else "the job never reached its last checkpoint")
        signalled = time.monotonic() - (time.time() - os.path.getmtime(marker))
        pid = int(open(marker).read())
        frozen = psutil.Process(pid)
        if launch == "python" and victim == 0:  # the frozen parent is the user's process: its children must end
            kids = [p for p in job_processes(proc, out) if belongs_to(p, out) and p.pid != proc.pid]
            while any(alive(p) for p in kids) and time.monotonic() - signalled < BOUND_S + 30:
                time.sleep(0.2)
            ended = None if any(alive(p) for p in kids) else time.monotonic() - signalled
            proc.kill()
            _, err = proc.communicate(timeout=60)
            code = None
        else:
            try:
                _, err = proc.communicate(timeout=max(signalled + BOUND_S + 30 - time.monotonic(), 1))
                ended, code = time.monotonic() - signalled, proc.returncode
            except subprocess.TimeoutExpired:  # the job hangs: record it, then end it
                ended, code = None, None
                for p in job_processes(proc, out):
                    if p.pid != proc.pid and alive(p):
                        p.kill()
                proc.kill()
                _, err = proc.communicate(timeout=60)
        results[(launch, victim)] = {"seconds": ended, "code": code, "err": err,
                                     "victim_left": alive(frozen) and not (launch == "python" and victim == 0)}
    finally:
        end_job(proc, out)


def run_exit_drills(model, tmp_path, cases, past_end: bool) -> dict:
    """One exit drill per (launch, victim) case, all at once, each in tmp_path/<launch>-<victim>; the results by case."""
    results: dict = {}
    threads = [threading.Thread(target=exit_drill, args=(model, str(tmp_path / f"{launch}-{victim}"), launch, victim,
                                                         results, past_end)) for launch, victim in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print({case: r["seconds"] for case, r in results.items()})
    return results


def test_a_rank_frozen_after_the_last_checkpoint(family_model, tmp_path):
    """SIGSTOP right after the last checkpoint (a 2-step job, 1 trainer + 1 generator), every rank, under torchrun
    and plain python: the survivor ends within collective_timeout_s + 30 s of the signal, non-zero, its last lines
    naming the frozen rank, and no process of the job is left (a frozen rank under torchrun is killed by the survivor;
    the frozen trainer of a plain-python job is the user's process: its generator child ends, the parent stays).
    A generator child frozen after it reached the end of the job (a race with the parent's signal) is killed after a
    short grace, with a warning naming it, and the complete run ends normally. Four jobs side by side."""
    cases = [(launch, victim) for launch in ("torchrun", "python") for victim in (0, 1)]
    results = run_exit_drills(family_model("llama"), tmp_path, cases, past_end=False)
    for case in cases:
        launch, victim = case
        r = results.get(case)
        assert r is not None, f"{case}: the drill itself failed"
        tail = "\n".join(r["err"].strip().splitlines()[-12:])
        name = "rank 0 (trainer 0)" if victim == 0 else "rank 1 (generator 0)"
        if case == ("python", 1) and "reached the end of the job" in tail:
            # The parent stops its child right after the commit; the child, past the commit's last barrier, may have
            # reached the end-of-job rendezvous first: the run is complete, the child is killed after a short grace.
            assert r["code"] == 0 and r["seconds"] is not None and r["seconds"] < 30, (case, r["code"], tail)
            assert name in tail and "killed" in tail and not r["victim_left"], (case, tail)
        else:
            assert r["seconds"] is not None and r["seconds"] < BOUND_S, (case, r["seconds"], tail)
            assert r["code"] != 0 and not r["victim_left"], (case, r["code"], tail)
            assert name in tail and "stopped answering" in tail, (case, tail)
        assert not orphans(str(tmp_path / f"{launch}-{victim}")), case


def test_a_rank_frozen_past_the_end_of_the_job_is_killed_and_the_launcher_returns(family_model, tmp_path):
    """SIGSTOP a rank right after it passed the end-of-job rendezvous (a 2-step job, 1 trainer + 1 generator, each
    rank in turn, under torchrun and accelerate launch): the other rank exits 0 at once, and without a watcher the
    launcher would wait for the frozen one forever. The watcher each rank leaves behind kills it after the heartbeat
    timeout (15 s at collective_timeout_s=60): the launcher returns within a minute of the signal, non-zero, its last
    lines naming the frozen rank as one that reached the end of the job; the last checkpoint is complete and no
    process is left. Four jobs side by side."""
    from hfllamarl.runtime.world.liveness import heartbeat_timeout

    cases = [(launch, victim) for launch in ("torchrun", "accelerate") for victim in (0, 1)]
    results = run_exit_drills(family_model("llama"), tmp_path, cases, past_end=True)
    for case in cases:
        r = results.get(case)
        assert r is not None, f"{case}: the drill itself failed"
        tail = "\n".join(r["err"].strip().splitlines()[-40:])
        name = "rank 0 (trainer 0)" if case[1] == 0 else "rank 1 (generator 0)"
        assert r["seconds"] is not None and heartbeat_timeout(TIMEOUT_S) - 1 < r["seconds"] < 60, (case, r, tail)
        assert r["code"] != 0 and not r["victim_left"], (case, r["code"], tail)
        assert f"{name} (pid" in tail and "reached the end of the job but did not exit" in tail, (case, tail)
        out = tmp_path / f"{case[0]}-{case[1]}"
        assert (out / f"checkpoint-{EXIT_STEPS}").is_dir(), sorted(os.listdir(out))
        assert not orphans(str(out)), case


def test_a_rank_hung_in_its_exit_is_named_after_the_collective_timeout_and_a_clean_exit_is_not_slowed():
    """Ranks started bare that only join the job and exit (collective_timeout_s=4, so a silent rank would be found
    after 10 s of silence, the heartbeat's floor). A rank whose interpreter cannot exit (a non-daemon thread that never
    ends; its heartbeat goes on) is named by the other after collective_timeout_s, which exits non-zero and kills it;
    two ranks that exit cleanly do so with code 0, the end-of-job rendezvous taking a moment (seen: 0.3-0.5 s on a
    loaded machine, load average 18 on 2 cores), not a timeout. A third pair: rank 1 passes the rendezvous, then
    hangs in an exit handler that runs after it; rank 0 exits 0, and the watcher it left asks the hung rank for its
    threads' Python stacks (SIGUSR1), which name the handler it hangs in, then kills it after the heartbeat's floor
    (10 s without work) and says so."""
    from hfllamarl.runtime.world.liveness import heartbeat_timeout

    script = str(SCRIPTS / "exit_rendezvous.py")
    clean = launch_bare(2, [script, "clean"], env={})
    hung = launch_bare(2, [script, "hung"], env={})
    outs, late, started = {}, [], 0.0
    for name in ("clean", "hung", "late"):
        procs = {"clean": clean, "hung": hung, "late": late}[name]
        try:
            outs[name] = [p.communicate(timeout=90) for p in procs] + [time.monotonic() - started]
        finally:
            for p in procs:
                p.kill()
        if name == "clean":  # (the third pair starts once the clean one, whose rendezvous is timed, has ended)
            started = time.monotonic()
            late[:] = launch_bare(2, [script, "hung-late"], env={})
    survivor, victim = late  # (the survivor's stderr closes once its watcher is done too)
    err, v_err = outs["late"][0][1], outs["late"][1][1]
    assert survivor.returncode == 0 and victim.returncode == -9, (survivor.returncode, victim.returncode, err[-2000:])
    assert "rank 1 (generator 0) (pid" in err and "reached the end of the job but did not exit" in err, err[-2000:]
    assert "its threads' Python stacks are printed above" in err, err[-2000:]
    assert "hang_in_teardown" in v_err and "exit_rendezvous.py" in v_err, v_err[-3000:]
    assert heartbeat_timeout(4.0) - 1 < outs["late"][-1] < 60, outs["late"][-1]
    survivor, victim = hung
    err = outs["hung"][0][1]
    assert survivor.returncode == 1 and victim.returncode == -9, (survivor.returncode, victim.returncode, err[-2000:])
    last = err.strip().splitlines()[-1]
    assert "rank 1 (generator 0) did not reach the end of the job within 4 s (collective_timeout_s)" in last, err[-2000:]
    assert [p.returncode for p in clean] == [0, 0], outs["clean"][0][1][-2000:]
    met = [float(line.split()[1]) for out, _ in outs["clean"][:2] for line in out.splitlines()
           if line.startswith("MET ")]
    # (well under the 4 s a missing rank would be waited for, and the 10 s of silence that would name one)
    assert len(met) == 2 and max(met) < 2.0, met


def test_a_bootstrap_batch_longer_than_the_generators_start_up_wait_does_not_fail_the_job(family_model, tmp_path):
    """Plain python, vllm_server_timeout=45: the bootstrap batch in progress when the generator becomes ready takes
    60 s more. The trainer announced the batch (bounded by collective_timeout_s), so the ready generator waits for
    it past its 45 s start-up wait, and the job trains its 8 steps (the generator used to give up: "rank 0 (trainer 0)
    did not reach 'start-up' within 45 s")."""
    out = str(tmp_path / "slow")
    proc = popen_script([str(SCRIPTS / "train_tiny.py"), family_model("llama"), out, "--steps", "8", "--report-to",
                         "none", "--startup-timeout", "45", "--slow-bootstrap", "60", "--timeout", "120"],
                        {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    try:
        stdout, stderr = proc.communicate(timeout=500)
    finally:
        end_job(proc, out)
    assert "SLOW_BOOTSTRAP generator ready" in stdout, stderr[-3000:]
    assert proc.returncode == 0 and "TRAINED global_step=8" in stdout, stderr[-3000:]
