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

from conftest import SCRIPTS, SIDE_BY_SIDE_ENV, beside, run_script, step_logs, tail

pytestmark = pytest.mark.slow

ARGS = ["--steps", "2", "--max-staleness", "0"]


def _train(tiny_model: str, out: str, preload: str, *extra: str) -> subprocess.CompletedProcess:
    return run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, out, *ARGS, *extra], timeout=400,
                      env={"HFLLAMARL_PRELOAD": preload, **SIDE_BY_SIDE_ENV})


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
def server(preload_server):
    """The session's server (conftest), or one owned by this module when the session runs without."""
    if preload_server is not None:
        yield preload_server
        return
    from hfllamarl.runtime.world.preload import start_server

    proc, client = start_server()
    yield client
    proc.terminate()
    proc.wait(timeout=10)


def test_a_forked_generator_trains_as_a_spawned_one(tiny_model, tmp_path, server):
    # (every batch from the generator: the trainer's own first batches would hide what is compared)
    spawned = beside(_train, tiny_model, str(tmp_path / "spawned"), "0", "--no-bootstrap")
    forked = _train(tiny_model, str(tmp_path / "forked"), server.path, "--no-bootstrap")
    spawned = spawned.result()
    assert spawned.returncode == 0, tail(spawned)
    assert forked.returncode == 0, tail(forked)
    assert _line(spawned, "GENERATOR_KINDS") == ["Popen"]
    assert _line(forked, "GENERATOR_KINDS") == ["PreloadedProcess"]
    assert _line(forked, "PRESTARTED") == []  # nothing imported vLLM a second time
    a, b = step_logs(spawned.stdout), step_logs(forked.stdout)
    assert [h["step"] for h in a] == [h["step"] for h in b] == [1, 2]
    compared, before = 0, (0.0, 0.0)
    for x, y in zip(a, b):
        assert abs(x["is_ratio/max"] - 1.0) < 1e-4 and abs(y["is_ratio/max"] - 1.0) < 1e-4
        counts = (x.get("reward_unscored", 0.0), y.get("reward_unscored", 0.0))  # (the job's count so far)
        unscored, before = (counts[0] - before[0], counts[1] - before[1]), counts
        if unscored[0] != unscored[1]:
            continue  # (a grader past its time budget on a loaded machine leaves a row unscored in one job only)
        assert x["reward"] == y["reward"], (x, y)
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7), (x, y)
        compared += 1
    assert compared, "every step had rows unscored in one job only: nothing was compared"
    assert server.hello()["pid"] > 0  # the server outlives the jobs it forked for
    # The start-up profile (`world.startup`): milestones in order, the first step where the script's own clock saw it
    # end; the spawned generator imported vLLM itself (seconds of work), the forked one had it imported already.
    for proc, kind in ((spawned, "spawned"), (forked, "forked")):
        s = _line(proc, "STARTUP")
        order = [s[k] for k in ("generator_started", "generator_imported", "generator_job", "generator_engine",
                                "generator_ready", "trainer_first_rollouts", "trainer_first_step")]
        assert order == sorted(order), (kind, s)
        assert s["trainer_first_step"] == pytest.approx(_line(proc, "FIRST_STEP_AFTER_TRAIN"), abs=0.5), (kind, s)
    spawned_s, forked_s = _line(spawned, "STARTUP"), _line(forked, "STARTUP")
    assert spawned_s["generator_imported"] - spawned_s["generator_started"] > 2.0, spawned_s
    assert forked_s["generator_started"] > 0 and forked_s["generator_imported"] - forked_s["generator_started"] < 0.5


def test_a_server_running_other_code_is_refused():
    """A long-lived server (`hfllamarl preload`) imported the packages as they were when it started: a job whose
    Python, package versions or source files differ spawns its generators instead of running stale code."""
    from hfllamarl.runtime.world.preload import fingerprint, usable

    mine = fingerprint()
    assert usable({"threads": 1, "code": mine})
    older = dict(mine, source_mtime=mine["source_mtime"] - 60)  # a source file was edited after it started
    other = dict(mine, versions=dict(mine["versions"], vllm="0.0.1"))
    for info, why in (({"threads": 1, "code": older}, "source files changed"), ({"threads": 1, "code": other},
                      "versions"), ({"threads": 2, "code": mine}, "threads"), ({"threads": 1}, "python")):
        with pytest.raises(OSError, match=why):
            usable(info)


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
    client = server
    (tmp_path / "probe.py").write_text(
        "import os, sys\nprint('OUT', os.environ['PROBE'], os.getcwd(), sys.argv[1:], flush=True)\n"
        "sys.stderr.write('ERR\\n')\nsys.exit(int(os.environ['PROBE']))\n")
    code = ("import os, sys\nfrom hfllamarl.runtime.world.preload import Client\n"
            f"p = Client({client.path!r}).run('probe', ['x'], {{**os.environ, 'PROBE': '7', 'PYTHONPATH': {str(tmp_path)!r}}})\n"
            "print('CODE', p.wait(60), flush=True)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert f"OUT 7 {tmp_path} ['x']" in res.stdout, res
    assert "ERR" in res.stderr and "CODE 7" in res.stdout, res


def test_a_job_whose_import_time_environment_differs_is_spawned_not_forked(tmp_path, server):
    """huggingface_hub reads HF_HOME once, when the server imports it: a child forked for a job with another HF_HOME
    would look for models in the server's cache. The server refuses to fork it, naming the variable and not its
    value (the job then spawns the child: `spawn._forked` falls back on that error)."""
    client = server
    (tmp_path / "probe.py").write_text("from huggingface_hub import constants\nprint('HOME', constants.HF_HOME)\n")
    code = ("import os, sys\nfrom hfllamarl.runtime.world.preload import Client\n"
            f"env = {{**os.environ, 'HF_HOME': {str(tmp_path / 'hf')!r}, 'PYTHONPATH': {str(tmp_path)!r}}}\n"
            "try:\n"
            f"    Client({client.path!r}).run('probe', [], env).wait(60)\n"
            "except OSError as e:\n    print('REFUSED', e, flush=True)\n"
            "same = {**os.environ, 'PYTHONPATH': env['PYTHONPATH']}\n"
            f"print('CODE', Client({client.path!r}).run('probe', [], same).wait(60), flush=True)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "REFUSED" in res.stdout and "differs from the server's in HF_HOME," in res.stdout, res
    refused = next(line for line in res.stdout.splitlines() if line.startswith("REFUSED"))
    assert str(tmp_path / "hf") not in refused  # (names only: a value may be a token)
    assert "CODE 0" in res.stdout and "HOME " in res.stdout, res  # the same environment still forks


@pytest.mark.parametrize("starter_imported_vllm", [False, True])
def test_a_variable_the_servers_own_imports_set_does_not_stop_a_fork(tmp_path, server, monkeypatch,
                                                                      starter_imported_vllm):
    """vLLM sets PYTORCH_NVML_BASED_CUDA_CHECK when it is imported (the server's warm imports do): a job whose
    environment has it (its process imported vLLM too) and one whose environment lacks it (a shell's) are both
    forked, since a spawned child's imports would set it the same way; also when the process that started the
    server had imported vLLM itself, so that the server's environment held the variable before its imports."""
    client, own = server, None
    if starter_imported_vllm:
        from hfllamarl.runtime.world.preload import start_server

        monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        own, client = start_server()
    (tmp_path / "probe.py").write_text("print('RAN', flush=True)\n")
    code = ("import os, sys\nfrom hfllamarl.runtime.world.preload import Client\n"
            f"base = {{k: v for k, v in os.environ.items() if k != 'PYTORCH_NVML_BASED_CUDA_CHECK'}}\n"
            f"base['PYTHONPATH'] = {str(tmp_path)!r}\n"
            "for env in (base, {**base, 'PYTORCH_NVML_BASED_CUDA_CHECK': '1'}):\n"
            f"    print('CODE', Client({client.path!r}).run('probe', [], env).wait(60), flush=True)\n")
    try:
        res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
    finally:
        if own is not None:
            own.terminate()
            own.wait(timeout=10)
    assert res.stdout.count("CODE 0") == 2 and res.stdout.count("RAN") == 2, res


def test_the_preload_command_serves_the_jobs_of_a_shell_and_refuses_an_open_directory(tmp_path):
    """`hfllamarl preload`: a directory others can write to is refused (anyone there could stand in for the
    server); a private one is made, the server answers there, forks a child whose command line reads as a spawned
    one's, and exits with its owner."""
    from hfllamarl.runtime.world.preload import Client, usable

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    refused = subprocess.run([sys.executable, "-m", "hfllamarl.cli", "preload", "--socket", str(open_dir / "s")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "not writable by others" in refused.stderr, refused
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    path = tmp_path / "new" / "s"
    server = subprocess.Popen([sys.executable, "-m", "hfllamarl.cli", "preload", "--socket", str(path), "--owner",
                               str(owner.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == f"export HFLLAMARL_PRELOAD={path}"
        assert os.stat(path.parent).st_mode & 0o777 == 0o700
        deadline = time.monotonic() + 300
        while not path.exists():
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        client = Client(str(path))
        assert usable(client.hello())["pid"] == server.pid  # (the command became the server: nothing in between)
        (tmp_path / "probe.py").write_text("import time, sys\nprint('READY', flush=True)\ntime.sleep(30)\n")
        child = client.run("probe", ["--out", str(tmp_path / "job")], {**os.environ, "PYTHONPATH": str(tmp_path)})
        import psutil

        deadline = time.monotonic() + 30
        while "probe" not in " ".join(psutil.Process(child.pid).cmdline()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert psutil.Process(child.pid).cmdline() == [sys.executable, "-m", "probe", "--out", str(tmp_path / "job")]
        child.kill()
        assert child.wait(30) == -9
        owner.kill()
        owner.wait()
        assert server.wait(timeout=30) == 0  # its owner gone, it ends
    finally:
        for p in (server, owner):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_terminated_server_removes_its_socket_and_directory():
    """SIGTERM (a scheduler's, a user's `kill`) ends the server as its owner's end does: its socket and the private
    directory `start_server` made for it are removed, not left for the next job to find."""
    from hfllamarl.runtime.world.preload import start_server

    for kills in (1, 3):  # (a second and third SIGTERM while it cleans up do not cut the cleanup short)
        proc, client = start_server(modules=("json",), ready_timeout=120)
        assert os.path.exists(client.path)
        for _ in range(kills):
            proc.terminate()
        assert proc.wait(timeout=30) == 0
        assert not os.path.exists(client.path) and not os.path.exists(os.path.dirname(client.path)), kills
