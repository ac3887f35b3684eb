"""Python's cyclic garbage collector, paused while a process imports its heavy modules.

Importing torch, transformers and vLLM makes millions of objects that live as long as the process, and the
collector, run every few hundred allocations, walks them again and again while the imports run (about 1.2 s of
the 6-7 s it takes to import vLLM and build an engine on a CPU core). This module imports nothing heavy, so that
it can be used before those imports.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused(freeze: bool = True):
    """The collector off inside the block, back on afterwards if it was on. With `freeze`, the garbage is collected
    once on the way out and the survivors are frozen (later collections skip them): for a process of our own (a
    generator), not for the user's."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.collect()
            gc.freeze()
        if enabled:
            gc.enable()
