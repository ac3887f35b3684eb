#!/usr/bin/env bash
# README command 2: set up the environment, build the docs site (strict) and run the whole test suite on the CPU.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(bash "$ROOT/scripts/setup.sh" | tail -n 1)
cd "$ROOT"
# The docs' own pins live in docs/requirements.txt, not setup.py (the venv's hash, hence its cache, stays put).
"$VENV/bin/python" -m pip install -q -r docs/requirements.txt >&2
# Any warning (a broken link, a page missing from the nav, a config field without help text) fails the build.
# (Not --quiet: it hides the warnings from the strict count too.)
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
NO_MKDOCS_2_WARNING=1 timeout 600 "$VENV/bin/python" -m mkdocs build --strict --site-dir "$SITE"
"$VENV/bin/python" -m pytest -q "$@"
