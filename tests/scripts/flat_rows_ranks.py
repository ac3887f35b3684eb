"""Under torchrun with 2 ranks (gloo), each trainer rank's rows with signal differ.

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/flat_rows_ranks.py
        `rows_to_train` tops rank 0 (one row with signal) up so both run three rows (rank 1 has three): as many
        micro-batches, whose gradient reduction is collective.
    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/flat_rows_ranks.py MODEL_DIR
        One step of two FSDP2-sharded trainer ranks, micro-batches of 2, with the flat rows run forward only
        (`forward_only_plan`) and with every row run both ways: rank 0's first micro-batch is flat and rank 1's is
        not (rank 0 runs a flat row with gradient, rank 1 a spare forward-only pass), and the other way round in the
        second; the third is flat on both (no backward: the gradients are reduced in the second's). Rank 0 reports
        the loss, the gathered gradients' largest difference and their size.

Prints `RESULT {json}` on rank 0.
"""

import json
import sys

import torch
import torch.distributed as dist


def rows(rank: int) -> None:
    from hfllamarl.runtime.training.iterations import rows_to_train

    advantages = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0] if rank == 0 else [1.0, 0.0, -1.0, 0.0, 0.0, 2.0])
    out = [None, None]
    dist.all_gather_object(out, rows_to_train(advantages, skip=True))
    return out


def sharded_step(rank: int, path: str) -> dict:
    from transformers import AutoModelForCausalLM

    from hfllamarl.plugins.algorithms.aipo import AIPO
    from hfllamarl.runtime.data.rewards import RewardRunner
    from hfllamarl.runtime.loop.rollout import Rollout
    from hfllamarl.runtime.loop.sampling import Sampling
    from hfllamarl.runtime.loop.schedule import Schedule
    from hfllamarl.runtime.training.trainer import TrainerExecutor, TrainerSpec
    from hfllamarl.runtime.weights.fsdp import shard_model
    from hfllamarl.runtime.world.topology import Topology

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    shard_model(model, "cpu")
    g = torch.Generator().manual_seed(10 + rank)
    rollouts = [Rollout(prompt="", prompt_ids=torch.randint(3, 50, (4 + i,), generator=g).tolist(),
                        completion_ids=torch.randint(3, 50, (3 + i,), generator=g).tolist(),
                        behavior_logprobs=(-3.0 - torch.rand(3 + i, generator=g)).tolist(), versions=[0] * (3 + i),
                        finish_reason="stop", completion_text="") for i in range(6)]
    advantages = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.0, 0.0] if rank == 0 else [1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    out = {}
    for forward_only in (False, True):
        spec = TrainerSpec(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), scheduler=None,
                           algorithm=AIPO(rho=4.0), rewards=RewardRunner([lambda completions, **kw: [0.0]]),
                           backend=None, schedule=Schedule(1, 0), sampling=Sampling(), max_grad_norm=None,
                           pad_token_id=0, device=torch.device("cpu"), num_generations=4, micro_batch_size=2,
                           skip_flat_backward=forward_only)
        ex = TrainerExecutor(spec, Topology(mode="launcher", rank=rank, world_size=3, num_generators=1, timeout_s=60,
                                            use_cpu=True))
        assert ex.skips_flat_backward == forward_only
        model.zero_grad()
        loss, stats = ex._accumulate_gradients(rollouts, advantages)
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
        out[forward_only] = (loss, grads, stats)
    (loss0, grads0, stats0), (loss1, grads1, stats1) = out[False], out[True]
    return {"loss": [loss0, loss1], "entropy": [stats0["entropy"], stats1["entropy"]],
            "forward_only_frac": stats1["trainer/flat_rows_forward_only_frac"],
            "grads": len(grads0), "same_names": sorted(grads0) == sorted(grads1),
            "max_diff": max(float((grads1[n] - grads0[n]).abs().max()) for n in grads0),
            "max_grad": max(float(grads0[n].abs().max()) for n in grads0)}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = rows(rank) if len(sys.argv) < 2 else sharded_step(rank, sys.argv[1])
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
