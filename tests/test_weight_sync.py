"""After a weight sync the generator computes with exactly the trainer's weights and vLLM's output follows them."""

import json

import pytest

from safetensors.torch import load_file

from conftest import SCRIPTS, run_script, tail

pytestmark = pytest.mark.slow


def check_sync(model: str, backend: str, trainers: int, generators: int, options=(), env=None) -> dict:
    proc = run_script([str(SCRIPTS / "weight_sync_check.py"), model, backend, *options],
                      nproc=trainers + generators, timeout=300, env={"GENERATORS": str(generators), **(env or {})})
    assert proc.returncode == 0, tail(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


GOOD = {"independent_check": None, "greedy_changed": True, "greedy_matches_hf": True, "version": 1,
        "same_output_on_every_generator_rank": True}


@pytest.mark.parametrize("backend,trainers,generators,options,family", [
    ("broadcast", 2, 1, [], "llama"),
    ("disk", 2, 1, [], "qwen2"),
    # small buckets (large tensors travel alone, small ones packed together), vLLM tensor parallel over 2
    # generator ranks (each receives only its boxes), biases, a tied lm_head. (nccl_ddma on every family and
    # layout, with the default buckets: tests/test_families.py.)
    ("nccl_ddma", 2, 2, ["8192"], "qwen2"),
])
def test_sync_matches_vllms_own_loader(family_model, backend, trainers, generators, options, family):
    """After one sync every generator rank's engine computes with exactly what vLLM's own loader makes of the
    trainer's weights read from disk (an independent check, not the backend's own bookkeeping), and vLLM's
    greedy output equals transformers' with the same weights."""
    result = check_sync(family_model(family), backend, trainers, generators, options)
    assert result["independent_check"] == [[]] * generators, result
    assert {**result, "independent_check": None, "sent_bytes": None} == {**GOOD, "trainer_ranks": trainers,
                                                                          "sent_bytes": None}


def test_tensor_parallel_trainer_shards_reach_a_tensor_parallel_generator(family_model):
    """4 trainer ranks as FSDP2 2 x tensor parallel 2 (blocks of rows and columns; one KV head kept whole on every
    rank) -> a vLLM engine tensor parallel over 2 (the KV head replicated): every generator rank holds exactly what
    vLLM's own loader reads from disk, and no trainer rank sends more than its share: the bytes each sends are within
    10% of each other, and together what the generator ranks read (nothing twice)."""
    result = check_sync(family_model("qwen3"), "nccl_ddma", 4, 2, ["8192"], env={"TRAINER_TP": "2"})
    assert result["independent_check"] == [[]] * 2, result
    assert result["greedy_matches_hf"] and result["same_output_on_every_generator_rank"], result
    sent = result["sent_bytes"]
    assert max(sent) < 1.1 * min(sent), sent
    model_bytes = sum(t.numel() * 4 for t in load_file(family_model("qwen3") + "/model.safetensors").values())
    # each generator rank reads half of every split weight and all of the rest (norms, embeddings, the KV head)
    assert model_bytes < sum(sent) < 2 * model_bytes, (sent, model_bytes)


def test_independent_check_catches_a_wrong_sync(family_model):
    """The negative control: a sync that slices k/v rows as if the model's single KV head were split over the
    two generator ranks (vLLM replicates it) leaves rows the loader reads unset; the check names qkv_proj."""
    result = check_sync(family_model("llama_gqa"), "nccl_ddma", 1, 2, env={"SABOTAGE": "kv_split"})
    for mismatches in result["independent_check"]:
        assert mismatches and all("qkv_proj" in m for m in mismatches), result
    assert not result["greedy_matches_hf"]


def test_bf16_trainer_to_fp32_generator(family_model):
    """dtype is explicit: a bf16 trainer's weights are converted on the trainer, travel as fp32, and the
    generator holds exactly the trainer's weights in fp32. (The other direction, a bf16 vLLM engine, dies
    with SIGILL on a CPU without bf16 instructions; the preflight refuses it.)"""
    result = check_sync(family_model("llama"), "nccl_ddma", 2, 1, ["8192"],
                        env={"TRAINER_DTYPE": "bfloat16", "TRANSFER_DTYPE": "float32"})
    assert result["independent_check"] == [[]] and result["greedy_matches_hf"], result
