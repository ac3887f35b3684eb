"""The hostile-code suite (`test_hostile_code.py`) again, as uid 65534, when the job runs as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.mark.skipif(os.geteuid() != 0, reason="this run is not root: test_hostile_code.py already ran unprivileged")
def test_every_case_holds_for_a_job_that_is_not_root():
    """The suite again, as uid 65534 (`tests/scripts/as_nobody.py`): a job that does not run as root keeps its own uid
    in the calls, so what the file system, the sockets and the environment show the call is the job's own, and
    nothing but the sandbox stands between them (no uid drop)."""
    here = Path(__file__).resolve().parent / "test_hostile_code.py"
    env = {k: v for k, v in os.environ.items() if k not in ("HFLLAMARL_PRELOAD", "PYTEST_ADDOPTS")}
    home = tempfile.mkdtemp(prefix="hfllamarl-nobody-home-")  # (pytest's tmp_path is below a 0700 directory)
    os.chown(home, 65534, 65534)
    env.update(HOME=home, HFLLAMARL_TEST_PRELOAD="0", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, str(here.parent / "scripts" / "as_nobody.py"), "-m", "pytest", "-q",
                           "-p", "no:cacheprovider", str(here)],
                          cwd=here.parents[1], env=env, capture_output=True, text=True, timeout=600)
    shutil.rmtree(home, ignore_errors=True)
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail + proc.stderr[-2000:]
    assert " passed" in tail and "failed" not in tail and "skipped" not in tail and "error" not in tail, tail
