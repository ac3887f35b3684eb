"""LoRA as users write it, on every tiny family, trained one run after another in this one process.

    python tests/scripts/lora_families.py WORKDIR FAMILY[,FAMILY...]

For each family two synchronous runs (max_staleness=0, fp32), 2 steps each:
- `default`: the default `peft.LoraConfig()` (peft picks q_proj and v_proj) on the model directory (llama, qwen3:
  loaded on the meta device, adapters initialised as peft does) or on a loaded model object (qwen2, mistral: what
  TRL's tests pass, wrapped in place by peft before the generator's copy is saved);
- `peft_model`: a `PeftModel` the script builds itself (`get_peft_model` on the loaded model, the other
  `target_modules` forms) with adapters set to random non-zero values, as a pretrained adapter would be, so the
  generator's first weights are already merged ones.
Prints `RESULT {json}`: per run the step logs' is_ratio min/max, the loss, and whether the adapters moved.
"""

import json
import os
import sys

import torch
from datasets import Dataset

TARGETS = {  # the PeftModel run's target_modules, one form per family (embed_tokens on the untied ones)
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"],
    "qwen2": "all-linear",
    "qwen3": ["q_proj", "v_proj"],
    "mistral": ["embed_tokens", "gate_proj", "up_proj", "lm_head"],
}
OBJECT = {"qwen2", "mistral"}  # the default run passes a model object (the others: the directory)


def digits(completions, **kwargs):
    return [float(sum(c.isdigit() for c in x)) for x in completions]


def run(model, out: str, peft_config, lora_sync: str = "auto") -> dict:
    from hfllamarl import AsyncAIPOConfig, AsyncAIPOTrainer
    from hfllamarl.testing.tiny import successor_rows

    config = AsyncAIPOConfig(output_dir=out, max_steps=2, per_device_train_batch_size=16, num_generations=4,
                             max_completion_length=4, learning_rate=5e-2, logging_steps=1, report_to="none",
                             max_staleness=0, seed=0, lora_sync=lora_sync)
    trainer = AsyncAIPOTrainer(model=model, reward_funcs=[digits], args=config, peft_config=peft_config,
                               train_dataset=Dataset.from_list(successor_rows(64, seed=2)))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" in n and not p.is_meta}
    trainer.train()
    after = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in trainer.model.named_parameters()
             if ".lora_" in n}
    steps = [h for h in trainer.state.log_history if "is_ratio/min" in h]
    return {"steps": [{k: h[k] for k in ("is_ratio/min", "is_ratio/max", "loss", "grad_norm")} for h in steps],
            # built on the meta device, the adapters start from peft's init: B zero (linear layers)
            "moved": sum(not torch.equal(before[n].cpu(), after[n].detach().cpu()) if n in before
                         else ".lora_B." in n and bool(after[n].abs().sum() > 0) for n in after),
            "adapters": len(after), "sync": trainer.lora_sync,
            "bytes": [h.get("weight_sync/bytes", 0) for h in steps],
            "adapter_bytes": sum(p.numel() * p.element_size() for p in after.values())}


def peft_model(path: str, family: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(target_modules=TARGETS[family]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def main() -> None:
    from peft import LoraConfig

    from hfllamarl.testing.tiny import build_tiny_model

    workdir, families = sys.argv[1], sys.argv[2].split(",")
    result = {}
    for family in families:
        path = build_tiny_model(os.path.join(workdir, f"model-{family}"), family=family)
        model = path
        if family in OBJECT:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        result[f"{family}/default"] = run(model, os.path.join(workdir, f"{family}-default"), LoraConfig(), "adapter")
        result[f"{family}/peft_model"] = run(peft_model(path, family), os.path.join(workdir, f"{family}-peft"), None)
        print(f"DONE {family} {json.dumps(result[f'{family}/default'])}", flush=True)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
