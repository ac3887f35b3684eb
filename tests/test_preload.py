"""Generator ranks forked from the preloaded process server (`hfllamarl.runtime.world.preload`): real jobs.

A forked child must be a generator rank as a spawned one is: the same job trains to the same rewards and losses
(fp32, max_staleness=0) whether its generator was spawned (the independent reference: today's path) or forked. A
killed trainer takes its forked children and its own server with it; a server that cannot be reached or started
leaves the job training on spawned children.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import SCRIPTS, run_script, step_logs, tail

pytestmark = pytest.mark.slow

ARGS = ["--steps", "2", "--max-staleness", "0"]


def _train(tiny_model: str, out: str, preload: str, *extra: str) -> subprocess.CompletedProcess:
    return run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, out, *ARGS, *extra], timeout=400,
                      env={"HFLLAMARL_PRELOAD": preload})


def _line(proc, key: str):
    rows = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith(key + " ")]
    return json.loads(rows[0].replace("'", '"')) if rows else None


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie (not yet reaped by its new parent) is gone too
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(")")[-1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def server():
    """A server owned by this test process (a session's, as the suite's)."""
    from hfllamarl.runtime.world.preload import start_server

    proc, client = start_server()
    yield proc, client
    proc.terminate()
    proc.wait(timeout=10)


def test_a_forked_generator_trains_as_a_spawned_one(tiny_model, tmp_path, server):
    proc_s, client = server
    spawned = _train(tiny_model, str(tmp_path / "spawned"), "0")
    forked = _train(tiny_model, str(tmp_path / "forked"), client.path)
    assert spawned.returncode == 0, tail(spawned)
    assert forked.returncode == 0, tail(forked)
    assert _line(spawned, "GENERATOR_KINDS") == ["Popen"]
    assert _line(forked, "GENERATOR_KINDS") == ["PreloadedProcess"]
    assert _line(forked, "PRESTARTED") == []  # nothing imported vLLM a second time
    a, b = step_logs(spawned.stdout), step_logs(forked.stdout)
    assert [h["step"] for h in a] == [h["step"] for h in b] == [1, 2]
    for x, y in zip(a, b):
        assert x["reward"] == y["reward"], (x, y)
        assert abs(x["is_ratio/max"] - 1.0) < 1e-4 and abs(y["is_ratio/max"] - 1.0) < 1e-4
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7), (x, y)
    assert proc_s.poll() is None  # the server outlives the jobs it forked for


def test_killing_the_trainer_ends_its_forked_generator_and_its_own_server(tiny_model, tmp_path):
    out = str(tmp_path / "killed")
    proc = _train(tiny_model, out, "1", "--steps", "3", "--kill-at-step", "1")
    assert proc.returncode == -9, tail(proc)
    server = _line(proc, "PRELOAD_SERVER")
    assert isinstance(server, int), tail(proc)
    child, = _line(proc, "GENERATORS")
    assert _line(proc, "GENERATOR_KINDS") == ["PreloadedProcess"]
    assert _gone(child, 5.0), "a forked generator outlived its killed trainer"
    assert _gone(server, 5.0), "the trainer's preload server outlived it"


def test_an_unreachable_server_leaves_the_job_training_on_spawned_children(tiny_model, tmp_path):
    proc = _train(tiny_model, str(tmp_path / "fallback"), str(tmp_path / "no-such-socket"))
    assert proc.returncode == 0, tail(proc)
    assert _line(proc, "GENERATOR_KINDS") == ["Popen"]
    assert len(step_logs(proc.stdout)) == 2


def test_a_server_that_cannot_start_says_why(tmp_path):
    from hfllamarl.runtime.world.preload import start_server

    with pytest.raises(OSError, match="exited .* before it was ready"):
        start_server(modules=("hfllamarl.no_such_module",), ready_timeout=120)


def test_a_forked_child_gets_the_requesters_env_stdio_and_exit_status(tmp_path, server):
    _, client = server
    (tmp_path / "probe.py").write_text(
        "import os, sys\nprint('OUT', os.environ['PROBE'], os.getcwd(), sys.argv[1:], flush=True)\n"
        "sys.stderr.write('ERR\\n')\nsys.exit(int(os.environ['PROBE']))\n")
    code = ("import os, sys\nfrom hfllamarl.runtime.world.preload import Client\n"
            f"p = Client({client.path!r}).run('probe', ['x'], {{**os.environ, 'PROBE': '7', 'PYTHONPATH': {str(tmp_path)!r}}})\n"
            "print('CODE', p.wait(60), flush=True)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert f"OUT 7 {tmp_path} ['x']" in res.stdout, res
    assert "ERR" in res.stderr and "CODE 7" in res.stdout, res
