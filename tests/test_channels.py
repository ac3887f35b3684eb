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
        assert "rank 1 (trainer 1) stopped" in outs[rank][1], outs[rank][1][-3000:]
    assert elapsed < 60, elapsed


def test_two_batches_finished_in_one_tick_are_shared_batch_by_batch():
    """Partial rollouts can finish batches k and k+1 in the same tick; each trainer rank gets half of each,
    not batch k on one rank and batch k+1 on the other."""
    from hfllamarl.runtime.rollout import RolloutGroup, split_by_batch

    groups = [RolloutGroup([], b, 0, 0.0, 0) for b in (3, 3, 3, 3, 4, 4, 4, 4)]
    chunks = split_by_batch(groups, 2)
    assert [[g.batch_index for g in c] for c in chunks] == [[3, 3, 4, 4], [3, 3, 4, 4]]
    assert [g for c in chunks for g in c if g.batch_index == 3] == groups[:4]  # order kept within a batch
    three = split_by_batch(groups[:3] + groups[4:7], 2)  # uneven: sizes differ by at most one per batch
    assert [[g.batch_index for g in c] for c in three] == [[3, 3, 4, 4], [3, 4]]
