"""Generator children started ahead of `train()` (`spawn.Prestarted`): real processes, each importing vLLM.

The job a prestarted child runs is checked end to end by the plain-python runs (`check_notebook_run`: the child
that trains the first `train()` is the one the trainer started, the second `train()` starts its own)."""

import logging
import os
import pickle
import signal
import subprocess
import sys
import time

import psutil
import pytest

from hfllamarl.runtime.world.spawn import Prestarted
from hfllamarl.runtime.world.topology import Topology

pytestmark = pytest.mark.slow  # real processes, each importing vLLM


@pytest.fixture(autouse=True)
def no_preload_server(monkeypatch):
    """The path a job takes without a preload server (the session's is named in the environment)."""
    monkeypatch.setenv("HFLLAMARL_PRELOAD", "0")


def gone(pid: int, within: float) -> bool:
    """Whether process `pid` has ended (a zombie counts as ended) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def single_topology(generators: int) -> Topology:
    return Topology(mode="single", rank=0, world_size=1 + generators, num_generators=generators, timeout_s=30.0,
                    use_cpu=True)


class Touch:
    """A generator spec that, unpickled, creates a file: the proof that a child read the spec it was handed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_prestarted_child_runs_the_job_it_is_handed_and_one_started_for_another_state_is_replaced(tmp_path,
                                                                                                 monkeypatch, caplog):
    topo = single_topology(2)
    prestarted = Prestarted(topo, str(tmp_path / "out"))
    pids = {rank: proc.pid for rank, (proc, _) in prestarted.children.items()}
    assert sorted(pids) == [1, 2]
    # Its command line names the job's output directory, as a job's spec does: `ps` (and `orphans`) tell whose it is.
    assert str(tmp_path / "out") in psutil.Process(pids[1]).cmdline()
    spec = tmp_path / "spec.pkl"
    spec.write_bytes(pickle.dumps(Touch(str(tmp_path / "read"))))
    try:
        monkeypatch.setenv("HFLLAMARL_TEST_SETTING", "changed after the trainer was built")
        with caplog.at_level(logging.INFO, logger="hfllamarl.runtime.world.spawn"):
            assert prestarted.claim(topo, 2, {}, {}, str(spec)) is None
        assert gone(pids[2], 1.0), "a child started for another environment was left running"
        assert "rank 2: a new generator process starts" in caplog.text and "HFLLAMARL_TEST_SETTING" in caplog.text
        assert prestarted.claim(topo, 2, {}, {}, str(spec)) is None  # each child is handed one job at most
        monkeypatch.delenv("HFLLAMARL_TEST_SETTING")

        proc = prestarted.claim(topo, 1, {}, {"HFLLAMARL_STORE": "127.0.0.1:1"}, str(spec))
        assert proc is not None and proc.pid == pids[1]
        # The child reads the spec once its import is done (it is no job: it then fails on the spec's content).
        assert proc.wait(timeout=120) == 1
        assert (tmp_path / "read").exists(), "the prestarted child never read the spec it was handed"
    finally:
        prestarted.release()


def test_a_child_started_for_another_world_is_not_handed_a_job(tmp_path):
    """A second config of the same process with more generators (the process's topology is one): rank 1's child
    was started for a world of 2, its job is in a world of 3."""
    topo = single_topology(1)
    prestarted = Prestarted(topo, str(tmp_path))
    (proc, _), = prestarted.children.values()
    try:
        assert prestarted.claim(single_topology(2), 1, {}, {}, "/no/spec.pkl") is None
        assert gone(proc.pid, 1.0)
    finally:
        prestarted.release()


def test_released_children_and_those_of_a_killed_trainer_end_at_once_even_while_they_import(tmp_path):
    prestarted = Prestarted(single_topology(1), str(tmp_path))
    (proc, _), = prestarted.children.values()
    time.sleep(1.0)  # importing vLLM, which takes several seconds
    started = time.monotonic()
    prestarted.release()
    assert proc.poll() is not None and time.monotonic() - started < 2.0
    assert prestarted.children == {}

    # A trainer process SIGKILLed while its child imports: the child sees its parent gone within a second.
    script = ("import sys, time\n"
              "from hfllamarl.runtime.world.spawn import Prestarted\n"
              "from hfllamarl.runtime.world.topology import Topology\n"
              "p = Prestarted(Topology(mode='single', rank=0, world_size=2, num_generators=1, timeout_s=30.0, "
              "use_cpu=True), sys.argv[1])\n"
              "print(*(proc.pid for proc, _ in p.children.values()), flush=True)\n"
              "time.sleep(600)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(trainer.stdout.readline())
        time.sleep(1.0)
        assert psutil.Process(child).status() != psutil.STATUS_ZOMBIE
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=10)
        assert gone(child, 2.0), "a prestarted child outlived its killed trainer"
    finally:
        trainer.kill()
        trainer.stdout.close()


def test_nothing_is_prestarted_where_this_process_starts_no_children(tmp_path):
    topo = single_topology(1)
    topo.mode = "launcher"
    assert topo.prestart_children(str(tmp_path)) is None


def test_a_trainer_built_for_another_output_directory_replaces_the_children_of_the_first(tmp_path):
    topo = single_topology(1)
    first = topo.prestart_children(str(tmp_path / "a"))
    try:
        assert topo.prestart_children(str(tmp_path / "a")) is first  # a second trainer of the same job
        (proc, _), = first.children.values()
        second = topo.prestart_children(str(tmp_path / "b"))
        assert second is not first and gone(proc.pid, 1.0) and len(second.children) == 1
    finally:
        topo.release_prestarted()


WATCHED_CHILD = """
import os, time
from hfllamarl.runtime.world.spawn import become_child
become_child({"cpus": "", "parent": os.getppid(), "rank": 1})
print("watching", flush=True)
time.sleep(120)
"""

PARENT_OF_WATCHED = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stderr=subprocess.PIPE)  # (its stderr: our pipe)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_child_whose_parent_and_stderr_reader_are_gone_ends_at_once():
    """A generator child's stderr is a pipe to the trainer (to the command that started the trainer, for replica
    groups): when both are killed, the child's parting words fail (EPIPE). It ends anyway, within its 0.5 s watch,
    rather than when its liveness gives up on the trainer (63 s after `hfllamarl train` was SIGKILLed, seen)."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT_OF_WATCHED, WATCHED_CHILD], stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "watching"
        parent.kill()  # (the pipe's only reader goes with it)
        parent.wait(timeout=10)
        assert gone(child, within=5.0), "the child outlived its parent"
    finally:
        parent.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
