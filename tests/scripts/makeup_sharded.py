"""Under torchrun with 2 ranks (gloo): a replica group of two FSDP2 trainer ranks makes up a missing share
(`replica_makeup.ShareMakeup`): both ranks sample the whole share in step (their sharded forward passes gather the
same parameters token after token, so neither may stop early), each keeps its own positions, and rank 0 compares
what they sampled with the same share sampled by the whole model in one process.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/makeup_sharded.py MODEL_DIR
Prints `RESULT {json}` on rank 0.
"""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist


def main() -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfllamarl.runtime.loop.sampling import Sampling
    from hfllamarl.runtime.training.bootstrap import BootstrapSampler
    from hfllamarl.runtime.training.replica_makeup import ShareMakeup
    from hfllamarl.runtime.weights.fsdp import shard_model

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    data = Dataset.from_dict({"prompt": [f"{n} + 1 =" for n in range(30)]})
    spec = SimpleNamespace(chat_template_kwargs={}, sampling=Sampling(temperature=1.0), max_completion_length=10,
                           max_model_len=128, prompts_per_batch=3, num_generations=4, seed=3, shuffle=True)
    group = SimpleNamespace(group=1, groups=2, members={1}, is_main=rank == 0, made_up=0, shared_generators=False)

    def sample(model, data_parallel_size, data_rank):
        sampler = BootstrapSampler(model, tok, data, spec, torch.device("cpu"), model.generation_config)
        groups = ShareMakeup(sampler, data_parallel_size, data_rank).sample(group, 0, 4, version=2)
        return [(g.position, [(r.row_index, r.completion_ids, r.behavior_logprobs, r.finish_reason)
                              for r in g.rollouts]) for g in groups]

    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    shard_model(model, "cpu")
    sharded = all(p.to_local().shape[0] < p.shape[0] for p in model.parameters() if p.shape[0] > 1)
    mine = sample(model, 2, rank)
    parts = [None, None]
    dist.all_gather_object(parts, mine)
    if rank == 0:
        whole = sample(AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32), 1, 0)
        print("RESULT " + json.dumps({"sharded": sharded, "parts": parts, "whole": whole,
                                      "made_up": group.made_up}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
