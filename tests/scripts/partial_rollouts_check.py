"""Partial rollouts in a real vLLM generator: do carried completions keep each token's mu and version?

    python tests/scripts/partial_rollouts_check.py WORKDIR   (prints one line: RESULT {json})

A random-init tiny Llama generates 2 batches with max_completion_length 12 and a budget of 4 tokens
per tick, so a completion spans 3 ticks; between ticks the generator loads new weights (versions
1 and 2, the base weights plus noise), as the trainer's weight sync would. Every token's recorded
behaviour log-prob is then recomputed with transformers under the weights of the version it says
sampled it, and, as a counter-check, under the version-0 weights.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch

BUDGET, LENGTH, TEMPERATURE = 4, 12, 0.8


def weight_versions(base: dict, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = [base]
    for _ in range(count):
        out.append({k: t + 0.3 * t.float().std().clamp(min=1e-2) * torch.randn(t.shape, generator=g)
                    for k, t in base.items()})
    return out


def main(workdir: str) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM

    from hfllamarl.generator import GeneratorExecutor, GeneratorSpec
    from hfllamarl.prompts import PromptEncoder
    from hfllamarl.tiny import build_tiny_model
    from hfllamarl.trainer_executor import completion_logprobs, pad_batch
    from hfllamarl.weight_sync import POLICY_WEIGHTS

    path = build_tiny_model(os.path.join(workdir, "model"), seed=3)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    versions = weight_versions({k: v.clone() for k, v in model.state_dict().items()}, 2)
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(6)]
    spec = GeneratorSpec(model_path=path, tokenizer_path=path, dataset=Dataset.from_list(rows), num_batches=2,
                         prompts_per_batch=3, num_generations=2, max_completion_length=LENGTH, max_model_len=64,
                         temperature=TEMPERATURE, dtype="float32", max_staleness=3, partial_rollout_tokens=BUDGET)
    gen = GeneratorExecutor(spec, SimpleNamespace(num_generators=1, use_cpu=True, local_rank=0, rank=0))
    gen.dataset, gen.llm = spec.dataset, gen._build_engine()
    gen.encoder = PromptEncoder(AutoTokenizer.from_pretrained(path))

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
    print("RESULT " + json.dumps({
        "finished_at": {g.batch_index: tick for tick, g in finished},
        "carried_after": carried_after,
        "num_rollouts": len(rollouts),
        "multi_segment": len(multi),
        "segments": sorted({r.segments for r in rollouts}),
        "lengths_ok": all(len(r.completion_ids) == len(r.behavior_logprobs) == len(r.versions) for r in rollouts),
        "finish_ok": all(r.finish_reason == "stop" or len(r.completion_ids) == LENGTH for r in rollouts),
        "segments_ok": all(r.segments == max(1, -(-len(r.completion_ids) // BUDGET)) for r in rollouts),
        "text_ok": all(r.completion_text == tok.decode(r.completion_ids, skip_special_tokens=True) for r in multi),
        "bad_versions": bad_versions,
        "max_error": max(errors),
        "num_tokens": len(errors),
        "wrong_version_mean_gap": sum(wrong_version_gap) / max(len(wrong_version_gap), 1),
    }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
