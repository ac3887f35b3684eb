"""Run under `torchrun --nproc_per_node 3`: 2 trainer ranks, 1 generator rank.

Checks each executor's own world and the three channel kinds over the bridge; with
`--die R`, rank R exits mid-run and every other rank must fail naming it.
"""

import os
import sys

import torch
import torch.distributed as dist

from hfllamarl.runtime.loop.channels import Channel, ChannelKind
from hfllamarl.runtime.loop.controller import fail
from hfllamarl.runtime.loop.executor import wait_for_startup
from hfllamarl.runtime.world.topology import init_topology

die = int(sys.argv[sys.argv.index("--die") + 1]) if "--die" in sys.argv else None
topo = init_topology(num_generator_processes=1, timeout_s=float(os.environ.get("T", "60")), use_cpu=True)
me = topo.rank
assert topo.world_size == 3 and topo.trainer_ranks == [0, 1] and topo.generator_ranks == [2]
# Each executor has a world of its own.
assert dist.get_world_size() == (2 if topo.role == "trainer" else 1), dist.get_world_size()
if topo.role == "trainer":
    t = torch.tensor([float(me + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0
topo.bridge("object"), topo.bridge("tensor")
wait_for_startup(topo, 120.0)  # as every executor does before its first exchange: from here a silent rank is lost

try:
    bcast = Channel("b", ChannelKind.BROADCAST, [2], [0, 1], topo)
    got = bcast.communicate({"w": torch.arange(4, dtype=torch.bfloat16), "v": 7} if me == 2 else None)
    if me in (0, 1):
        assert got["v"] == 7 and got["w"].dtype == torch.bfloat16 and got["w"].tolist() == [0, 1, 2, 3]
    if die is not None and me == die:
        os._exit(9)
    scatter = Channel("s", ChannelKind.SCATTER, [2], [0, 1], topo)
    got = scatter.communicate([[i, i] for i in range(5)] if me == 2 else None)
    if me == 0:
        assert got == [[0, 0], [1, 1], [2, 2]], got
    if me == 1:
        assert got == [[3, 3], [4, 4]], got
    gather = Channel("g", ChannelKind.GATHER, [0, 1, 2], [0], topo)
    got = gather.communicate(torch.full((2,), float(me)))
    if me == 0:
        assert [g.tolist() for g in got] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    # Trainer 1 -> trainer 0 and back: ranks of one role can use channels too.
    back = Channel("t", ChannelKind.BROADCAST, [1], [0, 2], topo).communicate("hello" if me == 1 else None)
    assert me == 1 or back == "hello"
except Exception as exc:
    raise fail(topo, exc)  # as the controller does: name the rank at fault
topo.liveness.mark_done()
print(f"CHANNELS OK rank {me}", flush=True)
