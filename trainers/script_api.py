"""What TRL scripts call on a trainer besides `train()`: `trainer.accelerator.print(...)`, `trainer.end()`,
`trainer.push_to_hub()`, `trainer.hub_model_id` (as in TRL's `trl/scripts/grpo.py`)."""

from __future__ import annotations

import os


class JobAccelerator:
    """`trainer.accelerator` for a job whose processes are split into trainer and generator worlds: what scripts
    use of Accelerate's object, over the whole job (process 0 of the job is the main process, so a message printed
    with `print` appears once, not once per world)."""

    def __init__(self, trainer):
        self._trainer = trainer

    @property
    def process_index(self) -> int:
        return self._trainer.topology.rank

    @property
    def num_processes(self) -> int:
        return self._trainer.topology.world_size

    @property
    def is_main_process(self) -> bool:
        return self._trainer.topology.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.is_main_process  # once per job: a generator node's first process stays quiet

    @property
    def device(self):
        import torch

        topo = self._trainer.topology
        return torch.device("cpu") if topo.use_cpu else torch.device("cuda", torch.cuda.current_device())

    def print(self, *args, **kwargs) -> None:
        """Print once for the whole job (on its process 0)."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Wait for the other processes of this process's world (the trainer ranks, or the generator ranks)."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def unwrap_model(self, model, **kwargs):
        return model

    def end_training(self) -> None:
        self._trainer.end()


def end(trainer) -> None:
    """`trainer.end()`: the job's processes are done with each other (call it last): stop the heartbeats and
    release this process's world and bridge groups, as transformers' `Trainer.end` destroys its process group."""
    import torch.distributed as dist

    topo = trainer.topology
    topo.liveness.stop()
    topo.drop_bridge()
    if dist.is_initialized():
        dist.destroy_process_group()


def hub_model_id(trainer) -> str:
    """The repository `push_to_hub` uploads to: `hub_model_id`, else the output directory's name (as transformers)."""
    return trainer.args.hub_model_id or os.path.basename(os.path.normpath(trainer.args.output_dir))


def push_to_hub(trainer, commit_message: str | None = "End of training", blocking: bool = True,
                token: str | None = None, revision: str | None = None, **kwargs):
    """Save the policy to `output_dir` (every trainer rank takes part) and, on the job's process 0, upload that
    folder to the Hub repository `hub_model_id` (checkpoints and the job's own files left out). Returns the
    upload's commit info on process 0, None elsewhere."""
    trainer.save_model(trainer.args.output_dir)
    if trainer.topology.rank != 0:
        return None
    from huggingface_hub import create_repo, upload_folder

    token = token or trainer.args.hub_token
    repo = create_repo(hub_model_id(trainer), token=token, private=trainer.args.hub_private_repo, exist_ok=True)
    return upload_folder(repo_id=repo.repo_id, folder_path=trainer.args.output_dir, commit_message=commit_message,
                         token=token, revision=revision or trainer.args.hub_revision, run_as_future=not blocking,
                         ignore_patterns=["checkpoint-*", "_*", ".hfllamarl*", "trained_prompts-*", "runs/*"])
