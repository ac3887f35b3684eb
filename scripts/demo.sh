#!/usr/bin/env bash
# README command 1: set up the environment and run the CPU demo (1 generator + 1 trainer process).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(bash "$ROOT/scripts/setup.sh" | tail -n 1)
cd "$ROOT"
exec "$VENV/bin/python" examples/demo_cpu.py "$@"
