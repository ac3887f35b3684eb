"""How long a killed trainer replica group takes to be back, restarted cold or from its standby, in one invocation.

    python scripts/replica_restart_times.py [--rounds 2] [--work DIR]

Builds the test suite's tiny model, then runs `hfllamarl train --trainer_replica_groups 2 --max_restarts 1` (two
groups of one trainer and one generator, the tiny CPU recipe) `--rounds` times each way, alternated: without
standbys (`HFLLAMARL_STANDBY_AFTER_S=off`: the restart is a new process that imports and prepares everything) and with
them (started 3 s after each group). In each run group 1's trainer is SIGKILLed once it has trained 5 steps (and, with
standbys, once group 1's is ready); the time from the kill to the first step group 1 trains again (its prompts log)
is printed per run, then the medians and their ratio. Each run is stopped (SIGTERM) once group 1 is back.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "examples" / "recipes" / "tiny_cpu.yaml"


def _steps(path: Path) -> list[list[dict]]:
    """Group 1's prompts log, cut where its step count starts again (a new process of the group)."""
    runs: list[list[dict]] = [[]]
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            e = json.loads(line)
            if runs[-1] and e["step"] <= runs[-1][-1]["step"]:
                runs.append([])
            runs[-1].append(e)
    return runs


def one_run(work: Path, model: str, data: Path, standby: bool, index: int) -> float:
    """One run of the command; returns the seconds from group 1's kill to its first step back."""
    import psutil

    out = work / f"run{index}-{'standby' if standby else 'cold'}"
    log_path = out.with_suffix(".log")
    exe = os.path.join(os.path.dirname(sys.executable), "hfllamarl")
    env = dict(os.environ, RUST_LOG="warn", HFLLAMARL_STANDBY_AFTER_S="3" if standby else "off")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [exe, "train", "--config", str(RECIPE), "--model_name_or_path", model, "--dataset_name", str(data),
             "--output_dir", str(out), "--num_processes", "0", "--trainer_replica_groups", "2", "--max_restarts", "1",
             "--max_steps", "400", "--save_strategy", "no", "--logging_steps", "50", "--collective_timeout_s", "60"],
            cwd=str(work), stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    prompts = out / "replica-group-1" / "trained_prompts-group1-rank0.jsonl"
    deadline = time.monotonic() + 600

    def wait_for(what, ok):
        while not ok():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{what}: the run ended or took too long; see {log_path}:\n"
                                 + log_path.read_text()[-3000:])
            time.sleep(0.05)

    def waiting_standbys() -> set[int]:
        text = log_path.read_text()
        ready = set(re.findall(r"standby of replica group 1 ready \(process (\d+)", text))
        return {int(p) for p in ready - set(re.findall(r"restarted from its standby \(process (\d+)", text))}

    try:
        wait_for("group 1 trains 5 steps", lambda: len(_steps(prompts)[0]) >= 5)
        if standby:
            wait_for("group 1's standby ready", lambda: bool(waiting_standbys()))
        skip = waiting_standbys()
        trainer = [p for p in psutil.Process(proc.pid).children()
                   if p.pid not in skip and "--trainer_replica_group" in p.cmdline()
                   and p.cmdline()[p.cmdline().index("--trainer_replica_group") + 1] == "1"]
        assert len(trainer) == 1, trainer
        trainer[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for("group 1 back", lambda: len(_steps(prompts)) == 2 and len(_steps(prompts)[1]) >= 1)
        back = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for p in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]:
                    p.kill()
    text = log_path.read_text()
    taken = "replica group 1 restarted from its standby" in text
    if taken != standby:
        raise SystemExit(f"run {index}: the restart was {'' if taken else 'not '}its standby's; see {log_path}")
    return back


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default=None, help="a directory for the model, data and runs (default: a temporary one)")
    args = parser.parse_args(argv)
    from hfllamarl.testing.tiny import build_tiny_model, warm_start_format

    work = Path(args.work or tempfile.mkdtemp(prefix="replica-restart-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(work / "model")
    if not (work / "model" / "config.json").exists():
        build_tiny_model(model, seed=0)
        warm_start_format(model, steps=40, seed=0)
    data = work / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+1=?", "answer": f"#### {a + 1}"}) + "\n" for a in range(40)))
    times: dict[bool, list[float]] = {False: [], True: []}
    index = 0
    for _ in range(args.rounds):
        for standby in (False, True):
            index += 1
            seconds = one_run(work, model, data, standby, index)
            times[standby].append(seconds)
            print(f"run {index}: {'standby' if standby else 'cold'} restart: group 1 back {seconds:.1f} s after the "
                  "kill", flush=True)
    cold, warm = statistics.median(times[False]), statistics.median(times[True])
    print(f"median: cold {cold:.1f} s, from the standby {warm:.1f} s: {cold / warm:.2f}x sooner "
          f"({args.rounds} run(s) each, alternated; {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
