"""Checks of a real vLLM generator executor in one process, without a trainer: weights are handed to it
as the weight sync would hand them, and its output is compared with transformers'.

    python tests/scripts/generator_checks.py partial WORKDIR      (prints one line: RESULT {json})
    python tests/scripts/generator_checks.py lora-greedy WORKDIR

`partial`: a random-init tiny Llama generates 2 batches with max_completion_length 12 and a budget of
4 tokens per tick, so a completion spans 3 ticks; between ticks the generator loads new weights
(versions 1 and 2, the base weights plus noise). Every token's recorded behaviour log-prob is then
recomputed with transformers under the weights of the version it says sampled it, and, as a
counter-check, under the version-0 weights.

`lora-greedy`: LoRA adapters (q, v and up projections) are set twice to new values; after each, the
generator receives what the trainer sends for a LoRA policy (`MergedLoraWeights`), and its greedy
completions are compared with the peft model's own greedy completions.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch

from hfllamarl.runtime.loop.schedule import Schedule

BUDGET, LENGTH, TEMPERATURE = 4, 12, 0.8


def weight_versions(base: dict, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = [base]
    for _ in range(count):
        out.append({k: t + 0.3 * t.float().std().clamp(min=1e-2) * torch.randn(t.shape, generator=g)
                    for k, t in base.items()})
    return out


ROWS = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(6)]


def local_generator(path: str, **spec_kw):
    """A generator executor with its vLLM engine in this process (no weight-sync backend: weights are
    handed to `put_input` directly)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from hfllamarl.runtime.generation.generator import GeneratorExecutor, GeneratorSpec
    from hfllamarl.runtime.data.prompts import PromptEncoder

    spec = GeneratorSpec(model_path=path, tokenizer_path=path, dataset=Dataset.from_list(ROWS), max_model_len=64,
                         dtype="float32", **spec_kw)
    gen = GeneratorExecutor(spec, SimpleNamespace(num_generators=1, use_cpu=True, local_rank=0, rank=0, replica=0,
                                                  num_replicas=1, replica_size=1, num_trainers=0))
    gen.dataset, gen.llm = spec.dataset, gen._build_engine()
    gen.encoder = PromptEncoder(AutoTokenizer.from_pretrained(path))
    return gen


def partial(workdir: str) -> dict:
    from transformers import LlamaForCausalLM

    from hfllamarl.runtime.loop.sampling import Sampling
    from hfllamarl.testing.tiny import build_tiny_model
    from hfllamarl.runtime.training.batching import completion_logprobs, pad_batch
    from hfllamarl.runtime.loop.weights_channel import POLICY_WEIGHTS

    path = build_tiny_model(os.path.join(workdir, "model"), seed=3)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    versions = weight_versions({k: v.clone() for k, v in model.state_dict().items()}, 2)
    gen = local_generator(path, schedule=Schedule(2, 3), prompts_per_batch=3, num_generations=2, max_completion_length=LENGTH,
                          sampling=Sampling(temperature=TEMPERATURE), partial_rollout_tokens=BUDGET)

    finished, carried_after = [], []
    for tick in range(4):  # weights of version min(tick, 2) at tick `tick`
        if 1 <= tick <= 2:
            gen.put_input(POLICY_WEIGHTS, (tick, iter(list(versions[tick].items()))))
        gen.set_step(tick)
        gen.step()
        finished += [(tick, g) for g in gen.get_output("rollouts")]
        carried_after.append([(f.batch_index, len(f.unfinished())) for f in gen.in_flight])

    rollouts = [r for _, g in finished for r in g.rollouts]
    errors, wrong_version_gap, bad_versions = [], [], 0
    tok = gen.encoder.tokenizer
    for v, weights in enumerate(versions):
        model.load_state_dict(weights)
        with torch.no_grad():
            pi = completion_logprobs(model, pad_batch(rollouts, 0, "cpu"), TEMPERATURE)
        for i, r in enumerate(rollouts):
            for t, (mu, ver) in enumerate(zip(r.behavior_logprobs, r.versions)):
                if ver == v:
                    errors.append(abs(pi[i, t].item() - mu))
                elif v == 0:  # the same token scored as if it had been sampled under version 0
                    wrong_version_gap.append(abs(pi[i, t].item() - mu))
    for tick, g in finished:
        start = g.batch_index  # batch b starts at tick b
        for r in g.rollouts:
            expected = [min(start + t // BUDGET, 2) for t in range(len(r.completion_ids))]
            bad_versions += r.versions != expected
    multi = [r for r in rollouts if r.segments > 1]
    # generation_kwargs={"detokenize": False}: the engine writes no text; the completion's text is its ids decoded.
    from hfllamarl.runtime.loop.rollout import Rollout, UNFINISHED

    gen.spec.generation_kwargs = {"detokenize": False}
    out = gen.sample([gen.encoder.encode(ROWS[0]["prompt"])], gen._sampling_params(1, LENGTH))[0].outputs[0]
    bare = Rollout(prompt=ROWS[0]["prompt"], prompt_ids=[], completion_ids=[], behavior_logprobs=[], versions=[],
                   finish_reason=UNFINISHED, completion_text="")
    gen._extend(bare, out, LENGTH)
    from torch._dynamo.utils import counters

    return {
        "compiled_frames": sum(counters["frames"].values()),  # what torch.compile traced in this process
        "finished_at": {g.batch_index: tick for tick, g in finished},
        "carried_after": carried_after,
        "num_rollouts": len(rollouts),
        "multi_segment": len(multi),
        "segments": sorted({r.segments for r in rollouts}),
        "lengths_ok": all(len(r.completion_ids) == len(r.behavior_logprobs) == len(r.versions) for r in rollouts),
        "finish_ok": all(r.finish_reason == "stop" or len(r.completion_ids) == LENGTH for r in rollouts),
        "segments_ok": all(r.segments == max(1, -(-len(r.completion_ids) // BUDGET)) for r in rollouts),
        "undetokenized": [out.text, bare.completion_text, tok.decode(bare.completion_ids, skip_special_tokens=True)],
        "text_ok": all(r.completion_text == tok.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts),
        "bad_versions": bad_versions,
        "max_error": max(errors),
        "num_tokens": len(errors),
        "wrong_version_mean_gap": sum(wrong_version_gap) / max(len(wrong_version_gap), 1),
    }


def lora_greedy(workdir: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from hfllamarl.runtime.weights.lora import MergedLoraWeights
    from hfllamarl.testing.tiny import build_tiny_model
    from hfllamarl.runtime.loop.weights_channel import POLICY_WEIGHTS

    path = build_tiny_model(os.path.join(workdir, "model"), seed=4)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])).eval()
    merged = MergedLoraWeights(model)
    gen = local_generator(path, schedule=Schedule(0, 1), prompts_per_batch=1, num_generations=1, max_completion_length=10)
    prompts = [gen.encoder.encode(row["prompt"]) for row in ROWS]

    def vllm_greedy():
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        outs = gen.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def hf_greedy():  # argmax 10 times (EOS included, as vLLM's ignore_eos samples it and goes on)
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = list(p)
                for _ in range(10):
                    ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
                out.append(ids[len(p):])
        return out

    result = {"base": vllm_greedy() == hf_greedy(), "follows": [], "changed": []}
    before = vllm_greedy()
    g = torch.Generator().manual_seed(0)
    for version in (1, 2):  # a training step would change B (and A); here they are set to new random values
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "lora_B" in name else 0.2))
        gen.put_input(POLICY_WEIGHTS, (version, iter(list(merged.state_dict().items()))))
        now = vllm_greedy()
        result["follows"].append(now == hf_greedy())
        result["changed"].append(sum(a != b for a, b in zip(now, before)))
        before = now
    result["sent"] = sorted(merged.state_dict())
    return result


def interrupted(workdir: str) -> dict:
    """A weight load whose stream breaks half-way (a relay source lost mid-sync), then the whole version again: the
    engine must hold exactly what vLLM's own loader makes of those weights, and its greedy output follow them."""
    from transformers import LlamaForCausalLM

    from hfllamarl.runtime.generation.engine import verify_against_disk
    from hfllamarl.runtime.weights.hf_export import export_weights
    from hfllamarl.runtime.loop.weights_channel import POLICY_WEIGHTS
    from hfllamarl.testing.tiny import build_tiny_model

    path = build_tiny_model(os.path.join(workdir, "model"), seed=5)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    new = weight_versions({k: v.clone() for k, v in model.state_dict().items()}, 1)[1]
    model.load_state_dict(new)
    export_weights(model, os.path.join(workdir, "new"), write=True)
    gen = local_generator(path, schedule=Schedule(0, 1), prompts_per_batch=1, num_generations=1, max_completion_length=8)

    def broken():
        for i, item in enumerate(new.items()):
            if i == len(new) // 2:
                raise ConnectionError("the relay source is gone")
            yield item

    try:
        gen.put_input(POLICY_WEIGHTS, (1, broken()))
        raised = False
    except ConnectionError:
        raised = True
    gen.put_input(POLICY_WEIGHTS, (1, iter(list(new.items()))))
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = gen.encoder.encode(ROWS[0]["prompt"])
    out = gen.llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0.0, max_tokens=8,
                                                                                   ignore_eos=True), use_tqdm=False)
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(prompt):].tolist()
    return {"raised": raised, "mismatches": verify_against_disk(gen.llm, os.path.join(workdir, "new")),
            "greedy_matches_hf": list(out[0].outputs[0].token_ids) == hf}


if __name__ == "__main__":
    check = {"partial": partial, "lora-greedy": lora_greedy, "interrupted": interrupted}[sys.argv[1]]
    print("RESULT " + json.dumps(check(sys.argv[2])), flush=True)
