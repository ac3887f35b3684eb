"""LoRA through peft_config: adapters train on the trainer and reach the generator every step (alone, or merged)."""

import os

import pytest
import torch

from conftest import REPO, SCRIPTS, SIDE_BY_SIDE_ENV, assert_on_policy, beside, run_script, step_logs, tail

pytestmark = pytest.mark.slow


def load(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_lora_updates_reach_the_generator_every_step(tiny_model, tmp_path):
    """`accelerate launch` with the shipped FSDP2 config: 2 trainer ranks sharding the LoRA policy (and the
    reference model, beta > 0) + 1 generator; every rank takes part in the LoRA checkpoints. The adapters travel
    alone and, at every sync, verify_weight_sync checks the engine's log-probs under them against those vLLM's own
    loader gives for the merged layers the trainer exported. Beside it, unpinned,
    the generator's greedy output is checked against peft's after each LoRA update (`check_greedy_follows`)."""
    greedy = beside(run_script, [str(SCRIPTS / "generator_checks.py"), "lora-greedy", str(tmp_path / "greedy")],
                    timeout=300, env=SIDE_BY_SIDE_ENV)
    out = str(tmp_path / "lora")
    proc = run_script([str(SCRIPTS / "train_tiny.py"), tiny_model, out, "--lora", "--steps", "4", "--max-staleness",
                       "0", "--save-steps", "2", "--learning-rate", "2e-2", "--beta", "0.04", "--report-to", "none",
                       "--verify-weight-sync", "--extra", '{"lora_sync": "adapter"}'],
                      nproc=3, timeout=400,
                      launcher=f"accelerate --config_file {REPO / 'examples' / 'accelerate' / 'fsdp2.yaml'}")
    check_greedy_follows(greedy.result())
    assert proc.returncode == 0, tail(proc)
    steps = step_logs(proc.stdout)
    assert len(steps) == 4
    assert all("kl" in h for h in steps)  # the reference model, sharded over the 2 trainer ranks like the policy

    base, merged = load(tiny_model), load(os.path.join(out, "checkpoint-4"))
    assert set(merged) == set(base)  # a plain model with the adapters merged, loadable by vLLM and transformers
    layers = {k for k in base if k.endswith(("q_proj.weight", "v_proj.weight"))}
    assert layers and all(not torch.equal(base[k], merged[k]) for k in layers)  # the adapters trained
    assert all(torch.equal(base[k], merged[k]) for k in set(base) - layers)  # nothing else moved
    assert os.path.isfile(os.path.join(out, "checkpoint-4", "hfllamarl", "adapters.pt"))

    # Synchronous: pi/mu == 1 at every step means the generator sampled with the merged weights. The check has
    # teeth: the merged policy's log-probs differ from the base's by far more than the 1e-4 tolerance.
    for h in steps:
        assert_on_policy(h)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        before = torch.log_softmax(model(ids).logits, -1)
        model.load_state_dict(merged)
        after = torch.log_softmax(model(ids).logits, -1)
    assert (before - after).abs().max() > 1e-2

    # Only the adapters travel (lora_sync='adapter': fresh adapters on q and v of a Llama), each trainer rank its
    # shard: r = 8 rows of A and r columns of B per adapted layer, far less than the layers themselves.
    adapters = sum(8 * (base[k].shape[0] + base[k].shape[1]) * 4 for k in layers)
    assert max(h["weight_sync/bytes"] for h in steps) == adapters < sum(base[k].numel() * 4 for k in layers) / 2


def test_lora_as_users_write_it_on_every_family(tmp_path):
    """One process trains, one run after another, each family (llama, qwen2, qwen3, mistral) with the default
    `LoraConfig()` (by directory, or on a model object as TRL's tests pass it), then with a PeftModel built by the
    user (other target_modules forms: all-linear, the seven projections + embed_tokens, embed_tokens + lm_head),
    its adapters non-zero from the start. Synchronous fp32: pi/mu == 1 at step 1 and at step 2 (after the adapters
    moved and were synced) means the generator sampled with exactly the trained policy: under vLLM's LoRA support
    for the default runs (adapters alone), under the merged weights for the PeftModel ones."""
    import json

    proc = run_script([str(SCRIPTS / "lora_families.py"), str(tmp_path), "llama,qwen2,qwen3,mistral"], timeout=900)
    assert proc.returncode == 0, tail(proc)
    res = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    assert len(res) == 8, sorted(res)
    for run, r in res.items():
        assert len(r["steps"]) == 2, (run, r)
        for h in r["steps"]:
            assert_on_policy(h)
        assert r["moved"] > 0 and all(h["grad_norm"] > 0 for h in r["steps"]), (run, r)  # the adapters trained
        # Fresh adapters travel alone (lora_sync='adapter'): the second sync's bytes are the adapters' own, counted
        # from the trained parameters. A PeftModel's adapters are non-zero from the start: under 'auto' its layers
        # go merged, more bytes than its adapters.
        if run.endswith("/default"):
            assert r["sync"] == "adapter" and r["bytes"][-1] == r["adapter_bytes"], (run, r)
        else:
            assert r["sync"] == "merged" and r["bytes"][-1] > r["adapter_bytes"], (run, r)


def check_greedy_follows(proc) -> None:
    """Adapters set twice to new values; each time the generator loads what the trainer sends for a LoRA policy
    and its greedy completions (vLLM) must equal the peft model's (transformers)."""
    import json

    assert proc.returncode == 0, tail(proc)
    res = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    assert res["base"]  # before any update both decode the base model alike
    assert res["follows"] == [True, True], res
    assert all(n >= 3 for n in res["changed"]), res  # each update changed most of the 6 greedy completions
    # q, v and up are adapted; k (fused with q and v) and gate (fused with up) travel along, nothing else does.
    assert {name.split(".")[-2] for name in res["sent"]} == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
