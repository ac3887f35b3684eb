"""Test-only functions run inside a sandbox by name (``"sandbox_targets:run_code"``)."""

from __future__ import annotations


def run_code(code: str) -> str:
    """Executes ``code`` and returns what it printed: it stands for an ``eval`` reached inside a parser."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<model>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def pbkdf2(rounds: int) -> str:
    """Runs in C without checking for signals, like sympy stuck in a huge power."""
    import hashlib

    return hashlib.pbkdf2_hmac("sha256", b"x", b"y", rounds).hex()
