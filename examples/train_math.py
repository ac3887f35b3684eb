"""Train a policy on MATH or GSM8K with asynchronous AIPO: `hfllamarl train` under a name the launch scripts use.

Every setting lives in a recipe (`examples/recipes/*.yaml`: AsyncAIPOConfig fields, the model, the data set, the
prompt template and the reward; see docs/guides/recipes.md); any field can be overridden on the command line
(`--learning_rate 5e-7`). This file is the command itself, so that a launcher can be given a script path:

    # 1 node x 8 GPUs: 6 FSDP2 trainer ranks + 2 generator ranks (one vLLM engine, tensor-parallel 2)
    bash examples/launch/1node_8gpu.sh
    # 2 nodes x 8 GPUs: node 0 trains, node 1 generates (vLLM tensor-parallel 8, fp8)
    MACHINE_RANK=0 MAIN_IP=10.0.0.1 bash examples/launch/2node_16gpu.sh   # on node 0
    MACHINE_RANK=1 MAIN_IP=10.0.0.1 bash examples/launch/2node_16gpu.sh   # on node 1

    # check a recipe (nothing is trained, no process is started):
    hfllamarl train --config examples/recipes/llama8b_1node_8gpu.yaml --check
"""

from __future__ import annotations

import sys

from hfllamarl.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
