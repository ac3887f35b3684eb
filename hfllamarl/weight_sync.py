"""What a weight-sync backend may use (`hfllamarl.contracts.WeightSyncBackend`, entry-point group
`hfllamarl.weight_sync`), as `hfllamarl.losses` is for algorithms. The built-in backends (`nccl_ddma`, `broadcast`,
`disk`) use only these names; the runtime's own modules behind them may change between versions, these do not.

Sending and receiving over the bridge between the trainer ranks and a generator replica (every call names what it
moves, so a timeout or a lost peer reports it, and waits at most `collective_timeout_s`):

- `send_tensor(topology, tensor, dst, what)` / `recv_tensor(topology, tensor, src, what)`: one tensor, blocking;
  `start_recv_tensor(...)` returns a wait to call later.
- `send_objects(topology, obj, dsts, what)` / `recv_object(topology, src, what)`: plain data (a layout, a manifest),
  never code; `start_send_object(...)` returns waits.

Shards and boxes:

- `local_box(tensor, trainer_rank)`: the part of a parameter this trainer rank sends, the box of the full tensor it
  is, and whether it sends anything: FSDP2 rows, or with trainer tensor parallelism a block of rows and columns; a
  part several ranks hold (tensor parallelism keeps norms and embeddings whole) is split by rows between them; a plain
  tensor is trainer rank 0's.
- `local_shard(tensor, trainer_rank)`: the same for a parameter sharded by rows only (FSDP2 alone): its rows and
  their offset on dim 0.
- `whole(shape)`: the box of a whole tensor; `crop(tensor, box)`: the part of a tensor a box names.

Surviving a lost replica (`generator_failure="continue"`):

- `ReplicaLostError`: raised by the calls above when the peer's replica is lost; `settle(waits)` finishes every
  wait and returns the replicas lost on the way, so a backend can go on sending to the others.
"""

from __future__ import annotations

from hfllamarl.runtime.loop.channels import (recv_object, recv_tensor, send_objects, send_tensor, start_recv_tensor,
                                             start_send_object)
from hfllamarl.runtime.loop.weights_channel import crop, settle, whole
from hfllamarl.runtime.weights.fsdp import local_box, local_shard
from hfllamarl.runtime.world.liveness import ReplicaLostError

__all__ = ["ReplicaLostError", "crop", "local_box", "local_shard", "recv_object", "recv_tensor", "send_objects", "send_tensor",
           "settle", "start_recv_tensor", "start_send_object", "whole"]
