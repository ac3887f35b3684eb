"""Checkpoints survive a stop at any instant of their publication, are flushed before their marker, and load
no state that would run code."""

import json
import os
import random

import pytest
import torch

from hfllamarl.runtime.weights import checkpoint
from hfllamarl.runtime.weights import durable
from hfllamarl.runtime.weights.durable import load_plain

STEP = 5


def _write_checkpoint(directory: str, version: str, marker: bool) -> None:
    """A checkpoint-shaped directory whose every file says which `version` wrote it."""
    os.makedirs(os.path.join(directory, "hfllamarl", "optimizer"), exist_ok=True)
    for rel in ("model.safetensors", "scheduler.pt", os.path.join("hfllamarl", "trainer-0.pt"),
                os.path.join("hfllamarl", "optimizer", "__0_0.distcp")):
        with open(os.path.join(directory, rel), "w") as fh:
            fh.write(version)
    if marker:
        with open(os.path.join(directory, checkpoint.MARKER), "w") as fh:
            json.dump({"step": STEP, "version": version}, fh)


def _version_of(path: str) -> str:
    """The version every file of a complete checkpoint holds (fails on a mixed or incomplete one)."""
    with open(os.path.join(path, checkpoint.MARKER)) as fh:
        marker = json.load(fh)
    found = set()
    for rel in ("model.safetensors", "scheduler.pt", os.path.join("hfllamarl", "trainer-0.pt"),
                os.path.join("hfllamarl", "optimizer", "__0_0.distcp")):
        with open(os.path.join(path, rel)) as fh:
            found.add(fh.read())
    assert found == {marker["version"]}, (path, found, marker)
    return marker["version"]


def _replacement(tmp_path, k: int):
    """checkpoint-5 ("old") being replaced by a new checkpoint-5 ("new"), stopped after the first k steps."""
    out = str(tmp_path / f"run-{k}")
    _write_checkpoint(checkpoint.final_dir(out, STEP), "old", marker=True)
    _write_checkpoint(checkpoint.partial_dir(out, STEP), "new", marker=False)
    steps = checkpoint.publish_steps(out, STEP, {"step": STEP, "version": "new"})
    for _, action in steps[:k]:
        action()
    return out, len(steps)


def test_a_replacement_stopped_after_any_step_resumes_from_a_complete_checkpoint(tmp_path):
    _, n = _replacement(tmp_path, 0)
    for k in range(n + 1):
        out, _ = _replacement(tmp_path, k)
        # the files a stop leaves: never a moment without one complete checkpoint-5, the old or the new
        on_disk = [name for name in os.listdir(out) if os.path.isfile(os.path.join(out, name, checkpoint.MARKER))]
        assert on_disk, (k, os.listdir(out))
        path, marker = checkpoint.resolve(True, out)
        assert os.path.basename(path) == "checkpoint-5" and marker["step"] == STEP
        # the old one until it is set aside (step 3); from then on the new one, complete since its marker (step 2)
        assert _version_of(path) == ("new" if k >= 3 else "old"), k
        checkpoint.remove_partial(out)  # what a resumed job does next: nothing else is left behind
        assert sorted(os.listdir(out)) == ["checkpoint-5"], (k, os.listdir(out))


def test_a_marker_cut_while_written_and_a_deletion_cut_halfway_are_not_checkpoints(tmp_path):
    out, _ = _replacement(tmp_path, 1)  # files flushed, the marker not yet in place: a truncated temporary one
    with open(os.path.join(checkpoint.partial_dir(out, STEP), checkpoint.MARKER + ".tmp"), "w") as fh:
        fh.write('{"step": 5, "vers')
    path, _ = checkpoint.resolve(True, out)
    assert _version_of(path) == "old"
    # a pruned checkpoint whose deletion stopped halfway (its marker still there) is never resumed
    _write_checkpoint(os.path.join(out, ".checkpoint-9.deleted"), "pruned", marker=True)
    os.remove(os.path.join(out, ".checkpoint-9.deleted", "model.safetensors"))
    path, _ = checkpoint.resolve(True, out)
    assert os.path.basename(path) == "checkpoint-5"
    assert ".checkpoint-9.deleted" in checkpoint.remove_partial(out)


def test_prune_leaves_no_directory_half_deleted(tmp_path):
    out = str(tmp_path)
    for step in (1, 2, 3):
        _write_checkpoint(checkpoint.final_dir(out, step), f"v{step}", marker=True)
    checkpoint.prune(out, 1)
    assert sorted(os.listdir(out)) == ["checkpoint-3"]


def test_every_file_and_directory_is_flushed_before_the_marker_and_the_parent_after_each_rename(tmp_path,
                                                                                                monkeypatch):
    """Supplementary (the checks above are on the files themselves): which paths os.fsync was given, in order."""
    out, n = _replacement(tmp_path, 0)
    partial = checkpoint.partial_dir(out, STEP)
    written = {os.path.join(here, name) for here, _, names in os.walk(partial) for name in names}
    dirs = {here for here, _, _ in os.walk(partial)}
    calls, real = [], os.fsync

    def recording(fd):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    renamed, real_replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append((len(calls), b)), real_replace(a, b)))
    for _, action in checkpoint.publish_steps(out, STEP, {"step": STEP, "version": "new"}):
        action()
    marker_tmp = os.path.join(partial, checkpoint.MARKER + ".tmp")
    first_marker = calls.index(marker_tmp)
    assert written | dirs <= set(calls[:first_marker]), sorted((written | dirs) - set(calls[:first_marker]))
    assert partial in calls[first_marker + 1:]  # the marker's rename inside the checkpoint, flushed
    for at, target in renamed:  # after every rename the directory holding it is flushed next
        assert calls[at] == os.path.dirname(target), (target, calls[at:at + 2])
    assert _version_of(checkpoint.final_dir(out, STEP)) == "new"


class _RunsCode:
    """Unpickling this creates a file: what a crafted checkpoint file could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_scheduler_file_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    crafted, created = tmp_path / "scheduler.pt", tmp_path / "pwned"
    torch.save({"last_epoch": 3, "payload": _RunsCode(str(created))}, crafted)
    with pytest.raises(Exception, match="plain data"):
        load_plain(str(crafted))
    assert not created.exists()
    torch.load(crafted, weights_only=False)  # the reference: unrestricted unpickling runs it
    assert created.exists()


def test_what_a_checkpoint_saves_as_scheduler_and_rng_state_loads_as_plain_data(tmp_path):
    """The states `save_trainer_side` writes (a transformers scheduler, Python's and torch's RNG) round-trip."""
    from transformers import get_linear_schedule_with_warmup

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_linear_schedule_with_warmup(opt, 2, 10)
    for _ in range(3):
        opt.step(), sched.step()
    torch.save(sched.state_dict(), tmp_path / "scheduler.pt")
    random.seed(7)
    torch_state = torch.get_rng_state().clone()
    torch.save({"python": random.getstate(), "torch": torch_state}, tmp_path / "rng_state_0.pth")
    expected_next = random.random()

    sched2 = get_linear_schedule_with_warmup(torch.optim.AdamW(model.parameters(), lr=1e-3), 2, 10)
    sched2.load_state_dict(load_plain(str(tmp_path / "scheduler.pt")))
    assert sched2.get_last_lr() == sched.get_last_lr() and sched2.last_epoch == 3
    rng = load_plain(str(tmp_path / "rng_state_0.pth"))
    random.seed(0)
    random.setstate(rng["python"])
    assert random.random() == expected_next
    assert torch.equal(rng["torch"], torch_state)


def test_the_trainer_side_loads_scheduler_and_rng_through_the_plain_loader():
    """Read the loading code: no unrestricted torch.load is left for these files."""
    import inspect

    source = inspect.getsource(checkpoint.load_trainer_side)
    assert "weights_only=False" not in source and source.count("load_plain(") == 2


def test_a_state_file_loads_the_records_a_checkpoint_holds_and_refuses_anything_else(tmp_path):
    """trainer-<rank>.pt / generator.pt: what `save_trainer_side` and `save_generator_side` write comes back equal;
    a file whose unpickling would create a file, or build any other object, is refused and nothing runs."""
    import datetime
    import pickle

    import numpy as np

    from hfllamarl.runtime.training.dynamic_sampling import ScoredGroup
    from hfllamarl.runtime.weights.durable import load_state
    from hfllamarl.runtime.data.episodes import Episode
    from hfllamarl.runtime.loop.rollout import InFlightBatch, Rollout, RolloutGroup

    rollout = Rollout(prompt=[{"role": "user", "content": "1+1?"}], prompt_ids=[1, 2], completion_ids=[3],
                      behavior_logprobs=[-0.5], versions=[2], finish_reason="", completion_text="2",
                      columns={"answer": "2", "when": datetime.date(2026, 1, 1), "n": np.int64(3),
                               "v": np.arange(3), "tags": {"a"}},
                      episode=Episode(messages=[{"role": "assistant", "content": "2"}], environment=b"opaque"))
    group = RolloutGroup([rollout], batch_index=4, policy_version=2, generation_seconds=0.5, batch_tokens=1)
    saved = {"inbox": [group], "version": 3, "trained_rows": [[1, 2]], "reserve": [ScoredGroup(group, [1.0])],
             "dispatch": {"assigned": {4: {0: 0}}, "losses": [], "regenerated": 0},
             "in_flight": [InFlightBatch(5, 3, [[rollout]], [0])]}
    path = tmp_path / "trainer-0.pt"
    with open(path, "wb") as fh:
        pickle.dump(saved, fh)
    loaded = load_state(str(path))
    assert loaded["inbox"][0].rollouts[0].columns["when"] == datetime.date(2026, 1, 1)
    assert (loaded["inbox"][0].rollouts[0].columns["v"] == np.arange(3)).all()
    loaded["inbox"][0].rollouts[0].columns["v"] = saved["inbox"][0].rollouts[0].columns["v"] = None  # (== on arrays)
    assert loaded == saved

    created = tmp_path / "pwned"
    with open(path, "wb") as fh:
        pickle.dump({"inbox": [], "payload": _RunsCode(str(created))}, fh)
    with pytest.raises(pickle.UnpicklingError, match="asks to build io.open"):
        load_state(str(path))
    assert not created.exists()

    class Shell:
        def __reduce__(self):
            return (os.system, (f"touch {created}",))

    with open(path, "wb") as fh:
        pickle.dump([Shell()], fh)
    with pytest.raises(pickle.UnpicklingError, match="asks to build posix.system"):
        load_state(str(path))
    assert not created.exists()


def test_a_state_file_written_before_the_runtime_was_grouped_still_loads(tmp_path):
    """Records pickled under their old module names (`hfllamarl.runtime.rollout`, before the runtime's subpackages)
    load as today's classes; an old name the checkpoint never held stays refused."""
    import pickle

    from hfllamarl.runtime.loop.rollout import RolloutGroup
    from hfllamarl.runtime.weights.durable import load_state

    group = RolloutGroup([], batch_index=1, policy_version=0, generation_seconds=0.0, batch_tokens=0)
    data = pickle.dumps([group], protocol=2)
    new_name = b"hfllamarl.runtime.loop.rollout"
    assert data.count(new_name) == 1
    path = tmp_path / "generator.pt"
    path.write_bytes(data.replace(new_name, b"hfllamarl.runtime.rollout"))  # protocol 2 names a class in text
    assert load_state(str(path)) == [group]
    path.write_bytes(data.replace(new_name, b"hfllamarl.runtime.channels").replace(b"RolloutGroup", b"Channel_____"))
    with pytest.raises(pickle.UnpicklingError, match="asks to build"):
        load_state(str(path))


def test_flushing_a_directory_other_ranks_are_still_writing_into(tmp_path):
    """Every rank flushes the checkpoint's directory before the commit barrier while other ranks still write into it
    (a `.tmp` file renamed into place): an entry that vanishes between the walk and its flush is no error (a run of
    the plans test failed so: FileNotFoundError on another replica's generator-1.pt.tmp)."""
    import threading

    stop = threading.Event()

    def other_rank():
        i = 0
        while not stop.is_set():
            tmp = tmp_path / f"generator-{i % 50}.pt.tmp"
            tmp.write_bytes(b"x" * 64)
            os.replace(tmp, tmp_path / f"generator-{i % 50}.pt")
            i += 1

    writer = threading.Thread(target=other_rank, daemon=True)
    writer.start()
    try:
        for _ in range(300):
            durable.sync_tree(str(tmp_path))
    finally:
        stop.set()
        writer.join(10)
