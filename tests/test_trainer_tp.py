"""Trainer tensor parallelism (`trainer_tensor_parallel_size`): trainer ranks in a (data parallel, tensor parallel)
mesh compute what one whole model computes, train as one rank trains, and hand the generator exactly their weights.

The references are independent of the sharded code: the same model whole in transformers (log-probs, gradients),
and a one-trainer run of the same job (losses, gradient norms, the trained weights); every weight sync is checked
against vLLM's own loader reading the trainer's weights from disk (`--verify-weight-sync`).
"""

import json
import os

import pytest
from safetensors.torch import load_file

from conftest import SCRIPTS, assert_on_policy, run_script, step_logs, tail

pytestmark = pytest.mark.slow

# kv < tp (k/v kept whole, one KV head per rank) + q/k norms + an untied, vocabulary-sharded output layer; biases +
# tied embeddings (output layer whole); the plain Llama shape (2 KV heads split); a sliding window; tied embeddings +
# one KV head + llama3 RoPE scaling (the whole-model check only)
FAMILIES = ["qwen3", "qwen2", "llama", "mistral"]
CHECKED = FAMILIES + ["llama32"]


def test_the_sharded_policy_computes_what_the_whole_model_does(family_model):
    """4 trainer ranks as TP 2 x FSDP 2: completion log-probs and entropies (vocabulary-sharded where the output
    layer is untied; gathered under top-k/top-p/min-p and penalties), and every parameter's gradient gathered whole,
    equal the whole model's in transformers on the same sequences (each data-parallel rank its own 4); each rank
    holds one box of every parameter, the sending ranks' boxes tile it, and each rank holds about a quarter of the
    parameter bytes. One AdamW step updates the weights as the whole model's does, and its state, checkpointed
    (torch's distributed checkpoint) and read into the model sharded with FSDP2 alone, holds the whole model's Adam
    moments: a checkpoint resumes on either layout. All of it again with sequence parallelism (the stream between
    the blocks split by sequence: each layer outputs half of it) and activation checkpointing, and with hybrid
    sharding (trainer_fsdp_shard_size: FSDP2 over groups of 2 replicated across them; with tensor parallelism, a 3-D
    mesh)."""
    paths = [family_model(f) for f in CHECKED]
    proc = run_script([str(SCRIPTS / "tp_check.py"), *paths], nproc=4, timeout=300, env={"TRAINER_TP": "2"})
    assert proc.returncode == 0, tail(proc)
    results = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    # the layers' and (untied) embeddings' weights are split 4 ways; norms and a tied embedding 2 ways (kept whole in
    # a tensor-parallel group); hybrid sharding 2 x 2: everything 2 ways; replicas 2 x tensor parallel 2: the TP split
    held = {"": (0.24, 0.30), "sequence": (0.24, 0.30), "hybrid": (0.49, 0.51), "hybrid tp": (0.5, 0.56)}
    for (family, path), variant in [(fp, v) for fp in zip(CHECKED, paths) for v in held]:
        sequence = variant == "sequence"
        key = f"{path} {variant}".strip()
        scale = results[key]["grad_scale"]
        for rank in results[key]["ranks"]:
            # sequence parallelism: each rank's decoder layers output half the sequence (the padded width)
            assert rank["stream_share"] == (0.5 if sequence else 1.0), (family, sequence, rank["stream_share"])
            # (the sequence-parallel variant runs with activation checkpointing: the layers ran again in backward)
            assert rank["layer_runs"] == (2 if sequence else 1), (family, rank["layer_runs"])
            assert rank["logprob_error"] < 1e-5 and rank["entropy_error"] < 1e-5, (family, rank)
            assert rank["transforms_error"] < 1e-5, (family, rank)
            bad = {n: e for n, e in rank["grad_errors"].items() if e > 1e-5 * max(scale[n], 1.0)}
            assert not bad, (family, variant, bad)
            assert not rank["box_errors"], (family, rank["box_errors"])
            assert held[variant][0] < rank["held_share"] < held[variant][1], (family, variant, rank["held_share"])
            # one AdamW step (lr 1e-3): the same weights wherever the gradient is more than rounding noise (Adam
            # divides each gradient by its own size: a weight whose gradient is noise moves by up to lr either way);
            # its state, checkpointed and read on FSDP2 alone: the same moments
            assert rank["updated_error"] < 1e-6 and rank["noise_moved"] <= 2.1e-3, (family, rank)
            assert rank["moments_error"] < 1e-6, (family, rank)


def _run(model: str, out: str, nproc: int | None, generators: int, extra: dict, steps: int = 3):
    args = [str(SCRIPTS / "train_tiny.py"), model, out, "--steps", str(steps), "--max-staleness", "0",
            "--num-generators", str(generators), "--reward", "digits", "--verify-weight-sync", "--report-to", "none",
            "--save-model", os.path.join(out, "final"), "--extra", json.dumps(extra)]
    proc = run_script(args + (["--no-bootstrap"] if nproc is None else []), nproc=nproc, timeout=500)
    assert proc.returncode == 0, tail(proc)
    return step_logs(proc.stdout), load_file(os.path.join(out, "final", "model.safetensors"))


# The 4 trainer ranks' layouts: TP 2 x FSDP2 2, the same with sequence parallelism, hybrid sharding (FSDP2 over 2,
# 2 replicas, no tensor parallelism). (Every family x layout: HFLLAMARL_ALL_LAYOUTS; in CI sequence parallelism
# runs in the resume test and tp_check.)
LAYOUTS = {"tp": {"trainer_tensor_parallel_size": 2, "per_device_train_batch_size": 8},
           "tp+sequence": {"trainer_tensor_parallel_size": 2, "trainer_sequence_parallel": True,
                           "per_device_train_batch_size": 8},
           "hybrid": {"trainer_fsdp_shard_size": 2, "per_device_train_batch_size": 4}}
CASES = [("qwen3", 2, "tp"), ("llama", 1, "hybrid")] + (
    [(f, g, "tp") for f in FAMILIES for g in (1, 2) if (f, g) != ("qwen3", 2)]
    + [(f, 1, layout) for f in FAMILIES for layout in ("tp+sequence", "hybrid") if (f, layout) != ("llama", "hybrid")]
    if os.environ.get("HFLLAMARL_ALL_LAYOUTS") else [])


@pytest.mark.parametrize("family,generators,layout", CASES)
def test_tp2_x_fsdp2_trains_as_one_rank_does(family_model, tmp_path, family, generators, layout):
    """3 on-policy steps of the same job, 4 trainer ranks as TP 2 x FSDP 2 (8 completions each data-parallel rank),
    or as FSDP2 2 x 2 replicas (hybrid sharding, 4 each), against one trainer rank (16): the same samples, losses and gradient norms at every step, pi/mu == 1 on every
    token (the generator holds exactly the trainer's weights, also checked against vLLM's loader after every sync),
    and the same trained weights. (Adam divides each gradient by its own running size, so a weight whose gradient
    is rounding noise moves by up to the learning rate either way: the weights compare at 2e-4, lr 1e-3.)"""
    model = family_model(family)
    one, one_weights = _run(model, str(tmp_path / "one"), None, generators, {})
    tp, tp_weights = _run(model, str(tmp_path / "tp"), 4 + generators, generators, LAYOUTS[layout])
    assert len(one) == len(tp) == 3
    for a, b in zip(one, tp):
        assert_on_policy(a)
        assert_on_policy(b)
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-9), "the runs sampled different completions"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["entropy"] == pytest.approx(a["entropy"], abs=1e-5)
    assert set(one_weights) == set(tp_weights)
    moved = max(float((tp_weights[k] - one_weights[k]).abs().max()) for k in one_weights)
    assert moved < 2e-4, moved


def test_a_tensor_parallel_run_checkpoints_and_resumes_on_another_layout(family_model, tmp_path):
    """2 trainer ranks as one TP-2 group (with sequence parallelism) + a generator, with a reference model (beta > 0)
    and evaluations: 4
    on-policy steps, checkpointed at 2. Resumed from checkpoint 2 as FSDP2 over the same 2 ranks (no tensor
    parallelism: the optimizer's distributed checkpoint reshards, the weights are whole safetensors): steps 3 and 4
    train on-policy (the generator holds exactly the resumed weights) against the restored reference, and the trained
    weights stay near the uninterrupted run's. (vLLM's random stream
    restarts with the engine, so the resumed run samples other completions: the optimizer state's resharding is
    checked exactly in tp_check.py.)"""
    import shutil

    model = family_model("qwen3")
    common = ["--steps", "4", "--save-steps", "2", "--max-staleness", "0", "--beta", "0.04", "--reward", "digits",
              "--report-to", "none", "--eval-rows", "2"]
    tp = {"trainer_tensor_parallel_size": 2, "trainer_sequence_parallel": True, "per_device_train_batch_size": 16,
          "eval_strategy": "steps",
          "eval_steps": 2, "num_generations_eval": 2}
    first = str(tmp_path / "tp")
    proc = run_script([str(SCRIPTS / "train_tiny.py"), model, first, *common, "--extra", json.dumps(tp)], nproc=3,
                      timeout=400)
    assert proc.returncode == 0, tail(proc)
    straight = step_logs(proc.stdout)
    assert [h["step"] for h in straight] == [1, 2, 3, 4]
    history = json.loads([l for l in proc.stdout.splitlines() if l.startswith("LOG_HISTORY ")][-1][12:])
    assert sum("eval_reward" in h for h in history) == 2  # steps 2 and 4, reduced over one rank of the group
    second = str(tmp_path / "fsdp")
    shutil.copytree(first, second, ignore=lambda where, names: [n for n in names if where == first and (
        n in ("checkpoint-4", "trainer_state.json") or n.endswith(".jsonl"))])
    fsdp = dict(tp, trainer_tensor_parallel_size=1, trainer_sequence_parallel=False, per_device_train_batch_size=8)
    proc = run_script([str(SCRIPTS / "train_tiny.py"), model, second, *common, "--resume", "--extra",
                       json.dumps(fsdp)], nproc=3, timeout=400)
    assert proc.returncode == 0, tail(proc)
    resumed = step_logs(proc.stdout)
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]
    for h in resumed[2:]:
        assert_on_policy(h)
    assert all(0 < h["kl"] < 1 for h in resumed[2:]), resumed  # the reference is the starting policy, restored
    a = load_file(os.path.join(first, "checkpoint-4", "model.safetensors"))
    b = load_file(os.path.join(second, "checkpoint-4", "model.safetensors"))
    start = load_file(os.path.join(first, "checkpoint-2", "model.safetensors"))
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    apart = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert apart <= 2 * moved + 1e-6, (apart, moved)  # two steps of lr 1e-3 Adam either way, from the same point


def test_a_tensor_parallel_group_scores_once_and_its_peers_train_the_same_rewards(family_model, tmp_path):
    """A TP-2 group (2 trainer ranks + a generator) trained on `reward = random.random()` (each process its own
    unseeded stream, as an API judge or a sampled reward differs between calls): the group's first rank alone calls
    the reward function, once per batch, and its peer trains the scores it broadcast: each step's reward and loss are
    the same on both ranks (scored on each, they differed: 0.378 / 0.435, losses 0.015 / 0.012), and the parameters
    the group holds whole (replicated over "tp") are bit-identical on both after 3 steps, and they moved."""
    import torch
    from safetensors.torch import load_file as load

    model = family_model("qwen3")
    out = str(tmp_path / "tp")
    args = [str(SCRIPTS / "train_tiny.py"), model, out, "--steps", "3", "--max-staleness", "1", "--reward", "noise",
            "--report-to", "none", "--dump-replicated", "--learning-rate", "1e-2",
            "--extra", json.dumps({"trainer_tensor_parallel_size": 2, "per_device_train_batch_size": 16})]
    proc = run_script(args, nproc=3, timeout=500)
    assert proc.returncode == 0, tail(proc)
    calls = [json.loads(line) for line in open(os.path.join(out, "noise-calls.jsonl"))]
    assert {c["rank"] for c in calls} == {0}, calls  # (rank 1, its TP peer, called nothing; rank 2 is the generator)
    assert len(calls) == 3 and all(c["n"] == 16 for c in calls), calls
    histories = [[(h["reward"], h["loss"]) for h in json.load(open(os.path.join(out, f"history-rank{r}.json")))
                  if "reward" in h] for r in (0, 1)]
    assert len(histories[0]) == 3 and histories[0] == histories[1], histories
    ranks = [torch.load(os.path.join(out, f"replicated-rank{r}.pt")) for r in (0, 1)]
    assert ranks[0] and set(ranks[0]) == set(ranks[1])
    for name in ranks[0]:
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    init = load(os.path.join(model, "model.safetensors"))
    moved = [n for n in ranks[0] if n in init and not torch.equal(init[n], ranks[0][n].to(init[n].dtype))]
    assert moved, "training moved none of the replicated parameters"
