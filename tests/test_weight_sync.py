"""After a weight sync the generator holds the trainer's weights bitwise and vLLM's output follows them."""

import json

import pytest

from conftest import SCRIPTS, run_script, tail

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend,trainers,options", [
    ("broadcast", 1, []), ("broadcast", 2, []), ("disk", 2, []),
    ("nccl_ddma", 1, []),
    ("nccl_ddma", 2, ["8192"]),  # small buckets: large tensors travel alone, small ones packed together
])
def test_sync_is_bitwise_and_vllm_follows(tiny_model, backend, trainers, options):
    proc = run_script([str(SCRIPTS / "weight_sync_check.py"), tiny_model, backend, *options], nproc=trainers + 1,
                      timeout=300)
    assert proc.returncode == 0, tail(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert result == {"bitwise_equal": True, "greedy_changed": True, "greedy_matches_hf": True, "version": 1,
                      "trainer_ranks": trainers}
