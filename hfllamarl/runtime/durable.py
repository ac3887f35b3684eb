"""Files that survive power loss, and loading saved state without running code.

A rename is atomic against a killed process, but until the data and the directory entries are flushed
(`fsync`) a power loss can leave a renamed file empty or the rename undone. The checkpoint code flushes every
file and directory of a checkpoint before it writes the completion marker, and the directory holding each
rename after it (`checkpoint.publish_steps`).
"""

from __future__ import annotations

import json
import os


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (the names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Flush a file's data and metadata (a file written by another process or library included)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: str) -> None:
    """Flush every file and directory under `root`, and `root` itself (deepest first: a directory's entries are
    flushed after what they name)."""
    for here, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(here, name)
            if not os.path.islink(path):
                fsync_file(path)
        fsync_dir(here)


def write_json(path: str, data) -> None:
    """Write `data` as JSON at `path`, whole or not at all, and flushed: a temporary file, fsync, rename, fsync of
    the directory."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def load_plain(path: str):
    """`torch.load` restricted to plain data (tensors, numbers, strings, lists, tuples, dicts): what a learning-rate
    scheduler's state and the RNG states are. A file that would build any other object, or run code, is refused
    (torch's `weights_only=True`, as transformers' Trainer loads `scheduler.pt` and `rng_state_*.pth`)."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(
            f"{path!r} holds more than plain data (numbers, lists, tensors), so it is not loaded: a checkpoint file "
            "can run code when unpickled. Resume from a checkpoint this version wrote, or one you trust after "
            f"checking it. ({str(exc).splitlines()[0]})") from exc
