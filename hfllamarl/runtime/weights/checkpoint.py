"""Checkpoints of the whole job, and resuming from one.

`output_dir/checkpoint-<step>` holds, after trainer step `step` (policy version `step`):

- the trainer side: the policy as a Hugging Face model (`model*.safetensors`, config, tokenizer; a LoRA
  policy with its adapters merged), written tensor by tensor so that no rank ever holds the model;
  `hfllamarl/optimizer/` (the AdamW state in torch distributed checkpoint format: every trainer rank
  writes its own shards); `hfllamarl/adapters.pt` (LoRA); `scheduler.pt`, `rng_state_<rank>.pth`,
  `trainer_state.json` as transformers' Trainer writes them (and, as it does, loaded as plain data only:
  `durable.load_plain`);
- `hfllamarl/trainer-<rank>.pt`: rollouts a trainer rank received but has not trained on yet, and the
  ledger of which generator replica owes which prompts of the batches not trained yet;
- `hfllamarl/generator.pt` (with several replicas `generator-<replica>.pt`, one each): the batches the
  generator finished but has not sent yet, the batches it is still generating (partial rollouts: every
  token so far with its log-prob and version), its policy version;
- `hfllamarl.json`, written last: the step and the tick (and the run's length, the layout and the settings a
  resume must share). A directory without it is not a checkpoint.

Every rank writes into `.checkpoint-<step>.partial` and flushes what it wrote; after a barrier over the bridge,
trainer rank 0 flushes the whole directory, writes the marker, and renames it into place (`publish_steps`:
durable against power loss, and a checkpoint of the same step being replaced is set aside, not deleted, until
the new one is in place; `recover` finishes an interrupted publication), then prunes to `save_total_limit`
(each deletion a rename first: never a half-deleted directory that still has its marker). A checkpoint lacking
the state of a replica the ledger says still owes prompts (a replica lost while it was written,
generator_failure="continue") is not committed: it could not be resumed. The dataset position needs no saving:
which rows batch b holds is a function of the seed and b.

On resume the generator starts vLLM from the checkpoint's policy, which is exactly the policy it would
have received at the next tick, and the loop restarts at the tick after the checkpoint's.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil

import torch

from hfllamarl.runtime.weights.durable import fsync_dir, load_plain, load_state, sync_tree, write_json

MARKER = "hfllamarl.json"
ADAPTERS = "adapters.pt"  # LoRA runs: the adapter weights (model.safetensors holds the merged policy)
REFERENCE = "reference"  # sync_ref_model: the reference model's shards (it moves during the run)
ADAPTER_DIR = "adapter"  # LoRA runs: the same adapters in peft's format (PeftModel.from_pretrained)


def due(step: int, save_steps: int, last_step: int) -> bool:
    """Whether trainer step `step` is checkpointed: every `save_steps` steps (0: never) and, as transformers'
    Trainer does whenever it saves at all, the run's last step (a finished run can be resumed for more steps)."""
    return save_steps > 0 and step > 0 and (step % save_steps == 0 or step == last_step)


def partial_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f".checkpoint-{step}.partial")


def final_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def aside_dir(output_dir: str, step: int) -> str:
    """Where a complete checkpoint of `step` waits while a new one of the same step replaces it."""
    return os.path.join(output_dir, f".checkpoint-{step}.old")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in `output_dir`, oldest first."""
    out = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        path = os.path.join(output_dir, name)
        if m and os.path.isfile(os.path.join(path, MARKER)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def prompts_log_name(rank: int, replica_group: int | None = None) -> str:
    """The file in output_dir where trainer rank `rank` logs each step's dataset rows (with trainer replica groups,
    its group's own file)."""
    return f"trained_prompts{'' if replica_group is None else f'-group{replica_group}'}-rank{rank}.jsonl"


def after_restart(resume_from_checkpoint, output_dir: str, attempt: int,
                  replica_groups: bool = False) -> tuple[object, str | None]:
    """What `train()` resumes from in attempt `attempt` of a launcher that restarts a failed job (torchrun
    --max-restarts, accelerate launch --max_restarts), and what to log about it: called without
    `resume_from_checkpoint` (None), a restarted job resumes from the newest complete checkpoint of `output_dir`,
    with no user action, and says what the failure cost (the steps trained past that checkpoint, to be trained
    again, and the seconds since it was written). `False` keeps a fresh start; the first attempt is left alone.
    `replica_groups`: the job is trainer replica group 0, which then copies the policy from a live group ahead of
    the checkpoint, if there is one."""
    import time

    if resume_from_checkpoint is not None or attempt == 0:
        return resume_from_checkpoint, None
    recover(output_dir)
    found = list_checkpoints(output_dir)
    if not found:
        return None, (f"restart {attempt} of the launcher: {output_dir} holds no complete checkpoint; training starts "
                      "from the beginning"
                      + (" unless a live replica group gives its policy" if replica_groups else ""))
    step, path = found[-1]
    reached = step
    try:  # the steps the stopped attempt trained (each step's line is written at its end)
        with open(os.path.join(output_dir, prompts_log_name(0, 0 if replica_groups else None))) as fh:
            reached = max([json.loads(line)["step"] for line in fh if line.strip()] + [step])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    since = time.time() - os.path.getmtime(os.path.join(path, MARKER))
    return True, (f"restart {attempt} of the launcher: resuming from {path} (step {step}); the stopped attempt had "
                  f"trained to step {reached}: {reached - step} step(s) to train again, {since:.0f} s since that "
                  "checkpoint was written" + ("; a live replica group ahead of it, if any, gives its policy instead"
                                              if replica_groups else ""))


def resolve(resume_from_checkpoint, output_dir: str) -> tuple[str, dict] | None:
    """`True` -> the newest complete checkpoint in `output_dir`; a path -> that one. Returns (path, marker)."""
    if not resume_from_checkpoint:
        return None
    recover(output_dir)  # a publication the stopped job left half-done
    if resume_from_checkpoint is True:
        found = list_checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(f"resume_from_checkpoint=True but {output_dir!r} holds no complete checkpoint "
                                    "(a `checkpoint-<step>` directory with hfllamarl.json).")
        path = found[-1][1]
    else:
        path = os.fspath(resume_from_checkpoint)
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise FileNotFoundError(f"{path!r} is not a complete hfllamarl checkpoint (no {MARKER}).")
    with open(marker) as fh:
        return path, json.load(fh)


# ---------------------------------------------------------------------------- saving
def policy_weights(model) -> list[tuple[str, torch.Tensor]]:
    """The policy under its Hugging Face names, each weight once (a tied `lm_head` is its embedding), sharded
    as trained; a LoRA policy with every adapted layer merged (`W + scaling * B @ A`, still sharded)."""
    from hfllamarl.runtime.weights.loading import checkpoint_name
    from hfllamarl.runtime.weights.lora import is_peft, merged_layers

    merged = merged_layers(model) if is_peft(model) else {}
    buffers = {n for n, _ in model.named_buffers()}
    out = []
    for name, t in model.named_parameters():
        if ".lora_" in name:
            continue
        key = checkpoint_name(name)
        out.append((key, merged[key]() if key in merged else t))
    persistent = [(n, t) for n, t in model.state_dict().items() if n in buffers]
    return out + [(checkpoint_name(n), t) for n, t in persistent]


def save_policy(trainer, directory: str) -> None:
    """Save the policy (a LoRA policy merged) and its tokenizer in the Hugging Face format, streaming one
    weight at a time from the shards (a collective over the trainer world: every trainer rank calls it);
    trainer rank 0 writes."""
    import torch.distributed as dist

    from hfllamarl.runtime.weights.hf_export import write_safetensors, gathered
    from hfllamarl.runtime.weights.lora import is_peft

    model, first = trainer.model, trainer.topology.rank == 0
    base = model.get_base_model() if is_peft(model) else model
    write_safetensors(gathered(policy_weights(model)), directory, write=first)
    if first:
        base.config.save_pretrained(directory)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(directory)
        trainer.processing_class.save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()


def gathered_adapters(model) -> dict[str, torch.Tensor]:
    """A LoRA policy's adapter weights, whole and on the CPU, under peft's names (a collective over the trainer
    world: every trainer rank calls it)."""
    from hfllamarl.runtime.weights.hf_export import full_tensor

    return {n: full_tensor(p).cpu() for n, p in model.state_dict().items() if ".lora_" in n}


def write_adapters(model, adapters: dict[str, torch.Tensor], directory: str) -> None:
    """peft's own adapter files (adapter_config.json, adapter_model.safetensors) in `directory`: what TRL's
    save_model writes for a PeftModel, loadable with `PeftModel.from_pretrained(base_model, directory)`."""
    model.save_pretrained(directory, state_dict=adapters)


def save_model(trainer, directory: str) -> None:
    """`trainer.save_model()`: as TRL's, a LoRA policy's adapters in peft's format plus the tokenizer; any other
    policy whole, in the Hugging Face format (a collective over the trainer world; trainer rank 0 writes)."""
    import torch.distributed as dist

    from hfllamarl.runtime.weights.lora import is_peft

    if not is_peft(trainer.model):
        save_policy(trainer, directory)
        return
    adapters = gathered_adapters(trainer.model)
    if trainer.topology.rank == 0:
        write_adapters(trainer.model, adapters, directory)
        trainer.processing_class.save_pretrained(directory)
    if dist.is_initialized():
        dist.barrier()


def save_trainer_side(trainer, executor, step: int, directory: str) -> None:
    """Called on every trainer rank (the policy export and the optimizer's checkpoint are collectives)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from hfllamarl.runtime.weights.lora import is_peft

    rank = trainer.topology.rank
    os.makedirs(os.path.join(directory, "hfllamarl"), exist_ok=True)
    save_policy(trainer, directory)
    if is_peft(trainer.model):  # the adapters themselves (small), to train on from where they were
        adapters = gathered_adapters(trainer.model)
        if rank == 0:
            torch.save(adapters, os.path.join(directory, "hfllamarl", ADAPTERS))
            write_adapters(trainer.model, adapters, os.path.join(directory, ADAPTER_DIR))
    dcp.save({"optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer)},
             checkpoint_id=os.path.join(directory, "hfllamarl", "optimizer"))
    ref = getattr(executor, "spec", None) and executor.spec.ref_model
    if ref is not None and executor.spec.ref_sync is not None:  # sync_ref_model: the reference moved; keep its shards
        dcp.save({"reference": ref.state_dict()}, checkpoint_id=os.path.join(directory, "hfllamarl", REFERENCE))
    if rank == 0:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(directory, "scheduler.pt"))
        trainer._reporter.save_state(os.path.join(directory, "trainer_state.json"))
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state()},
               os.path.join(directory, f"rng_state_{rank}.pth"))
    dispatch = executor.dispatch.state() if getattr(executor, "dispatch", None) is not None else {}
    with open(os.path.join(directory, "hfllamarl", f"trainer-{rank}.pt"), "wb") as fh:
        reserve = executor.group_filter.reserve if getattr(executor, "group_filter", None) is not None else []
        pickle.dump({"inbox": executor.inbox, "version": executor.version,
                     "trained_rows": executor.trained_rows, "dispatch": dispatch, "reserve": reserve,
                     "replica_offset": getattr(executor, "data_offset", 0)}, fh)


def generator_file(replica: int, replicas: int) -> str:
    """A replica's part of a checkpoint, relative to the checkpoint directory (one generator: `generator.pt`)."""
    return os.path.join("hfllamarl", "generator.pt" if replicas == 1 else f"generator-{replica}.pt")


def save_generator_side(executor, directory: str) -> None:
    """Called on every generator rank; the first rank of each replica writes its replica's state (every rank of an
    engine holds the same), under a temporary name first: the file is whole or absent."""
    topo = executor.topology
    if topo.local_rank != 0:
        return
    os.makedirs(os.path.join(directory, "hfllamarl"), exist_ok=True)
    path = os.path.join(directory, generator_file(topo.replica, topo.num_replicas))
    with open(path + ".tmp", "wb") as fh:
        pickle.dump({"pending": executor.pending, "in_flight": executor.in_flight, "version": executor.version,
                     "tick": executor.tick}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(os.path.dirname(path))


def unsampled_batches(marker: dict, schedule) -> list[int]:
    """The batches a run of `schedule` has started by the checkpoint's tick that the run which wrote it never
    sampled: none from a checkpoint in the middle of a run; from the last step of a shorter run (resumed with a
    larger max_steps), its generator stopped with that run's last batch, and the s batches an uninterrupted run
    would hold in flight (max_staleness = s) are sampled first, under the checkpoint's policy."""
    ran = marker.get("num_batches") or schedule.num_batches
    return list(range(ran, min(marker["tick"] + 1, schedule.num_batches)))


def job_signature(args) -> dict:
    """The settings a checkpoint's step and tick mean something under: a resume must use the same."""
    return {"max_staleness": args.max_staleness, "num_generations": args.num_generations,
            "prompts_per_step": args.prompts_per_step, "seed": args.seed, "shuffle_dataset": args.shuffle_dataset,
            "prompts_per_generation": args.prompts_per_generation,
            "drop_zero_variance_groups": args.drop_zero_variance_groups,
            "num_iterations": args.num_iterations, "sync_ref_model": args.sync_ref_model}


def check_resumable(path: str, marker: dict, topology, args) -> None:
    """Refuse, before any work, a resume whose layout or schedule differs from the checkpoint's."""
    layout = {"processes": (marker["world_size"], topology.world_size),
              "generator processes": (marker["num_generators"], topology.num_generators),
              "generator replicas": (marker.get("num_replicas", 1), topology.num_replicas)}
    differ = [f"{k}: {old} -> {new}" for k, (old, new) in layout.items() if old != new]
    if differ:
        why = ""
        if layout["generator replicas"][0] != layout["generator replicas"][1]:
            why = (" Each replica's carried work (sampled but unsent batches, partial rollouts) is in its own file "
                   "and the ledger of which replica owes which prompts follows the replica count, so the work in "
                   "flight cannot be handed to another number of replicas.")
        raise ValueError(f"checkpoint {path!r} was written by {marker['world_size']} processes with "
                         f"{marker['num_generators']} generator(s); this job has {topology.world_size} with "
                         f"{topology.num_generators} ({'; '.join(differ)}).{why} Resume with the same layout.")
    saved, now = marker.get("job", {}), job_signature(args)
    changed = [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in sorted(saved) if k in now and saved[k] != now[k]]
    if changed:
        raise ValueError(f"checkpoint {path!r} was written by a job with other settings ({'; '.join(changed)}). "
                         "Its step and dataset position only mean something under the same settings: resume "
                         "with them, or start a new run from its policy (model=" f"{path!r}).")


def remove_partial(output_dir: str) -> list[str]:
    """Delete what a killed job left half-written (`.checkpoint-<step>.partial`) or half-deleted
    (`.checkpoint-<step>.deleted`); never a complete checkpoint (`recover` first moves those into place)."""
    recover(output_dir)
    removed = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        if re.fullmatch(r"\.checkpoint-\d+\.(partial|deleted)", name):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


def prune(output_dir: str, save_total_limit: int, keep: list[str] = ()) -> None:
    """Delete the oldest checkpoints until `save_total_limit` are left, never the newest nor one of `keep` (the best
    one, and those whose evaluation has not arrived yet: `Reporter.protected_checkpoints`), as transformers'
    `rotate_checkpoints` does with its best checkpoint (so a limit may be exceeded by the protected ones)."""
    paths = [os.path.normpath(path) for _, path in list_checkpoints(output_dir)]
    protected = set(paths[-1:]) | {os.path.normpath(p) for p in keep if p}
    removable = [path for path in paths if path not in protected]
    for old in removable[:max(len(paths) - max(save_total_limit, len(protected & set(paths))), 0)]:
        discard(old)


def discard(path: str) -> None:
    """Delete a checkpoint directory so that no instant shows it half-deleted with its marker: rename it to
    `.checkpoint-<step>.deleted` (atomic, flushed), then delete that (`remove_partial` finishes an interrupted one)."""
    parent, name = os.path.split(os.path.normpath(path))
    m = re.fullmatch(r"\.?checkpoint-(\d+)(\.old)?", name)
    if m is None:
        raise ValueError(f"{path!r} is not a checkpoint directory")
    trash = os.path.join(parent, f".checkpoint-{m.group(1)}.deleted")
    shutil.rmtree(trash, ignore_errors=True)  # an earlier deletion of this step that was interrupted
    try:
        os.replace(path, trash)
    except FileNotFoundError:  # another rank's `recover` got there first
        return
    fsync_dir(parent)
    shutil.rmtree(trash, ignore_errors=True)


def publish_steps(output_dir: str, step: int, marker: dict) -> list[tuple[str, object]]:
    """The sequence that turns `.checkpoint-<step>.partial` (every rank has written its files) into the complete
    `checkpoint-<step>`, as (name, action) in order. Whatever instant the process (or the machine's power) stops
    at, `recover` then finds a complete checkpoint of `step`: the one replaced until it is set aside (its directory
    is renamed, never deleted before the new one is in place), the new one from then on (complete since its
    marker is on disk)."""
    partial, final, old = partial_dir(output_dir, step), final_dir(output_dir, step), aside_dir(output_dir, step)

    def set_old_aside():
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)  # (only left by an interrupted publication that `recover` saw)
            os.replace(final, old)
            fsync_dir(output_dir)

    def move_new_in():
        os.replace(partial, final)
        fsync_dir(output_dir)

    def delete_old():
        if os.path.exists(old):
            discard(old)

    return [("flush every file and directory", lambda: sync_tree(partial)),
            ("write the marker", lambda: write_json(os.path.join(partial, MARKER), marker)),
            ("set the replaced checkpoint aside", set_old_aside),
            ("move the new checkpoint in", move_new_in),
            ("delete the replaced checkpoint", delete_old)]


def recover(output_dir: str) -> None:
    """Finish a checkpoint publication a stopped job left between two `publish_steps`: a partial checkpoint whose
    marker was written is complete and goes into place; a checkpoint set aside is put back if nothing replaced
    it, else deleted. Safe to run on several ranks at once (each step is a rename that only one can make)."""
    if not os.path.isdir(output_dir):
        return
    complete = lambda step: os.path.isfile(os.path.join(final_dir(output_dir, step), MARKER))  # noqa: E731
    names = os.listdir(output_dir)
    for name in names:
        m = re.fullmatch(r"\.checkpoint-(\d+)\.partial", name)
        if m and os.path.isfile(os.path.join(output_dir, name, MARKER)) and not os.path.exists(
                final_dir(output_dir, int(m.group(1)))):
            try:
                os.replace(os.path.join(output_dir, name), final_dir(output_dir, int(m.group(1))))
            except OSError:  # another rank moved it first
                pass
    for name in names:
        m = re.fullmatch(r"\.checkpoint-(\d+)\.old", name)
        if not m:
            continue
        step = int(m.group(1))
        if complete(step):
            discard(os.path.join(output_dir, name))
        elif os.path.isfile(os.path.join(output_dir, name, MARKER)):
            try:
                os.replace(os.path.join(output_dir, name), final_dir(output_dir, step))
            except OSError:  # another rank restored it first
                pass
    fsync_dir(output_dir)


def commit(topology, output_dir: str, step: int, tick: int, save_total_limit: int | None,
           job: dict | None = None, required: list[str] = (), num_batches: int | None = None,
           keep: list[str] = ()) -> None:
    """Every rank: wait until all have written, then trainer rank 0 makes the checkpoint visible at once.
    `job` (trainer rank 0's `job_signature`) and `num_batches` (the run's length) go into the marker, which trainer
    rank 0 writes (the generator ranks pass none of these); without every file of `required` (relative paths)
    the checkpoint is dropped instead. `keep`: checkpoints `save_total_limit` does not delete (`prune`)."""
    import logging

    from hfllamarl.runtime.loop.channels import bridge_barrier

    partial = partial_dir(output_dir, step)
    if topology.rank != 0 and os.path.isdir(partial):  # (rank 0 syncs the whole tree after the barrier)
        sync_tree(partial)  # what this rank wrote is on disk before trainer rank 0 can mark it complete
    bridge_barrier(topology, f"checkpoint {step}")
    missing = [f for f in required if not os.path.isfile(os.path.join(partial, f))]
    if topology.rank == 0 and missing:
        logging.getLogger(__name__).warning(
            "checkpoint %d is not kept: %s missing (a generator replica was lost while it was written); the next "
            "one will be", step, ", ".join(missing))
        shutil.rmtree(partial, ignore_errors=True)
    elif topology.rank == 0:
        marker = {"step": step, "tick": tick, "world_size": topology.world_size,
                  "num_generators": topology.num_generators, "num_replicas": topology.num_replicas,
                  "lost_replicas": sorted(topology.lost), "job": job or {}, "num_batches": num_batches}
        for _, action in publish_steps(output_dir, step, marker):
            action()
        if save_total_limit:
            prune(output_dir, save_total_limit, keep)
    bridge_barrier(topology, f"checkpoint {step} committed")


# ---------------------------------------------------------------------------- loading
def load_model_weights(model: torch.nn.Module, directory: str) -> None:
    """Load the policy saved in `directory` into an (unsharded) model; a LoRA policy gets its adapters."""
    from safetensors.torch import load_file

    from hfllamarl.runtime.weights.lora import is_peft

    if is_peft(model):
        path = os.path.join(directory, "hfllamarl", ADAPTERS)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint {directory!r} holds no LoRA adapters ({path}); it was not written by a "
                             "run with this peft_config.")
        missing, unexpected = model.load_state_dict(torch.load(path, weights_only=True), strict=False)
        if unexpected or [m for m in missing if ".lora_" in m]:
            raise ValueError(f"the adapters in {path!r} do not match peft_config: missing "
                             f"{[m for m in missing if '.lora_' in m]}, unexpected {unexpected}")
        return

    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        state = load_file(single)
    else:
        with open(os.path.join(directory, "model.safetensors.index.json")) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
        state = {}
        for name in files:
            state.update(load_file(os.path.join(directory, name)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("rotary_emb.inv_freq")]:
        raise ValueError(f"checkpoint {directory!r} does not match the model: missing {missing}, "
                         f"unexpected {unexpected}")


def load_adapter_shards(model: torch.nn.Module, directory: str) -> None:
    """A sharded LoRA policy's adapters from the checkpoint in `directory` (each rank keeps its rows)."""
    from hfllamarl.runtime.weights.fsdp import held_box

    path = os.path.join(directory, "hfllamarl", ADAPTERS)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {directory!r} holds no LoRA adapters ({path}); it was not written by a "
                         "run with this peft_config.")
    saved = torch.load(path, weights_only=True)
    mine = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    if set(saved) != set(mine):
        raise ValueError(f"the adapters in {path!r} do not match peft_config: missing {sorted(set(mine) - set(saved))}, "
                         f"unexpected {sorted(set(saved) - set(mine))}")
    with torch.no_grad():
        for name, p in mine.items():
            local, box = held_box(p)
            local.copy_(saved[name][tuple(slice(s, e) for s, e in box)])


def load_trainer_side(trainer, executor, directory: str, unsampled: list[int] = ()) -> None:
    """After sharding and building the optimizer: restore optimizer, scheduler, RNG, state, inbox (and the ledger,
    with the `unsampled_batches` the generator samples first)."""
    from transformers.trainer_callback import TrainerState

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    rank = trainer.topology.rank
    state = {"optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer)}  # the layout to fill
    dcp.load(state, checkpoint_id=os.path.join(directory, "hfllamarl", "optimizer"))
    set_optimizer_state_dict(trainer.model, trainer.optimizer, optim_state_dict=state["optimizer"])
    ref = executor.spec.ref_model if executor.spec.ref_sync is not None else None
    if ref is not None:  # sync_ref_model: the reference as synced by the checkpoint's step, not the starting policy
        where = os.path.join(directory, "hfllamarl", REFERENCE)
        if not os.path.isdir(where):
            raise ValueError(f"checkpoint {directory!r} holds no reference model, but this run syncs it "
                             "(sync_ref_model=True): it was written by a run that did not; resume with its settings.")
        held = {"reference": ref.state_dict()}  # the layout to fill (in place, shard by shard)
        dcp.load(held, checkpoint_id=where)
    # Plain data only (numbers, lists, tuples, tensors), as transformers' Trainer loads these: a file that would
    # run code when unpickled is refused.
    trainer.lr_scheduler.load_state_dict(load_plain(os.path.join(directory, "scheduler.pt")))
    rng = load_plain(os.path.join(directory, f"rng_state_{rank}.pth"))
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    trainer._reporter.restore(TrainerState.load_from_json(os.path.join(directory, "trainer_state.json")))
    saved = load_state(os.path.join(directory, "hfllamarl", f"trainer-{rank}.pt"))
    executor.inbox = saved["inbox"]
    executor.version = executor.sent_version = saved["version"]
    executor.trained_rows = saved["trained_rows"]
    group = getattr(executor.spec, "replica_group", None)
    if group is not None:  # trainer replica groups: the global step of the checkpoint is version + offset
        group.resume_at(saved["version"], int(saved.get("replica_offset", 0)))
    if getattr(executor, "group_filter", None) is not None:  # dynamic sampling's groups with signal not trained yet
        executor.group_filter.reserve = saved.get("reserve", [])
    # the ledger; `dispatch.stages` hands it to the Dispatch
    executor.dispatch_state = dict(saved.get("dispatch", {}), unsampled=list(unsampled))


def load_generator_side(executor, directory: str) -> None:
    """Called on every generator rank: all ranks of a replica continue the same carried completions. (A replica
    whose file the checkpoint lacks owes nothing: the checkpoint was committed without it.)"""
    topo = executor.topology
    path = os.path.join(directory, generator_file(topo.replica, topo.num_replicas))
    if not os.path.isfile(path):
        return
    saved = load_state(path)
    executor.in_flight = saved.get("in_flight", [])
    if executor.topology.local_rank == 0:  # only the first rank sends rollouts
        executor.pending = saved["pending"]
