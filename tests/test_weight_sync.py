"""After a weight sync the generator holds the trainer's weights bitwise and vLLM's output follows them."""

import json

import pytest

from conftest import SCRIPTS, run_script, tail

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend,trainers,generators,options", [
    ("broadcast", 1, 1, []), ("broadcast", 2, 1, []), ("disk", 2, 1, []),
    ("nccl_ddma", 1, 1, []),
    ("nccl_ddma", 2, 1, ["8192"]),  # small buckets: large tensors travel alone, small ones packed together
    ("nccl_ddma", 1, 2, []),  # vLLM tensor parallel over 2 generator ranks: each receives only its slices
    ("nccl_ddma", 2, 2, ["8192"]),
])
def test_sync_is_bitwise_and_vllm_follows(tiny_model, backend, trainers, generators, options):
    """After one sync every generator rank holds (its part of) the trainer's weights, bitwise, and vLLM's
    greedy output equals transformers' with the same weights."""
    proc = run_script([str(SCRIPTS / "weight_sync_check.py"), tiny_model, backend, *options],
                      nproc=trainers + generators, timeout=300, env={"GENERATORS": str(generators)})
    assert proc.returncode == 0, tail(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert result == {"bitwise_equal": True, "greedy_changed": True, "greedy_matches_hf": True, "version": 1,
                      "trainer_ranks": trainers, "same_output_on_every_generator_rank": True}
