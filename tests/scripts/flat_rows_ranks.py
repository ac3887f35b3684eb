"""Under torchrun with 2 ranks (gloo): each trainer rank's rows with signal differ (rank 0: one, rank 1: three);
`rows_to_train` tops rank 0 up so both run three rows (as many micro-batches: their gradient reduction is collective).

    python -m torch.distributed.run --nproc_per_node 2 tests/scripts/flat_rows_ranks.py
Prints `RESULT {json}` on rank 0: each rank's rows.
"""

import json

import torch
import torch.distributed as dist


def main() -> None:
    from hfllamarl.runtime.training.iterations import rows_to_train

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    advantages = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0] if rank == 0 else [1.0, 0.0, -1.0, 0.0, 0.0, 2.0])
    rows = [None, None]
    dist.all_gather_object(rows, rows_to_train(advantages, skip=True))
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
