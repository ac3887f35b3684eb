"""Under torchrun with 2 ranks (gloo): the merged LoRA weights each rank computes from its FSDP2 shards, gathered,
equal peft's own merge_and_unload() of the unsharded model (embedding, linear layers, fused siblings).

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/lora_sharded_merge.py MODEL_DIR
Prints `RESULT {json}` on rank 0: the largest difference per weight.
"""

import copy
import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hfllamarl.runtime.weights.fsdp import shard_model
    from hfllamarl.runtime.weights.lora import MergedLoraWeights

    dist.init_process_group("gloo")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32),
                           LoraConfig(target_modules=["embed_tokens", "q_proj", "up_proj"], lora_alpha=16))
    g = torch.Generator().manual_seed(1)  # the same adapters on both ranks
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    base = {k.replace(".base_layer.", ".").removeprefix("base_model.model."): t.detach().clone()
            for k, t in model.state_dict().items() if ".lora_" not in k}
    moved = {k: float((reference[k] - base[k]).abs().max()) for k in reference}
    shard_model(model, "cpu")
    sent = MergedLoraWeights(model).state_dict()
    diffs = {k: float((t.full_tensor() - reference[k]).abs().max()) for k, t in sent.items()}
    sharded = all(hasattr(t, "to_local") and t.to_local().shape[0] < t.shape[0] for t in sent.values())
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"diffs": diffs, "sharded": sharded, "moved": moved}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
