"""After a weight sync the generator holds the trainer's weights bitwise and vLLM's output follows them."""

import json
import time

import pytest

from conftest import SCRIPTS, launch_bare, run_script, tail

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend,trainers,generators,options", [
    ("broadcast", 1, 1, []), ("broadcast", 2, 1, []), ("disk", 2, 1, []),
    ("nccl_ddma", 1, 1, []),
    ("nccl_ddma", 2, 1, ["8192"]),  # small buckets: large tensors travel alone, small ones packed together
    ("nccl_ddma", 1, 2, []),  # vLLM tensor parallel over 2 generator ranks: each receives only its slices
    ("nccl_ddma", 2, 2, ["8192"]),
])
def test_sync_is_bitwise_and_vllm_follows(tiny_model, backend, trainers, generators, options, env=None):
    """After one sync every generator rank holds (its part of) the trainer's weights, bitwise, and vLLM's
    greedy output equals transformers' with the same weights."""
    proc = run_script([str(SCRIPTS / "weight_sync_check.py"), tiny_model, backend, *options],
                      nproc=trainers + generators, timeout=300,
                      env={"GENERATORS": str(generators), **(env or {})})
    assert proc.returncode == 0, tail(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert result == {"bitwise_equal": True, "greedy_changed": True, "greedy_matches_hf": True, "version": 1,
                      "trainer_ranks": trainers, "same_output_on_every_generator_rank": True}


@pytest.mark.parametrize("backend", ["nccl_ddma", "broadcast"])
def test_bf16_trainer_to_fp32_generator(tiny_model, backend):
    """dtype is explicit: a bf16 trainer's weights are converted on the trainer, travel as fp32, and the
    generator holds exactly the trainer's weights in fp32. (The other direction, a bf16 vLLM engine, dies
    with SIGILL on this CPU virtual machine, so it is not exercised here.)"""
    test_sync_is_bitwise_and_vllm_follows(tiny_model, backend, 2, 1, ["8192"] if backend == "nccl_ddma" else [],
                                          env={"TRAINER_DTYPE": "bfloat16", "TRANSFER_DTYPE": "float32"})


@pytest.mark.parametrize("dead,name", [(1, "rank 1 (trainer 1)"), (2, "rank 2 (generator 0)")])
def test_rank_dying_mid_sync_is_named_by_the_others(tiny_model, dead, name):
    """2 trainers + 1 generator; one rank exits in the middle of a nccl_ddma transfer. The others fail
    within the timeout with an error naming it: no hang."""
    start = time.monotonic()
    procs = launch_bare(3, [str(SCRIPTS / "weight_sync_check.py"), tiny_model, "nccl_ddma", "8192"],
                        {"DIE": str(dead), "GENERATORS": "1"})
    outs = [p.communicate(timeout=240) for p in procs]
    assert procs[dead].returncode == 9
    for rank in {0, 1, 2} - {dead}:
        assert procs[rank].returncode != 0, outs[rank][1][-2000:]
        assert name in outs[rank][1], outs[rank][1][-3000:]
    assert time.monotonic() - start < 200
