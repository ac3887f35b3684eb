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
