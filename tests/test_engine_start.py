"""The generator's engine on a machine that has never run vLLM: a fresh home (a new container, a CI job, a cluster
node) has no `$VLLM_CACHE_ROOT/modelinfos`, and vLLM would inspect the model class in a Python subprocess that
imports vLLM again (8 s of a 2-core machine's start-up). The engine is built in-process instead
(`hfllamarl.runtime.generation.engine._model_classes_in_process`) and must still be the model it was given: the
log-probs it records equal transformers' for the same tokens."""

import json
import os
import textwrap

from conftest import popen_script

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from hfllamarl.runtime.generation.engine import build_engine
    from vllm import SamplingParams
    path = sys.argv[1]
    llm = build_engine(path, path, dtype="float32", seed=0, max_model_len=64, tensor_parallel_size=1,
                       distributed=False, use_cpu=True)
    prompt = [1, 5, 9, 13, 17]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    mu = [next(iter(d.values())).logprob for d in out.logprobs]
    print("RESULT " + json.dumps({"prompt": prompt, "tokens": list(out.token_ids), "mu": mu}), flush=True)
    os._exit(0)
""")


def test_a_cold_vllm_cache_costs_no_subprocess_and_the_engine_samples_the_model_it_was_given(tmp_path, tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    script = tmp_path / "cold_engine.py"
    script.write_text(SCRIPT)
    cache = tmp_path / "vllm-cache"  # empty: as in a home where vLLM never ran
    proc = popen_script([str(script), tiny_model], env={**os.environ, "VLLM_CACHE_ROOT": str(cache)})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    # vLLM writes this file only after inspecting a model class in its subprocess.
    assert not (cache / "modelinfos").exists() or not any((cache / "modelinfos").iterdir()), \
        sorted(p.name for p in (cache / "modelinfos").iterdir())
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = torch.tensor([result["prompt"] + result["tokens"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    n = len(result["prompt"])
    pi = [logp[n - 1 + i, t].item() for i, t in enumerate(result["tokens"])]
    assert len(result["tokens"]) == 8
    assert max(abs(a - b) for a, b in zip(result["mu"], pi)) < 1e-4, (result["mu"], pi)
