#!/usr/bin/env bash
# README command 2: set up the environment and run the whole test suite on the CPU.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(bash "$ROOT/scripts/setup.sh" | tail -n 1)
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q "$@"
