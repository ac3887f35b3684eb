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
# Two workers (HFLLAMARL_TEST_WORKERS; 0: one process), each taking whole files (the files with the most tests first,
# pytest-xdist's order): a test that waits (a drill's frozen rank, a launcher) leaves its cores to the other worker.
# (The longest files first was slower: the drills' side-by-side jobs and the TRL port then share the cores.)
"$VENV/bin/python" -m pip install -q -r tests/requirements.txt >&2
WORKERS=${HFLLAMARL_TEST_WORKERS:-2}
XDIST=()
if [ "$WORKERS" != 0 ]; then XDIST=(-n "$WORKERS" --dist loadfile); fi
if [ $# -gt 0 ]; then exec "$VENV/bin/python" -m pytest -q --durations=20 "${XDIST[@]}" "$@"; fi
# The whole suite: the tests that hold a wall-clock bound (marker `timing`: a grader's budget, a tool's turns) run
# alone after the others, so that a drill on the other worker cannot make them miss it.
status=0
"$VENV/bin/python" -m pytest -q --durations=20 "${XDIST[@]}" -m "not timing" || status=$?
"$VENV/bin/python" -m pytest -q -m timing || status=$?
exit $status
