"""Under torchrun with 2 ranks (gloo): the lookahead weights each rank computes from its FSDP2 shards of the policy
and of AdamW's state, gathered, equal the weights torch's own AdamW reaches on the unsharded model in the same
number of steps whose gradients equal its exp_avg.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/lookahead_sharded.py MODEL_DIR STEPS
Prints `RESULT {json}` on rank 0: the largest difference per weight, and how far the weights moved.
"""

import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    from transformers import AutoModelForCausalLM

    from hfllamarl.runtime.weights.fsdp import shard_model
    from hfllamarl.runtime.weights.lookahead import LookaheadWeights

    dist.init_process_group("gloo")
    steps = int(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    shard_model(model, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.arange(2 * 12).reshape(2, 12) % model.config.vocab_size
    for _ in range(3):  # real steps, so that AdamW has state
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    sent = {k: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
            for k, t in LookaheadWeights(model, model, optimizer, steps).state_dict().items()}
    sharded = all(t.to_local().shape[0] < t.shape[0] for t in model.parameters() if t.shape[0] > 1)
    # The reference: the whole model and AdamW state on one process, `steps` real AdamW steps with grad = exp_avg.
    names = {id(p): n for n, p in model.named_parameters()}
    whole = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    states = {names[id(p)]: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                             for k, v in optimizer.state[p].items()} for p in model.parameters()}
    if dist.get_rank() == 0:
        params = {n: torch.nn.Parameter(t.clone()) for n, t in whole.items()}
        reference = torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.1)
        for n, p in params.items():
            reference.state[p] = states[n]
        for _ in range(steps):
            for n, p in params.items():
                p.grad = states[n]["exp_avg"].clone()
            reference.step()
        diffs = {n: float((sent[n] - p.detach()).abs().max()) for n, p in params.items()}
        moved = {n: float((p.detach() - whole[n]).abs().max()) for n, p in params.items()}
        print("RESULT " + json.dumps({"diffs": diffs, "moved": moved, "sharded": sharded,
                                      "names": sorted(sent)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
