"""What TRL scripts call on a trainer besides `train()`: `trainer.accelerator.print(...)`, `trainer.end()`,
`trainer.push_to_hub()`, `trainer.hub_model_id` (as in TRL's `trl/scripts/grpo.py`), and what open-r1's
`grpo.py` calls after it on every process: `log_metrics`, `save_metrics`, `save_state`, `create_model_card`,
`trainer.model.config` / `.generation_config` (on a generator rank too)."""

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
    """`trainer.end()`: the job's processes are done with each other (call it last): release this process's world
    and bridge groups, as transformers' `Trainer.end` destroys its process group, then meet the other ranks at the
    end of the job and stop the heartbeats (`Liveness.finish`; under a launcher it happens at exit otherwise)."""
    import torch.distributed as dist

    topo = trainer.topology
    topo.drop_bridge()
    if dist.is_initialized():
        dist.destroy_process_group()
    topo.liveness.finish()  # (after the teardown, which the watchdog still watches: the end-of-job rendezvous)


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


class GeneratorRankModel:
    """`trainer.model` on a generator rank (under a launcher, where the script runs there too): the policy lives in
    vLLM on that rank, so this holds only what scripts touch on every process after `train()`: the model's `config`
    and `generation_config` (read from the model directory when first asked for)."""

    def __init__(self, config, model_path: str):
        self.config = config
        self._path = model_path
        self._generation_config = None

    @property
    def generation_config(self):
        if self._generation_config is None:
            from transformers import GenerationConfig

            try:
                self._generation_config = GenerationConfig.from_pretrained(self._path)
            except (OSError, ValueError):  # no generation_config.json: transformers' default for this config
                self._generation_config = GenerationConfig.from_model_config(self.config)
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        self._generation_config = value

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"trainer.model.{name}: this process is a generator rank, where the policy is held by vLLM; trainer.model "
            "here has only `config` and `generation_config`. The trained policy is on the trainer ranks: "
            "trainer.save_model() writes it (call it on every process), or guard with trainer.accelerator.is_main_process.")


def save_metrics(trainer, split: str, metrics: dict, combined: bool = True) -> None:
    """`{split}_results.json` in output_dir (and `all_results.json` updated with them), on the job's process 0:
    transformers' own `save_metrics`, the directory made first."""
    from transformers.trainer_pt_utils import save_metrics as transformers_save_metrics

    if trainer.is_world_process_zero():
        os.makedirs(trainer.args.output_dir, exist_ok=True)
    transformers_save_metrics(trainer, split, metrics, combined)


def save_state(trainer) -> None:
    """`trainer_state.json` (the TrainerState: log_history, global_step, ...) in output_dir, on the job's process 0."""
    if not trainer.is_world_process_zero():
        return
    from transformers.trainer_callback import TrainerState

    os.makedirs(trainer.args.output_dir, exist_ok=True)
    (trainer.state or TrainerState()).save_to_json(os.path.join(trainer.args.output_dir, "trainer_state.json"))


def create_model_card(trainer, model_name: str | None = None, dataset_name: str | None = None,
                      tags: str | list[str] | None = None) -> None:
    """A model card, `README.md` in output_dir, on the job's process 0: the base model (when it is a Hub id), the
    data set, the tags, how the model was trained and the library versions."""
    if not trainer.is_world_process_zero():
        return
    from importlib.metadata import PackageNotFoundError, version

    from huggingface_hub import ModelCard, ModelCardData

    source = getattr(trainer.model_config, "_name_or_path", "") or ""
    base_model = source if source and not os.path.isdir(source) else None  # a local directory names nothing public
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    name = model_name or hub_model_id(trainer).split("/")[-1]
    data = ModelCardData(base_model=base_model, datasets=dataset_name, library_name="transformers", model_name=name,
                         tags=["generated_from_trainer", "hfllamarl", trainer.args.algorithm, *tags])

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    base = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a local model"
    on = f" on the [{dataset_name}](https://huggingface.co/datasets/{dataset_name}) data set" if dataset_name else ""
    steps = trainer.state.global_step if trainer.state is not None else 0
    versions = "\n".join(f"- {p}: {installed(p)}" for p in ("hfllamarl", "transformers", "trl", "torch", "vllm"))
    content = (f"---\n{data.to_yaml()}\n---\n\n# Model card for {name}\n\nThis model is a fine-tuned version of {base}{on}, "
               f"trained with hfllamarl's `AsyncAIPOTrainer` ({steps} steps of asynchronous, off-policy reinforcement "
               f"learning; algorithm `{trainer.args.algorithm}`, generation up to {trainer.args.max_staleness} policy "
               "versions ahead of training, after LlamaRL, arXiv 2505.24034).\n\n"
               f"## Quick start\n\n```python\nfrom transformers import pipeline\n\n"
               f"generator = pipeline(\"text-generation\", model=\"{hub_model_id(trainer)}\")\n"
               "print(generator([{\"role\": \"user\", \"content\": \"What is 12 * 7?\"}], max_new_tokens=128, "
               "return_full_text=False)[0][\"generated_text\"])\n```\n\n"
               f"## Framework versions\n\n{versions}\n")
    os.makedirs(trainer.args.output_dir, exist_ok=True)
    ModelCard(content).save(os.path.join(trainer.args.output_dir, "README.md"))
