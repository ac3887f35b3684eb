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
    flushed after what they name).

    Every rank flushes a checkpoint's directory while the other ranks may still be writing into it: an entry
    another rank renames (its `.tmp` file) or removes meanwhile is skipped, not an error. What this rank wrote is
    flushed all the same, and trainer rank 0 flushes the whole tree again once every rank is done
    (`checkpoint.publish_steps`)."""
    for here, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(here, name)
            try:
                if not os.path.islink(path):
                    fsync_file(path)
            except FileNotFoundError:
                pass  # renamed or removed by another rank since the walk listed it
        try:
            fsync_dir(here)
        except FileNotFoundError:
            pass


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


# The classes a checkpoint's own state files (`trainer-<rank>.pt`, `generator*.pt`) may build: the project's plain
# records and data types a dataset row's columns can hold. Nothing that runs code when built.
_STATE_CLASSES = {
    "hfllamarl.runtime.loop.rollout": {"Rollout", "RolloutGroup", "InFlightBatch"},
    "hfllamarl.runtime.data.episodes": {"Episode"},
    "hfllamarl.runtime.training.dynamic_sampling": {"ScoredGroup"},
    "builtins": {"set", "frozenset", "complex", "slice", "range", "bytearray", "list", "dict", "tuple", "int",
                 "float", "str", "bool", "bytes"},
    "collections": {"OrderedDict", "defaultdict", "Counter", "deque"},
    "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
    "decimal": {"Decimal"},
    "numpy": {"ndarray", "dtype"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
}


# Where those records lived before the runtime was grouped into subpackages: checkpoints written then resume.
_MOVED = {"hfllamarl.runtime.rollout": "hfllamarl.runtime.loop.rollout",
          "hfllamarl.runtime.episodes": "hfllamarl.runtime.data.episodes",
          "hfllamarl.runtime.dynamic_sampling": "hfllamarl.runtime.training.dynamic_sampling"}


def _allowed(module: str, name: str) -> bool:
    if name in _STATE_CLASSES.get(module, ()):
        return True
    return module == "numpy.dtypes" and name.endswith("DType")  # numpy >= 1.25 pickles a dtype by its class


def load_state(path: str):
    """Unpickle a checkpoint's state file (rollouts, ledgers) building only the classes `_STATE_CLASSES` names:
    a file crafted to run code when unpickled, or holding any other object, is refused with what to do.

    A multi-turn rollout still in flight at the checkpoint carries its environment instance as bytes; those are
    a user object and are unpickled (without restriction) only when that rollout's generation resumes.
    """
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            module = _MOVED.get(module, module)
            if _allowed(module, name):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(
                f"{path!r} asks to build {module}.{name}, which a checkpoint's state never holds, so it is not "
                "loaded (a checkpoint file can run code when unpickled). Resume from a checkpoint this version "
                "wrote, or, if a dataset column holds that type, convert the column to plain values.")

    with open(path, "rb") as fh:
        return Restricted(fh).load()
