#!/usr/bin/env bash
# Llama 70B on 2 nodes x 8 GPUs: run on every node with its MACHINE_RANK (0 or 1) and node 0's address.
#   MACHINE_RANK=0 MAIN_IP=10.0.0.1 bash examples/launch/2node_16gpu.sh
set -euo pipefail
: "${MACHINE_RANK:?set MACHINE_RANK to this node's index (0 or 1)}"
: "${MAIN_IP:?set MAIN_IP to node 0's address}"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec accelerate launch --config_file examples/accelerate/gpu_2node_16.yaml \
    --machine_rank "$MACHINE_RANK" --main_process_ip "$MAIN_IP" --main_process_port "${MAIN_PORT:-29500}" \
    examples/train_math.py --config examples/recipes/llama70b_2node_16gpu.yaml "$@"
