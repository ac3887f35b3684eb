"""Two FSDP2 trainer ranks (no generator; TRAINER_TP=2: one tensor-parallel group): rank 1's micro-batch holds a NaN mu. Both ranks stop before the
backward pass with the same error, naming rank 1, and neither weight shard changes. Each rank writes its
result to RESULT_DIR/rank<N>.json (the ranks share one stdout, where their lines could interleave).

    RESULT_DIR=/tmp/out torchrun --nproc_per_node 2 tests/scripts/finite_check.py
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/", 1)[0] + "/..")
from test_finite import executor, groups  # noqa: E402

from hfllamarl.runtime.training.finite import NonFiniteError  # noqa: E402
from hfllamarl.runtime.weights.fsdp import shard_model  # noqa: E402
from hfllamarl.runtime.world.topology import Topology, settle_collectives_at_exit  # noqa: E402


def main():
    dist.init_process_group("gloo")
    settle_collectives_at_exit()  # the script ends right after its last collective
    rank = dist.get_rank()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    shard_model(model, "cpu", tp=int(os.environ.get("TRAINER_TP", "1")))  # (2: one tensor-parallel group)
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    ex = executor(model)
    ex.topology = Topology(mode="launcher", rank=rank, world_size=3, num_generators=1, timeout_s=30, use_cpu=True)
    try:
        ex.train_on(groups(mu_nan_at=(2, 0) if rank == 1 else None))
        message = None
    except NonFiniteError as exc:
        message = str(exc)
    model.reshard()  # the root's parameters stay gathered after a forward pass that had no backward
    unchanged = all(torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters())
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "message": message, "unchanged": unchanged}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
