"""Entry point of a generator child process in a single-process job (`python script.py`).

    python -m hfllamarl.runtime.generator_child SPEC.pkl

The parent (the trainer) writes the generator's spec and starts one such process per generator
rank; the child joins the parent's store, runs the generator loop, and exits with its parent.
"""

from __future__ import annotations

import pickle
import sys

from hfllamarl.runtime.collector import collector_paused


def main(spec_path: str) -> int:
    # (torch and the spec's modules; the generator pauses it again while it starts, and freezes what was made)
    with collector_paused(freeze=False):
        with open(spec_path, "rb") as fh:
            job = pickle.load(fh)
        from hfllamarl.runtime.controller import run_job
        from hfllamarl.runtime.generator import GeneratorExecutor
        from hfllamarl.runtime.topology import init_topology
        from hfllamarl.runtime.weight_sync import build_backend

    topo = init_topology(job["num_generators"], job["timeout_s"], job["use_cpu"],
                         tensor_parallel_size=job.get("tensor_parallel_size"), failure=job.get("failure", "stop"))
    topo.liveness.announce_joining()
    topo.join_bridges()
    spec = job["spec"]
    backend = build_backend(spec.weight_sync_backend, topo, **spec.weight_sync_options)
    run_job(GeneratorExecutor(spec, topo), backend, topo, spec.schedule, start_tick=job.get("start_tick", 0))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    # A finished child skips the interpreter's teardown of torch and vLLM (seconds the parent would wait for):
    # its work is delivered and its files closed. Errors take the normal exit, with their traceback.
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
