"""1 trainer rank + 2 generator replicas of one rank, started bare (RANK/WORLD_SIZE/MASTER_*), no vLLM: one
`nccl_ddma` sync down the relay (trainer -> replica 0 -> replica 1), generator_failure="continue".

    python tests/scripts/relay_check.py [--break]

Every rank prints one line `RESULT {json}`. With `--break`, replica 0 (rank 1) exits in the middle of the sync,
after receiving its first pieces: the trainer finishes its send without it, and replica 1 receives the rest of
the sync as zeros, says so (`incomplete`) and does not hang. Without it, both replicas receive the trainer's
weights bitwise.
"""

import json
import os
import sys

import torch

from hfllamarl.runtime.weights.fsdp import shard_model
from hfllamarl.runtime.world.topology import init_topology
from hfllamarl.runtime.loop.weights_channel import build_backend, tensor_digest


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2))


def main() -> dict:
    topo = init_topology(2, timeout_s=60, use_cpu=True, tensor_parallel_size=1, failure="continue")
    topo.join_bridges()
    backend = build_backend("nccl_ddma", topo, bucket_bytes=4096, alone_bytes=1024)
    reference = model()
    if topo.role == "trainer":
        policy = model()
        shard_model(policy, "cpu")
        backend.setup_trainer(policy)
    else:
        backend.setup_generator(None)  # whole tensors: no engine narrows them here
    topo.containing = True  # the job has started: a lost replica is survived from here on
    backend.targets = [0, 1]
    if topo.role == "trainer":
        backend.send(policy)
        return {"lost": sorted(topo.lost)}
    if "--break" in sys.argv and topo.replica == 0:  # gone once 4 pieces have arrived and been passed on
        from hfllamarl.plugins.weight_sync import ddma

        send = ddma.send_tensor

        def passed_on(*args, **kwargs):  # the pieces it forwards are sent whole before it can die
            send(*args, **kwargs)()
            return lambda: None

        ddma.send_tensor = passed_on
        arrive, seen = backend._arrive, []

        def dying(*args, **kwargs):
            seen.append(1)
            if len(seen) == 5:
                os._exit(9)
            return arrive(*args, **kwargs)

        backend._arrive = dying
    got = list(backend.receive())
    expected = reference.state_dict()
    same = [name for name, t in got if torch.equal(t, expected[name])]
    return {"incomplete": backend.incomplete, "weights": len(got), "of": len(expected), "same": len(same),
            "bitwise": tensor_digest(got) == tensor_digest(expected.items())}


if __name__ == "__main__":
    result = main()
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # (no teardown of the groups of a lost peer)
