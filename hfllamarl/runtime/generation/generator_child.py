"""Entry point of a generator child process in a single-process job (`python script.py`).

    python -m hfllamarl.runtime.generation.generator_child SPEC.pkl
    python -m hfllamarl.runtime.generation.generator_child --prestarted OUTPUT_DIR    (its job comes on standard input)

The parent (the trainer) writes the generator's spec and starts one such process per generator
rank; the child joins the parent's store, runs the generator loop, and exits with its parent.
A child prestarted by `AsyncAIPOTrainer.__init__` (`spawn.Prestarted`) imports vLLM first, then
waits for one line, `{"spec": SPEC.pkl, "env": {...}}`, and runs that job; its input closed
without a line (the trainer was released, or its process ended) or its parent gone, it exits quietly.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading

from hfllamarl.runtime.world import startup
from hfllamarl.runtime.world.collector import collector_paused
from hfllamarl.runtime.world.spawn import ENV_CPUS, ENV_PARENT, take_cores, watch_parent


def main(spec_path: str) -> int:
    startup.mark("started")
    # (torch and the spec's modules; the generator pauses it again while it starts, and freezes what was made)
    with collector_paused(freeze=False):
        with open(spec_path, "rb") as fh:
            job = pickle.load(fh)
        from hfllamarl.runtime.loop.controller import run_job
        from hfllamarl.runtime.generation.generator import GeneratorExecutor
        from hfllamarl.runtime.world.topology import init_topology
        from hfllamarl.runtime.loop.weights_channel import build_backend
        from hfllamarl.runtime.world.processes import release_cpu_shm
    startup.mark("imported")
    startup.mark("job")

    topo = init_topology(job["num_generators"], job["timeout_s"], job["use_cpu"],
                         tensor_parallel_size=job.get("tensor_parallel_size"), failure=job.get("failure", "stop"))
    topo.liveness.announce_joining()
    topo.join_bridges()
    spec = job["spec"]
    backend = build_backend(spec.weight_sync_backend, topo, **spec.weight_sync_options)
    executor = GeneratorExecutor(spec, topo)
    run_job(executor, backend, topo, spec.schedule, start_tick=job.get("start_tick", 0))
    topo.liveness.finish()  # the parent is done with this child too (or it froze or died: named, exit non-zero)
    if topo.replica_size > 1 and topo.use_cpu:  # (its engine's shared memory: `os._exit` runs no exit handler)
        release_cpu_shm(f"{topo.engine_id(topo.replica)}_")
    # The engine stays as it is until the process ends (`os._exit`, below): dropped here, vLLM's teardown would
    # unfreeze the heap and collect it whole twice (1.4 s of a tiny model's job on this CPU), while the trainer
    # waits for this process to exit before its train() returns.
    _kept.append(executor)
    return 0


_kept: list = []  # (what `main` leaves for the process's end)


def warm() -> None:
    """Import what the generator will use (vLLM first of all): a prestarted child does while it waits for its job,
    and the preload server (`hfllamarl.runtime.world.preload`) before it forks any child."""
    from hfllamarl.runtime.loop import controller  # noqa: F401
    from hfllamarl.runtime.generation import generator  # noqa: F401
    from hfllamarl.runtime.world import topology  # noqa: F401
    from hfllamarl.runtime.loop import weights_channel  # noqa: F401
    from hfllamarl.runtime.generation.engine import import_vllm

    import_vllm()


def await_job() -> str | None:
    """A prestarted child: take its cores, import what the generator will, and wait for its job (the spec's path,
    with the job's environment set here), or None: no job will come (the input closed without one, or Ctrl-C).
    While it waits, even in the middle of an import, it exits as soon as its parent is gone."""
    startup.mark("started")
    take_cores(os.environ.get(ENV_CPUS))
    # A trainer killed during its set-up leaves no process behind, even while this one imports.
    claimed = threading.Event()
    watch_parent(int(os.environ.get(ENV_PARENT, "0")), lambda: os._exit(0), "hfllamarl-prestart-watch", until=claimed)
    try:
        try:
            with collector_paused(freeze=False):
                warm()
                startup.mark("imported")
        except Exception:  # noqa: BLE001 - the job's own start imports them again and reports what is wrong
            pass
        line = b""
        while not line.endswith(b"\n"):  # `train()` may come at any time (a notebook)
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return None
            line += chunk
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group: the trainer handles it
        return None
    startup.mark("job")
    claimed.set()  # (from here on the job's own watch, `spawn.become_child`, says why it stops)
    job = json.loads(line)
    os.environ.update(job["env"])
    return job["spec"]


if __name__ == "__main__":
    spec_path = await_job() if sys.argv[1] == "--prestarted" else sys.argv[1]
    code = main(spec_path) if spec_path is not None else 0
    # A finished child skips the interpreter's teardown of torch and vLLM (seconds the parent would wait for):
    # its work is delivered and its files closed. Errors take the normal exit, with their traceback.
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
