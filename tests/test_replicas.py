"""Generator replicas: the layout, how a batch splits over replicas and trainer ranks, the ledger that survives a
lost replica, and (slow) whole jobs with several replicas. Failure drills: tests/test_drills.py."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import (SCRIPTS, assert_on_policy, free_port, job_processes, kill_processes, orphans, run_script,
                      step_logs, tail, trained_rows)
from hfllamarl.runtime.loop.schedule import Schedule, position_owner, replica_share, trainer_positions
from hfllamarl.runtime.world.topology import Topology


def topology(rank=0, world=5, generators=4, tp=2, failure="stop", **kw) -> Topology:
    return Topology(mode="launcher", rank=rank, world_size=world, num_generators=generators, timeout_s=5,
                    use_cpu=True, tensor_parallel_size=tp, failure=failure, **kw)


def test_the_layout_is_replicas_of_consecutive_ranks():
    topo = topology(rank=3, world=6, generators=4, tp=2)  # trainers 0-1, replica 0 = ranks 2-3, replica 1 = 4-5
    assert (topo.num_trainers, topo.num_replicas, topo.replica_size) == (2, 2, 2)
    assert [topo.replica_of(r) for r in range(6)] == [None, None, 0, 0, 1, 1]
    assert topo.replica_ranks(1) == [4, 5] and (topo.replica, topo.local_rank, topo.local_world_size) == (0, 1, 2)
    assert topo.describe(5) == "rank 5 (generator 3, replica 1)" and topo.describe_replica(1) == "replica 1 (ranks 4-5)"
    assert topology(world=3, generators=2, tp=None).num_replicas == 1  # default: one engine over every generator
    assert topology(world=3, generators=2, tp=None).describe(2) == "rank 2 (generator 1)"


def test_only_another_replicas_loss_is_survived_and_only_once_started():
    # 1 trainer; replica 0 = ranks 1-2, replica 1 = ranks 3-4
    trainer, gen = topology(rank=0, failure="continue"), topology(rank=1, failure="continue")
    for topo in (trainer, gen):
        assert not topo.contained(4)  # not started yet: a replica that cannot start stops the job
        topo.containing = True
    assert trainer.contained(2) and trainer.contained(4) and not trainer.contained(0)
    assert gen.contained(3) and not gen.contained(2) and not gen.contained(0)  # its own replica, a trainer: no
    stop = topology(rank=0, failure="stop")
    stop.containing = True
    assert not stop.contained(4)


@pytest.mark.parametrize("prompts", [4, 7, 12])
@pytest.mark.parametrize("live", [[0], [0, 1], [0, 2], [1, 2, 3]])
def test_a_batch_splits_over_live_replicas_in_whole_prompts(prompts, live):
    sizes = set()
    for batch in range(6):
        share = replica_share(prompts, live, batch)
        assert sorted(share) == sorted(live)
        assert sorted(p for ps in share.values() for p in ps) == list(range(prompts))  # each prompt exactly once
        for positions in share.values():  # contiguous runs, sizes within one of each other
            assert positions == list(range(positions[0], positions[0] + len(positions))) if positions else True
        assert max(map(len, share.values())) - min(map(len, share.values())) <= 1
        assert share == replica_share(prompts, live, batch)  # a function of (prompts, live, batch) alone
        sizes.add(tuple(len(share[r]) for r in live))
    if prompts % len(live):  # the longer runs go to each replica in turn
        assert len(sizes) > 1


def test_hand_values_of_the_two_splits():
    assert replica_share(8, [0, 1], 0) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    assert replica_share(8, [0, 1], 1) == {1: [0, 1, 2, 3], 0: [4, 5, 6, 7]}
    assert replica_share(7, [0, 1], 0) == {0: [0, 1, 2, 3], 1: [4, 5, 6]}
    assert replica_share(7, [0, 1], 1) == {1: [0, 1, 2, 3], 0: [4, 5, 6]}
    assert [list(trainer_positions(8, 3, k)) for k in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [position_owner(p, 8, 3) for p in range(8)] == [0, 0, 0, 1, 1, 1, 2, 2]


def test_rollouts_reach_the_trainer_rank_of_their_position_whichever_replica_sent_them():
    from hfllamarl.runtime.loop.rollout import RolloutGroup, split_by_position

    split = split_by_position(8)
    from_replica_1 = [RolloutGroup([], 5, 0, 0.0, 0, position=p, replica=1) for p in (2, 3, 4, 5)]
    assert [[g.position for g in c] for c in split(from_replica_1, 2)] == [[2, 3], [4, 5]]
    assert [[g.position for g in c] for c in split(from_replica_1, 3)] == [[2], [3, 4, 5], []]
    evaluation = RolloutGroup([], -3, 2, 1.0, 0, eval_version=2)  # evaluations are shared as before (every rank a part)
    chunks = split([evaluation], 2)
    assert chunks[0] == [evaluation] and [g.eval_version for g in chunks[1]] == [2]


def _dispatch(rank=1, trainers=2, replicas=2, failure="continue"):
    from hfllamarl.runtime.loop.dispatch import Dispatch

    topo = topology(rank=rank, world=trainers + replicas, generators=replicas, tp=1, failure=failure)
    topo.containing = True
    return topo, Dispatch(topo, Schedule(num_batches=10, max_staleness=1, prompts_per_batch=8))


def test_the_ledger_owes_exactly_what_a_lost_replica_did_not_deliver():
    from hfllamarl.runtime.loop.rollout import RolloutGroup

    topo, d = _dispatch(rank=1)
    tick = type("Executor", (), {"tick": 5})()
    assert d.begin_tick(tick) == [0, 1]  # batch 5: replica 1 generates positions 0-3, replica 0 positions 4-7
    assert d.assigned[5] == {**dict.fromkeys(range(4), 1), **dict.fromkeys(range(4, 8), 0)}
    inbox = {5: [RolloutGroup([], 5, 4, 0.0, 0, position=p) for p in (4, 5)]}
    assert d.owed(inbox) == {}  # nothing lost yet: what has not arrived is still to come
    topo.lost[0] = "killed"
    assert d.owed(inbox) == {5: [6, 7]}  # trainer rank 1 owns 4-7 and has 4, 5
    d.agree(5)  # (one trainer rank: nothing to gather) the loss is agreed and counted once
    assert d.live == [1] and d.metrics() == {"replicas/live": 1.0, "replicas/lost": 1.0,
                                             "replicas/regenerated_prompts": 0.0}
    orders = d.plan({5: [6, 7]}, stale=[], tick=5)
    assert orders == {1: {"weights": False, "work": {5: [6, 7]}}} and d.assigned[5][6] == d.assigned[5][7] == 1
    assert d.owed(inbox) == {} and d.regenerated == 2  # reassigned to a live replica: no longer owed
    assert d.plan({}, stale=[], tick=5) == {}  # nothing to do: the round ends


def test_a_trainer_rank_trains_exactly_its_positions_once_in_order():
    from hfllamarl.runtime.loop.rollout import RolloutGroup

    _, d = _dispatch(rank=1)
    group = lambda p: RolloutGroup([], 3, 2, 0.0, 0, position=p)  # noqa: E731
    assert [g.position for g in d.ordered(3, [group(p) for p in (6, 4, 7, 5)])] == [4, 5, 6, 7]
    with pytest.raises(RuntimeError, match=r"missing \[6\]"):
        d.ordered(3, [group(p) for p in (4, 5, 7)])
    with pytest.raises(RuntimeError, match=r"more than once \[5\]"):
        d.ordered(3, [group(p) for p in (4, 5, 5, 6, 7)])


def test_every_generator_replica_lost_stops_the_job_naming_them():
    from hfllamarl.runtime.loop.dispatch import NoReplicaLeftError

    topo, d = _dispatch(rank=0)
    topo.lost.update({0: "rank 2 (generator 0, replica 0) was killed by signal 9", 1: "rank 3 froze"})
    with pytest.raises(NoReplicaLeftError, match=r"every generator replica is lost: replica 0 \(rank 2\): rank 2 .*"
                                                  r"signal 9; replica 1 \(rank 3\): rank 3 froze"):
        d.agree(7)


def test_weights_flow_down_fan_out_chains_of_replicas():
    from hfllamarl.plugins.weight_sync.ddma import DDMAWeightSync, relay_layout

    assert relay_layout([0, 1, 2, 3], 1) == {0: None, 1: 0, 2: 1, 3: 2}  # one chain
    assert relay_layout([0, 1, 2, 3], 2) == {0: None, 1: None, 2: 0, 3: 1}  # two chains
    assert relay_layout([0, 2, 3], 5) == {0: None, 2: None, 3: None}  # the trainers feed every replica
    # fan_out defaults to trainer ranks // tensor-parallel size: a trainer rank feeds T/m replicas at the rate one
    # replica's rank takes its slice in
    assert DDMAWeightSync(topology(world=6, generators=4, tp=2)).fan_out == 1
    assert DDMAWeightSync(topology(world=8, generators=4, tp=1)).fan_out == 4
    backend = DDMAWeightSync(topology(world=5, generators=4, tp=1))
    backend.targets = [0, 2, 3]  # replica 1 is lost: the chain closes over it
    assert backend.layout() == {0: None, 2: 0, 3: 2} and backend.downstream(0) == [2, 3] and backend.downstream(3) == []


@pytest.mark.parametrize("kw,match", [
    ({"num_generator_processes": 3, "generator_tensor_parallel_size": 2}, "multiple of generator_tensor_parallel_size"),
    ({"num_generator_processes": 4, "vllm_data_parallel_size": 3}, "do not split num_generator_processes=4 evenly"),
    ({"num_generator_processes": 4, "generator_tensor_parallel_size": 1, "vllm_data_parallel_size": 2},
     "vllm_data_parallel_size=2 replicas, but .* make 4: set vllm_data_parallel_size=4"),
    ({"generator_failure": "ignore"}, "generator_failure must be 'stop' or 'continue'"),
    ({"vllm_data_parallel_size": 0}, "vllm_data_parallel_size=0; it must be a whole number >= 1"),
])
def test_a_generator_layout_that_cannot_run_is_refused(kw, match):
    from hfllamarl import AsyncAIPOConfig

    with pytest.raises(ValueError, match=match):
        AsyncAIPOConfig(output_dir="/tmp/hfllamarl-test-config", report_to="none", **kw)


def test_trls_data_parallel_size_is_the_replica_count():
    from hfllamarl import AsyncAIPOConfig

    args = AsyncAIPOConfig(output_dir="/tmp/hfllamarl-test-config", report_to="none", num_generator_processes=4,
                           vllm_data_parallel_size=2)
    assert (args.generator_tensor_parallel_size, args.num_generator_replicas) == (2, 2)
    assert args.topology.num_replicas == 2 and args.topology.replica_size == 2
    args = AsyncAIPOConfig(output_dir="/tmp/hfllamarl-test-config", report_to="none", num_generator_processes=2)
    assert (args.generator_tensor_parallel_size, args.num_generator_replicas) == (2, 1)  # as before: one engine


def test_a_resume_with_another_replica_count_is_refused_with_the_reason():
    from hfllamarl.runtime.weights.checkpoint import check_resumable

    marker = {"world_size": 4, "num_generators": 2, "num_replicas": 2, "job": {}}
    with pytest.raises(ValueError, match=r"generator replicas: 2 -> 1\).* own file .* cannot be handed to another "
                                         r"number of replicas"):
        check_resumable("ckpt", marker, topology(world=4, generators=2, tp=2), args=None)


def test_the_watchdog_marks_a_failed_replica_lost_and_stops_only_when_none_is_left():
    """A trainer rank's verdict over a real store: another replica's own failure is not a verdict with
    generator_failure="continue" (its replica is marked lost), the last replica's is (naming every replica);
    with "stop" the first failure is."""
    import datetime

    import torch.distributed as dist

    def record(topo, rank, cause):
        client = dist.TCPStore(*topo.store_addr, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=5))
        client.set(topo.liveness._key("failed", rank), json.dumps({"time": time.time(), "cause": cause,
                                                                    "reaction": False}))

    for failure in ("continue", "stop"):
        topo = Topology(mode="single", rank=0, world_size=3, num_generators=2, timeout_s=1, use_cpu=True,
                        tensor_parallel_size=1, failure=failure)
        topo.store()
        topo.containing = True
        record(topo, 2, "RuntimeError: engine died")
        verdict = topo.liveness.verdict()
        if failure == "stop":
            assert verdict == "rank 2 (generator 1, replica 1) failed:\nRuntimeError: engine died", verdict
            continue
        assert verdict is None and topo.lost == {1: "rank 2 (generator 1, replica 1) failed: RuntimeError: engine died"}
        record(topo, 1, "ValueError: no KV cache")
        assert topo.liveness.verdict() == (
            "every generator replica is lost: replica 0 (rank 1): rank 1 (generator 0, replica 0) failed: ValueError: "
            "no KV cache; replica 1 (rank 2): rank 2 (generator 1, replica 1) failed: RuntimeError: engine died")


def rows_of(rank: int, step: int, trainers: int, prompts: int) -> list[int]:
    """The independent reference: the dataset rows trainer rank `rank` trains at `step`, from the data schedule
    (seed 0, 64 rows) and the positions it owns: the same with one replica or many."""
    from hfllamarl.runtime.data.prompts import batch_rows

    rows = batch_rows(64, prompts, step - 1, seed=0)
    return [rows[p] for p in trainer_positions(prompts, trainers, rank)]


@pytest.mark.slow
def test_two_trainers_two_replicas_power_cut_and_resume(tiny_model, tmp_path):
    """torchrun, 2 FSDP2 trainer ranks + 2 vLLM replicas, two versions stale, partial rollouts (a completion spans
    two ticks, so each replica carries work in every checkpoint): SIGKILL every process after checkpoint 2, resume,
    and every rank trains exactly its positions of the data schedule at every step. A resume with one replica of
    tensor parallel 2 (same processes) is refused, naming the replica counts."""
    out = str(tmp_path / "replicas")
    common = ["--steps", "6", "--save-steps", "2", "--report-to", "none", "--max-staleness", "2",
              "--partial-rollout-tokens", "2", "--num-generators", "2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port", str(free_port()),
           str(SCRIPTS / "train_tiny.py"), tiny_model, out, *common, "--generator-tp", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = os.path.join(out, "trained_prompts-rank0.jsonl")
    deadline = time.monotonic() + 400
    try:
        while not (os.path.exists(log) and open(log).read().count("\n") >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, tail_of(proc)
            time.sleep(0.2)
    finally:
        kill_processes(job_processes(proc, out))
        proc.communicate(timeout=60)
    time.sleep(1)
    assert not orphans(out) and "checkpoint-2" in os.listdir(out)
    saved = sorted(os.listdir(os.path.join(out, "checkpoint-2", "hfllamarl")))
    assert {"generator-0.pt", "generator-1.pt"} <= set(saved), saved  # each replica's carried work

    with ThreadPoolExecutor(2) as pool:  # the refused resume only reads the checkpoint: run it beside the resume
        refused = pool.submit(run_script, [str(SCRIPTS / "train_tiny.py"), tiny_model, out, *common,
                                           "--generator-tp", "2", "--resume"], nproc=4, timeout=200)
        resumed = pool.submit(run_script, [str(SCRIPTS / "train_tiny.py"), tiny_model, out, *common,
                                           "--generator-tp", "1", "--resume"], nproc=4, timeout=400)
        proc = refused.result()
        assert proc.returncode != 0 and "generator replicas: 2 -> 1" in proc.stderr, tail(proc)
        proc = resumed.result()
    assert proc.returncode == 0, tail(proc)
    steps = step_logs(proc.stdout)
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5, 6]
    assert max(h["staleness/max"] for h in steps) == 2 and all(h["replicas/live"] == 2 for h in steps)
    assert any(h["partial_rollouts/count"] > 0 for h in steps)
    for rank in (0, 1):  # 2 ranks x 16 completions / 4 per prompt = 8 prompts per step
        rows = trained_rows(out, rank)
        assert [rows[step] for step in range(1, 7)] == [rows_of(rank, step, 2, 8) for step in range(1, 7)], rank


def tail_of(proc) -> str:
    if proc.poll() is None:
        return "still running"
    return proc.communicate()[1][-3000:]


@pytest.mark.slow
def test_a_replica_lost_mid_sync_leaves_the_next_one_a_flagged_partial_load():
    """The relay trainer -> replica 0 -> replica 1 (no vLLM; whole tensors). Whole, both replicas receive the
    trainer's weights bitwise. With replica 0 gone after its first pieces, the trainer finishes its send without it
    and replica 1, whose relay source it was, receives the rest as zeros, flags the load incomplete (the recovery
    stage sends it the version again) and does not hang."""
    from conftest import launch_bare

    def run(*flags):
        procs = launch_bare(3, [str(SCRIPTS / "relay_check.py"), *flags], env={"OMP_NUM_THREADS": "1"})
        outs = [p.communicate(timeout=120) for p in procs]
        return [p.returncode for p in procs], [
            json.loads(next((l for l in o.splitlines() if l.startswith("RESULT ")), "RESULT null")[7:])
            for o, _ in outs], outs

    codes, results, outs = run()
    assert codes == [0, 0, 0], outs
    assert results[0] == {"lost": []}
    for r in results[1:]:
        assert r["bitwise"] and not r["incomplete"] and r["weights"] == r["of"] == r["same"], r
    started = time.monotonic()
    codes, results, outs = run("--break")
    assert codes[1] == 9 and codes[0] == codes[2] == 0, (codes, outs)
    assert results[0] == {"lost": [0]}
    r = results[2]
    assert r["incomplete"] and r["weights"] == r["of"] and 0 < r["same"] < r["of"], r  # the first pieces, then zeros
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_an_interrupted_weight_load_is_repaired_by_the_next_whole_one(tmp_path):
    """What the recovery stage relies on when a replica's relay source is lost mid-sync: vLLM's reload_weights
    stopped half-way, then given the whole version, leaves the engine exactly as vLLM's own loader makes those
    weights (an independent check) and sampling greedily as transformers does with them."""
    proc = run_script([str(SCRIPTS / "generator_checks.py"), "interrupted", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, tail(proc)
    result = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    assert result == {"raised": True, "mismatches": [], "greedy_matches_hf": True}, result
