#!/usr/bin/env bash
# Llama 8B on 1 node x 8 GPUs (6 trainer + 2 generator ranks). Extra arguments override recipe fields.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec accelerate launch --config_file examples/accelerate/gpu_1node_8.yaml \
    examples/train_math.py --config examples/recipes/llama8b_1node_8gpu.yaml "$@"
