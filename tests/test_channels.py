"""Channels across 3 processes (gloo): BROADCAST, SCATTER, GATHER; a dead rank is named, nobody hangs."""

import time

from conftest import SCRIPTS, launch_bare, run_script, tail


def test_channels_across_three_processes():
    proc = run_script([str(SCRIPTS / "channels_check.py")], nproc=3, timeout=180)
    assert proc.returncode == 0, tail(proc)
    for r in range(3):
        assert f"CHANNELS OK rank {r}" in proc.stdout


def test_dead_rank_is_named_and_nobody_hangs():
    start = time.monotonic()
    procs = launch_bare(3, [str(SCRIPTS / "channels_check.py"), "--die", "1"], {"T": "30"})
    outs = [p.communicate(timeout=120) for p in procs]
    elapsed = time.monotonic() - start
    assert procs[1].returncode == 9
    for rank in (0, 2):
        assert procs[rank].returncode != 0
        # (the ranks share this machine: the dead rank's process is seen gone, without waiting for its heartbeat)
        assert "rank 1 (trainer 1) is gone (its process, pid" in outs[rank][1], outs[rank][1][-3000:]
    assert elapsed < 60, elapsed


def test_two_batches_finished_in_one_tick_are_shared_batch_by_batch():
    """Partial rollouts can finish batches k and k+1 in the same tick; each trainer rank gets half of each,
    not batch k on one rank and batch k+1 on the other."""
    from hfllamarl.runtime.loop.rollout import RolloutGroup, split_by_batch

    groups = [RolloutGroup([], b, 0, 0.0, 0) for b in (3, 3, 3, 3, 4, 4, 4, 4)]
    chunks = split_by_batch(groups, 2)
    assert [[g.batch_index for g in c] for c in chunks] == [[3, 3, 4, 4], [3, 3, 4, 4]]
    assert [g for c in chunks for g in c if g.batch_index == 3] == groups[:4]  # order kept within a batch
    three = split_by_batch(groups[:3] + groups[4:7], 2)  # uneven: sizes differ by at most one per batch
    assert [[g.batch_index for g in c] for c in three] == [[3, 3, 4, 4], [3, 4]]


def test_every_trainer_rank_takes_part_in_an_evaluation():
    """An evaluation with fewer prompts than trainer ranks still reaches every rank (an empty share), so every rank
    joins the reduction of its metrics; a training batch is split as before."""
    from hfllamarl.runtime.loop.rollout import RolloutGroup, split_by_batch

    evaluation = [RolloutGroup([], -3, 2, 1.5, 7, eval_version=2)]
    train = [RolloutGroup([], 5, 2, 0.0, 0) for _ in range(2)]
    chunks = split_by_batch(train + evaluation, 3)
    assert [[(g.batch_index, g.eval_version) for g in c] for c in chunks] == [
        [(5, None), (-3, 2)], [(5, None), (-3, 2)], [(-3, 2)]]
    assert chunks[0][1] is evaluation[0] and chunks[1][1].rollouts == [] and chunks[1][1].generation_seconds == 1.5


def _rendezvous_with_a_peer(peer, budget_s: float):
    """Rank 0 of a real store (timeout 1 s) meets rank 1, played by `peer(client, key)` in a thread."""
    import datetime
    import threading

    import torch.distributed as dist

    from hfllamarl.runtime.world.topology import Topology

    topo = Topology(mode="single", rank=0, world_size=2, num_generators=1, timeout_s=1, use_cpu=True)
    topo.store()
    client = dist.TCPStore(*topo.store_addr, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    thread = threading.Thread(target=peer, args=(client, lambda kind: topo.liveness._key(kind, 1)), daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        topo.liveness.rendezvous("start-up", budget_s, why=" (vllm_server_timeout)")
        return time.monotonic() - started, None
    except Exception as exc:  # noqa: BLE001 (the caller checks which)
        return time.monotonic() - started, exc
    finally:
        thread.join()


def test_startup_waits_for_a_slow_peer_past_the_collective_timeout_and_no_longer_than_its_budget():
    """A peer still starting (beating, not there yet) is waited for beyond collective_timeout_s (1 s here) up to
    the start-up budget, also through a silence longer than the heartbeat timeout (a starting rank's heartbeat
    thread can be starved on a crowded machine); one that failed meanwhile ends the wait at once with its own
    error. The four cases run side by side, each on a store of its own (they are mostly waiting)."""
    from concurrent.futures import ThreadPoolExecutor

    def slow(client, key, arrive_after=3.0):
        end = time.time() + arrive_after
        while time.time() < end:
            client.set(key("heartbeat"), repr(time.time()))
            time.sleep(0.2)
        client.set(key("reached/start-up"), "1")

    def starved(client, key):  # beats, then (a native library loading, the machine crowded) is silent past the
        client.set(key("heartbeat"), repr(time.time()))  # heartbeat timeout (10 s here), then reaches start-up
        time.sleep(12.0)
        client.set(key("heartbeat"), repr(time.time()))
        client.set(key("reached/start-up"), "1")

    def fails(client, key):
        import json
        client.set(key("failed"), json.dumps({"time": time.time(), "cause": "ValueError: no KV cache",
                                              "reaction": False}))

    cases = [(slow, 30), (lambda c, k: slow(c, k, arrive_after=4.0), 2), (starved, 30), (fails, 30)]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: _rendezvous_with_a_peer(*case), cases))

    waited, error = results[0]
    assert error is None and 3.0 <= waited < 10, (waited, error)

    waited, error = results[1]
    assert "rank 1 (generator 0) did not reach 'start-up' within 2 s (vllm_server_timeout)" in str(error), error
    assert 2.0 <= waited < 4.0, waited

    waited, error = results[2]
    assert error is None and 12.0 <= waited < 20, (waited, error)

    waited, error = results[3]
    assert "rank 1 (generator 0) failed:\nValueError: no KV cache" in str(error) and waited < 5, (waited, error)


def _store_host(world_size: int = 2):
    """Rank 0 of a single-process job (it hosts the job's store) and its liveness, set up as `Liveness.start` does
    it, without the heartbeat and watchdog threads: the tests drive it."""
    from hfllamarl.runtime.world.processes import process_identity
    from hfllamarl.runtime.world.topology import Topology

    topo = Topology(mode="single", rank=0, world_size=world_size, num_generators=world_size - 1, timeout_s=60,
                    use_cpu=True)
    topo.store()
    topo.liveness._here = process_identity()
    return topo, topo.liveness


def test_a_peer_whose_process_ended_on_this_machine_is_named_at_once():
    """A rank whose process ended on this machine (SIGKILL: a zombie until its parent reaps it, then a free pid) is
    named by the next verdict, long before its heartbeat would go stale. A live process, a record from another
    machine or pid namespace, and a pid now held by another process (another start time) are told apart."""
    import json
    import signal
    import subprocess
    import sys

    from hfllamarl.runtime.world.processes import process_gone, process_identity, proc_stat as _proc_stat

    topo, live = _store_host()
    here = live._here
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        where = process_identity(peer.pid)
        assert where["pid"] == peer.pid and where["boot"] == here["boot"] and where["start"] != here["start"]
        live._locked(lambda c: (c.set(live._key("process", 1), json.dumps(where)),
                                c.set(live._key("heartbeat", 1), repr(time.time() + 600))))  # fresh all along
        assert live.verdict() is None and not process_gone(where, here)
        peer.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _proc_stat(peer.pid)[0] != "Z":  # dead, not yet reaped
            assert time.monotonic() < deadline
            time.sleep(0.05)
        verdict = live.verdict()
        assert verdict == (f"rank 1 (generator 0) is gone (its process, pid {peer.pid} on this machine, ended) "
                           "without reporting an error."), verdict
        peer.wait()  # reaped: the pid is free
        assert process_gone(where, here)
        assert not process_gone(dict(where, boot="another machine"), here)
        assert not process_gone(dict(where, pidns=1), here)
        assert not process_gone({k: v for k, v in where.items() if k != "start"}, here)  # nothing to compare
        assert process_gone(dict(here, start=str(int(here["start"]) + 1)), here)  # this pid, another process's
        # A rank that finished (its done mark written before it exits) is no loss.
        live._locked(lambda c: c.set(live._key("done", 1), "1"))
        assert live.verdict() is None
    finally:
        peer.kill()
        peer.wait()


def test_a_killed_child_is_named_by_its_signal_while_another_thread_reaps_it():
    """In a single-process job the generator ranks are this process's children: one SIGKILLed is named by its
    signal, also when two threads look at once (the watchdog killing the other children while the main thread
    explains a failed collective: Popen.poll answers None while the other thread's waitpid runs)."""
    import json
    import subprocess
    import sys
    import threading

    from hfllamarl.runtime.world.processes import process_identity, proc_stat as _proc_stat

    topo, live = _store_host()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    topo._children = [(1, child)]
    try:
        live._locked(lambda c: (c.set(live._key("process", 1), json.dumps(process_identity(child.pid))),
                                c.set(live._key("heartbeat", 1), repr(time.time() + 600))))
        assert live.verdict() is None  # (it reads where the child runs)
        child.kill()
        deadline = time.monotonic() + 10
        while _proc_stat(child.pid)[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        held = threading.Event()

        def other_thread_reaping():  # holds the lock Popen takes around waitpid, as another thread's poll does
            with child._waitpid_lock:
                held.set()
                time.sleep(0.5)

        thread = threading.Thread(target=other_thread_reaping)
        thread.start()
        held.wait(5)
        verdict = live.verdict()
        thread.join()
        assert verdict == "rank 1 (generator 0) was killed by signal 9 without reporting an error.", verdict
    finally:
        child.kill()
        child.wait()


def test_a_failing_store_host_waits_for_a_survivor_to_look_not_for_a_rank_that_ended():
    """A failing rank that hosts the job's store keeps the store up (`Liveness._linger`, after a failed collective
    and when its watchdog gives up) until every other rank has finished, failed, ended or gone silent: a survivor
    that had not looked yet would otherwise lose the store and blame its host, not the rank at fault. Here rank 2's
    process has ended (it holds nothing up) and rank 1, alive and beating, records its verdict after 2 s."""
    import json
    import subprocess
    import sys
    import threading

    from hfllamarl.runtime.world.processes import process_identity

    topo, live = _store_host(world_size=3)
    assert topo.hosts_store
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    where = process_identity(dead.pid)
    dead.kill()
    dead.wait()
    live._locked(lambda c: (c.set(live._key("process", 2), json.dumps(where)),
                            c.set(live._key("heartbeat", 1), repr(time.time())),
                            c.set(live._key("heartbeat", 2), repr(time.time()))))
    record = json.dumps({"time": time.time(), "cause": "rank 2 (generator 1) was killed", "reaction": True})
    verdict = threading.Timer(2.0, lambda: live._locked(lambda c: c.set(live._key("failed", 1), record)))
    verdict.start()
    started = time.monotonic()
    live._linger(linger_s=20.0)
    waited = time.monotonic() - started
    verdict.join()
    assert 2.0 <= waited < 4.0, waited  # until rank 1 has looked: not less, and not for rank 2
    started = time.monotonic()
    live._linger(linger_s=20.0)  # nobody left to wait for
    assert time.monotonic() - started < 3.0  # not the 20 s bound


def test_under_torchrun_the_survivors_failure_not_the_frozen_ranks_kill_is_the_root_cause(tmp_path):
    """torchrun names as the root cause the failure with the earliest timestamp, in whole seconds, the lowest rank on
    a tie. A survivor whose watchdog gives up on a frozen rank records its failure (torchrun's error file) and kills
    the frozen rank: in a later second, or torchrun names the frozen rank's SIGKILL instead of the survivor's message
    (the torchrun drill failed so once). Checked with torchrun's own choice (`ChildFailedError.get_first_failure`) on
    a real survivor process, a real frozen process, and the time the frozen one is seen dead."""
    import json
    import os
    import signal
    import subprocess
    import sys

    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from hfllamarl.runtime.world.processes import process_identity, proc_stat as _proc_stat

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    error_file = str(tmp_path / "error.json")
    survivor_code = f"""
from hfllamarl.runtime.world.processes import process_identity
from hfllamarl.runtime.world.topology import Topology
topo = Topology(mode="launcher", rank=1, world_size=2, num_generators=1, timeout_s=60, use_cpu=True,
                store_addr=("127.0.0.1", {store.port}))
live = topo.liveness
live._here, live._frozen, live.culprit = process_identity(), [0], 0
live._where[0] = {json.dumps(process_identity(frozen.pid))}
live._act("rank 0 (trainer 0) stopped answering: no heartbeat for more than 15 s")
"""
    try:
        frozen.send_signal(signal.SIGSTOP)
        env = dict(os.environ, TORCHELASTIC_RUN_ID="drill", TORCHELASTIC_ERROR_FILE=error_file,
                   TORCHELASTIC_USE_AGENT_STORE="true")
        survivor = subprocess.Popen([sys.executable, "-c", survivor_code], env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while _proc_stat(frozen.pid)[0] != "Z":  # killed by the survivor (this process reaps it)
            assert time.monotonic() < deadline and survivor.poll() in (None, 1), survivor.stderr.read()
            time.sleep(0.005)
        seen_dead = ProcessFailure(local_rank=0, pid=frozen.pid, exitcode=-9, error_file=str(tmp_path / "none.json"))
        _, err = survivor.communicate(timeout=60)
        assert survivor.returncode == 1 and "rank 1 (generator 0) stops because rank 0 (trainer 0)" in err, err
        named = ProcessFailure(local_rank=1, pid=survivor.pid, exitcode=1, error_file=error_file)
        rank, cause = ChildFailedError("train_tiny.py", {0: seen_dead, 1: named}).get_first_failure()
        assert rank == 1 and "stopped answering" in cause.message["message"], (rank, cause.message)
    finally:
        frozen.kill()
        frozen.wait()
