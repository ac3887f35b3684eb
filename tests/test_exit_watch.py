"""The watcher a launched rank leaves behind at the end of the job (`hfllamarl.runtime.world.exit_watch`), on real
processes: it kills a peer that has stopped working at its exit, and waits for one that is still working (the
interpreter's teardown of torch and vLLM takes seconds of CPU), up to its bound."""

import json
import subprocess
import sys
import time

from hfllamarl.runtime.world import exit_watch
from hfllamarl.runtime.world.processes import process_identity

GRACE_S = 1.5

# A process that works (CPU) for SECONDS and then exits, or forever (-1).
BUSY = ("import sys, time\nend = time.monotonic() + float(sys.argv[1])\n"
        "while float(sys.argv[1]) < 0 or time.monotonic() < end:\n    pass\n")


def _start(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _watch(peers: dict[str, subprocess.Popen], job_id: str) -> tuple[str, float]:
    spec = json.dumps({"peers": {name: process_identity(p.pid) for name, p in peers.items()}, "grace_s": GRACE_S,
                       "job_id": job_id})
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-S", "-I", exit_watch.__file__, spec], capture_output=True, text=True,
                          timeout=60)
    return done.stderr, time.monotonic() - start


def test_a_peer_that_stops_working_is_killed_after_the_grace_and_one_still_working_is_waited_for():
    """Three peers, grace 1.5 s: one asleep from the start (no CPU: killed after about the grace), one working for
    3 s and then exiting (twice the grace: it ends by itself, exit code 0), one working forever (killed at the bound,
    4 x the grace, and named as still working). The watcher returns once none is left."""
    asleep = _start("import time; time.sleep(120)")
    finishing = _start(BUSY, "3")
    forever = _start(BUSY, "-1")
    job = f"test-{time.time_ns()}"
    try:
        err, seconds = _watch({"rank 1 (asleep)": asleep, "rank 2 (finishing)": finishing,
                               "rank 3 (forever)": forever}, job)
        codes = [p.wait(timeout=10) for p in (asleep, finishing, forever)]
    finally:
        for p in (asleep, finishing, forever):
            p.kill()
    assert codes == [-9, 0, -9], (codes, err)
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert "rank 1 (asleep)" in lines[0] and f"did no work for {GRACE_S:.0f} s" in lines[0], err
    assert "rank 3 (forever)" in lines[1] and "still worked on its exit" in lines[1], err
    assert exit_watch.BUSY_LIMIT * GRACE_S - 0.5 < seconds < exit_watch.BUSY_LIMIT * GRACE_S + 5, seconds


def test_a_stopped_peer_is_killed_and_named_as_stopped():
    """SIGSTOP counts as no progress whatever the CPU time the peer used before."""
    peer = _start(BUSY, "-1")
    try:
        time.sleep(0.5)
        peer.send_signal(19)  # SIGSTOP
        err, seconds = _watch({"rank 1 (trainer 0)": peer}, f"test-{time.time_ns()}")
        code = peer.wait(timeout=10)
    finally:
        peer.kill()
    assert code == -9 and "stopped (SIGSTOP or a tracer)" in err, (code, err)
    assert GRACE_S - 0.5 < seconds < GRACE_S + 3, seconds


def test_a_ranks_error_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """torchrun reads a rank's error file as soon as the rank is gone (`ProcessFailure`, json.load): the file is
    written whole (torchrun's own reader takes it, the message first), never over an existing one, and a writer ended
    half-way leaves none, where an empty file would end torchrun in a JSONDecodeError."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from hfllamarl.runtime.world import exit_watch

    path = str(tmp_path / "error.json")
    exit_watch.write_error_file(path, "rank 0 (trainer 0) stopped answering", "Traceback ...\nthe whole story")
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=1, error_file=path)
    assert failure.message["message"] == "rank 0 (trainer 0) stopped answering" and failure.timestamp > 0
    assert failure.message["extraInfo"]["py_callstack"].endswith("the whole story")
    exit_watch.write_error_file(path, "a second message", "")
    assert json.load(open(path))["message"]["message"] == "rank 0 (trainer 0) stopped answering"

    other = str(tmp_path / "other.json")

    def dies(obj, fh):  # the writer ended after creating its file and before filling it
        fh.flush()
        raise OSError("ended")

    monkeypatch.setattr(exit_watch.json, "dump", dies)
    exit_watch.write_error_file(other, "lost", "lost")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json"]
